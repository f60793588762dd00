"""Facts about a state's values are never trusted from its tree structure.

`State.filled` (which histories hold an observation) rides in the pytree structure, which
outlives the values: a warmed state reset to `init`'s values with `tree_map`, restored with
`tree_unflatten(leaves, tree_structure(current))` or by an in-place `copy_` still said "filled",
and fp8fn 0.4 cast with the stored scale 1 (inputs of amax ~4,000 saturated: SQNR 3 dB, no
warning). Each route below must give the bits of a fresh state with the same values; a compiled
step refuses the contradiction in the graph. Random keys follow the scales' rule: an in-place
change after `update` is checked again.
"""

import optree
import pytest
import torch
import torch.utils._pytree as pytree
from _helpers import DELAYED_AUTO, CountHostReads, assert_bit_identical, loss_of

import fp8fn


def _mlp():
    """`(fn, params, x)`: a 32-64-16 MLP (seed 0) and an input of amax ~4,000 (float32)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 1000
    return fp8fn.transform(model, DELAYED_AUTO), dict(model.named_parameters()), x


def _func_route(fn, params, state, x):
    """`(loss, param grads, obs)` by torch.func."""
    (grads, obs), loss = torch.func.grad_and_value(loss_of(fn), argnums=(0, 1))(params, state, x)
    return loss, grads, obs


def _autograd_route(fn, params, state, x):
    """`(loss, param grads, obs)` by plain autograd on observed leaves."""
    observed = fp8fn.observe(state)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = loss_of(fn)(leaves, observed, x)
    loss.backward()
    return loss, {k: v.grad for k, v in leaves.items()}, fp8fn.observations(observed)


def _warmed(fn, params, x):
    """A state updated twice on `x`: every history filled (and known to be)."""
    state = fn.init(x)
    for _ in range(2):
        state = fp8fn.update(state, _func_route(fn, params, state, x)[2])
    assert state.filled == (True,) * 6
    return state


def _tree_map(warmed, fresh):
    return pytree.tree_map(lambda w, f: f.clone(), warmed, fresh)


def _optree_map(warmed, fresh):
    return optree.tree_map(lambda w, f: f.clone(), warmed, fresh, namespace="fp8fn")


def _tree_unflatten(warmed, fresh):
    return pytree.tree_unflatten(pytree.tree_leaves(fresh), pytree.tree_structure(warmed))


def _copy_in_place(warmed, fresh):
    warmed.amax_history.copy_(fresh.amax_history)
    warmed.scale.copy_(fresh.scale)
    return warmed


def _zero_history_in_place(warmed, fresh):  # the scales kept: valid, but the history is empty
    warmed.amax_history.zero_()
    warmed.scale.copy_(fresh.scale)
    return warmed


REBUILDS = [_tree_map, _optree_map, _tree_unflatten, _copy_in_place, _zero_history_in_place]


@pytest.mark.parametrize("route", [_func_route, _autograd_route])
@pytest.mark.parametrize("rebuild", REBUILDS)
def test_a_state_rebuilt_on_a_filled_structure_casts_as_its_values_say(rebuild, route):
    """The rebuilt state holds `init`'s values (empty histories, scales 1) under a structure
    that says "filled": it must cast with current scaling, as the fresh state does, bit for
    bit (0.4: the stored scale 1, the input saturated at 448, SQNR 3.1 dB); `update` then
    derives `filled` from the values."""
    fn, params, x = _mlp()
    fresh = fn.init(x)
    rebuilt = rebuild(_warmed(fn, params, x), fresh)
    assert rebuilt.filled == (True,) * 6  # what the structure says
    got, want = route(fn, params, rebuilt, x), route(fn, params, fresh, x)
    assert_bit_identical(got, want)
    new, ref = fp8fn.update(rebuilt, got[2]), fp8fn.update(fresh, want[2])
    assert new.filled == ref.filled == (True,) * 6
    assert_bit_identical((new.amax_history, new.scale), (ref.amax_history, ref.scale))


def test_state_to_keeps_what_is_known_of_its_values():
    """`State.to` on the same device returns the same tensors (the mark holds: no host read in
    the next update); a state whose values changed in place after `to` is not trusted."""
    fn, params, x = _mlp()
    state = _warmed(fn, params, x).to("cpu")
    obs = _func_route(fn, params, state, x)[2]
    with CountHostReads() as c:
        state = fp8fn.update(state, obs).to("cpu")
    assert c.reads == []
    state.amax_history.zero_()
    state.scale.fill_(1.0)
    assert_bit_identical(_func_route(fn, params, state, x), _func_route(fn, params, fn.init(x), x))


@pytest.mark.slow  # (compiles: ~15 s on 2 cores)
def test_compiled_apply_refuses_a_state_whose_values_contradict_its_structure():
    """Compiled, the structure's `filled` decides the graph: an assert in the graph (no host
    read) refuses values that contradict it, rather than cast with the stored scale 1."""
    fn, params, x = _mlp()
    warmed = _warmed(fn, params, x)
    step = torch.compile(lambda p, s, x: fn.apply(p, s, x), fullgraph=True)
    assert_bit_identical(step(params, warmed, x), fn.apply(params, warmed, x))
    rebuilt = _tree_unflatten(warmed, fn.init(x))
    with pytest.raises(RuntimeError, match=r"fp8fn\.apply: `state` says \(in its tree struct"):
        step(params, rebuilt, x)


def _nvfp4():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    fn = fp8fn.transform(model, fp8fn.NVFP4Scaling())
    return fn, dict(model.named_parameters()), torch.randn(16, 32)


@pytest.mark.parametrize(
    "change", ["fill_nan", "fill_fraction", "copy_negative", "view_fraction", "detached_nan"]
)
def test_a_key_changed_in_place_after_update_is_checked_again(change):
    """A key fp8fn made (`update`) is known valid until changed in place: then `apply`,
    `update` and `fold_in` read it again and refuse it (0.4 accepted `fill_(nan)`)."""
    fn, params, x = _nvfp4()
    state = fn.init(x, seed=0)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    state = fp8fn.update(state, obs)
    fn.apply(params, state, x)  # known valid
    {
        "fill_nan": lambda k: k.fill_(float("nan")),
        "fill_fraction": lambda k: k.fill_(0.5),
        "copy_negative": lambda k: k.copy_(torch.tensor(-1.0, dtype=torch.float64)),
        "view_fraction": lambda k: k.view(1)[0].fill_(0.5),
        "detached_nan": lambda k: k.detach().fill_(float("nan")),
    }[change](state.key)
    message = r"^fp8fn\.{}: expected `state\.key` to hold integers in \[0, 2\*\*52\)"
    with pytest.raises(ValueError, match=message.format("apply")):
        fn.apply(params, state, x)
    with pytest.raises(ValueError, match=message.format("update")):
        fp8fn.update(state, obs)
    with pytest.raises(ValueError, match=message.format("fold_in")):
        fp8fn.fold_in(state, 1)


SCALE_CHANGES = {
    "fill_nan": lambda s: s.fill_(float("nan")),
    "view_zero": lambda s: s[0, 1].fill_(0.0),
    "copy_inf": lambda s: s.copy_(torch.full_like(s, float("inf"))),
    "no_grad_negative": lambda s: torch.no_grad()(s.neg_)(),
    "detached_zero": lambda s: s.detach().zero_(),
}


@pytest.mark.parametrize("change", SCALE_CHANGES)
def test_a_scale_changed_in_place_after_update_is_checked_again(change):
    """Scales follow the keys' rule (identity and version): any in-place change after `update`
    made them is read again by `apply` and `update` and refused when invalid."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    params, x = dict(model.named_parameters()), torch.randn(8, 32)
    state = fn.init(x)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    state = fp8fn.update(state, obs)
    fn.apply(params, state, x)  # known valid
    SCALE_CHANGES[change](state.scale)
    message = r"^fp8fn\.{}: expected the scales of `state` finite and > 0, got \["
    with pytest.raises(ValueError, match=message.format("apply")):
        fn.apply(params, state, x)
    with pytest.raises(ValueError, match=message.format("update")):
        fp8fn.update(state, obs)


