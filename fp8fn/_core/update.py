"""`update` and `merge` of packed scaling states: constant kernels, whatever the sites.

The scale convention (`_numerics/fp8.py`): `fp8 = saturate(hp * scale)`, `scale = fp8_max / (amax *
2**margin)`.
"""

from __future__ import annotations

import math
import warnings

import torch

from .._numerics.fp8 import ROLE_FP8_MAX, scale_from_amax
from .._torch_private import assert_in_graph, functorch_level
from .keys import advance_key, check_key, fold_key, mark_key_valid
from .state import (
    State,
    check_scales,
    check_state,
    filled_mark,
    known_valid,
    mark_filled,
    mark_valid,
    supersede,
)


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
    if (a.key is None) != (b.key is None):
        has, lacks = (a_name, b_name) if b.key is None else (b_name, a_name)
        raise ValueError(
            f"fp8fn.{api}: `{has}` has a random key (a model with NVFP4 layers) and `{lacks}` "
            "has none; both must come from the same model's fn.init."
        )


_NOT_AN_OBSERVATION = (
    "fp8fn.update: expected `obs` an observation (the amaxes seen, in `amax_history[..., 0]`, "
    "zeros elsewhere, and a key of 0), got older history entries or a random key too: a state. "
    "The order is fp8fn.update(state, obs), obs from the backward."
)


_NOT_A_HISTORY = (
    "fp8fn.update: expected `state.amax_history` to hold finite amaxes >= 0 (what fn.init and "
    "update write), got NaN, inf or a negative value: changed in place? Pass a state from fn.init "
    "or update, or a saved one loaded as it was saved."
)


