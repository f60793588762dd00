"""The packed state as data (`_core/state.py`): two leaves under torch's pytree and optree
whatever the sites, `torch.save` and flat-dict round trips."""

import copy

import optree
import pytest
import torch
from _helpers import (
    CURRENT_AUTO,
    DELAYED,
    ROLES,
    assert_bit_identical,
    params_of,
    saved_and_loaded,
    stepped,
    transformed_mlp,
)
from _models import ReusedLayer
from torch import nn
from torch.utils import _pytree as pytree

import fp8fn


def test_state_round_trips_through_torch_save_and_flat_dicts():
    model, fn, x, params, state = transformed_mlp(batch=4)
    state = stepped(fn, params, state, x)
    loaded = saved_and_loaded(state)
    assert type(loaded) is fp8fn.State and loaded.static == state.static
    assert_bit_identical(loaded, state)
    assert type(loaded["0"]) is fp8fn.SiteState
    assert torch.equal(fn.apply(params, loaded, x), fn.apply(params, state, x))
    flat = fp8fn.flatten_state(state)
    assert list(flat) == [
        f"{site}.{role}.{field}"
        for site in ("0", "2", "4")
        for role in ROLES
        for field in ("amax_history", "scale")
    ]
    for i, site in enumerate(("0", "2", "4")):
        for r, role in enumerate(ROLES):
            assert torch.equal(flat[f"{site}.{role}.amax_history"], state.amax_history[i, r])
            assert torch.equal(flat[f"{site}.{role}.scale"], state.scale[i, r])
            assert flat[f"{site}.{role}.scale"].shape == ()
    # Independent tensors: writing into the flat dict leaves the state alone.
    snapshot = copy.deepcopy(state)
    flat["0.input.amax_history"].add_(1.0)
    assert_bit_identical(state, snapshot)
    flat["0.input.amax_history"].sub_(1.0)
    # The flat dict itself saves and loads with weights_only=True.
    flat = saved_and_loaded(flat)
    unflat = fp8fn.unflatten_state(flat, DELAYED)
    assert unflat.static == state.static
    assert_bit_identical(unflat, state)
    assert torch.equal(fn.apply(params, unflat, x), fn.apply(params, state, x))
    # Unflattened with another recipe's static config: apply refuses it.
    most_recent = fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent")
    with pytest.raises(ValueError, match="fp8fn.apply: `state` was made for another recipe"):
        fn.apply(params, fp8fn.unflatten_state(flat, most_recent), x)
    other = ReusedLayer(16)
    with pytest.raises(ValueError, match=r"fp8fn.apply: `state` does not belong.*'fc'"):
        fp8fn.transform(other, DELAYED).apply(params_of(other), unflat, x)
    with pytest.raises(ValueError, match="fp8fn.unflatten_state: expected keys"):
        fp8fn.unflatten_state({"0.inputs.scale": torch.ones(())}, DELAYED)
    with pytest.raises(ValueError, match="fp8fn.unflatten_state: expected keys"):
        fp8fn.unflatten_state({"0.input.margin": torch.ones(())}, DELAYED)
    with pytest.raises(ValueError, match=r"fp8fn.unflatten_state: missing keys \['2.input.scale"):
        fp8fn.unflatten_state({k: v for k, v in flat.items() if k != "2.input.scale"}, DELAYED)
    with pytest.raises(ValueError, match="fp8fn.unflatten_state: expected no sites under Cur"):
        fp8fn.unflatten_state(flat, CURRENT_AUTO)


@pytest.mark.parametrize("n_sites", [1, 64])
def test_state_is_two_leaves_under_torch_pytree_and_optree_whatever_the_sites(n_sites):
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n_sites)))
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(2, 4)
    state = fn.init(x)
    assert list(state) == [str(i) for i in range(n_sites)]
    assert state.amax_history.shape == (n_sites, 3, 4) and state.scale.shape == (n_sites, 3)
    by_hand = fp8fn.init_state(DELAYED, list(state))
    assert_bit_identical(by_hand, state)
    leaves, spec = pytree.tree_flatten(state)
    o_leaves, o_spec = optree.tree_flatten(state, namespace="fp8fn")
    for ls in (leaves, o_leaves, pytree.tree_leaves(by_hand)):
        assert len(ls) == 2
    assert leaves[0] is o_leaves[0] is state.amax_history
    assert leaves[1] is o_leaves[1] is state.scale
    for rebuilt in (pytree.tree_unflatten(leaves, spec), optree.tree_unflatten(o_spec, o_leaves)):
        assert type(rebuilt) is fp8fn.State and rebuilt.static == state.static
        assert rebuilt.amax_history is state.amax_history and rebuilt.scale is state.scale
    # The gradient with respect to the state (the observation) is a State of two leaves too.
    params = params_of(model)
    obs = torch.func.grad(lambda p, s: fn.apply(p, s, x).sum(), argnums=1)(params, state)
    assert type(obs) is fp8fn.State and pytree.tree_structure(obs) == spec
    assert len(optree.tree_leaves(obs, namespace="fp8fn")) == 2
    assert bool((obs.amax_history[..., 0] > 0).all())
