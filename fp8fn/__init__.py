"""fp8fn: float8 training with delayed scaling as a pure, functional transform for PyTorch."""

from ._linear import linear
from ._recipe import CurrentScaling, DelayedScaling
from ._scaling import compute_scale, merge, update
from ._state import ScaleState, SiteState, init_site_state

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "ScaleState",
    "SiteState",
    "compute_scale",
    "init_site_state",
    "linear",
    "merge",
    "update",
]