def _optim_step(fn, state, x, params):
    observed = fp8fn.observe(state)
    loss_of(fn)(params, observed, x).backward()
    return observed


@pytest.mark.parametrize(
    "detached",
    [
        lambda m: {k: v.detach() for k, v in m.named_parameters()},
        lambda m: m.state_dict(),
        lambda m: {**dict(m.named_parameters()), "2.weight": m[2].weight.detach()},
    ],
    ids=["detach", "state_dict", "one_detached"],
)
def test_the_torch_optim_loop_refuses_detached_parameters(detached):
    """Detached copies of trainable parameters in a plain autograd loop: `backward()` would
    succeed on the observed state alone and the optimizer get no gradient (0.4: silently)."""
    fn, _, x = _mlp()
    model = fn.module
    state = fn.init(x)
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: `loss\.backward\(\)` of a forward on"):
        _optim_step(fn, state, x, detached(model))
    observed = _optim_step(fn, state, x, dict(model.named_parameters()))  # the fix
    assert all(p.grad is not None for p in model.parameters())
    fp8fn.update(state, fp8fn.observations(observed))


def test_observations_alone_may_be_taken_with_detached_parameters():
    """`torch.autograd.grad` of the observed history (no `.grad` for an optimizer), or a
    frozen model (calibration): nothing to train, nothing refused; the same observation."""
    fn, params, x = _mlp()
    state = fn.init(x)
    want = _func_route(fn, params, state, x)[2]
    observed = fp8fn.observe(state)
    detached = {k: v.detach() for k, v in params.items()}
    (got,) = torch.autograd.grad(loss_of(fn)(detached, observed, x), observed.amax_history)
    assert torch.equal(got, want.amax_history)
    fn.module.requires_grad_(False)
    observed = _optim_step(fn, state, x, fn.module.state_dict())
    assert torch.equal(fp8fn.observations(observed).amax_history, want.amax_history)


