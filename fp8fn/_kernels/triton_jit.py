"""The Triton kernels of `cast.py`, their launcher and the op that wraps them (imported by it on
first use only).

Importing this module imports Triton and defines the kernels, so `TRITON_INTERPRET=1` must be set
before. The numerics are described in `cast.py`; shapes and dtypes are given on each function.
The kernels have run under the interpreter only (CPU, bit for bit against torch): their GPU
compilation (and the `triton_op` route under torch.compile) is untested.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton  # (this spelling lets triton_op find the kernels)
from triton.runtime.jit import JITFunction

from .._numerics.fp8 import E4M3, E5M2, FP8_MAX
from .._torch_private import is_fake

_FORMAT = {E4M3: (7, 3), E5M2: (15, 2)}  # float8 format: (exponent bias, mantissa bits)
_BLOCK, _WARPS = 4096, 8  # elements per program of the flat kernels (one atomic each)
_TILE, _TILE_WARPS = 64, 4  # (_TILE, _TILE) tiles of the transposing kernels


@triton.jit
def scale_from_amax(amax, margin, FP8_MAX: tl.constexpr):
    """`compute_scale(amax, FP8_MAX, margin)`: float32 scalar -> float32 scalar, in float64.

    The one place the scale is computed. `margin` is a float32 scalar holding a non-negative
    integer (0 to 64); `2**margin` is built exactly from float64 exponent bits. A scale beyond
    float32's range becomes its smallest positive value or its max, as in `compute_scale`.
    """
    m = tl.minimum(tl.maximum(margin, 0.0), 1024.0).to(tl.int64)
    multiplier = ((m + 1023) << 52).to(tl.float64, bitcast=True)
    denom = amax.to(tl.float64) * multiplier
    scale = FP8_MAX / denom
    # amax 0 (scale inf), inf (scale 0) or NaN give 1; finite scales are clamped to float32's
    # positive range, then rounded to float32.
    ok = (denom > 0) & (scale > 0)
    clamped = tl.minimum(tl.maximum(scale, 1.401298464324817e-45), 3.4028234663852886e38)
    return tl.where(ok, clamped, 1.0).to(tl.float32)


@triton.jit
def saturate_to_fp8(y, MAX_BITS: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr):
    """`_numerics/fp8.py`'s `saturate(y, float8)` as uint8 bits: float32 tensor -> uint8 tensor.

    Round to nearest even, as torch. Finite values beyond the format's max saturate; inf and NaN
    give NaN, 0x7F (positive), in both formats.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    a = tl.where((a > MAX_BITS) & (a < 0x7F800000), MAX_BITS, a)  # saturate finite values
    # normal float8: round the mantissa to MBITS bits, then rebias the exponent
    SHIFT: tl.constexpr = 23 - MBITS
    lsb = (a >> SHIFT) & 1
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT) - ((127 - BIAS) << MBITS)
    # subnormal float8 (|y| < 2**(1 - BIAS)): |y| = sig * 2**(e - 150) for exponent field
    # e >= 1 and the float8 subnormal step is 2**(1 - BIAS - MBITS), so the code is sig / 2**k
    # with k = 151 - BIAS - MBITS - e, rounded to nearest even (2**MBITS: the smallest normal).
    e = a >> 23
    sig = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    k = tl.minimum(tl.maximum(151 - BIAS - MBITS - tl.maximum(e, 1), 1), 31)
    q = sig >> k
    rem = sig & ((1 << k) - 1)
    halfway = 1 << (k - 1)
    up = (rem > halfway) | ((rem == halfway) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    r = tl.where(a < ((128 - BIAS) << 23), sub, normal)
    nonfinite = a >= 0x7F800000
    return tl.where(nonfinite, 0x7F, r | (sign << 7)).to(tl.uint8)


@triton.jit
def tile(n_rows, n_cols, TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets and mask of this program's elements: flat `(BLOCK,)` of `n_rows` elements,
    or a `(BLOCK, BLOCK)` tile of a row-major `(n_rows, n_cols)` when TRANSPOSE."""
    if TRANSPOSE:
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        offs = rows[:, None] * n_cols + cols[None, :]
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    else:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_rows
    return offs, mask


@triton.jit
def store_fp8(
    out_ptr, out_t_ptr, q, offs, mask, n_rows, n_cols, TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr
):
    """Store uint8 bits `q` into the float8 output, and transposed into `out_t` if asked."""
    fp8_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, q.to(fp8_ty, bitcast=True), mask=mask)
    if TRANSPOSE:
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        offs_t = cols[:, None] * n_rows + rows[None, :]
        mask_t = (cols[:, None] < n_cols) & (rows[None, :] < n_rows)
        tl.store(out_t_ptr + offs_t, tl.trans(q).to(fp8_ty, bitcast=True), mask=mask_t)


@triton.jit
def write_scale(scale, scale_out_ptr, inv_out_ptr):
    """Program (0, 0) stores `scale` and its reciprocal (float32 scalars) to the float32 `()`
    outputs. The reciprocal is taken in float64 and rounded once to float32: the correctly rounded
    float32 `1 / scale`, as `torch.reciprocal` (float64 has more than 2 * 24 + 2 bits, so the
    double rounding is innocuous; Triton's float32 `/` may be approximate on a GPU)."""
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    tl.store(scale_out_ptr, scale, mask=first)
    tl.store(inv_out_ptr, (1.0 / scale.to(tl.float64)).to(tl.float32), mask=first)


@triton.jit
def cast_amax_kernel(
    hp_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    amax_ptr,
    scale_out_ptr,
    inv_out_ptr,
    input_amax_ptr,
    weight_amax_ptr,
    n_rows,
    n_cols,
    CAST: tl.constexpr,
    FINAL: tl.constexpr,
    OBSERVE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    MAX_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MBITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 1: the amax of |hp| and, if CAST, the cast with a known scale.

    `hp_ptr`: float32, bfloat16 or float16, `n_rows` elements (`n_cols` 1), or `(n_rows, n_cols)`
    row-major when TRANSPOSE. `out_ptr`: float8 of hp's shape; `out_t_ptr`: float8
    `(n_cols, n_rows)`, written when TRANSPOSE. `scale_ptr`: float32 `()`. `amax_ptr`: float32
    `()`, or `(3,)` when OBSERVE, zero on entry; each program max-es its block's amax into its
    last entry (an integer atomic). When OBSERVE, program (0, 0) also copies the float32 `()`
    amaxes at `input_amax_ptr` and `weight_amax_ptr` (bit for bit) into entries 0 and 1: the
    linear's observation `[input, weight, grad_output]`. When FINAL (the cast's scale is known to
    be the stored one: a single pass), program (0, 0) writes that scale and its reciprocal to
    the float32 `()` `scale_out_ptr` and `inv_out_ptr`.
    """
    offs, mask = tile(n_rows, n_cols, TRANSPOSE, BLOCK)
    x = tl.load(hp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # |x| as int32 bits orders like the float, NaN above inf: one integer atomic max
    magnitude = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_bits = amax_ptr.to(tl.pointer_type(tl.int32))
    if OBSERVE:
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        prior = tl.pointer_type(tl.int32)
        tl.store(amax_bits, tl.load(input_amax_ptr.to(prior)), mask=first)
        tl.store(amax_bits + 1, tl.load(weight_amax_ptr.to(prior)), mask=first)
        amax_bits += 2
    tl.atomic_max(amax_bits, tl.max(magnitude, axis=None), sem="relaxed")
    if CAST:
        scale = tl.load(scale_ptr)
        q = saturate_to_fp8(x * scale, MAX_BITS, BIAS, MBITS)
        store_fp8(out_ptr, out_t_ptr, q, offs, mask, n_rows, n_cols, TRANSPOSE, BLOCK)
        if FINAL:
            write_scale(scale, scale_out_ptr, inv_out_ptr)


@triton.jit
def cast_from_amax_kernel(
    hp_ptr,
    out_ptr,
    out_t_ptr,
    amax_ptr,
    newest_ptr,
    stored_ptr,
    scale_out_ptr,
    inv_out_ptr,
    margin,
    n_rows,
    n_cols,
    DELAYED: tl.constexpr,
    OBSERVE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MBITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 2: the scale from pass 1's amax, written with its reciprocal, and the cast with it.

    `hp_ptr`, `out_ptr`, `out_t_ptr`, `amax_ptr`, `OBSERVE`, `n_rows`, `n_cols` as for pass 1.
    The scale is `compute_scale(amax, FP8_MAX, margin)`, or when DELAYED and the newest history
    entry is > 0, the stored scale, which pass 1 already cast with: then every program returns
    once (0, 0) has written it. `newest_ptr`, `stored_ptr`, `scale_out_ptr`, `inv_out_ptr`:
    float32 `()`; `margin` a float holding the recipe's integer margin.
    """
    amax = tl.load(amax_ptr + 2) if OBSERVE else tl.load(amax_ptr)
    scale = scale_from_amax(amax, margin, FP8_MAX)
    if DELAYED:
        use_stored = tl.load(newest_ptr) > 0
        scale = tl.where(use_stored, tl.load(stored_ptr), scale)
    write_scale(scale, scale_out_ptr, inv_out_ptr)
    if DELAYED:
        if use_stored:  # pass 1 already cast with the stored scale
            return
    offs, mask = tile(n_rows, n_cols, TRANSPOSE, BLOCK)
    x = tl.load(hp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = saturate_to_fp8(x * scale, MAX_BITS, BIAS, MBITS)
    store_fp8(out_ptr, out_t_ptr, q, offs, mask, n_rows, n_cols, TRANSPOSE, BLOCK)


INTERPRETED = not isinstance(cast_amax_kernel, JITFunction)  # TRITON_INTERPRET=1 (CPU)


def _format(dtype: torch.dtype) -> dict:
    """The constexpr arguments describing float8 `dtype`."""
    bias, mbits = _FORMAT[dtype]
    max_bits = struct.unpack("<i", struct.pack("<f", FP8_MAX[dtype]))[0]
    return {"MAX_BITS": max_bits, "BIAS": bias, "MBITS": mbits}


def _allocate(hp: torch.Tensor, dtype: torch.dtype, transpose: bool, observe: bool):
    """`(outputs, fp8_t, amax, geometry)`: the op's outputs `[fp8, (fp8_t,) scale, inverse,
    amax]`, the kernels' `fp8_t` argument (`fp8` itself, never written, unless `transpose`), the
    amax zeroed (float32 `()`, or `(3,)` when `observe`), and the launch geometry `(grid, n_rows,
    n_cols, BLOCK, num_warps)`."""
    device = hp.device
    fp8 = torch.empty(hp.shape, dtype=dtype, device=device)
    scale, inverse = (torch.empty((), dtype=torch.float32, device=device) for _ in range(2))
    amax = torch.zeros((3,) if observe else (), dtype=torch.float32, device=device)
    if transpose:
        n_rows, n_cols = hp.shape
        fp8_t = torch.empty((n_cols, n_rows), dtype=dtype, device=device)
        grid = (max(1, triton.cdiv(n_rows, _TILE)), max(1, triton.cdiv(n_cols, _TILE)))
        return [fp8, fp8_t, scale, inverse, amax], fp8_t, (grid, n_rows, n_cols, _TILE, _TILE_WARPS)
    grid = (max(1, triton.cdiv(hp.numel(), _BLOCK)),)
    return [fp8, scale, inverse, amax], fp8, (grid, hp.numel(), 1, _BLOCK, _WARPS)


def _shapes_only(hp: torch.Tensor) -> bool:
    """True when tracing with fake tensors that an interpreted kernel cannot be launched on."""
    return INTERPRETED and is_fake(hp)


def scaled_cast(
    hp: torch.Tensor,
    newest: torch.Tensor | None,
    stored: torch.Tensor | None,
    margin: float,
    dtype: torch.dtype,
    transpose: bool,
    filled: bool,
    input_amax: torch.Tensor | None,
    weight_amax: torch.Tensor | None,
) -> list[torch.Tensor]:
    """The op `fp8fn::scaled_cast`: `[fp8, (fp8_t,) scale, inverse, amax]` (see `cast.py`).

    Current scaling when `stored` is None (2 launches: amax, then the cast). Delayed scaling
    otherwise: with `filled` (the history is known non-empty) the stored scale in one launch;
    else `newest` decides on the device between the stored scale and current scaling (2
    launches; the second returns at once when the stored scale was right). `margin`: the recipe's,
    as a float. With `input_amax` and `weight_amax` (float32 `()`), `amax` is the linear's
    observation `[input_amax, weight_amax, amax of hp]`, float32 `(3,)`.
    """
    hp = hp.contiguous()
    observe = input_amax is not None
    out, fp8_t, (grid, n_rows, n_cols, block, warps) = _allocate(hp, dtype, transpose, observe)
    if _shapes_only(hp):
        return out
    fp8, scale, inverse, amax = out[0], out[-3], out[-2], out[-1]
    delayed, single = stored is not None, stored is not None and filled
    geometry = {"TRANSPOSE": transpose, "BLOCK": block, "num_warps": warps, **_format(dtype)}
    # pass 1: the amax, and under delayed scaling the cast with the stored scale
    wrap_triton(cast_amax_kernel)[grid](
        hp, fp8, fp8_t, stored if delayed else amax, amax, scale, inverse,
        input_amax if observe else amax, weight_amax if observe else amax, n_rows, n_cols,
        CAST=delayed, FINAL=single, OBSERVE=observe, **geometry,
    )  # fmt: skip
    if single:
        return out
    # pass 2: the scale from the amax (or the stored one), written out; the cast unless done
    wrap_triton(cast_from_amax_kernel)[grid](
        hp, fp8, fp8_t, amax, newest if delayed else amax, stored if delayed else amax, scale,
        inverse, margin, n_rows, n_cols, DELAYED=delayed, OBSERVE=observe,
        FP8_MAX=FP8_MAX[dtype], **geometry,
    )  # fmt: skip
    return out


_OPS_REGISTERED = False


@torch.compiler.assume_constant_result  # so that a first use inside torch.compile runs it
def register_ops() -> bool:
    """Register `torch.ops.fp8fn.*` (once, on first use) and return whether the kernels run
    under Triton's interpreter.

    With compiled kernels the ops are `torch.library.triton_op`s, so torch.compile traces into
    them and sees the kernels. Under `TRITON_INTERPRET=1` (CPU tests) a kernel is not a
    `JITFunction` and cannot be traced: the ops are then opaque `custom_op`s, whose fake
    implementation allocates the outputs and skips the launch.
    """
    global _OPS_REGISTERED
    if _OPS_REGISTERED:
        return INTERPRETED
    if INTERPRETED:
        torch.library.custom_op("fp8fn::scaled_cast", scaled_cast, mutates_args=()).register_fake(
            scaled_cast
        )
    else:
        torch.library.triton_op("fp8fn::scaled_cast", scaled_cast, mutates_args=())
    op = torch.ops.fp8fn.scaled_cast.default  # under vmap: one call per member
    torch.library.register_vmap("fp8fn::scaled_cast", functools.partial(_per_member, op))
    _OPS_REGISTERED = True
    return INTERPRETED


def _per_member(op, info, in_dims, *args):
    """vmap rule: the op on each member of the batch, stacked (each member its own amax)."""
    members = [
        op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
        for i in range(info.batch_size)
    ]
    outs = [torch.stack(o) for o in zip(*members)]
    return outs, [0] * len(outs)
