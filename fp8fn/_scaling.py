"""Scaling numerics: scales from amaxes, and the batched `update` / `merge` of scaling state.

One convention throughout: `fp8 = saturate(hp * scale)` and `scale = fp8_max / (amax * 2**margin)`.
"""

from __future__ import annotations

import torch

from ._state import ROLES, ScaleState, SiteState

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
ROLE_DTYPE = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}
_F32_MAX = torch.finfo(torch.float32).max
_ROLE_FP8_MAX = tuple(FP8_MAX[ROLE_DTYPE[role]] for role in ROLES)  # in SiteState order


def compute_scale(amax: torch.Tensor, fp8_max: float | torch.Tensor, margin=0.0) -> torch.Tensor:
    """`fp8_max / (amax * 2**margin)`, computed in float64, returned as float32.

    Always finite and > 0: an amax that is 0, inf or NaN gives scale 1, a tiny amax whose scale
    would overflow float32 gives float32's max.

    Args:
      amax: float tensor of any shape (e.g. `()` or `(n_states,)`).
      fp8_max: the float8 format's largest value, a float or a tensor broadcastable to `amax`.
      margin: a float or a tensor broadcastable to `amax`.

    Returns:
      float32 tensor of `amax`'s shape.

    Example:
      >>> import torch, fp8fn
      >>> fp8fn.compute_scale(torch.tensor(2.0), 448.0, margin=1)
      tensor(112.)
    """
    # Few ops on purpose: in eager mode each is a kernel launch on a scalar.
    amax64 = amax.double()
    if isinstance(margin, torch.Tensor):
        amax64 = amax64 * torch.exp2(margin.double())
    elif margin:
        amax64 = amax64 * 2.0**margin
    scale = fp8_max / amax64  # amax 0 -> inf, inf -> 0, NaN -> NaN: all become 1 below
    scale = torch.nan_to_num(scale, nan=1.0, posinf=1.0)
    return torch.where(scale > 0, scale.clamp(max=_F32_MAX), 1.0).float()


def _check_trees(api: str, a, b, a_name: str, b_name: str) -> None:
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise TypeError(
            f"fp8fn.{api}: expected `{a_name}` and `{b_name}` to be dicts of fp8fn.SiteState, "
            f"got {type(a).__name__} and {type(b).__name__}."
        )
    if a.keys() != b.keys():
        diff = sorted(set(a) ^ set(b))
        raise ValueError(
            f"fp8fn.{api}: `{a_name}` and `{b_name}` must have the same sites; "
            f"these are in only one of them: {diff}."
        )
    for name, tree in ((a_name, a), (b_name, b)):
        for site, s in tree.items():
            if s is not None and not isinstance(s, SiteState):
                raise TypeError(
                    f"fp8fn.{api}: expected `{name}[{site!r}]` to be an fp8fn.SiteState or "
                    f"None, got {type(s).__name__}."
                )
            for role, r in zip(ROLES, () if s is None else s):
                if r is not None and not isinstance(r, ScaleState):
                    raise TypeError(
                        f"fp8fn.{api}: expected `{name}[{site!r}].{role}` to be an "
                        f"fp8fn.ScaleState or None, got {type(r).__name__}."
                    )


