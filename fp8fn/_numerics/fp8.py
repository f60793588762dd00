"""Every quantizer of fp8fn, and the float8 format constants.

Conventions throughout: `fp8 = saturate(hp * scale)` and, per tensor, `scale = fp8_max / (amax
* 2**margin)`. Saturation clamps finite values to the format's range and lets inf and NaN
through (e4m3fn, which has no inf, turns inf into NaN), so an overflow stays visible.

* Per tensor (delayed and current scaling): `amax`, `scale_from_amax` / `compute_scale`,
  `cast_to_fp8`.
* Finer, stateless: rowwise, MXFP8 blocks and DeepSeek-V3 tiles. Each reduces the amax along the
  *last* dim (callers transpose a tensor to put the contraction dim last), returns the float8
  `float8_e4m3fn` data in the input's shape and one scale per row or block; dequantization
  divides by the scale (rowwise), multiplies by the E8M0 scale (MX) or by the returned inverse
  scale (blockwise). Their numerics are those of torchao 0.18, bit for bit:

  * `448.0 / t` in torch is `t.reciprocal() * 448.0`, not a division (`Tensor.__rtruediv__`):
    in float64 it differs from the quotient in the last bit for about a quarter of inputs, and
    the float32 scale it rounds to can then differ too. `fp8_scale` keeps that form.
  * Power-of-two rounding goes through `torch.log2` in float32, so a float32 value within an
    ulp of a power of two may round to that power (rowwise: a scale just below `2**k` becomes
    `2**k` and the row's largest value saturates to 448; MX RCEIL likewise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._torch_private import functorch_level
from .cpu_fast import fast_amax

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_MAX = {d: torch.finfo(d).max for d in FP8_DTYPES}  # 448.0, 57344.0 (not for inside an op)
ROLE_DTYPE = (E4M3, E4M3, E5M2)  # input, weight, grad_output
ROLE_FP8_MAX = tuple(FP8_MAX[d] for d in ROLE_DTYPE)
_E8M0_BIAS = 127
_E8M0_NAN = 255
# e4m3's largest value, 448.0, and the amax floor, 1e-12, are written as literals where used:
# under torch.compile(dynamic=True) dynamo turns a float module global into a symbolic float,
# and two layers' autograd.Function subgraphs sharing it fail dynamo's assertion
# `lift_tracked_freevar_to_input should not be called on root SubgraphTracer`.

# -- per tensor ---------------------------------------------------------------------------------


def check_margin(api: str, margin) -> None:
    """The one check of a margin: an int (TypeError otherwise) from 0 to 64 (ValueError)."""
    if isinstance(margin, bool) or not isinstance(margin, int):
        raise TypeError(
            f"fp8fn.{api}: expected `margin` an int from 0 to 64, got "
            f"{type(margin).__name__} {margin!r}."
        )
    if not 0 <= margin <= 64:
        raise ValueError(f"fp8fn.{api}: expected `margin` an int from 0 to 64, got {margin}.")


def amax(hp: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of `hp` (any shape, floating), as a float32 `()` tensor.

    NaN in `hp` gives NaN, an empty `hp` gives 0 (both of which `update` ignores). One kernel
    (an inf-norm), except eager on a plain CPU tensor of 64K elements or more: by `aminmax`, one
    dispatched op (`cpu_fast.fast_amax`; the same value: a max is exact), since the CPU's
    inf-norm kernel is 20x slower (4.5 ms against 0.2 ms for 1M float32 elements on one core).
    Compiled, inductor fuses the inf-norm into the cast's loop.
    """
    if hp.numel() == 0:
        return hp.new_zeros((), dtype=torch.float32)
    plain = type(hp) in (torch.Tensor, torch.nn.Parameter)  # (not a DTensor)
    if plain and hp.is_cpu and hp.numel() >= 2**16 and not torch.compiler.is_compiling():
        return fast_amax(hp)
    return torch.linalg.vector_norm(hp, float("inf")).float()


