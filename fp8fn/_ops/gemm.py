"""Backends: which one a recipe runs on a device, and the float8 matmuls.

`"emulated"` (any device: dequantize, float32 matmul), `"scaled_mm"` (the float8 GEMM of CUDA
devices of compute capability >= 8.9; `scaled_mm` here is the one place that calls it), and for
the per-tensor recipes `"triton"` (fused Triton casts, matmuls as `"auto"`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._core.device import cuda_capability, describe, scaled_mm_supported
from .._core.recipes import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    MXScaling,
    NVFP4Scaling,
    RowwiseScaling,
)
from .._numerics.cpu_fast import fast_widen
from .._numerics.fp8 import may_overwrite
from .._torch_private import scaled_mm as torch_scaled_mm


def matmul_backend(device: torch.device) -> str:
    """The float8 matmul of `backend="auto"` (per-tensor recipes) and of `"triton"` (which
    fuses the casts only) on `device`: `"scaled_mm"` where it has the float8 GEMM, else
    `"emulated"`."""
    return "scaled_mm" if scaled_mm_supported(device) else "emulated"


def resolve_backend(recipe, device: torch.device, api: str = "linear") -> str:
    """The backend `recipe` runs on `device`: `"emulated"`, `"scaled_mm"` or `"triton"`.

    `"auto"` is the verified path: `torch`'s float8 GEMM where the device has one, for the
    per-tensor recipes; emulation for the finer recipes (their GEMMs have not run on a GPU).

    Raises:
      ValueError: `backend="scaled_mm"` or `"triton"` on a device without the float8 GEMM and
        Triton's float8 type (compute capability below 8.9, or a device other than CUDA; the
        CPU's own path excepted: its reference kernel and Triton's interpreter are exact, for
        tests at small shapes).
    """
    backend = recipe.backend
    cpu_own_path = device.type == "cpu" and cuda_capability(device) is None
    if backend in ("scaled_mm", "triton") and not (cpu_own_path or scaled_mm_supported(device)):
        raise ValueError(
            f"fp8fn.{api}: {type(recipe).__name__}(backend={backend!r}) needs a CUDA device of "
            f"compute capability >= 8.9 (torch._scaled_mm; Triton's float8 type), got "
            f"{describe(device)}. Use backend='auto' (emulated there) or 'emulated'."
        )
    if isinstance(recipe, (DelayedScaling, CurrentScaling)):
        if backend == "auto":
            return matmul_backend(device)
        return backend
    if isinstance(recipe, (BlockwiseScaling, MXScaling, NVFP4Scaling)) or backend == "auto":
        return "emulated"
    assert isinstance(recipe, RowwiseScaling), recipe
    return backend


def _widen(fp8: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`(hp, factor)` with `fp8.float() == hp * factor` exactly; `hp` float32, fp8's shape.

    On CPU, `float8_e4m3fn.to(float32)` is slow (3.0 ms for 1024 x 1024 on one core, against
    0.5 ms for integer ops), so e4m3 goes through float16 bits instead, as one dispatched op
    (`cpu_fast.fast_widen`: the values times 2**-8, so `factor` 256; scaling by a power of two
    leaves the matmul's rounding as is). Only on CPU and from 64K elements: other devices
    convert natively, inductor vectorizes the plain conversion itself, and below that size the
    integer ops cost more.
    """
    small = fp8.numel() < 2**16  # below this the integer ops cost more than they save
    plain = fp8.dtype != torch.float8_e4m3fn or fp8.device.type != "cpu" or small
    if plain or torch.compiler.is_compiling():
        return fp8.float(), 1.0
    return fast_widen(fp8), 256.0


def _widen_stored(fp8: torch.Tensor, left: bool) -> tuple[torch.Tensor, float]:
    """`_widen` of a float8 GEMM operand, `left` (`a` of `a @ b`) or right (`b`).

    Compiled, a 2-D operand is widened in the order of its storage, then viewed as it is (the
    same values, bit for bit), for two reasons:

    * A transposed view widened as it is makes a transposed store, which inductor's CPU backend
      tiles (2-D, 16x16), and with more than one thread a scatter-add fused into such a tile (an
      embedding's backward) gets a wrong index: wrong gradients or heap corruption
      (tools/inductor_repro_embedding_tile.py, pytorch/pytorch#191837). So a transposed view of a
      row-major copy is widened as that copy, then transposed.
    * No widening in the backward may be one of the forward's: AOTAutograd would save that
      float32 tensor for the backward (4x the bytes) instead of the float8 copy. The forward's
      GEMM is `x @ w.T`, the backward's `g @ w` and `g.T @ x`: a left operand is widened
      flattened (a view of its storage), a right one that is row-major as it is, so `x` (left,
      then right) and `w` (right: transposed, then row-major) are widened once each way.

    Eager, `_widen` as it is (it keeps the layout; the views would be more dispatched ops).
    (Through float16 it would be the same values too, but inductor's CPU code converts float8
    to float16 element by element, 8x slower than to float32; a bitcast to uint8 and back,
    inductor removes.)"""
    if not torch.compiler.is_compiling() or fp8.dim() != 2:
        return _widen(fp8)
    if fp8.t().is_contiguous():
        stored = fp8.t()
        return stored.reshape(-1).float().view(stored.shape).t(), 1.0
    if left and fp8.is_contiguous():
        return fp8.reshape(-1).float().view(fp8.shape), 1.0
    return _widen(fp8)


