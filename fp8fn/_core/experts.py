"""Experts weights: the 3-D floating parameters of a module that `filter_fn` gives a recipe,
and the routers and gates next to them (found by structure, never by class name).

Read by `fp8fn.transform` (`_transform/`) and by `fp8fn.float8_all_gather` (`_parallel/`); how a
forward reaches these weights is `_transform/experts.py`'s.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._torch_private import is_convolution
from .owners import owner_of


@dataclasses.dataclass(frozen=True, eq=False)
class Experts:
    """A 3-D weight whose GEMMs run per expert in float8.

    Its sites are `path[e]` (expert e's first call), `path[e]#k` for its k-th further call.
    """

    path: str  # the weight's name in `module.named_parameters()` (first name when tied)
    module: nn.Module = dataclasses.field(repr=False)  # the module holding it
    attr: str  # its name on `module`
    recipe: object
    experts: int  # E, its leading dim

    def own(self, tensors: dict):
        """The weight this call runs with: from `tensors`, else the module's own."""
        weight = tensors.get(self.path)
        return getattr(self.module, self.attr) if weight is None else weight

    def expert(self, e: int) -> str:
        """The layer path of expert `e` (its sites are `site_name(path, k)`)."""
        return f"{self.path}[{e}]"


def find_experts(module, choose) -> list[Experts]:
    """The 3-D floating parameters of `module` that `choose(name, owner)` gives a recipe
    (torch's convolutions' weights are not asked about: their op is a convolution; nor are
    uninitialized parameters of lazy modules: torch's are linear or convolution weights)."""
    found = []
    for name, p in module.named_parameters():
        if is_lazy(p) or p.dim() != 3 or not p.is_floating_point():
            continue  # (a lazy module's parameter has no shape before its first forward)
        owner, attr = owner_of(module, name)
        if is_convolution(owner):
            continue
        chosen = choose(name, owner)
        if chosen is not None:
            found.append(Experts(name, owner, attr, chosen, p.shape[0]))
    return found


def find_gates(module, experts: list[Experts]) -> set[str]:
    """The paths of the routers and gates next to `experts`: the direct children with a 2-D
    `weight` (an `nn.Linear`, or a router that calls `F.linear` on its own weight, as
    transformers' `*TopKRouter`) of the module holding an experts weight, or, when it has none,
    of that module's parent (transformers' `mlp` holding `experts`, `gate`,
    `shared_expert_gate`), with at most that weight's number of experts E outputs (rows of
    `weight`: a router scores the E experts; a gate such as Qwen2-MoE's `shared_expert_gate`
    gives 1 output). Their GEMMs are tiny and decide which experts run, so they stay in high
    precision by default."""
    gates = set()

    def weighted_children(path):
        prefix = f"{path}." if path else ""
        return [
            (prefix + n, c)
            for n, c in module.get_submodule(path).named_children()
            if isinstance(w := getattr(c, "weight", None), torch.Tensor)
            and not is_lazy(w)  # (a lazy layer's shape is not known before its first call)
            and w.dim() == 2
        ]

    for entry in experts:
        owner_path = entry.path.rpartition(".")[0]
        near = weighted_children(owner_path) or weighted_children(owner_path.rpartition(".")[0])
        gates.update(n for n, c in near if c.weight.shape[0] <= entry.experts)
    return gates
