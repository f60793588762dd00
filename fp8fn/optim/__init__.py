"""fp8fn.optim: optimizers as pure functions over pytrees, with block-scaled float8 moments
whose bits do not depend on how the parameters are sharded (docs/optim.md)."""

from ._adamw import PureOptimizer, adamw
from ._clip import clip_by_global_norm
from ._state import AdamWState, MomentConfig, QuantizedMoment
from ._torch_optim import AdamW

__all__ = [
    "AdamW",
    "AdamWState",
    "MomentConfig",
    "PureOptimizer",
    "QuantizedMoment",
    "adamw",
    "clip_by_global_norm",
]
