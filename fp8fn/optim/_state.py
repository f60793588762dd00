"""The optimizer's state: a pytree of tensors (torch's pytree and optree, namespace "fp8fn"),
with the static config in its tree structure.

`AdamWState.mu` and `.nu` have the structure of the params; each leaf is the moment of one
parameter: a float32 (or bfloat16) tensor of the parameter's shape, or, block-scaled, a
`QuantizedMoment`. A DTensor parameter's moments are DTensors of its placements; a
`QuantizedMoment.scale` holds the scales of *all* the parameter's global blocks, the same plain
tensor on every rank (`_blocks`: a block cut by a shard is scaled alike on both sides).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .._core.state import register_state_class

MOMENTS = ("fp32", "bf16", "fp8")
MASTERS = (None, "bf16-sr")
# The float8 format of the moments, chosen by measurement (docs/optim.md): e4m3 for both, held
# as they are (a square root or COAT's expansion before the cast measured no better for nu).
MOMENT_FORMAT = "e4m3"


class QuantizedMoment(NamedTuple):
    """One parameter's moment in float8, block-scaled on the parameter's global flat index.

    Attributes:
      data: float8 of the parameter's shape (a DTensor of its placements for a DTensor).
      scale: float32 `(ceil(numel / block),)`, one per global block: the moment is
        `float32(data) / scale` of each element's block.
    """

    data: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass(frozen=True)
class MomentConfig:
    """What the state holds (static: in the tree structure, compared by `update`).

    Attributes:
      moments: "fp32", "bf16" or "fp8".
      block: elements per scaling block of the float8 moments.
      min_size: parameters of fewer elements (global) keep float32 moments.
      master: None (the params' own dtype) or "bf16-sr" (bfloat16 params, stochastic rounding).
    """

    moments: str = "fp32"
    block: int = 128
    min_size: int = 4096
    master: str | None = None


@dataclasses.dataclass(frozen=True)
class AdamWState:
    """The state of `fp8fn.optim.adamw`.

    Attributes:
      count: int64 `()`, the steps taken (a skipped step does not count).
      skipped: int64 `()`, the steps skipped for a non-finite gradient.
      mu: the first moments, the params' structure; each leaf a tensor of the parameter's shape
        (float32, or bfloat16 with `moments="bf16"`) or a `QuantizedMoment`.
      nu: the second moments, likewise.
      config: the `MomentConfig` (static).
      key: float64 `()`, an integer in `[0, 2**52)`: the stochastic rounding's key
        (`master="bf16-sr"`), else None (no leaf).
    """

    count: torch.Tensor
    skipped: torch.Tensor
    mu: object
    nu: object
    config: MomentConfig
    key: torch.Tensor | None = None

    def _replace(self, **fields) -> AdamWState:
        """A copy with `fields` replaced (the state is immutable)."""
        return dataclasses.replace(self, **fields)


register_state_class(AdamWState, ("count", "skipped", "mu", "nu"), lambda s: (s.config,))
torch.serialization.add_safe_globals([QuantizedMoment, MomentConfig])
for _cls in (QuantizedMoment, MomentConfig, AdamWState):
    _cls.__module__ = "fp8fn.optim"
