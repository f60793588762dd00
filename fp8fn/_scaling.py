"""Scaling numerics: scales from amaxes, and `update` / `merge` of packed scaling states.

One convention throughout: `fp8 = saturate(hp * scale)` and `scale = fp8_max / (amax * 2**margin)`.
"""

from __future__ import annotations

import warnings

import torch

from ._state import State, check_state

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
ROLE_DTYPE = (E4M3, E4M3, E5M2)  # input, weight, grad_output
ROLE_FP8_MAX = tuple(FP8_MAX[d] for d in ROLE_DTYPE)


def compute_scale(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """`fp8_max / (amax * 2**margin)`, computed in float64, returned as float32.

    Always finite and > 0: an amax that is 0, inf or NaN gives scale 1; a scale beyond float32's
    range is clamped to it (float32's max for a tiny amax, its smallest positive value for a
    huge one).

    Args:
      amax: float tensor of any shape (e.g. `()` or `(n_sites, 3)`).
      fp8_max: the float8 format's largest value (448.0 for e4m3, 57344.0 for e5m2).
      margin: an int from 0 to 64.

    Returns:
      float32 tensor of `amax`'s shape.

    Example:
      >>> import torch, fp8fn
      >>> fp8fn.compute_scale(torch.tensor(2.0), 448.0, margin=1)
      tensor(112.)
    """
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        raise TypeError(
            f"fp8fn.compute_scale: expected `amax` to be a floating tensor, "
            f"got {getattr(amax, 'dtype', type(amax).__name__)}."
        )
    if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)) or not fp8_max > 0:
        raise ValueError(f"fp8fn.compute_scale: expected `fp8_max` a float > 0, got {fp8_max!r}.")
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= 64:
        raise ValueError(
            f"fp8fn.compute_scale: expected `margin` an int from 0 to 64, got {margin!r}."
        )
    return torch.where(amax > 0, scale_from_amax(amax, float(fp8_max), margin), 1.0)


def scale_from_amax(amax: torch.Tensor, fp8_max, margin: int) -> torch.Tensor:
    """`compute_scale` for amaxes >= 0 (or NaN), without checks: the op's and `update`'s path.

    Six kernels. The division is in float64 (the numerator is a float64 tensor, 0-dim only for
    a 0-dim `amax`, so type promotion widens `amax` inside the division), so that eager,
    compiled and Triton code agree bit for bit. `fp8_max`: a float, or a tuple broadcastable to
    `amax`. Returns float32 of `amax`'s shape.
    """
    f64, device = torch.float64, amax.device
    if isinstance(fp8_max, tuple):
        numerator = torch.tensor([v * 2.0**-margin for v in fp8_max], dtype=f64, device=device)
    else:
        shape = (1,) if amax.dim() else ()
        numerator = torch.full(shape, fp8_max * 2.0**-margin, dtype=f64, device=device)
    finite = torch.nan_to_num(amax, posinf=0.0)  # inf -> 0; 0 and NaN are handled below
    scale = torch.div(numerator, finite).nan_to_num(nan=1.0, posinf=1.0)  # 0, NaN -> 1
    # Beyond float32's range: its smallest positive value or its max. (Literals, not module
    # globals: under dynamic shapes dynamo turns float globals into symbols.)
    return scale.float().clamp(2.0**-149, 3.4028234663852886e38)


def _check_pair(api: str, a, b, a_name: str, b_name: str) -> None:
    """Both are `State`s of the same structure (sites, static config, shapes, device)."""
    check_state(api, a, a_name, batch_dims=None)
    check_state(api, b, b_name, batch_dims=None)
    if a.static != b.static:
        raise ValueError(
            f"fp8fn.{api}: `{a_name}` and `{b_name}` must have the same sites and static config; "
            f"got {a!r} and {b!r}."
        )
    if a.amax_history.shape != b.amax_history.shape or a.scale.device != b.scale.device:
        raise ValueError(
            f"fp8fn.{api}: `{a_name}` and `{b_name}` must have the same shapes and device; got "
            f"amax_history {tuple(a.amax_history.shape)} on {a.scale.device} and "
            f"{tuple(b.amax_history.shape)} on {b.scale.device}."
        )


