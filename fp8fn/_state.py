"""Scaling state: NamedTuples of float tensors, understood by optree and torch.utils._pytree."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._recipe import DelayedScaling

ROLES = ("input", "weight", "grad_output")


class ScaleState(NamedTuple):
    """The delayed-scaling state of one tensor role at one site.

    The same type holds observations (the gradient of a loss with respect to a `ScaleState`):
    then `amax_history[0]` is the amax observed in that step, the other entries and the other
    fields are zero.
    """

    amax_history: torch.Tensor  # (history_len,), float32, newest first; 0 = never observed
    scale: torch.Tensor  # (), float32; fp8 = saturate(hp * scale), finite and > 0
    margin: torch.Tensor  # (), float32; recipe's margin, carried so `update` needs no recipe
    amax_window: torch.Tensor  # (), float32; newest entries the amax is taken over (1 or all)


class SiteState(NamedTuple):
    """The scaling state of one fp8 call site: one `ScaleState` per role."""

    input: ScaleState  # cast to float8_e4m3fn in the forward
    weight: ScaleState  # cast to float8_e4m3fn in the forward
    grad_output: ScaleState  # cast to float8_e5m2 in the backward


def init_scale_state(recipe: DelayedScaling, device=None) -> ScaleState:
    """An empty `ScaleState`: zero history (cast with current scaling until observed), scale 1."""
    window = recipe.history_len if recipe.amax_compute == "max" else 1
    return ScaleState(
        amax_history=torch.zeros(recipe.history_len, dtype=torch.float32, device=device),
        scale=torch.ones((), dtype=torch.float32, device=device),
        margin=torch.tensor(float(recipe.margin), dtype=torch.float32, device=device),
        amax_window=torch.tensor(float(window), dtype=torch.float32, device=device),
    )


def init_site_state(recipe, device=None) -> SiteState | None:
    """The initial state of one site: a `SiteState` for `DelayedScaling`, None otherwise.

    Example:
      >>> import fp8fn
      >>> s = fp8fn.init_site_state(fp8fn.DelayedScaling(history_len=4))
      >>> s.input.amax_history
      tensor([0., 0., 0., 0.])
    """
    if not isinstance(recipe, DelayedScaling):
        return None
    return SiteState(*(init_scale_state(recipe, device) for _ in ROLES))


def check_site_state(api: str, site_state, recipe, where: str = "`site_state`") -> None:
    """Raise a clear error unless `site_state` has the structure `recipe` needs."""
    if not isinstance(recipe, DelayedScaling):
        if site_state is not None:
            raise TypeError(
                f"fp8fn.{api}: {type(recipe).__name__} is stateless: expected {where} None, "
                f"got {type(site_state).__name__}."
            )
        return
    if not isinstance(site_state, SiteState):
        raise TypeError(
            f"fp8fn.{api}: expected {where} to be an fp8fn.SiteState, "
            f"got {type(site_state).__name__}. Make one with fp8fn.init_site_state(recipe)."
        )
    for role, s in zip(ROLES, site_state):
        if not isinstance(s, ScaleState):
            raise TypeError(
                f"fp8fn.{api}: expected {where}.{role} to be an fp8fn.ScaleState, "
                f"got {type(s).__name__}."
            )
        shapes = ((recipe.history_len,), (), (), ())
        for field, leaf, shape in zip(ScaleState._fields, s, shapes):
            if not isinstance(leaf, torch.Tensor) or leaf.dtype != torch.float32:
                got = getattr(leaf, "dtype", type(leaf).__name__)
                raise TypeError(
                    f"fp8fn.{api}: expected {where}.{role}.{field} to be a float32 tensor, "
                    f"got {got}."
                )
            if tuple(leaf.shape) != shape:
                raise ValueError(
                    f"fp8fn.{api}: expected {where}.{role}.{field} of shape {shape}, "
                    f"got {tuple(leaf.shape)}."
                )


# So that state saved with torch.save loads with torch.load(..., weights_only=True).
torch.serialization.add_safe_globals([ScaleState, SiteState])


def flatten_state(state: dict) -> dict[str, torch.Tensor]:
    """A state as a flat `{"site.role.field": tensor}` dict (for safetensors, distributed
    checkpoints, or `torch.save`). Sites without state (`None`) have no entries.

    Example:
      >>> import fp8fn
      >>> flat = fp8fn.flatten_state({"fc": fp8fn.init_site_state(fp8fn.DelayedScaling())})
      >>> list(flat)[:2]
      ['fc.input.amax_history', 'fc.input.scale']
    """
    return {
        f"{site}.{role}.{field}": leaf
        for site, site_state in state.items()
        if site_state is not None
        for role, scale_state in zip(ROLES, site_state)
        for field, leaf in zip(ScaleState._fields, scale_state)
    }


def unflatten_state(flat: dict[str, torch.Tensor]) -> dict:
    """The inverse of `flatten_state`: `{"site.role.field": tensor}` back to `{site: SiteState}`.

    Raises ValueError naming the key when a key is not of that form or a site lacks a field.
    """
    fields: dict[str, dict] = {}
    for key, leaf in flat.items():
        parts = key.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in ROLES or parts[2] not in ScaleState._fields:
            raise ValueError(
                f"fp8fn.unflatten_state: expected keys 'site.role.field' with role in {ROLES} "
                f"and field in {ScaleState._fields}, got {key!r}."
            )
        fields.setdefault(parts[0], {})[(parts[1], parts[2])] = leaf
    state = {}
    for site, leaves in fields.items():
        missing = [
            f"{site}.{r}.{f}" for r in ROLES for f in ScaleState._fields if (r, f) not in leaves
        ]
        if missing:
            raise ValueError(f"fp8fn.unflatten_state: missing keys {missing}.")
        state[site] = SiteState(
            *(ScaleState(*(leaves[r, f] for f in ScaleState._fields)) for r in ROLES)
        )
    return state
