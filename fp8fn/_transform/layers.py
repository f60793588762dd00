"""Layer discovery: the linear layers of a module that run in float8, and their recipes."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from .._core.recipes import RECIPES


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

    def held(self):
        """The weight the module holds now (FSDP2 swaps its shard and the unsharded weight)."""
        return self.module._parameters.get(self.attrs[0])

    def holds(self, weight) -> bool:
        """Whether `weight` is what the module holds now."""
        return self.held() is weight

    def own(self, tensors: dict):
        """`(weight, bias)` this layer runs with: from `tensors`, else the module's own."""
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


def _linear_base(module):
    """The base class of a linear-like module fp8fn converts (nn.Linear, HF Conv1D), or None."""
    if isinstance(module, nn.Linear):
        return nn.Linear
    if _is_hf_conv1d(module):
        return next(c for c in type(module).__mro__ if c.__name__ == "Conv1D")
    return None


def _recipe_for(recipe, name, module):
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


def _find_layers(module, recipe, filter_fn) -> list[_Layer]:
    """The linear layers that run in float8, in module order: nn.Linear (and subclasses that
    keep its forward), HF Conv1D, and nn.MultiheadAttention's projections (`<path>.in_proj`, or
    `q_proj`/`k_proj`/`v_proj`, and its `out_proj`). Warns when there are none."""
    names = {id(p): n for n, p in module.named_parameters()}  # tied: the first name
    layers = []

    def add(name, sub, attrs, transposed):
        if filter_fn is not None and not filter_fn(name, sub):
            return
        chosen = _recipe_for(recipe, name, sub)
        if chosen is None:
            return
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
            )
        )

    for name, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention):
            for path, weight, bias in _attention_layers(name, sub, names):
                add(path, sub, (weight, bias), False)
            continue
        base = _linear_base(sub)
        if base is None:
            continue
        refuse = None
        if type(sub).forward is not base.forward:
            refuse = f"a {type(sub).__name__}, a {base.__name__} subclass with its own forward"
        elif torch.nn.utils.parametrize.is_parametrized(sub, "weight"):
            refuse = "parametrized (torch.nn.utils.parametrize: its weight is made at each use)"
        if refuse and (filter_fn is None or filter_fn(name, sub)):
            raise TypeError(
                f"fp8fn.transform: layer {name!r} is {refuse}, which fp8fn cannot convert "
                "faithfully. Leave it in high precision with `filter_fn=lambda name, module: "
                f"name != {name!r}`."
            )
        add(name, sub, ("weight", "bias"), base is not nn.Linear)
    if not layers:
        warnings.warn(
            "fp8fn.transform: no layer was converted to float8, so the model runs entirely in "
            "high precision. fp8fn converts nn.Linear, HF Conv1D and nn.MultiheadAttention's "
            "projections, chosen by `filter_fn` and given a recipe.",
            stacklevel=3,
        )
    return layers
