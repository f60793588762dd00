"""fp8fn: float8 training with delayed scaling as a pure, functional transform for PyTorch."""

__version__ = "0.5.0.dev0"  # the one place of the version (pyproject.toml reads it)

from . import optim
from ._core.observe import observations, observe, value_and_grad
from ._core.recipes import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    MXScaling,
    NVFP4Scaling,
    Recipe,
    RowwiseScaling,
)
from ._core.state import (
    ScaleState,
    SiteState,
    State,
    flatten_state,
    init_state,
    stack_states,
    unflatten_state,
)
from ._core.update import fold_in, merge, update
from ._numerics.fp8 import compute_scale
from ._ops.linear import linear
from ._parallel.all_reduce import all_reduce
from ._parallel.fsdp_gather import float8_all_gather
from ._transform.checkpoint import checkpoint
from ._transform.expert_parallel import expert_parallel
from ._transform.transformed import Transformed, transform

__all__ = [
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXScaling",
    "NVFP4Scaling",
    "Recipe",
    "RowwiseScaling",
    "ScaleState",
    "SiteState",
    "State",
    "Transformed",
    "__version__",
    "all_reduce",
    "checkpoint",
    "compute_scale",
    "expert_parallel",
    "flatten_state",
    "float8_all_gather",
    "fold_in",
    "init_state",
    "linear",
    "merge",
    "observations",
    "observe",
    "optim",
    "stack_states",
    "transform",
    "unflatten_state",
    "update",
    "value_and_grad",
]
