"""Casts between high precision and float8, with saturation."""

from __future__ import annotations

import torch


def amax(hp: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of `hp` (any shape, floating), as a float32 `()` tensor.

    One kernel. NaN in `hp` gives NaN, an empty `hp` gives 0 (both of which `update` ignores).
    """
    if hp.numel() == 0:
        return hp.new_zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(hp, float("inf")).float()


def cast_to_fp8(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`saturate(hp * scale)` in float8 `dtype`.

    Args:
      hp: floating tensor of any shape; the product is taken in float32.
      scale: float32 `()` tensor, finite and > 0.
      dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.

    Returns:
      Tensor of `hp`'s shape in `dtype`; values beyond the format's max become +-max.
    """
    fp8_max = torch.finfo(dtype).max
    return (hp.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
