"""Layer discovery: the linear layers of a module that run in float8, and their recipes."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from .._core.owners import held, owner_of
from .._core.recipes import RECIPES
from .._torch_private import module_buffers, module_parameters


@dataclasses.dataclass(frozen=True, eq=False)
class _Layer:
    """A layer that runs in float8: its module path, its parameters' names, its recipe."""

    path: str
    weight: str  # the weight's name in `module.named_parameters()` (the first name when tied)
    bias: str | None
    recipe: object
    transposed: bool  # HF Conv1D: weight stored `(in, out)`, called through torch.addmm
    module: nn.Module = dataclasses.field(repr=False)  # the module holding the weight
    attrs: tuple = ("weight", "bias")  # the weight's and the bias's names on `module`
    slot: str = ""  # the weight's own name: `<module path>.<attrs[0]>` (not the first when tied)

    def held(self):
        """The weight the module holds now (FSDP2 swaps its shard and the unsharded weight)."""
        return held(self.module, self.attrs[0])

    def holds(self, weight) -> bool:
        """Whether `weight` is what the module holds now."""
        return self.held() is weight

    def own(self, tensors: dict):
        """`(weight, bias)` this layer runs with: from `tensors` (given under the weight's own
        name, else under its first name), else the module's own."""
        weight = tensors.get(self.slot)
        if weight is None:
            weight = tensors.get(self.weight)
        if weight is None:
            weight = getattr(self.module, self.attrs[0])
        if self.bias is None:
            return weight, None
        bias = tensors.get(self.bias)
        return weight, getattr(self.module, self.attrs[1]) if bias is None else bias


