"""FSDP2 (`fully_shard`) bookkeeping of one transform: the parameter slots FSDP2 manages, and
the layers whose weights it all-gathers in float8 (`fp8fn.float8_all_gather`)."""

from __future__ import annotations

import contextlib
import dataclasses

from torch import nn

from .._core.owners import held, owner_of
from .._core.recipes import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    MXScaling,
    RowwiseScaling,
)
from .._core.registries import GATHER_SCALES
from .._core.state import site_name
from .._parallel.dtensor import sharded_operands
from .._parallel.fsdp_finer import FinerGatheredWeight, finer_scales
from .._parallel.fsdp_gather import (
    Float8GatheredWeight,
    ScalesForCall,
    is_float8_gathered,
    weight_scales,
)
from .._parallel.wrappers import is_fsdp_module, reshard_fsdp
from .._torch_private import module_parameters
from .experts import expert_rows


class Fsdp2:
    """What a `Transformed` knows of FSDP2 in its module; empty without FSDP2.

    Args:
      module: the transformed module.
      layers: its `_Layer`s that run in float8.
      experts: its `Experts` (the candidates `fn.init` confirms).

    Attributes:
      managed: `{name: (submodule, attribute, sharded parameter)}` of the parameters FSDP2
        manages (when `fully_shard` came after `transform`, `apply` reads the module into a
        new `Plan`, and so a new `Fsdp2`: `Plan.current`).
      gathered: `_Gathered`, one per layer or experts weight that FSDP2 all-gathers in float8.
    """

    def __init__(self, module, layers, experts=()):
        self.module = module
        self.managed = self._managed()
        self.gathered = self._float8_gathered(layers, experts)

    def _managed(self) -> dict:
        """`{name: (submodule, attribute, sharded parameter)}` of the parameters FSDP2 manages.

        FSDP2's hooks put each module's unsharded parameters on it for its forward and its
        sharded ones back after, so `apply` must leave these slots to FSDP2 (a swap by
        `functional_call` would be undone on its exit, leaving the module holding shards
        while FSDP2 counts it unsharded). Empty without FSDP2.
        """
        if not any(is_fsdp_module(m) for m in self.module.modules()):
            return {}
        reshard_fsdp(self.module)  # all shards in place (a forward may have left the root not)
        managed = {}
        for prefix, sub in self.module.named_modules():
            if not is_fsdp_module(sub):
                continue
            for name, p in sub.named_parameters():
                if sharded_operands(p):
                    full = f"{prefix}.{name}" if prefix else name
                    managed.setdefault(full, (*owner_of(self.module, full), p))
        return managed

    def without_params(self, params: dict) -> dict:
        """`params` without the FSDP2-managed parameters, which must be the model's own."""
        if not self.managed:
            return params
        for name, (module, attr, shard) in self.managed.items():
            given = params.get(name)
            own = module_parameters(module)[attr]
            if given is not None and given is not shard and given is not own:
                raise ValueError(
                    f"fp8fn.apply: expected `params[{name!r}]` to be the model's own parameter, "
                    f"which FSDP2 shards and gathers, got another tensor "
                    f"({type(given).__name__}). Pass `dict(model.named_parameters())`: under "
                    "FSDP2 the module's parameters are the ones that train."
                )
        return {k: v for k, v in params.items() if k not in self.managed}

    def _float8_gathered(self, layers, experts) -> list:
        """The layers and experts weights whose weights FSDP2 all-gathers in float8
        (`fp8fn.float8_all_gather`); raises unless each runs in float8 with a per-tensor or
        finer recipe (not NVFP4) and is sharded."""
        gathered = [_Gathered(m.path, m.module, m.attrs[0], m.recipe, m.path) for m in layers]
        gathered += [_Gathered(e.path, e.module, e.attr, e.recipe, e.expert(0)) for e in experts]
        gathered = [g for g in gathered if is_float8_gathered(g.held())]
        weights = {id(g.held()) for g in gathered}
        for name, p in self.module.named_parameters():
            if is_float8_gathered(p) and id(p) not in weights:
                raise ValueError(
                    f"fp8fn.transform: parameter {name!r} is all-gathered in float8 "
                    "(fp8fn.float8_all_gather), but its layer (or experts weight) does not run "
                    "in float8 under this transform (left out by `filter_fn` or its recipe). "
                    "Give float8_all_gather the same `filter_fn` as fp8fn.transform."
                )
        for g in gathered:
            kind = "layer" if g.held().dim() < 3 else "experts weight"
            if not isinstance(g.recipe, (DelayedScaling, CurrentScaling, *_FINER)):
                names = "DelayedScaling, CurrentScaling, " + ", ".join(f.__name__ for f in _FINER)
                raise ValueError(
                    f"fp8fn.transform: expected {kind} {g.path!r}, whose weight is all-gathered "
                    f"in float8 (fp8fn.float8_all_gather), to use {names}, got "
                    f"{type(g.recipe).__name__} (not gathered in float8: {_NOT_GATHERED}). "
                    "Leave it out of float8_all_gather."
                )
            weight = g.held()
            gathered_now = isinstance(weight, (Float8GatheredWeight, FinerGatheredWeight))
            if not (sharded_operands(weight) or gathered_now):
                raise ValueError(
                    f"fp8fn.transform: expected the float8_all_gather weight of {kind} "
                    f"{g.path!r} to be sharded by FSDP2, got an unsharded weight. Call "
                    "fully_shard after fp8fn.float8_all_gather and before fp8fn.transform."
                )
        return gathered

    def refuse_unused(self, confirmed: set):
        """Raise when a float8-gathered 3-D weight is not an experts weight `fn.init` saw in
        a GEMM (`confirmed`): it would be used dequantized, in high precision."""
        for g in self.gathered:
            if g.held().dim() >= 3 and g.path not in confirmed:
                raise ValueError(
                    f"fp8fn.init: expected {g.path!r}, whose weight is all-gathered in float8 "
                    "(fp8fn.float8_all_gather chose it as an experts weight), to be used as an "
                    "experts weight in a GEMM, got no such use in the example's forward pass. "
                    f"Leave it out of float8_all_gather with `filter_fn`."
                )

    def scales(self, state):
        """Inside, FSDP2's float8 all-gathers cast with the weight scales of `state` (None while
        discovering); nothing without such all-gathers."""
        if not self.gathered:
            return contextlib.nullcontext()
        if state is None:
            _reshard_gathered(self.module, self.gathered)
            finer = finer_scales(self._finer_entries(), discovering=True)
            return _scales_for_call(ScalesForCall(None, discovering=finer))
        return _scales_for_call(self._weight_scales(state))

    def _finer_entries(self) -> list:
        """`(module, attr, recipe)` of the float8-gathered weights under finer recipes."""
        return [(g.module, g.attr, g.recipe) for g in self.gathered if isinstance(g.recipe, _FINER)]

    def _weight_scales(self, state) -> ScalesForCall:
        """The weight scales of this call's float8 all-gathers (`_parallel/fsdp_gather.py`,
        `_parallel/fsdp_finer.py`)."""
        _reshard_gathered(self.module, self.gathered)
        positions = state._positions()

        def row(g):  # the state row of its (first expert's) first site
            if not isinstance(g.recipe, DelayedScaling):
                return None
            weight = g.held()
            if weight.dim() < 3:
                return positions[site_name(g.site, 0)]
            return expert_rows("apply", positions, g.path, len(weight), 0)

        entries = [
            (g.module, g.attr, row(g), getattr(g.recipe, "margin", 0))
            for g in self.gathered
            if not isinstance(g.recipe, _FINER)
        ]
        scales = weight_scales(entries, state) if entries else {}
        finer = self._finer_entries()
        return ScalesForCall({**scales, **(finer_scales(finer) if finer else {})})


