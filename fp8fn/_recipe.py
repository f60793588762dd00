"""Recipes: frozen, validated, static configuration of how tensors are scaled to float8."""

from __future__ import annotations

import dataclasses

_BACKENDS = ("auto", "emulated", "scaled_mm")
_AMAX_COMPUTE = ("max", "most_recent")


def _check_backend(api: str, backend: object) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"fp8fn.{api}: expected `backend` in {_BACKENDS}, got {backend!r}.")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed per-tensor scaling: each cast uses a scale derived from an amax history.

    The scale of a cast is `fp8_max / (amax * 2**margin)`, where `amax` is the maximum of the
    history (`amax_compute="max"`) or its newest entry (`"most_recent"`). A history that is still
    all zeros means "never observed": that cast scales from the tensor itself (current scaling).

    Args:
      history_len: number of past amaxes kept per tensor, >= 1.
      amax_compute: `"max"` or `"most_recent"`.
      margin: non-negative integer; scales are divided by `2**margin` for headroom.
      backend: `"auto"` (`torch._scaled_mm` on CUDA devices of compute capability >= 8.9,
        emulation elsewhere), `"emulated"` or `"scaled_mm"`.

    Example:
      >>> import fp8fn
      >>> fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent")
      DelayedScaling(history_len=4, amax_compute='most_recent', margin=0, backend='auto')
    """

    history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    backend: str = "auto"

    def __post_init__(self):
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int):
            raise TypeError(
                f"fp8fn.DelayedScaling: expected `history_len` to be an int, "
                f"got {type(self.history_len).__name__} {self.history_len!r}."
            )
        if self.history_len < 1:
            raise ValueError(
                f"fp8fn.DelayedScaling: expected `history_len` >= 1, got {self.history_len}."
            )
        if self.amax_compute not in _AMAX_COMPUTE:
            raise ValueError(
                f"fp8fn.DelayedScaling: expected `amax_compute` in {_AMAX_COMPUTE}, "
                f"got {self.amax_compute!r}."
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise TypeError(
                f"fp8fn.DelayedScaling: expected `margin` to be an int, "
                f"got {type(self.margin).__name__} {self.margin!r}."
            )
        if self.margin < 0:
            raise ValueError(f"fp8fn.DelayedScaling: expected `margin` >= 0, got {self.margin}.")
        _check_backend("DelayedScaling", self.backend)


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Current (dynamic) per-tensor scaling: every cast scales from the tensor's own amax.

    Stateless: sites have no scaling state (`None`), and there is nothing to `update`.

    Args:
      backend: as for `DelayedScaling`.

    Example:
      >>> import fp8fn
      >>> fp8fn.CurrentScaling()
      CurrentScaling(backend='auto')
    """

    backend: str = "auto"

    def __post_init__(self):
        _check_backend("CurrentScaling", self.backend)


Recipe = DelayedScaling | CurrentScaling
RECIPES = (DelayedScaling, CurrentScaling)  # for isinstance checks
