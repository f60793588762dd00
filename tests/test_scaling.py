import io
import math

import optree
import pytest
import torch
from _helpers import (
    F32_MAX,
    FP8_MAX,
    assert_bit_identical,
    bits,
    expected_scale,
    observation,
    site_obs,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8fn

SETTINGS = settings(max_examples=60, deadline=None)
FLOAT32S = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _state(**recipe_kwargs) -> dict:
    return {"fc": fp8fn.init_site_state(fp8fn.DelayedScaling(**recipe_kwargs))}


def _step(state: dict, **amaxes) -> dict:
    """One `update` of the single site "fc" with the given amax per role."""
    history_len = state["fc"].input.amax_history.shape[0]
    return fp8fn.update(state, {"fc": site_obs(history_len, **amaxes)})


def _role(state: dict, role: str) -> tuple[list, torch.Tensor]:
    s = getattr(state["fc"], role)
    return s.amax_history.tolist(), s.scale


# compute_scale ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amax, fp8_max, margin, want",
    [
        (2.0, 448.0, 0, 224.0),
        (2.0, 448.0, 1, 112.0),
        (4.0, 448.0, 2, 28.0),
        (8.0, 57344.0, 0, 7168.0),
        (3.0, 448.0, 0, 149.33333333333334),  # rounded to float32 once, from float64
        (0.1, 448.0, 3, 448.0 / (float(torch.tensor(0.1)) * 8)),
        (0.0, 448.0, 0, 1.0),
        (-2.0, 448.0, 0, 1.0),
        (math.inf, 448.0, 0, 1.0),
        (math.nan, 57344.0, 2, 1.0),
        (1e-45, 448.0, 0, F32_MAX),  # would overflow float32: clamped to its max
    ],
)
def test_compute_scale_exact(amax, fp8_max, margin, want):
    got = fp8fn.compute_scale(torch.tensor(amax), fp8_max, margin)
    assert got.dtype == torch.float32 and got.shape == ()
    assert torch.equal(bits(got), bits(torch.tensor(want, dtype=torch.float32)))


def test_compute_scale_float64_not_float32():
    # 448 / 3 / 2**margin in float32 arithmetic would round twice; float64 rounds once.
    amax = torch.tensor(3.0)
    want = torch.tensor(448.0 / (3.0 * 2.0**5), dtype=torch.float32)
    assert torch.equal(bits(fp8fn.compute_scale(amax, 448.0, 5)), bits(want))


def test_compute_scale_batched_tensors():
    amax = torch.tensor([2.0, 0.0, 8.0])
    fp8_max = torch.tensor([448.0, 448.0, 57344.0])
    margin = torch.tensor([1.0, 0.0, 0.0])
    got = fp8fn.compute_scale(amax, fp8_max, margin)
    assert got.tolist() == [112.0, 1.0, 7168.0] and got.dtype == torch.float32


@SETTINGS
@given(amax=FLOAT32S, margin=st.integers(0, 8), fp8_max=st.sampled_from([448.0, 57344.0]))
def test_compute_scale_finite_positive_exact(amax, margin, fp8_max):
    got = fp8fn.compute_scale(torch.tensor(amax, dtype=torch.float32), fp8_max, margin)
    assert torch.isfinite(got) and got > 0 and got.dtype == torch.float32
    assert torch.equal(bits(got), bits(expected_scale(amax, fp8_max, margin)))


@SETTINGS
@given(exponent=st.integers(-149, -126), margin=st.integers(0, 8))
def test_compute_scale_subnormal_amax(exponent, margin):
    got = fp8fn.compute_scale(torch.tensor(2.0**exponent), 448.0, margin)
    assert torch.isfinite(got) and got > 0


# update: exact histories and scales ------------------------------------------------------------


def test_update_max_exact_histories():
    state = _state(history_len=4)
    state = _step(state, input=2.0, weight=4.0, grad_output=8.0)
    assert _role(state, "input") == ([2, 0, 0, 0], 224.0)
    assert _role(state, "weight") == ([4, 0, 0, 0], 112.0)
    assert _role(state, "grad_output") == ([8, 0, 0, 0], 7168.0)  # e5m2: 57344 / 8
    state = _step(state, input=4.0, weight=1.0, grad_output=None)
    assert _role(state, "input") == ([4, 2, 0, 0], 448.0 / 4)
    assert _role(state, "weight") == ([1, 4, 0, 0], 448.0 / 4)  # max of the history
    assert _role(state, "grad_output") == ([8, 0, 0, 0], 7168.0)
    state = _step(state, input=1.0, weight=0.5, grad_output=16.0)
    assert _role(state, "input") == ([1, 4, 2, 0], 448.0 / 4)
    assert _role(state, "weight") == ([0.5, 1, 4, 0], 448.0 / 4)
    assert _role(state, "grad_output") == ([16, 8, 0, 0], 57344.0 / 16)


