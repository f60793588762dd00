"""fp8fn: float8 training with delayed scaling as a functional transform for PyTorch: the scaling
state is data, passed in and returned.

Layers, lowest first. A module imports from its own layer and the layers below it, never from
one above (`tests/test_layers.py` walks every import, also those inside functions):

    _torch_private  every private torch API fp8fn uses (the fence, scanned by a test)
    _torch_errors   torch's own error wording, matched and told as fp8fn errors
    _numerics       float8 and NVFP4 formats, scales, amaxes and casts: tensors in, tensors out
    _core           recipes, state, observations, update, keys, checks, whose error it is, and
                    everything kept outside the state (registries.py: marks, registries)
    _kernels        the fused Triton casts
    _ops            the float8 autograd ops: per-tensor, rowwise/blockwise/MX, NVFP4, grouped
    _parallel       DTensor, FSDP2's float8 all-gather, all_reduce, the experts' exchange
    _transform      transform, Transformed, checkpoint, expert_parallel: the user's module
    optim           fp8fn.optim, the pure AdamW with quantized moments
    testing         fp8fn.testing, the CUDA contract checked on CPU
    fp8fn           this file: the public names
    demo            the demo model and its training loop, run by `python -m fp8fn.demo`
"""

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
