"""Float8 matmul backends: emulation (any device) and `torch._scaled_mm` (CUDA, sm >= 8.9).

Both compute `(a_fp8 @ b_fp8) * (inv_scale_a * inv_scale_b)` with float32 accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend `"auto"` stands for on `device`: `"scaled_mm"` or `"emulated"`."""
    if backend != "auto":
        return backend
    return "scaled_mm" if scaled_mm_supported(device) else "emulated"


def _widen(fp8: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`(hp, factor)` with `fp8.float() == hp * factor` exactly; `hp` float32, fp8's shape.

    On CPU, `float8_e4m3fn.to(float32)` is slow (785 us for 512 x 512 on one core, against
    193 us for these integer ops), so e4m3 goes through float16 bits instead. Its seven
    magnitude bits placed at float16's bit 7 give the value times 2**-8 (float16's exponent bias
    is 15, e4m3's 7; subnormals land on float16 subnormals), and magnitude 0x7F (NaN) gets
    float16's all-ones exponent. Scaling by a power of two leaves the matmul's rounding as is.
    """
    small = fp8.numel() < 2**16  # below this the seven integer ops cost more than they save
    if fp8.dtype != torch.float8_e4m3fn or small or torch.compiler.is_compiling():
        return fp8.float(), 1.0  # (inductor vectorizes the plain conversion itself)
    bits = fp8.view(torch.uint8).to(torch.int16)
    magnitude, sign = bits & 0x7F, (bits >> 7) * -32768
    nan = (magnitude + 1) >> 7  # 1 for magnitude 0x7F only
    half = (magnitude << 7) | (nan * 0x7C00) | sign
    return half.view(torch.float16).float(), 256.0


def pad16(t: torch.Tensor, dim: int) -> torch.Tensor:
    extra = -t.shape[dim] % 16
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return F.pad(t.view(torch.uint8), pad).view(t.dtype)


def fp8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_scale_a: torch.Tensor,
    inv_scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """`(a @ b.T) * inv_scale_a * inv_scale_b` for float8 operands, accumulated in float32.

    Args:
      a: float8 `(m, k)`, any layout.
      b: float8 `(n, k)`, any layout (a linear layer's weight layout).
      inv_scale_a, inv_scale_b: float32 `()` dequantization scales (`1 / scale`).
      out_dtype: dtype of the result.
      backend: `"emulated"`, `"scaled_mm"`, or `"triton"` (Triton casts: the matmul is
        `torch._scaled_mm` where supported, else emulated).

    Returns:
      `(m, n)` tensor in `out_dtype`.
    """
    if backend == "triton":
        backend = "scaled_mm" if scaled_mm_supported(a.device) else "emulated"
    if backend == "emulated":
        # Each operand is widened in the layout it comes in: the backward widens transposed
        # views of the saved float8 copies, which are not the forward's graph nodes, so when
        # compiled AOTAutograd cannot save the forward's float32 widening (4x the bytes).
        (a_hp, a_factor), (b_hp, b_factor) = _widen(a), _widen(b)
        inv = inv_scale_a * inv_scale_b
        if a_factor * b_factor != 1.0:  # powers of two: exact
            inv = inv * (a_factor * b_factor)
        return (torch.mm(a_hp, b_hp.t()) * inv).to(out_dtype)
    # torch._scaled_mm: `a` row-major, `b` column-major, every dimension a multiple of 16.
    m, n = a.shape[0], b.shape[0]
    a = pad16(pad16(a, 0), 1).contiguous()
    b = pad16(pad16(b, 0), 1).contiguous()
    out = torch._scaled_mm(a, b.t(), scale_a=inv_scale_a, scale_b=inv_scale_b, out_dtype=out_dtype)
    return out if out.shape == (m, n) else out[:m, :n]