def update(state: dict, obs: dict) -> dict:
    """Push each observed amax into its history and recompute the scale, for all sites at once.

    An observed amax that is > 0 and finite goes to the front of the history (the oldest entry
    drops) and the scale becomes `fp8_max / (amax * 2**margin)`, with `amax` the max of the
    history ("max") or its newest entry ("most_recent"). An observation that is 0, None, inf or
    NaN leaves that `ScaleState` unchanged. Pure: nothing passed in is modified.

    The work is batched: all states of one history length are stacked, so the number of
    kernels does not grow with the number of sites.

    Args:
      state: `{site: SiteState}`, as made by `fn.init`.
      obs: observations of the same structure (the gradient with respect to `state`; None or
        zero leaves mean "not observed").

    Returns:
      The new state, of the same structure as `state`.

    Example:
      >>> import torch, fp8fn
      >>> state = {"fc": fp8fn.init_site_state(fp8fn.DelayedScaling(history_len=2))}
      >>> obs = {"fc": state["fc"]._replace(input=state["fc"].input._replace(
      ...     amax_history=torch.tensor([4.0, 0.0])))}
      >>> new = fp8fn.update(state, obs)
      >>> new["fc"].input.amax_history, new["fc"].input.scale
      (tensor([4., 0.]), tensor(112.))
    """
    _check_trees("update", state, obs, "state", "obs")
    # Per-state Python work is kept to a minimum (this loop is the cost for many sites): group
    # the states by (history_len, device), stack each field once, update, unbind once.
    groups: dict[tuple, tuple[list, list, list, list]] = {}
    n_states = 0
    for site, site_state in state.items():
        if site_state is None:
            continue
        site_obs = obs[site]
        for i, s in enumerate(site_state):
            history = s.amax_history
            key = (history.shape, history.device)
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [], [], [])
            o = None if site_obs is None else site_obs[i]
            o = None if o is None else o.amax_history
            if o is not None and o.shape != history.shape:
                raise ValueError(
                    f"fp8fn.update: expected `obs[{site!r}].{ROLES[i]}.amax_history` of shape "
                    f"{tuple(history.shape)} like the state's, got {tuple(o.shape)}."
                )
            positions, states, observed, fp8_max = group
            positions.append(n_states)
            states.append(s)
            observed.append(o)
            fp8_max.append(_ROLE_FP8_MAX[i])
            n_states += 1

    new: list = [None] * n_states
    for (shape, device), (positions, states, observed, fp8_max) in groups.items():
        zero = torch.zeros(shape, dtype=torch.float32, device=device)
        observed = [zero if o is None else o for o in observed]
        amax = torch.stack(observed)[:, 0].float()
        fields = [torch.stack(field) for field in zip(*(s[:4] for s in states))]
        fp8_max = torch.tensor(fp8_max, dtype=torch.float32, device=device)
        with torch.no_grad():  # state is data: no autograd history carried across steps
            histories, scales = _update_stacked(*fields, amax, fp8_max)
        for p, s, h, sc in zip(positions, states, histories.unbind(), scales.unbind()):
            new[p] = ScaleState(h, sc, *s[2:])
    roles = iter(new)
    return {
        site: None if s is None else SiteState(next(roles), next(roles), next(roles))
        for site, s in state.items()
    }


def _update_stacked(history, scale, margin, window, amax, fp8_max):
    """The update of n stacked states. history (n, h), the rest (n,); returns (history, scale)."""
    push = (amax > 0) & torch.isfinite(amax)
    rolled = torch.cat([amax[:, None], history[:, :-1]], dim=1)
    history = torch.where(push[:, None], rolled, history)
    positions = torch.arange(history.shape[1], device=history.device)
    in_window = positions[None, :] < window[:, None]
    amax_used = torch.where(in_window, history, 0.0).amax(dim=1)
    scale = torch.where(push, compute_scale(amax_used, fp8_max, margin), scale)
    return history, scale


def merge(obs_a: dict, obs_b: dict) -> dict:
    """Combine two observation trees by elementwise max (for microbatches, or repeated calls).

    None leaves count as "not observed". Never sums: the amax of a union is the max of amaxes.

    Example:
      >>> import torch, fp8fn
      >>> a = {"fc": fp8fn.init_site_state(fp8fn.DelayedScaling(history_len=1))}
      >>> b = {"fc": a["fc"]._replace(input=a["fc"].input._replace(
      ...     amax_history=torch.tensor([3.0])))}
      >>> fp8fn.merge(a, b)["fc"].input.amax_history
      tensor([3.])
    """
    _check_trees("merge", obs_a, obs_b, "obs_a", "obs_b")
    return {site: _max_node(obs_a[site], obs_b[site]) for site in obs_a}


def _max_node(x, y):
    """Elementwise max of two observation nodes; None is "not observed", NaN is ignored."""
    if x is None or y is None:
        return y if x is None else x
    if isinstance(x, torch.Tensor):
        return torch.fmax(x, y)
    return type(x)(*map(_max_node, x, y))