def update(state: State, obs: State) -> State:
    """Push each observed amax into its history and recompute the scale, for all sites at once.

    An observed amax (`obs.amax_history[..., 0]`) that is > 0 and finite goes to the front of
    its history (the oldest entry drops) and the scale becomes `fp8_max / (amax * 2**margin)`,
    with `amax` the max of the history ("max") or its newest entry ("most_recent"). An
    observation that is 0, inf or NaN leaves that role unchanged. The random key (`state.key`,
    of models with NVFP4 layers) advances by one, modulo 2**52 (it stays exact and in range past
    any step count), so the next step draws other random bits; the observation's key (0) is not
    used. A constant number of kernels whatever the number of sites.

    Neither argument is modified and the result depends on them alone. Not pure in memory: it
    records facts about the tensors it made outside the state (their scales and key valid, which
    histories hold an observation, the state it superseded, for the warnings:
    `_core/registries.py`), never a number that a result depends on.

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
    if isinstance(obs, dict) and isinstance(state, State):  # the gradients of argument 0
        raise TypeError(
            "fp8fn.update: expected `obs` to be an fp8fn.State (the gradient with respect to the "
            f"state), got dict ({len(obs)} tensors: parameter gradients?). torch.func.grad "
            "differentiates argument 0 only unless told otherwise: "
            "`grads, obs = torch.func.grad(loss_fn, argnums=(0, 1))(params, state, ...)`."
        )
    _check_pair("update", state, obs, "state", "obs")
    observed = obs.amax_history.requires_grad and obs.amax_history.is_leaf
    if observed and functorch_level() is None:
        raise ValueError(
            "fp8fn.update: expected `obs` an observation, got a state whose `amax_history` is "
            "a leaf that requires grad: the observed state that fp8fn.observe made for the "
            "forward, whose values are the state's (delayed scaling would never start). Pass "
            "its observation: `state = fp8fn.update(state, fp8fn.observations(observed))`."
        )
    check_scales("update", state.scale)
    if state.key is not None:
        check_key("update", state.key)
    history, scale = state.amax_history, state.scale
    # A state known as one (no host read): the same history, or other scales that fp8fn made
    # or checked (an observation's scales are zeros, or `state`'s own when made by _replace).
    known = (
        not torch.compiler.is_compiling()
        and obs.scale is not state.scale
        and known_valid(obs.scale)
    )
    if obs.amax_history is state.amax_history or known:
        raise ValueError(_NOT_AN_OBSERVATION)
    with torch.no_grad():  # state is data: no autograd history carried across steps
        # Any other state (older history entries or a random key) is refused in the graph, in
        # one pass over the observation: a sum of magnitudes is 0 exactly when every entry is 0
        # (no cancellation; NaN and inf make it NaN and inf).
        older = obs.amax_history[..., 1:].abs().sum() != 0
        if obs.key is not None:
            older = older | obs.key.any()
        assert_in_graph(~older, _NOT_AN_OBSERVATION)
        # A history `update` made (its mark: no host read, never while compiling) holds
        # amaxes >= 0, finite (a valid input, pushed amaxes > 0 and finite); others are checked.
        mark = (None, 0) if torch.compiler.is_compiling() else filled_mark(history)
        if mark[0] is None:
            assert_in_graph(_holds_amaxes(history), _NOT_A_HISTORY)
        amax = obs.amax_history[..., 0]
        push = (amax > 0) & (amax < math.inf)  # (NaN fails both)
        history = _pushed(history, amax, push)
        # The window's amax where pushed (elsewhere the scale stays).
        peak = amax if state.amax_compute == "most_recent" else _max_of_amaxes(history)
        new_scale = scale_from_amax(peak, ROLE_FP8_MAX, state.margin)
        scale = torch.where(push, new_scale, scale)
        key = None if state.key is None else advance_key(state.key)
    new = State(history, scale, *state.static, key=key, filled=_filled(state, history, mark))
    if not torch.compiler.is_compiling():
        mark_valid(scale)
        if key is not None:
            mark_key_valid(key)
        supersede(state, new)
    return new


def _pushed(history: torch.Tensor, amax: torch.Tensor, push: torch.Tensor) -> torch.Tensor:
    """`history` (float32 `(..., h)`) with `amax` (`(...)`) pushed to the front of each row
    where `push` (bool `(...)`), its oldest entry dropped, and the other rows as they were: a
    new contiguous tensor, written in one pass.

    Eager, each row's entries 1.. are a window of `h - 1` consecutive entries of the flat
    history, the row's own from its entry 0 where pushed and from its entry 1 where not (one
    index per row into the overlapping windows), and entry 0 is `amax` or the row's own: two
    kernels writing into one new tensor. Compiled, a shift and a select, which inductor fuses
    into one kernel (dynamo breaks the graph at an `out=` view).
    """
    if torch.compiler.is_compiling():
        rolled = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
        return torch.where(push.unsqueeze(-1), rolled, history)
    h = history.shape[-1]
    new = torch.empty(history.shape, dtype=history.dtype, device=history.device)
    if not new.numel():  # no sites: no windows
        return new
    rows = new.view(-1, h)
    start = torch.add(
        torch.arange(1, new.numel() + 1, h, device=history.device), push.flatten(), alpha=-1
    )
    windows = history.contiguous().view(-1).unfold(0, h - 1, 1)
    torch.index_select(windows, 0, start, out=rows[:, 1:])
    torch.where(push, amax, history[..., 0], out=new[..., 0])
    return new


def _max_of_amaxes(history: torch.Tensor) -> torch.Tensor:
    """float32 `(...)`: the max of each row of `history` (`(..., h)`, finite amaxes >= 0), exact
    where a row holds one > 0: positive floats order as their bits do as int32 (and -0 below
    them), and an int32 reduction runs twice as fast as a float one on CPU (no NaN to keep)."""
    return history.view(torch.int32).amax(dim=-1).view(torch.float32)


def _holds_amaxes(history: torch.Tensor) -> torch.Tensor:
    """bool `()`: whether every entry of `history` is finite and >= 0, in one pass (`aminmax`
    propagates NaN, which fails both comparisons). A history written in place otherwise would
    set a scale from NaN (1) or from a negative amax."""
    if not history.numel():
        return torch.ones((), dtype=torch.bool, device=history.device)
    low, high = torch.aminmax(history)
    return (low >= 0) & (high < math.inf)


# The updates of a state's line that read which histories are filled (one host read each):
# afterwards a history still empty (a layer or an expert that has not run) is left to the graph
# (correct, two passes over its tensor), so that a steady step reads nothing.
FILLED_READS = 2


def _filled(state: State, history: torch.Tensor, mark: tuple) -> tuple[bool, ...] | None:
    """`filled` of the state after `update` (`history`, its new histories; `mark`, the
    `filled_mark` of `state.amax_history`), marked on `history` (`known_filled` trusts the
    mark only). No host read once all are filled (update pushes amaxes > 0 only: a filled
    history stays filled) or after the first `FILLED_READS` updates of a state's line; one
    before (warm-up), and for a state fp8fn did not mark (loaded, rebuilt, changed in place).
    Where values cannot be read (compiled, inside torch.func) the structure's, which the ops
    check against the values (`known_filled`)."""
    if torch.compiler.is_compiling() or functorch_level() is not None:
        return state.filled
    known, reads = mark
    if known is not None and (reads >= FILLED_READS or all(known)):
        filled = known
    else:
        filled, reads = (), reads + 1
        if state.sites:
            newest = (history[..., 0] > 0).reshape(-1, 3 * len(state.sites))
            filled = tuple(newest.all(0).tolist())
    mark_filled(history, filled, reads)
    return filled


def merge(obs_a: State, obs_b: State) -> State:
    """Combine two observations by elementwise max (microbatches; repeated forward passes).

    Never sums: the amax of a union is the max of the amaxes. An amax that is inf or NaN counts
    as "not observed" (like 0), so a finite observation of the other side survives. The random
    keys of observations are 0 and stay so (their max).

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
        amax_history=torch.maximum(
            observed_only(obs_a.amax_history), observed_only(obs_b.amax_history)
        ),
        scale=torch.maximum(obs_a.scale, obs_b.scale),
        key=None if obs_a.key is None else torch.maximum(obs_a.key, obs_b.key),
    )