def may_overwrite(temporary: torch.Tensor) -> bool:
    """Whether an op may write a temporary of its own in place: eager, outside torch.func's
    transforms (each in-place op there adds a clone) and from 64K elements (no new tensor: 2-3%
    of an eager step of 1M-element layers on CPU; below that size, one more dispatched op)."""
    if torch.compiler.is_compiling() or temporary.numel() < 2**16:
        return False
    return functorch_level() is None


def saturate(
    hp32: torch.Tensor, dtype: torch.dtype, keep_nonfinite: bool = True, owned: bool = False
) -> torch.Tensor:
    """float32 `hp32` in float8 `dtype`: finite values clamped to +-max; inf and NaN give NaN
    (a positive one), so that an overflow stays visible (torch's own conversion would make inf
    448 in e4m3fn). `keep_nonfinite=False` clamps inf to +-max (torchao's finer recipes).
    `owned`: `hp32` is the caller's temporary, which may be overwritten (`may_overwrite`)."""
    fp8_max = 448.0 if dtype == E4M3 else 57344.0  # literals (see the module's top)
    if not keep_nonfinite:
        return hp32.clamp(-fp8_max, fp8_max).to(dtype)
    nan = float("nan")
    if torch.compiler.is_compiling():
        # The same bytes as eager, in a loop inductor vectorizes (its `nan_to_num` tests each
        # element with a scalar `isnan`: 8x slower), with the NaN selected after the clamp
        # (inductor's vectorized clamp turns a NaN negative).
        finite = hp32.abs() < float("inf")
        return torch.where(finite, hp32.clamp(-fp8_max, fp8_max), nan).to(dtype)
    if owned and may_overwrite(hp32):
        return hp32.nan_to_num_(nan=nan, posinf=nan, neginf=nan).clamp_(-fp8_max, fp8_max).to(dtype)
    return hp32.nan_to_num(nan=nan, posinf=nan, neginf=nan).clamp(-fp8_max, fp8_max).to(dtype)


def cast_to_fp8(
    hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3, keep_nonfinite: bool = True
) -> torch.Tensor:
    """`saturate(hp * scale)` in float8 `dtype`, the product taken in float32.

    Args:
      hp: floating tensor of any shape.
      scale: float32, broadcastable to `hp` (a `()` per-tensor scale, or one per row or block).
      dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
      keep_nonfinite: see `saturate`.

    Returns:
      Tensor of `hp`'s shape in `dtype`; finite values beyond the format's max become +-max.
    """
    return saturate(hp.float() * scale, dtype, keep_nonfinite, owned=True)


def compute_scale(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """`fp8_max / (amax * 2**margin)`, computed in float64, returned as float32.

    Always finite and > 0: an amax that is 0, inf or NaN gives scale 1; a scale beyond float32's
    range is clamped to it (float32's max for a tiny amax, its smallest positive value for a
    huge one).

    Args:
      amax: float tensor of any shape (e.g. `()` or `(n_sites, 3)`).
      fp8_max: the float8 format's largest value (448.0 for e4m3, 57344.0 for e5m2).
      margin: an int from 0 to 64.

    Returns:
      float32 tensor of `amax`'s shape.

    Example:
      >>> import torch, fp8fn
      >>> fp8fn.compute_scale(torch.tensor(2.0), 448.0, margin=1)
      tensor(112.)
    """
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        raise TypeError(
            f"fp8fn.compute_scale: expected `amax` to be a floating tensor, "
            f"got {getattr(amax, 'dtype', type(amax).__name__)}."
        )
    if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)) or not fp8_max > 0:
        raise ValueError(f"fp8fn.compute_scale: expected `fp8_max` a float > 0, got {fp8_max!r}.")
    check_margin("compute_scale", margin)
    return torch.where(amax > 0, scale_from_amax(amax, float(fp8_max), margin), 1.0)