def _is_hf_conv1d(module) -> bool:
    """HF transformers' `Conv1D` (GPT-2 family): a linear layer with its weight `(in, out)`.

    Duck-typed, so that transformers stays an optional dependency.
    """
    return any(
        c.__name__ == "Conv1D" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def linear_base(module):
    """The base class of a linear-like module fp8fn converts (nn.Linear, HF Conv1D), or None."""
    if isinstance(module, nn.Linear):
        return nn.Linear
    if _is_hf_conv1d(module):
        return next(c for c in type(module).__mro__ if c.__name__ == "Conv1D")
    return None


def recipe_for(recipe, name, module):
    """The recipe of one layer: `recipe` itself, or `recipe(name, module)` when a function."""
    chosen = recipe if isinstance(recipe, RECIPES) else recipe(name, module)
    if chosen is not None and not isinstance(chosen, RECIPES):
        raise TypeError(
            f"fp8fn.transform: expected the recipe of layer {name!r} to be an fp8fn recipe "
            f"(e.g. fp8fn.DelayedScaling()) or None, got {type(chosen).__name__}."
        )
    return chosen


def _attention_layers(path: str, attention: nn.MultiheadAttention, names: dict):
    """`[(path, weight attr, bias attr)]` of an nn.MultiheadAttention's input projections: one
    packed `in_proj`, or `q_proj`, `k_proj`, `v_proj` (its `out_proj` is an nn.Linear)."""
    prefix = f"{path}." if path else ""
    if attention.in_proj_weight is not None:
        return [(f"{prefix}in_proj", "in_proj_weight", "in_proj_bias")]
    return [(f"{prefix}{r}_proj", f"{r}_proj_weight", "in_proj_bias") for r in "qkv"]


def _computed_attribute(layer, attrs=("weight", "bias")) -> str | None:
    """Why `layer`'s weight or bias (`attrs`) is not a tensor it holds but one made at each
    call (a parametrization, or a forward pre-hook as in torch.nn.utils.prune, weight_norm and
    spectral_norm), else None: fp8fn knows a layer's weight by identity, so such a layer
    cannot be converted."""
    for attr in attrs:
        if torch.nn.utils.parametrize.is_parametrized(layer, attr):
            return f"has its {attr} parametrized (torch.nn.utils.parametrize: made at each use)"
        if attr in module_parameters(layer) or attr in module_buffers(layer):
            continue
        if isinstance(getattr(layer, attr, None), torch.Tensor):
            return (
                f"has its {attr} made by a forward pre-hook at each call (torch.nn.utils.prune, "
                "weight_norm or spectral_norm)"
            )
    return None


def find_layers(module, recipe, filter_fn, warn=True, gates=frozenset()) -> list[_Layer]:
    """The linear layers that run in float8, in module order: nn.Linear (and subclasses that
    keep its forward), HF Conv1D, and nn.MultiheadAttention's projections (`<path>.in_proj`, or
    `q_proj`/`k_proj`/`v_proj`, and its `out_proj`), but not the modules with a path in `gates`
    (routers and gates: high precision; under any of its paths, for a module shared by blocks).
    Warns when there are none and `warn`.

    A subclass with its own forward (Llama 4's router) is not converted: what it computes
    with its weight is its own; `fn.init` reports its GEMMs that run in high precision."""
    named = (*module.named_parameters(), *module.named_buffers())
    names = {id(t): n for n, t in named}  # tied: the first name (a frozen bias may be a buffer)
    layers = []

    paths = {}  # every path of each submodule: a router shared by blocks is a gate by any
    for name, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(name)

    def add(name, sub, attrs, transposed):
        if (
            name in gates
            or not isinstance(sub, nn.MultiheadAttention)
            and gates & {*paths[id(sub)]}
        ):
            return
        if filter_fn is not None and not filter_fn(name, sub):
            return
        chosen = recipe_for(recipe, name, sub)
        if chosen is None:
            return
        module_path = name.rpartition(".")[0] if isinstance(sub, nn.MultiheadAttention) else name
        bias = getattr(sub, attrs[1])
        layers.append(
            _Layer(
                path=name,
                weight=names[id(getattr(sub, attrs[0]))],
                bias=None if not isinstance(bias, torch.Tensor) else names[id(bias)],
                recipe=chosen,
                transposed=transposed,
                module=sub,
                attrs=attrs,
                slot=f"{module_path}.{attrs[0]}" if module_path else attrs[0],
            )
        )

    def refuse(name, sub, why):
        if why and (filter_fn is None or filter_fn(name, sub)):
            raise TypeError(
                f"fp8fn.transform: layer {name!r} {why}, which fp8fn cannot convert "
                "faithfully. Leave it in high precision with `filter_fn=lambda name, module: "
                f"name != {name!r}`."
            )

    for name, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention):
            for path, weight, bias in _attention_layers(name, sub, names):
                refuse(path, sub, _computed_attribute(sub, (weight, bias)))
                add(path, sub, (weight, bias), False)
            continue
        base = linear_base(sub)
        if base is None:
            continue
        if type(sub).forward is not base.forward:
            continue
        refuse(name, sub, _computed_attribute(sub))
        add(name, sub, ("weight", "bias"), base is not nn.Linear)
    if not layers and warn:
        warnings.warn(
            "fp8fn.transform: no layer was converted to float8, so the model runs entirely in "
            "high precision. fp8fn converts nn.Linear, HF Conv1D, nn.MultiheadAttention's "
            "projections and experts weights (3-D parameters that reach a GEMM), chosen by "
            "`filter_fn` and given a recipe. `filter_fn(name, module)` is asked with a layer's "
            "path for a layer (e.g. 'model.layers.0.mlp.down_proj') and with the weight's name "
            "for an experts weight (e.g. 'model.layers.0.mlp.experts.gate_up_proj', `module` "
            "its owner).",
            stacklevel=4,
        )
    return layers


def is_linear_weight(module, name: str) -> bool:
    """Whether the tensor `name` of `module` is the weight of a linear layer fp8fn converts
    (chosen or not): an nn.Linear's or HF Conv1D's, or an nn.MultiheadAttention projection's."""
    sub, attr = owner_of(module, name)
    if isinstance(sub, nn.MultiheadAttention):
        return attr.endswith("proj_weight")
    return attr == "weight" and linear_base(sub) is not None