def observed_only(amax: torch.Tensor) -> torch.Tensor:
    """`amax` with inf and NaN (not observations) replaced by 0 (not observed)."""
    return torch.where(torch.isfinite(amax), amax, 0.0)


def fold_in(state: State, data: int) -> State:
    """`state` with its random key replaced by one derived from `(state.key, data)`.

    Each cast of an NVFP4 layer draws its random bits from the state's key, the site and the
    role, so two forward passes with one state round alike: the microbatches of one step, or
    two `apply` calls in one loss, would correlate their rounding errors. Fold in the
    microbatch's index to give each its own bits, and update the state itself with the merged
    observations:

        for i, (x, y) in enumerate(microbatches):
            obs_i = grad_of_loss(params, fp8fn.fold_in(state, i), x, y)
        state = fp8fn.update(state, obs)  # obs: the merged obs_i

    `state` is not modified; the result depends on `state` and `data` alone (its key is marked
    valid outside the state, `_core/registries.py`). A few kernels; no host read for a key that
    fp8fn made or checked (compiles). A state without a key (no NVFP4 layer draws random bits)
    is returned as it is. Within a step, distinct `data` give independent keys
    (a hash, not `key + data`, so no microbatch draws another step's bits by construction).

    Args:
      state: an `fp8fn.State` (any leading dims).
      data: an int in `[0, 2**63)`, e.g. the microbatch's index.

    Returns:
      A `State` of `state`'s structure; `key` float64, an integer in `[0, 2**52)`.

    Example:
      >>> import torch, fp8fn
      >>> fn = fp8fn.transform(torch.nn.Linear(32, 16), fp8fn.NVFP4Scaling())
      >>> state = fn.init(torch.randn(4, 32), seed=0)
      >>> a, b = fp8fn.fold_in(state, 0), fp8fn.fold_in(state, 1)
      >>> bool(a.key != b.key), bool(a.key == fp8fn.fold_in(state, 0).key)
      (True, True)
    """
    check_state("fold_in", state, batch_dims=None)
    if isinstance(data, bool) or not isinstance(data, int):
        raise TypeError(
            f"fp8fn.fold_in: expected `data` an int in [0, 2**63), got "
            f"{type(data).__name__} {data!r}. Pass the microbatch's index."
        )
    if not 0 <= data < 2**63:
        raise ValueError(
            f"fp8fn.fold_in: expected `data` an int in [0, 2**63), got {data}. Pass the "
            "microbatch's index."
        )
    if state.key is None:
        return state
    check_key("fold_in", state.key)
    return state._replace(key=mark_key_valid(fold_key(state.key, data)))
