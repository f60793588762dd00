"""fp8fn: float8 training with delayed scaling as a pure, functional transform for PyTorch."""

from ._checkpoint import checkpoint
from ._linear import linear
from ._recipe import CurrentScaling, DelayedScaling
from ._scaling import compute_scale, merge, update
from ._state import ScaleState, SiteState, flatten_state, init_site_state, unflatten_state
from ._transform import Transformed, transform

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "ScaleState",
    "SiteState",
    "Transformed",
    "checkpoint",
    "compute_scale",
    "flatten_state",
    "init_site_state",
    "linear",
    "merge",
    "transform",
    "unflatten_state",
    "update",
]