def update(state: State, obs: State) -> State:
    """Push each observed amax into its history and recompute the scale, for all sites at once.

    An observed amax (`obs.amax_history[..., 0]`) that is > 0 and finite goes to the front of
    its history (the oldest entry drops) and the scale becomes `fp8_max / (amax * 2**margin)`,
    with `amax` the max of the history ("max") or its newest entry ("most_recent"). An
    observation that is 0, inf or NaN leaves that role unchanged. Pure, and a constant number of
    kernels whatever the number of sites.

    Warns (`fp8fn.update: ...`) and returns `state` when `obs` holds no tensor at all (its
    `amax_history` is None): the classic slip of a plain autograd loop whose state never
    required grad, so that `.grad` stayed None. `fp8fn.observe` / `fp8fn.observations` avoid it.

    Args:
      state: an `fp8fn.State`, from `fn.init` or a previous `update`.
      obs: the observations, a `State` of the same structure (the gradient with respect to
        `state`).

    Returns:
      The new `State`.

    Example:
      >>> import torch, fp8fn
      >>> state = fp8fn.init_state(fp8fn.DelayedScaling(history_len=2), ["fc"])
      >>> history = torch.zeros(1, 3, 2)
      >>> history[0, 0, 0] = 4.0  # the input amax seen at site "fc"
      >>> new = fp8fn.update(state, state._replace(amax_history=history))
      >>> new["fc"].input.amax_history, new["fc"].input.scale
      (tensor([4., 0.]), tensor(112.))
    """
    if isinstance(obs, State) and obs.amax_history is None:
        warnings.warn(
            "fp8fn.update: `obs.amax_history` is None, so nothing was observed and the state "
            "does not change. With plain autograd, make the state observable before the forward "
            "(`state = fp8fn.observe(state)`) and read `obs = fp8fn.observations(state)` after "
            "backward().",
            stacklevel=2,
        )
        return state
    _check_pair("update", state, obs, "state", "obs")
    history, scale = state.amax_history, state.scale
    with torch.no_grad():  # state is data: no autograd history carried across steps
        amax = obs.amax_history[..., 0]
        push = (amax > 0) & torch.isfinite(amax)
        rolled = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
        history = torch.where(push.unsqueeze(-1), rolled, history)
        window = history if state.amax_compute == "max" else history[..., :1]
        new_scale = scale_from_amax(window.amax(dim=-1), ROLE_FP8_MAX, state.margin)
        scale = torch.where(push, new_scale, scale)
    return state._replace(amax_history=history, scale=scale)


def merge(obs_a: State, obs_b: State) -> State:
    """Combine two observations by elementwise max (microbatches; repeated forward passes).

    Never sums: the amax of a union is the max of the amaxes. An amax that is inf or NaN counts
    as "not observed" (like 0), so a finite observation of the other side survives.

    Example:
      >>> import torch, fp8fn
      >>> a = fp8fn.init_state(fp8fn.DelayedScaling(history_len=1), ["fc"])
      >>> a = a._replace(amax_history=torch.zeros(1, 3, 1), scale=torch.zeros(1, 3))
      >>> b = a._replace(amax_history=torch.full((1, 3, 1), 3.0))
      >>> fp8fn.merge(a, b)["fc"].input.amax_history
      tensor([3.])
    """
    _check_pair("merge", obs_a, obs_b, "obs_a", "obs_b")
    return obs_a._replace(
        amax_history=torch.maximum(_observed(obs_a.amax_history), _observed(obs_b.amax_history)),
        scale=torch.maximum(obs_a.scale, obs_b.scale),
    )


def _observed(amax: torch.Tensor) -> torch.Tensor:
    """`amax` with inf and NaN (not observations) replaced by 0 (not observed)."""
    return torch.where(torch.isfinite(amax), amax, 0.0)