def test_update_refuses_the_observed_state_for_its_observation():
    """`fp8fn.update(state, observed)`: the observed copy holds the state's values, so 0.4 took
    it as an observation of nothing and delayed scaling never started (0 of 1,200 entries)."""
    fn, params, x = _mlp()
    state = fn.init(x)
    observed = _optim_step(fn, state, x, params)
    with pytest.raises(ValueError, match=r"fp8fn\.observations\(observed\)\)`\.$"):
        fp8fn.update(state, observed)
    assert fp8fn.update(state, fp8fn.observations(observed)).filled == (True,) * 6


def test_update_refuses_the_state_itself_as_its_observation_even_when_empty():
    """`update(state, state)` on a state fresh from `init`: its histories are zeros, so the
    in-graph check of older entries passes; the identity check must refuse it (a surviving
    mutant of the audit: nothing else sees it)."""
    fn, params, x = _mlp()
    state = fn.init(x)
    with pytest.raises(ValueError, match=r"^fp8fn\.update: expected `obs` an observation"):
        fp8fn.update(state, state)
    with pytest.raises(ValueError, match=r"^fp8fn\.update: expected `obs` an observation"):
        fp8fn.update(state, state._replace(scale=state.scale.clone()))  # its history, other scales


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_history_changed_in_place_to_a_non_amax_is_refused_by_update(value):
    """A history entry that is not a finite amax >= 0 would give its role the scale 1 (NaN) or a
    negative one, for as long as it stays in the window: `update` refuses it, in the graph (no
    host read), and leaves the state as it was."""
    fn, params, x = _mlp()
    state = _warmed(fn, params, x)
    obs = _func_route(fn, params, state, x)[2]
    state.amax_history[0, 1, 3] = value
    before = state.amax_history.clone(), state.scale.clone()
    with pytest.raises(
        RuntimeError, match=r"fp8fn\.update: expected `state\.amax_history` to hold"
    ):
        fp8fn.update(state, obs)
    assert torch.equal(state.amax_history.nan_to_num(), before[0].nan_to_num())
    assert torch.equal(state.scale, before[1])
