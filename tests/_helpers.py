"""Shared test helpers (not a test module)."""

from __future__ import annotations

import torch

import fp8fn

FP8_MAX = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}
F32_MAX = torch.finfo(torch.float32).max


def expected_scale(amax: float, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """The scale `compute_scale` must give, modelled with Python floats (float64)."""
    if not (amax > 0 and amax != float("inf")):  # 0, negative, inf or NaN
        return torch.tensor(1.0)
    return torch.tensor(min(fp8_max / (amax * 2.0**margin), F32_MAX), dtype=torch.float32)


def observation(history_len: int, amax: float | None) -> fp8fn.ScaleState | None:
    """The observation of one role: `[amax, 0, ...]`, all else zero (None stays None)."""
    if amax is None:
        return None
    zero = torch.zeros(())
    history = torch.zeros(history_len)
    history[0] = amax
    return fp8fn.ScaleState(history, zero, zero, zero)


def site_obs(history_len: int, input=None, weight=None, grad_output=None) -> fp8fn.SiteState:
    """A `SiteState` of observations, one amax (or None) per role."""
    return fp8fn.SiteState(*(observation(history_len, a) for a in (input, weight, grad_output)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s float32 bits as int32 (so NaN == NaN and -0 != 0 when comparing)."""
    assert t.dtype == torch.float32, t.dtype
    return t.contiguous().view(torch.int32)


def assert_bit_identical(a, b) -> None:
    """Two pytrees have the same structure and bit-identical float32 leaves."""
    la, spec_a = torch.utils._pytree.tree_flatten(a)
    lb, spec_b = torch.utils._pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(bits(x), bits(y)), (x, y)