_FINER = (RowwiseScaling, BlockwiseScaling, MXScaling)  # gathered one plane per phase
_NOT_GATHERED = "NVFP4Scaling, whose FP4 weight planes FSDP2 gathers in high precision"


@dataclasses.dataclass(frozen=True, eq=False)
class _Gathered:
    """A layer's weight, or an experts weight, that FSDP2 all-gathers in float8."""

    path: str  # the layer's (an experts weight: the weight's) name
    module: nn.Module = dataclasses.field(repr=False)  # the module holding the weight
    attr: str  # the weight's name on `module`
    recipe: object
    site: str  # the layer path of the first site (an experts weight: expert 0's, `path[0]`)

    def held(self):
        """The weight the module holds now (FSDP2 swaps its shard and the unsharded weight)."""
        return held(self.module, self.attr)


def _reshard_gathered(module, gathered):
    """A weight still gathered from an earlier forward without backward (FSDP2 keeps the root
    unsharded) holds that call's scales: reshard `module`, so it is gathered again."""
    if any(not sharded_operands(g.held()) for g in gathered):
        reshard_fsdp(module)


@contextlib.contextmanager
def _scales_for_call(scales: ScalesForCall):
    token = GATHER_SCALES.set(scales)
    try:
        yield
    finally:
        GATHER_SCALES.reset(token)