def test_update_most_recent_exact_histories():
    state = _state(history_len=3, amax_compute="most_recent")
    state = _step(state, input=2.0, weight=4.0, grad_output=8.0)
    state = _step(state, input=8.0, weight=1.0, grad_output=2.0)
    assert _role(state, "input") == ([8, 2, 0], 448.0 / 8)
    assert _role(state, "weight") == ([1, 4, 0], 448.0 / 1)  # newest, not max
    assert _role(state, "grad_output") == ([2, 8, 0], 57344.0 / 2)


def test_update_margin_exact():
    state = _state(history_len=2, margin=2)
    state = _step(state, input=4.0, weight=3.0, grad_output=1.0)
    assert _role(state, "input") == ([4, 0], 448.0 / 16)
    assert _role(state, "weight")[1] == torch.tensor(448.0 / 12, dtype=torch.float32)
    assert _role(state, "grad_output") == ([1, 0], 57344.0 / 4)


def test_update_history_len_one():
    state = _step(_step(_state(history_len=1), input=2.0), input=8.0)
    assert _role(state, "input") == ([8], 56.0)


def test_update_roll_drops_oldest():
    state = _state(history_len=4)
    for a in (1.0, 2.0, 3.0, 4.0, 5.0, 0.5):
        state = _step(state, input=a)
    assert _role(state, "input") == ([0.5, 5, 4, 3], 448.0 / 5)


@SETTINGS
@given(
    amaxes=st.lists(FLOAT32S, max_size=8),
    history_len=st.integers(1, 5),
    amax_compute=st.sampled_from(["max", "most_recent"]),
    margin=st.integers(0, 3),
    role=st.sampled_from(["input", "weight", "grad_output"]),
)
def test_update_matches_list_model(amaxes, history_len, amax_compute, margin, role):
    state = _state(history_len=history_len, amax_compute=amax_compute, margin=margin)
    model, model_scale = [0.0] * history_len, torch.tensor(1.0)
    for a in amaxes:
        state = _step(state, **{role: a})
        if a > 0 and math.isfinite(a):
            model = [a, *model[:-1]]
            used = max(model) if amax_compute == "max" else model[0]
            model_scale = expected_scale(used, FP8_MAX[role], margin)
        history, scale = _role(state, role)
        assert history == model
        assert torch.equal(bits(scale), bits(model_scale))


# update: what is not observed is unchanged -----------------------------------------------------


@pytest.fixture
def stepped():
    """A two-site state after two updates (non-trivial histories and scales)."""
    recipe = fp8fn.DelayedScaling(history_len=4, margin=1)
    state = {"a": fp8fn.init_site_state(recipe), "b": fp8fn.init_site_state(recipe)}
    for amaxes in ((3.0, 5.0, 7.0), (6.0, 2.0, 9.0)):
        obs = {site: site_obs(4, *amaxes) for site in state}
        state = fp8fn.update(state, obs)
    return state


@pytest.mark.parametrize("amax", [0.0, None, math.inf, -math.inf, math.nan, -1.0])
def test_update_unobserved_role_unchanged(stepped, amax):
    obs = {"a": site_obs(4, input=amax, weight=amax, grad_output=amax), "b": site_obs(4, 1.0)}
    new = fp8fn.update(stepped, obs)
    assert_bit_identical(new["a"], stepped["a"])
    assert new["b"].input.amax_history.tolist() == [1, 6, 3, 0]
    assert_bit_identical(new["b"].weight, stepped["b"].weight)


def test_update_unobserved_site_or_leaf_unchanged(stepped):
    none_leaf = observation(4, 2.0)._replace(amax_history=None)
    obs = {"a": None, "b": fp8fn.SiteState(none_leaf, None, observation(4, 0.0))}
    assert_bit_identical(fp8fn.update(stepped, obs), stepped)


def test_update_is_pure(stepped):
    obs = {site: site_obs(4, 1.0, 2.0, 3.0) for site in stepped}
    before = [t.clone() for t in torch.utils._pytree.tree_leaves((stepped, obs))]
    new = fp8fn.update(stepped, obs)
    after = torch.utils._pytree.tree_leaves((stepped, obs))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert new["a"].input.amax_history.tolist() == [1, 6, 3, 0]