def scale_from_amax(amax: torch.Tensor, fp8_max, margin: int) -> torch.Tensor:
    """`compute_scale` for amaxes >= 0 (or NaN), without checks: the op's and `update`'s path.

    Six kernels. The division is in float64 (the numerator is a float64 tensor, 0-dim only for
    a 0-dim `amax`, so type promotion widens `amax` inside the division), so that eager,
    compiled and Triton code agree bit for bit. `fp8_max`: a float, or a tuple broadcastable to
    `amax`. Returns float32 of `amax`'s shape.
    """
    f64, device = torch.float64, amax.device
    if isinstance(fp8_max, tuple):
        numerator = torch.tensor([v * 2.0**-margin for v in fp8_max], dtype=f64, device=device)
    else:
        shape = (1,) if amax.dim() else ()
        numerator = torch.full(shape, fp8_max * 2.0**-margin, dtype=f64, device=device)
    finite = torch.nan_to_num(amax, posinf=0.0)  # inf -> 0; 0 and NaN are handled below
    scale = torch.div(numerator, finite).nan_to_num(nan=1.0, posinf=1.0)  # 0, NaN -> 1
    # Beyond float32's range: its smallest positive value or its max. (Literals, not module
    # globals: under dynamic shapes dynamo turns float globals into symbols.)
    return scale.float().clamp(2.0**-149, 3.4028234663852886e38)


# -- finer: shared helpers ------------------------------------------------------------------------


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 `448 / clamp(amax, 1e-12)`, computed in float64 (any shape)."""
    return (amax.double().clamp(min=1e-12).reciprocal() * 448.0).float()


def ceil_div(n: int, d: int) -> int:
    """`ceil(n / d)` for ints, exactly (e.g. the rows of each of `d` equal shards of `n`)."""
    return -(-n // d)


def pad_last(hp: torch.Tensor, block: int) -> torch.Tensor:
    """`hp` with zeros appended to its last dim up to a multiple of `block`.

    Zeros do not change a block's amax, so a partial last block is scaled by its own elements.
    """
    extra = -hp.shape[-1] % block
    return F.pad(hp, (0, extra)) if extra else hp


def _mul_blocks(hp: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """`hp * scale`, one `scale` per `block` elements along the last dim.

    `hp` `(..., k)`, `scale` `(..., ceil(k / block))`; returns `(..., k)`. Padded to whole
    blocks, multiplied per block and sliced back: the same products as
    `hp * scale.repeat_interleave(block, -1)[..., :k]`, a form inductor (torch 2.13) compiles
    wrongly: for a partial block after a whole one it leaves the columns past the first block
    unwritten (garbage), and a graph holding two such products of one tensor along different
    dims (`g` and `g.t()` in the backward) fails with an InductorError.
    """
    k, nb = hp.shape[-1], scale.shape[-1]
    blocks = pad_last(hp, block).unflatten(-1, (nb, block))
    return (blocks * scale.unsqueeze(-1)).flatten(-2)[..., :k]


# -- rowwise (torchao "rowwise" / "rowwise_with_gw_hp") -----------------------------------------


def rowwise_scale(hp: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale of each row of `hp`: `2**floor(log2(448 / amax))`.

    Args:
      hp: `(..., k)` float32, bfloat16 or float16.

    Returns:
      float32 `(..., 1)`.
    """
    return torch.exp2(torch.floor(torch.log2(fp8_scale(hp.abs().amax(-1, keepdim=True)))))


