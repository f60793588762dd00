"""fp8fn: float8 training with delayed scaling as a pure, functional transform for PyTorch."""

from ._checkpoint import checkpoint
from ._distributed import all_reduce
from ._fsdp import float8_all_gather
from ._linear import linear
from ._quantize import compute_scale
from ._recipe import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    MXScaling,
    NVFP4Scaling,
    RowwiseScaling,
)
from ._routes import observations, observe, value_and_grad
from ._state import ScaleState, SiteState, State, flatten_state, init_state, unflatten_state
from ._transform import Transformed, transform
from ._update import merge, update

__all__ = [
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXScaling",
    "NVFP4Scaling",
    "RowwiseScaling",
    "ScaleState",
    "SiteState",
    "State",
    "Transformed",
    "all_reduce",
    "checkpoint",
    "compute_scale",
    "flatten_state",
    "float8_all_gather",
    "init_state",
    "linear",
    "merge",
    "observations",
    "observe",
    "transform",
    "unflatten_state",
    "update",
    "value_and_grad",
]
