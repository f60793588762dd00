"""The checks of `fp8fn.transform`'s and `fn.apply`'s arguments (`apply`'s against the `Plan`):
each a clear `fp8fn.` error, raised before anything runs."""

from __future__ import annotations

import functools

import torch
from torch import nn

from .._core.checks import check_function
from .._core.observe import refuse_untrained_backward
from .._core.owners import held
from .._core.recipes import RECIPES, DelayedScaling
from .._core.state import (
    check_scales,
    check_state,
    claim,
    parse_site,
    site_name,
    warn_if_never_updated,
    warn_if_superseded,
)
from .._torch_private import recomputing_in_torch_checkpoint
from .plan import Plan

# The parameters of the user's choice functions: the recipe function, `filter_fn`, `checkpoint_fn`.
_CHOICE = ("name", "module")


def check_transform(module, recipe, filter_fn, checkpoint_fn) -> None:
    """Raise unless `fp8fn.transform`'s arguments have the types it takes."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fp8fn.transform: expected `module` to be an nn.Module, got {type(module).__name__}."
        )
    if isinstance(recipe, type) and issubclass(recipe, RECIPES):
        raise TypeError(
            f"fp8fn.transform: expected `recipe` to be a recipe instance, got the class "
            f"{recipe.__name__}. Pass an instance: fp8fn.{recipe.__name__}()."
        )
    if not (isinstance(recipe, RECIPES) or callable(recipe)):
        raise TypeError(
            "fp8fn.transform: expected `recipe` to be an fp8fn recipe (e.g. "
            "fp8fn.DelayedScaling()) or a function (name, module) -> recipe or None, "
            f"got {type(recipe).__name__}."
        )
    if not isinstance(recipe, RECIPES):
        check_function("transform", "recipe", recipe, _CHOICE, "recipe or None")
    for arg, f in (("filter_fn", filter_fn), ("checkpoint_fn", checkpoint_fn)):
        if f is not None:
            check_function("transform", arg, f, _CHOICE, "bool")


def check_apply(plan: Plan, params, state) -> None:
    """Raise unless `fn.apply`'s `params` and `state` fit `plan` (but for the state's sites:
    `check_sites`); warn about a state superseded by `update`, or never updated."""
    if not isinstance(params, dict):
        raise TypeError(
            f"fp8fn.apply: expected `params` to be a dict of tensors keyed like "
            f"module.named_parameters(), got {type(params).__name__}."
        )
    first = plan.slots.first
    if not params.keys() <= first.keys():
        raise ValueError(
            "fp8fn.apply: `params` must be keyed like module.named_parameters() (or "
            f"named_buffers()); unexpected {sorted(params.keys() - first.keys())}. "
            "Key them as the model is now (apply re-reads parameters and submodules "
            "changed after fp8fn.transform; a buffer registered after it needs a new "
            "fp8fn.transform)."
        )
    check_state("apply", state)
    check_scales("apply", state.scale)
    warn_if_superseded("apply", state)
    warn_if_never_updated("apply", state, params)
    refuse_untrained_backward(params, functools.partial(held, plan.module), state)
    if plan.ddp_param is not None and torch.is_grad_enabled():
        name, own = plan.ddp_param
        if params.get(name, own) is not own:
            raise ValueError(
                "fp8fn.apply: a DistributedDataParallel model averages gradients only in "
                "loss.backward() into its own parameters, and these are other tensors "
                "(torch.func.grad, fp8fn.value_and_grad): gradients would silently differ "
                "across ranks. Use plain autograd with `dict(ddp.named_parameters())` "
                "(fp8fn.observe, loss.backward()), or transform the model without DDP and "
                "all-reduce the gradients yourself."
            )
    if state.key is None and plan.needs_key:
        raise ValueError(
            "fp8fn.apply: expected `state` with a random key (`state.key`) for the model's "
            "NVFP4Scaling layers, got a state without one. Make it with fn.init(..., seed=...) "
            "of this transform."
        )
    recipe = plan.delayed
    if recipe is not None and (
        state.history_len != recipe.history_len
        or (state.amax_compute, state.margin) != (recipe.amax_compute, recipe.margin)
    ):
        raise ValueError(
            f"fp8fn.apply: `state` was made for another recipe: {state!r} with history_len "
            f"{state.history_len}, but the model's layers use {recipe}. Make it with fn.init."
        )


def check_sites(plan: Plan, state) -> None:
    """Raise unless `state` has a site for each stateful layer and confirmed experts weight of
    `plan`, and none of another layer."""
    missing = [p for p in plan.stateful if site_name(p, 0) not in state] + [
        e.expert(0)
        for e in plan.experts
        if e.path in plan.confirmed
        and isinstance(e.recipe, DelayedScaling)
        and e.expert(0) not in state
    ]
    extra = [n for n in state.sites if parse_site(n)[0] not in plan.known_paths]
    if missing or extra:
        raise ValueError(
            "fp8fn.apply: `state` does not belong to this model: "
            f"missing sites {missing}, unknown sites {extra}. Make it with fn.init."
        )


def claim_for_apply(state) -> None:
    """Mark `state.amax_history` as used by this `apply` when gradients are recorded for it
    (`claim`): raise when it already took part in another `apply` of that gradient."""
    try:
        claim(state.amax_history, "apply", "state")
    except RuntimeError:
        # torch.utils.checkpoint around apply: its recompute reruns the forward whose
        # observations are recorded (bit for bit), and observes nothing a second time.
        if not recomputing_in_torch_checkpoint():
            raise