class Widened(NamedTuple):
    """A float8 operand of the emulated matmul, widened once for several GEMMs (`fp8_mm` takes
    it in place of the float8 tensor): `hp * factor` is the float8 values, exactly."""

    hp: torch.Tensor  # float32, the float8 operand's shape and layout
    factor: float  # a power of two

    def t(self) -> Widened:
        return Widened(self.hp.t(), self.factor)


def widen_operand(fp8: torch.Tensor) -> Widened:
    """`fp8`, a left operand, widened as `fp8_mm`'s emulated matmul would widen it, for use in
    several GEMMs."""
    return Widened(*_widen_stored(fp8, left=True))


def _pad16(t: torch.Tensor, dim: int) -> torch.Tensor:
    extra = -t.shape[dim] % 16
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return F.pad(t.view(torch.uint8), pad).view(t.dtype)


def _column_major(t: torch.Tensor) -> bool:
    """`t.t().is_contiguous()` for a 2-D `t`, read from its strides (no dispatched view)."""
    rows, cols = t.shape
    return (rows <= 1 or t.stride(0) == 1) and (cols <= 1 or t.stride(1) == rows)


def scaled_mm(
    a, b, scale_a, scale_b, out_dtype: torch.dtype, fast_accum: bool = False
) -> torch.Tensor:
    """`(a @ b) * scale_a * scale_b` by torch's float8 GEMM, for any shapes and layouts.

    Args:
      a: float8 `(m, k)`; b: float8 `(k, n)` (a linear layer's weight transposed).
      scale_a, scale_b: float32 dequantization scales: `()` and `()` (per tensor), or `(m, 1)`
        and `(1, n)` (per row of `a` and per column of `b`: torch's row-wise scaled GEMM).
      out_dtype: the result's dtype.
      fast_accum: the GEMM's `use_fast_accum` (the recipe's `fast_accum` for this GEMM).

    Returns:
      `(m, n)` in `out_dtype`. (The GEMM wants `a` row-major, `b` column-major, and K and N
    multiples of 16, M any: K and N are padded with zeros (a column scale of a padded column of
    `b` with 1), operands copied to their layouts where they are not in them, the result
    sliced.)
    """
    n = b.shape[1]
    a = _pad16(a, 1).contiguous()
    if b.shape[0] % 16 or n % 16 or not _column_major(b):
        b = _pad16(_pad16(b.t(), 0), 1).contiguous().t()
    if scale_a.dim() == 2 and b.shape[1] != n:  # row-wise: padded columns of `b` scale by 1
        scale_b = F.pad(scale_b, (0, b.shape[1] - n), value=1.0)
    out = torch_scaled_mm(a, b, scale_a.contiguous(), scale_b.contiguous(), out_dtype, fast_accum)
    return out if out.shape[1] == n else out[:, :n]


def fp8_mm(a, b, inv_scale_a, inv_scale_b, out_dtype: torch.dtype, backend: str, fast_accum=False):
    """`(a @ b) * inv_scale_a * inv_scale_b` for float8 operands, accumulated in float32.

    Args:
      a: float8 `(m, k)`, any layout (or, emulated, a `Widened` one).
      b: float8 `(k, n)`, any layout (a linear layer's weight transposed; or a `Widened` one).
      inv_scale_a, inv_scale_b: float32 `()` dequantization scales (`1 / scale`).
      out_dtype: dtype of the result.
      backend: `"emulated"`, `"scaled_mm"`, or `"triton"` (Triton casts: the matmul is
        `scaled_mm` where supported, else emulated).
      fast_accum: `scaled_mm`'s (emulation ignores it).

    Returns:
      `(m, n)` tensor in `out_dtype`.
    """
    if backend == "triton":
        backend = matmul_backend(a.device)
    if backend == "scaled_mm":
        return scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, fast_accum)
    # Each operand is widened in the layout it comes in (compiled: `_widen_stored`).
    (a_hp, a_factor), (b_hp, b_factor) = (
        t if isinstance(t, Widened) else _widen_stored(t, left)
        for t, left in ((a, True), (b, False))
    )
    inv = inv_scale_a * inv_scale_b
    if a_factor * b_factor != 1.0:  # powers of two: exact
        inv = inv * (a_factor * b_factor)
    out = torch.mm(a_hp, b_hp)
    return (out.mul_(inv) if may_overwrite(out) else out * inv).to(out_dtype)