def tensorwise_scale(hp: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale of the whole of `hp` (any shape), float32 `()`."""
    return torch.exp2(torch.floor(torch.log2(fp8_scale(hp.abs().amax()))))


def quantize_rowwise(hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3 quantization of `hp` `(..., k)`: `(fp8 (..., k), scale float32 (..., 1))`."""
    scale = rowwise_scale(hp)
    return cast_to_fp8(hp, scale, keep_nonfinite=False), scale


def dequantize_scaled(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `fp8 / scale` (`scale` broadcastable; exact for power-of-two scales)."""
    return fp8.float() / scale


# -- MXFP8 (OCP MX, E8M0 block scales) -----------------------------------------------------------


def _mx_exponent_rceil(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent `ceil(log2(amax / 448)) + 127` (uint8), clamped to [0, 254].

    `amax` float32. NaN gives 255, inf gives 254.
    """
    descale = amax / 448.0
    exponent = torch.ceil(torch.log2(descale)).clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS
    exponent = torch.where(torch.isinf(descale), 254, exponent.to(torch.uint8))
    return torch.where(torch.isnan(descale), _E8M0_NAN, exponent).to(torch.uint8)


def _mx_exponent_floor(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent `floor(log2(amax)) - 8 + 127` (uint8), from `amax`'s float32 bits.

    Clamped to [0, 255]; NaN gives 255. (8 = floor(log2(448)), e4m3's largest exponent.)
    """
    unbiased = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 8
    exponent = (unbiased.clamp(-_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isnan(amax), _E8M0_NAN, exponent).to(torch.uint8)


def e8m0_to_float32(exponent: torch.Tensor) -> torch.Tensor:
    """The value `2**(exponent - 127)` of biased E8M0 exponents (uint8), NaN for 255; float32.

    Built from bits, so exact; exponent 0 is the float32 subnormal `2**-127`.
    """
    bits = torch.where(exponent == 0, 1 << 22, exponent.to(torch.int32) << 23)
    bits = torch.where(exponent == _E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def mx_exponent(amax: torch.Tensor, rounding: str) -> torch.Tensor:
    """The biased E8M0 exponents (uint8) of blocks of float32 amaxes `amax`, under `rounding`
    (`"rceil"` or `"floor"`). Never decreases as the amax grows (NaN gives 255, the largest)."""
    return _mx_exponent_rceil(amax) if rounding == "rceil" else _mx_exponent_floor(amax)


def mx_cast_factor(exponent: torch.Tensor, rounding: str) -> tuple[torch.Tensor, bool]:
    """`(t, divide)`: a block of E8M0 `exponent` (uint8) is cast as `saturate(x * t)`, or
    `saturate(x / t)` when `divide` (FLOOR), float32 `t` of `exponent`'s shape; torchao's
    special cases kept (see `quantize_mx`), NaN (RCEIL) or inf (FLOOR) for 255."""
    if rounding == "rceil":  # the inverse scale 2**(127 - e)
        inverse = torch.exp2(_E8M0_BIAS - exponent.float())
        inverse = torch.where(exponent == 0, 1.0, inverse)
        inverse = torch.where(exponent == 254, 2.0**-127, inverse)
        return torch.where(exponent == _E8M0_NAN, float("nan"), inverse), False
    divisor = e8m0_to_float32(exponent).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(exponent == _E8M0_NAN, float("inf"), divisor), True


def quantize_mx(
    hp: torch.Tensor, block_size: int = 32, rounding: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantization of `hp` in blocks of `block_size` along its last dim.

    As torchao 0.18 `to_mx` (`ScaleCalculationMode.RCEIL` or `FLOOR`): the data is divided by
    the block's power-of-two scale in float32 and saturated to +-448. Quirks kept for bit
    identity: under RCEIL a block whose exponent clamps to 0 (amax <= 448 * 2**-127) is cast
    unscaled (so it flushes to zero), and an inf element casts its block with `2**-127`;
    under FLOOR an exponent of 0 casts with `2**-126` (float32's smallest normal).

    Args:
      hp: `(..., k)` float32 or bfloat16; a partial last block holds the remaining elements.
      block_size: elements per block.
      rounding: `"rceil"` or `"floor"`.

    Returns:
      `(fp8 (..., k) e4m3, exponent (..., ceil(k / block_size)) uint8)`, biased E8M0.
    """
    k = hp.shape[-1]
    blocks = pad_last(hp, block_size).unflatten(-1, (-1, block_size))
    exponent = mx_exponent(blocks.abs().amax(-1).float(), rounding)
    factor, divide = mx_cast_factor(exponent, rounding)
    data, factor = blocks.float(), factor.unsqueeze(-1)
    scaled = data / factor if divide else data * factor
    fp8 = saturate(scaled, E4M3, keep_nonfinite=False).flatten(-2)[..., :k]
    return fp8, exponent


def dequantize_mx(
    fp8: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype, block_size: int = 32
) -> torch.Tensor:
    """`fp8 * 2**(exponent - 127)` per block along the last dim, in `dtype` (NaN for 255).

    Args:
      fp8: `(..., k)` e4m3.
      exponent: `(..., ceil(k / block_size))` uint8, as from `quantize_mx`.
      dtype: float32 or bfloat16; the product is taken in it (exact but for underflow).

    Returns:
      `(..., k)` in `dtype`.
    """
    return _mul_blocks(fp8.to(dtype), e8m0_to_float32(exponent).to(dtype), block_size)


# -- blockwise (DeepSeek-V3: 1 x 128 tiles, 128 x 128 weight blocks) -----------------------------


def quantize_tiles(hp: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization of `hp` in `1 x tile` tiles along its last dim.

    As torchao 0.18 `torch_blockwise_scale_act_quant_lhs` (and its `_rhs` on `hp.T`, except
    that `_rhs` clamps the amax to 1e-12 in `hp`'s dtype: tiles with amax < 1e-12 differ).

    Args:
      hp: `(..., k)` float32, bfloat16 or float16; a partial last tile holds the rest.
      tile: tile length.

    Returns:
      `(fp8 (..., k) e4m3, inverse_scale (..., ceil(k / tile)) float32)`, where
      `inverse_scale = 1 / scale` and `scale = 448 / clamp(amax, 1e-12)` (float64 -> float32).
    """
    k = hp.shape[-1]
    tiles = pad_last(hp, tile).unflatten(-1, (-1, tile))
    scale = fp8_scale(tiles.abs().amax(-1))
    fp8 = cast_to_fp8(tiles, scale.unsqueeze(-1), keep_nonfinite=False).flatten(-2)[..., :k]
    return fp8, scale.reciprocal()


def quantize_blocks(hp: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization of a matrix in `block x block` blocks.

    As torchao 0.18 `torch_blockwise_scale_weight_quant`. Partial blocks at the ends hold
    the remaining rows and columns.

    Args:
      hp: `(n, k)` float32, bfloat16 or float16.
      block: block side.

    Returns:
      `(fp8 (n, k) e4m3, inverse_scale (ceil(n / block), ceil(k / block)) float32)`.
    """
    n, k = hp.shape
    padded = F.pad(hp, (0, -k % block, 0, -n % block))
    blocks = padded.unflatten(1, (-1, block)).unflatten(0, (-1, block))  # (nb, b, kb, b)
    scale = fp8_scale(blocks.abs().amax((1, 3)))
    fp8 = cast_to_fp8(blocks, scale[:, None, :, None], keep_nonfinite=False)
    fp8 = fp8.flatten(2).flatten(0, 1)
    return fp8[:n, :k], scale.reciprocal()


def dequantize_tiles(fp8: torch.Tensor, inverse_scale: torch.Tensor, tile: int = 128):
    """float32 `fp8 * inverse_scale`, one inverse scale per `1 x tile` tile along the last dim.

    `fp8` `(..., k)`, `inverse_scale` `(..., ceil(k / tile))`; returns float32 `(..., k)`.
    """
    return _mul_blocks(fp8.float(), inverse_scale, tile)


def dequantize_blocks(fp8: torch.Tensor, inverse_scale: torch.Tensor, block: int = 128):
    """float32 `fp8 * inverse_scale` per `block x block` block of the `(n, k)` matrix `fp8`."""
    n, k = fp8.shape
    nb, kb = inverse_scale.shape
    padded = F.pad(fp8.float(), (0, -k % block, 0, -n % block))
    blocks = padded.unflatten(1, (kb, block)).unflatten(0, (nb, block))  # (nb, b, kb, b)
    return (blocks * inverse_scale[:, None, :, None]).flatten(2).flatten(0, 1)[:n, :k]