def test_update_stateless_and_mixed_history_lengths():
    state = {
        "short": fp8fn.init_site_state(fp8fn.DelayedScaling(history_len=2)),
        "stateless": None,
        "long": fp8fn.init_site_state(fp8fn.DelayedScaling(history_len=5, margin=1)),
    }
    obs = {"short": site_obs(2, 4.0), "stateless": None, "long": site_obs(5, 4.0)}
    new = fp8fn.update(fp8fn.update(state, obs), obs)
    assert list(new) == ["short", "stateless", "long"] and new["stateless"] is None
    assert new["short"].input.amax_history.tolist() == [4, 4]
    assert new["long"].input.amax_history.tolist() == [4, 4, 0, 0, 0]
    assert new["short"].input.scale == 112.0 and new["long"].input.scale == 56.0


# merge -----------------------------------------------------------------------------------------


def test_merge_elementwise_max_never_sums():
    a = {"fc": site_obs(3, 2.0, 5.0, 1.0)}
    b = {"fc": site_obs(3, 2.0, 3.0, 4.0)}
    merged = fp8fn.merge(a, b)
    got = [r.amax_history.tolist() for r in merged["fc"]]
    assert got == [[2, 0, 0], [5, 0, 0], [4, 0, 0]]


def test_merge_none_and_nan():
    a = {"x": None, "y": site_obs(2, None, math.nan, math.nan), "z": site_obs(2, 1.0)}
    b = {"x": site_obs(2, 3.0), "y": site_obs(2, 7.0, 2.0, math.nan), "z": None}
    merged = fp8fn.merge(a, b)
    assert merged["x"] is b["x"] and merged["z"] is a["z"]
    assert merged["y"].input.amax_history.tolist() == [7, 0]
    assert merged["y"].weight.amax_history.tolist() == [2, 0]  # NaN ignored (fmax)
    assert math.isnan(merged["y"].grad_output.amax_history[0])


def test_merge_then_update_is_max_of_microbatches():
    state = _state(history_len=2)
    micro = [{"fc": site_obs(2, a, a, a)} for a in (3.0, 8.0, math.nan, 5.0)]
    merged = micro[0]
    for m in micro[1:]:
        merged = fp8fn.merge(merged, m)
    assert _role(fp8fn.update(state, merged), "input") == ([8, 0], 56.0)


# structural errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["update", "merge"])
def test_trees_different_sites_raise(api):
    a = {"fc1": site_obs(2, 1.0), "fc2": None}
    b = {"fc1": site_obs(2, 1.0), "fc3": None}
    with pytest.raises(ValueError, match=rf"fp8fn\.{api}: .* same sites.*\['fc2', 'fc3'\]"):
        getattr(fp8fn, api)(a, b)


@pytest.mark.parametrize("api", ["update", "merge"])
@pytest.mark.parametrize(
    "bad, match",
    [
        ([("fc", None)], r"to be dicts of fp8fn\.SiteState, got dict and list"),
        ({"fc": (1, 2, 3)}, r"\['fc'\]` to be an fp8fn\.SiteState or None, got tuple"),
        ({"fc": {"input": None}}, r"\['fc'\]` to be an fp8fn\.SiteState or None, got dict"),
        (
            {"fc": fp8fn.SiteState(torch.zeros(2), None, None)},
            r"\['fc'\]\.input` to be an fp8fn\.ScaleState or None, got Tensor",
        ),
    ],
)
def test_trees_wrong_types_raise(api, bad, match):
    good = {"fc": site_obs(2, 1.0)}
    with pytest.raises(TypeError, match=rf"^fp8fn\.{api}: expected .*{match}"):
        getattr(fp8fn, api)(good, bad)


def test_update_observation_wrong_shape_raises():
    with pytest.raises(ValueError, match=r"fp8fn\.update: .*\['fc'\]\.input\.amax_history.*\(4,\)"):
        fp8fn.update(_state(history_len=4), {"fc": site_obs(2, 1.0)})


# pytrees and serialization ---------------------------------------------------------------------


def test_state_pytree_optree_and_torch_agree(stepped):
    tree = stepped  # (a None site is a leaf for torch.utils._pytree, not for optree)
    leaves_o = optree.tree_leaves(tree)
    leaves_t = torch.utils._pytree.tree_leaves(tree)
    assert len(leaves_t) == 2 * 3 * len(fp8fn.ScaleState._fields)
    assert all(a is b for a, b in zip(leaves_o, leaves_t, strict=True))
    assert all(t.dtype == torch.float32 for t in leaves_t)
    _, spec = torch.utils._pytree.tree_flatten(tree)
    assert_bit_identical(torch.utils._pytree.tree_unflatten(leaves_o, spec), tree)


def test_state_safe_globals_registered():
    registered = torch.serialization.get_safe_globals()
    assert fp8fn.ScaleState in registered and fp8fn.SiteState in registered


def test_state_torch_save_load_weights_only(stepped):
    buffer = io.BytesIO()
    torch.save(stepped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded["a"]) is fp8fn.SiteState and type(loaded["a"].input) is fp8fn.ScaleState
    assert_bit_identical(loaded, stepped)
