"""Casts between high precision and float8, with saturation."""

from __future__ import annotations

import torch

from ._scaling import FP8_MAX, compute_scale


def amax(hp: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of `hp` (any shape, floating), as a float32 `()` tensor.

    NaN in `hp` gives NaN, an empty `hp` gives 0 (both of which `update` then ignores).
    """
    if hp.numel() == 0:
        return hp.new_zeros((), dtype=torch.float32)
    return hp.abs().amax().float()


def cast_to_fp8(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`saturate(hp * scale)` in float8 `dtype`.

    Args:
      hp: floating tensor of any shape; the product is taken in float32.
      scale: float32 `()` tensor, finite and > 0.
      dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.

    Returns:
      Tensor of `hp`'s shape in `dtype`; values beyond the format's max become +-max.
    """
    fp8_max = FP8_MAX[dtype]
    return (hp.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def choose_scale(
    history: torch.Tensor, stored: torch.Tensor, hp_amax: torch.Tensor, margin, fp8_max: float
) -> torch.Tensor:
    """The scale a cast uses: the stored one, or current scaling while `history` is empty.

    Args:
      history: float32 `(history_len,)`, newest first; `history[0] == 0` means never observed.
      stored: float32 `()` scale from the state.
      hp_amax: float32 `()` amax of the tensor being cast.
      margin: float32 `()` or a float.

    Returns:
      float32 `()` scale, finite and > 0.
    """
    return torch.where(history[0] > 0, stored, compute_scale(hp_amax, fp8_max, margin))
