import gc
import math
import sys

import optree
import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    F32_MAX,
    FP8_MAX,
    HOST_READ_FUNCTIONS,
    HOST_READS,
    ROLES,
    CountHostReads,
    CountOps,
    assert_bit_identical,
    bits,
    expected_scale,
    loss_of,
    observation,
    saved_and_loaded,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8fn

SETTINGS = settings(max_examples=60, deadline=None)
FLOAT32S = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _state(sites=("fc",), **recipe_kwargs) -> fp8fn.State:
    return fp8fn.init_state(fp8fn.DelayedScaling(**recipe_kwargs), sites)


def _step(state: fp8fn.State, **amaxes) -> fp8fn.State:
    """One `update` of the single site "fc" with the given amax per role (None: not observed)."""
    values = tuple(amaxes.get(role) for role in ROLES)
    return fp8fn.update(state, observation(state, fc=values))


def _role(state: fp8fn.State, role: str) -> tuple[list, torch.Tensor]:
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
        (3e38, 448.0, 64, 2.0**-149),  # would underflow to 0: clamped to the smallest > 0
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


def test_compute_scale_batched_and_bfloat16():
    amax = torch.tensor([2.0, 0.0, 8.0, math.nan])
    assert fp8fn.compute_scale(amax, 448.0, 1).tolist() == [112.0, 1.0, 28.0, 1.0]
    got = fp8fn.compute_scale(torch.tensor(3.0, dtype=torch.bfloat16), 448.0)
    assert got.dtype == torch.float32 and torch.equal(bits(got), bits(expected_scale(3.0, 448.0)))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((2.0, 448.0), TypeError, r"`amax` to be a floating tensor, got float"),
        ((torch.tensor(2), 448.0), TypeError, r"`amax` to be a floating tensor, got torch\.int64"),
        ((torch.tensor(2.0), 0.0), ValueError, r"`fp8_max` a float > 0, got 0\.0"),
        ((torch.tensor(2.0), 448.0, -1), ValueError, r"`margin` an int from 0 to 64, got -1"),
        (
            (torch.tensor(2.0), 448.0, 1.5),
            TypeError,
            r"`margin` an int from 0 to 64, got float 1\.5",
        ),
    ],
)
def test_compute_scale_bad_arguments_raise(args, error, match):
    with pytest.raises(error, match=rf"^fp8fn\.compute_scale: expected {match}"):
        fp8fn.compute_scale(*args)


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
    role=st.sampled_from(ROLES),
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


def _float32_scale(amax: float, fp8_max: float, margin: int, order: str) -> torch.Tensor:
    """`fp8_max / (amax * 2**margin)` in float32 arithmetic, in the given order, clamped to
    float32's positive range as `compute_scale` does: what a float32 `update` would give."""
    a, factor = torch.tensor(amax, dtype=torch.float32), 2.0**margin
    scale = fp8_max / (a * factor) if order == "product_first" else fp8_max / a / factor
    return scale.clamp(2.0**-149, F32_MAX)


# amax, margin, role, and the order of float32 arithmetic that gives other bits than float64
# rounded once, because the product or the first quotient leaves float32's range on the way.
# (Elsewhere the two agree: a float64 quotient rounded to float32 is the float32 quotient, so a
# random amax rarely tells them apart.)
FLOAT32_TRAPS = [
    (2.0148699846580557e38, 1, "input", "product_first"),  # amax * 2 overflows float32
    (3.0e38, 3, "grad_output", "product_first"),  # amax * 8 overflows
    (7.511965334907201e21, 64, "weight", "product_first"),  # amax * 2**64 overflows
    (7.4383568137861935e-37, 1, "input", "quotient_first"),  # 448 / amax overflows
    (5.0e-35, 3, "grad_output", "quotient_first"),  # 57344 / amax overflows
]


@pytest.mark.parametrize("amax, margin, role, order", FLOAT32_TRAPS)
def test_update_scale_is_float64_rounded_once(amax, margin, role, order):
    amax = float(torch.tensor(amax, dtype=torch.float32))  # the observation is float32
    want = expected_scale(amax, FP8_MAX[role], margin)
    assert not torch.equal(bits(_float32_scale(amax, FP8_MAX[role], margin, order)), bits(want))
    state = _step(_state(history_len=2, margin=margin), **{role: amax})
    history, scale = _role(state, role)
    assert history == [amax, 0.0]
    assert torch.equal(bits(scale), bits(want))


def test_update_stacked_ensemble_state():
    """Leading dims (a stacked ensemble) update member by member."""
    one = _state(("a", "b"), history_len=3)
    obs = [observation(one, a=(2.0, 4.0, 8.0)), observation(one, b=(1.0, None, 3.0))]
    stack = torch.utils._pytree.tree_map(lambda *t: torch.stack(t), one, one)
    stacked_obs = torch.utils._pytree.tree_map(lambda *t: torch.stack(t), *obs)
    new = fp8fn.update(stack, stacked_obs)
    for e in range(2):
        want = fp8fn.update(one, obs[e])
        assert torch.equal(new.amax_history[e], want.amax_history)
        assert torch.equal(new.scale[e], want.scale)


# update: what is not observed is unchanged -----------------------------------------------------


@pytest.fixture
def stepped():
    """A two-site state after two updates (non-trivial histories and scales)."""
    state = _state(("a", "b"), history_len=4, margin=1)
    for amaxes in ((3.0, 5.0, 7.0), (6.0, 2.0, 9.0)):
        state = fp8fn.update(state, observation(state, a=amaxes, b=amaxes))
    return state


@pytest.mark.parametrize("amax", [0.0, math.inf, -math.inf, math.nan, -1.0])
def test_update_unobserved_role_unchanged(stepped, amax):
    obs = observation(stepped, a=(amax, amax, amax), b=(1.0, None, None))
    new = fp8fn.update(stepped, obs)
    assert_bit_identical(new["a"], stepped["a"])
    assert new["a"].input.amax_history.tolist() == [6, 3, 0, 0]  # not rolled
    assert new["b"].input.amax_history.tolist() == [1, 6, 3, 0]
    assert_bit_identical(new["b"].weight, stepped["b"].weight)


def test_update_is_pure(stepped):
    obs = observation(stepped, a=(1.0, 2.0, 3.0), b=(1.0, 2.0, 3.0))
    before = [t.clone() for t in torch.utils._pytree.tree_leaves((stepped, obs))]
    new = fp8fn.update(stepped, obs)
    after = torch.utils._pytree.tree_leaves((stepped, obs))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert new["a"].input.amax_history.tolist() == [1, 6, 3, 0]


def test_update_warns_on_an_observation_of_nothing(stepped):
    obs = stepped._replace(amax_history=None)  # `.grad` of a leaf that never required grad
    with pytest.warns(UserWarning, match=r"^fp8fn\.update: `obs\.amax_history` is None"):
        new = fp8fn.update(stepped, obs)
    assert new is stepped


def test_update_without_sites():
    state = _state((), history_len=2)
    new = fp8fn.update(state, observation(state))
    assert new.amax_history.shape == (0, 3, 2) and new.sites == ()


# merge -----------------------------------------------------------------------------------------


def test_merge_elementwise_max_never_sums():
    state = _state(history_len=3)
    merged = fp8fn.merge(observation(state, fc=(2.0, 5.0, 1.0)), observation(state, fc=(2, 3, 4)))
    assert merged["fc"].amax_history.tolist() == [[2, 0, 0], [5, 0, 0], [4, 0, 0]]


def test_merge_takes_the_max_of_the_scale_leaf_too():
    # Both leaves combine by elementwise max, as `all_reduce` combines them over ranks (one
    # collective on the packed tensors): merging microbatches and reducing ranks commute.
    state = _state(("a", "b"), history_len=2)
    a = observation(state, a=(1.0, None, 3.0))._replace(
        scale=torch.tensor([[0.0, 2.0, 0.5], [4.0, 0.0, 1.0]])
    )
    b = observation(state, b=(2.0, 2.0, None))._replace(
        scale=torch.tensor([[1.0, 0.0, 0.25], [3.0, 5.0, 1.0]])
    )
    want = torch.tensor([[1.0, 2.0, 0.5], [4.0, 5.0, 1.0]])
    for merged in (fp8fn.merge(a, b), fp8fn.merge(b, a)):
        assert torch.equal(merged.scale, want)
        assert torch.equal(merged.amax_history, torch.maximum(a.amax_history, b.amax_history))


def test_merge_inf_and_nan_are_not_observed():
    state = _state(history_len=2)
    a = observation(state, fc=(math.inf, math.nan, math.nan))
    b = observation(state, fc=(7.0, 2.0, None))
    merged = fp8fn.merge(a, b)
    assert merged["fc"].amax_history.tolist() == [[7, 0], [2, 0], [0, 0]]
    assert torch.equal(merged.amax_history, fp8fn.merge(b, a).amax_history)


def test_merge_then_update_is_max_of_microbatches():
    state = _state(history_len=2)
    micro = [observation(state, fc=(a, a, a)) for a in (3.0, 8.0, math.nan, math.inf, 5.0)]
    merged = micro[0]
    for m in micro[1:]:
        merged = fp8fn.merge(merged, m)
    assert _role(fp8fn.update(state, merged), "input") == ([8, 0], 56.0)


# constant cost ---------------------------------------------------------------------------------


def _python_calls(f) -> int:
    """The number of Python function calls `f()` makes (the garbage collector held off: its
    weakref callbacks, e.g. the caches' removals of dead tensors, are not `f`'s calls)."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        f()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


@pytest.mark.parametrize("api", ["update", "merge"])
def test_state_functions_cost_does_not_grow_with_sites(api):
    costs = []
    for n in (8, 512):
        state = _state([f"blocks.{i}.fc" for i in range(n)], history_len=16)
        obs = observation(state, **{s: (1.0, 2.0, 3.0) for s in state.sites[::3]})
        f = getattr(fp8fn, api)
        f(state, obs)  # warm caches
        with CountOps() as ops:
            f(state, obs)
        costs.append((ops.count, _python_calls(lambda: f(state, obs))))
    assert costs[0] == costs[1], costs


# structural errors: every bad input names the API, what was expected and what came ---------------


@pytest.mark.parametrize("api", ["update", "merge"])
def test_trees_different_sites_raise(api):
    a, b = _state(("fc1", "fc2")), _state(("fc1", "fc3"))
    with pytest.raises(ValueError, match=rf"^fp8fn\.{api}: .* same sites and static config"):
        getattr(fp8fn, api)(a, b)


@pytest.mark.parametrize("api", ["update", "merge"])
def test_trees_different_history_lengths_raise(api):
    with pytest.raises(
        ValueError, match=rf"^fp8fn\.{api}: .* same shapes.*\(1, 3, 4\).*\(1, 3, 2\)"
    ):
        getattr(fp8fn, api)(_state(history_len=4), _state(history_len=2))


def _bad_states():
    good = _state(("fc",), history_len=4)
    return [
        ([("fc", None)], TypeError, r"fp8fn\.State .*got list"),
        ({"fc": good["fc"]}, TypeError, r"fp8fn\.State .*got dict"),
        (3.0, TypeError, r"fp8fn\.State .*got float"),
        (
            good._replace(amax_history=[0.0] * 12),
            TypeError,
            r"amax_history` to be a tensor, got list",
        ),
        (
            good._replace(scale=good.scale.double()),
            TypeError,
            r"scale` to be float32, got torch\.float64",
        ),
        (
            good._replace(amax_history=good.amax_history.int()),
            TypeError,
            r"float32, got torch\.int32",
        ),
        (
            good._replace(amax_history=good.amax_history.bool()),
            TypeError,
            r"float32, got torch\.bool",
        ),
        (
            good._replace(amax_history=good.amax_history.to("meta")),
            ValueError,
            r"on a device that holds values, got meta",
        ),
        (
            good._replace(scale=torch.ones(2, 3)),
            ValueError,
            r"n_sites = 1; got \(1, 3, 4\) and \(2, 3\)",
        ),
        (good._replace(amax_history=torch.zeros(1, 2, 4)), ValueError, r"got \(1, 2, 4\)"),
        (good._replace(amax_history=torch.zeros(12)), ValueError, r"got \(12,\)"),
    ]


@pytest.mark.parametrize("api", ["update", "merge"])
@pytest.mark.parametrize("bad, error, match", _bad_states())
def test_bad_state_or_obs_raises_and_changes_nothing(api, bad, error, match):
    good = _state(("fc",), history_len=4)
    before = good.amax_history.clone()
    for args in ((good, bad), (bad, good)):
        with pytest.raises(error, match=rf"^fp8fn\.{api}: expected .*{match}"):
            getattr(fp8fn, api)(*args)
    assert torch.equal(good.amax_history, before)


@SETTINGS
@given(
    dtype=st.sampled_from([torch.float64, torch.float16, torch.int64, torch.bool]),
    shape=st.lists(st.integers(0, 4), max_size=4).map(tuple),
    field=st.sampled_from(["amax_history", "scale"]),
)
def test_bad_leaves_always_raise_a_named_error(dtype, shape, field):
    good = _state(("a", "b"), history_len=3)
    right = tuple(getattr(good, field).shape)
    bad = good._replace(**{field: torch.zeros(shape if shape != right else (1,), dtype=dtype)})
    for api in ("update", "merge"):
        with pytest.raises((TypeError, ValueError), match=rf"^fp8fn\.{api}: expected"):
            getattr(fp8fn, api)(good, bad)


# pytrees and serialization ---------------------------------------------------------------------


@pytest.mark.parametrize("n_sites", [1, 64])
def test_state_is_two_leaves_under_torch_pytree_and_optree(stepped, n_sites):
    state = _state([f"s{i}" for i in range(n_sites)])
    leaves_t, spec = torch.utils._pytree.tree_flatten(state)
    leaves_o, treedef = optree.tree_flatten(state, namespace="fp8fn")
    assert len(leaves_t) == len(leaves_o) == 2
    assert leaves_t[0] is leaves_o[0] is state.amax_history and leaves_t[1] is state.scale
    back = torch.utils._pytree.tree_unflatten(leaves_t, spec)
    assert type(back) is fp8fn.State and back.static == state.static
    assert optree.tree_unflatten(treedef, leaves_o).static == state.static


def test_state_reads_as_a_mapping_of_views(stepped):
    assert len(stepped) == 2 and list(stepped) == ["a", "b"] and "a" in stepped
    assert [k for k, _ in stepped.items()] == ["a", "b"]
    a = stepped["a"]
    assert isinstance(a, fp8fn.SiteState) and isinstance(a.weight, fp8fn.ScaleState)
    assert a.weight.amax_history.tolist() == [2, 5, 0, 0]
    assert a.weight.scale.shape == () and a.weight.scale == 448.0 / (5 * 2)
    assert a.grad_output.amax_history._base is stepped.amax_history  # a view, not a copy
    with pytest.raises(KeyError, match=r"fp8fn\.State: no site 'c'"):
        stepped["c"]


def test_state_flat_dict_round_trip(stepped):
    flat = fp8fn.flatten_state(stepped)
    assert list(flat)[:2] == ["a.input.amax_history", "a.input.scale"] and len(flat) == 12
    flat["a.input.scale"].fill_(0.0)  # independent tensors: the state is untouched
    assert stepped["a"].input.scale == 448.0 / 12
    flat = fp8fn.flatten_state(stepped)
    back = fp8fn.unflatten_state(flat, fp8fn.DelayedScaling(history_len=4, margin=1))
    assert_bit_identical(back, stepped)
    with pytest.raises(
        ValueError, match=r"fp8fn\.unflatten_state: missing keys \['a\.weight\.scale'\]"
    ):
        fp8fn.unflatten_state(
            {k: v for k, v in flat.items() if k != "a.weight.scale"}, fp8fn.DelayedScaling()
        )
    with pytest.raises(
        ValueError, match=r"fp8fn\.unflatten_state: expected keys .* got 'a\.scale'"
    ):
        fp8fn.unflatten_state({"a.scale": torch.ones(())}, fp8fn.DelayedScaling())


def test_state_torch_save_load_weights_only(stepped):
    loaded = saved_and_loaded(stepped)
    assert type(loaded) is fp8fn.State and loaded.static == stepped.static
    assert_bit_identical(loaded, stepped)


def _golden_records():
    """`tools/golden_v0_3.py`'s records, computed with today's code."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "tools" / "golden_v0_3.py"
    spec = importlib.util.spec_from_file_location("golden_v0_3", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.records()


def test_numbers_are_those_of_v0_3_bit_for_bit():
    """Outputs, parameter gradients, observations, updated states and fp8 casts of every recipe
    (delayed with empty and filled histories) and route equal fp8fn 0.3's (509a66d), recorded in
    tests/data/golden_v0_3.pt by tools/golden_v0_3.py."""
    from pathlib import Path

    golden = torch.load(Path(__file__).parent / "data" / "golden_v0_3.pt", weights_only=True)
    now = _golden_records()
    assert sorted(now) == sorted(golden["records"])
    differ = [name for name, d in golden["records"].items() if now[name] != d]
    assert differ == []


def _mlp_fn(recipe=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    fn = fp8fn.transform(model, recipe or fp8fn.DelayedScaling())
    return fn, dict(model.named_parameters()), torch.randn(8, 32)


def test_scales_changed_in_place_after_update_are_checked_again():
    fn, params, x = _mlp_fn()
    state = fn.init(x)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    new = fp8fn.update(state, obs)
    fn.apply(params, new, x)  # known valid: no check
    new.scale.zero_()  # the same tensor, changed in place
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected the scales of `state` finite"):
        fn.apply(params, new, x)
    with pytest.raises(ValueError, match=r"^fp8fn\.update: expected the scales of `state` finit"):
        fp8fn.update(new, obs)


def test_update_refuses_a_state_it_does_not_know_in_the_graph():
    """A state fp8fn did not make (loaded) passed as the observation: its older history entries
    are refused by an assert in the graph (no host read)."""
    fn, params, x = _mlp_fn()
    state = fn.init(x)
    for _ in range(2):
        state = fp8fn.update(state, torch.func.grad(loss_of(fn), argnums=1)(params, state, x))
    loaded = saved_and_loaded(state)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.update: expected `obs` an observation"):
        fp8fn.update(state, loaded)


def test_count_host_reads_sees_each_kind():
    t = torch.ones(())
    with CountHostReads() as c:
        bool(t), t.item(), t.tolist(), int(t), float(t), [0, 1][t.long()]
        torch.equal(t, t), torch.allclose(t, t), t.cpu(), t.numpy()
    assert sorted(c.reads) == sorted(HOST_READS + HOST_READ_FUNCTIONS)


def _func_step(fn, params, state, x):
    _, obs = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)
    return fp8fn.update(state, obs)


def _autograd_step(fn, params, state, x):
    observed = fp8fn.observe(state)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss_of(fn)(leaves, observed, x).backward()
    return fp8fn.update(state, fp8fn.observations(observed))


def _value_and_grad_merge_step(fn, params, state, x):
    grad = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))
    _, (_, obs_a) = grad(params, state, x[:4])
    _, (_, obs_b) = grad(params, state, x[4:])
    return fp8fn.update(state, fp8fn.merge(obs_a, obs_b))


@pytest.mark.parametrize("step", [_func_step, _autograd_step, _value_and_grad_merge_step])
def test_a_steady_state_step_reads_no_tensor_value_on_the_host(step):
    """No `bool(t)`, `.item()`, ... (each a device sync on a GPU) in a step after the first."""
    fn, params, x = _mlp_fn()
    state = fn.init(x)
    for _ in range(2):
        state = step(fn, params, state, x)
    with CountHostReads() as c:
        new = step(fn, params, state, x)
    assert c.reads == []
    assert torch.equal(new.amax_history[..., 1:], state.amax_history[..., :-1])  # it stepped


class _IdleExpertMoE(torch.nn.Module):
    """A Linear(16, 32), then 3 experts `(3, 16, 32)` with fixed routing: the first half of the
    rows to expert 0, the second to expert 2; expert 1 never receives a token (its input and
    grad_output histories stay empty). `form`: F.linear on `W[e]`, `torch.bmm` over all
    experts (the idle one on zero rows), or `torch._grouped_mm` with offsets."""

    def __init__(self, form):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.proj = torch.nn.Linear(16, 32)
        self.experts = torch.nn.Parameter(torch.randn(3, 16, 32) / 6)

    def forward(self, x):
        h, w, n = self.proj(x), self.experts, len(x) // 2
        if self.form == "linear":
            return torch.cat([F.linear(h[:n], w[0]), F.linear(h[n:], w[2])])
        if self.form == "bmm":
            rows = torch.stack([h[:n], torch.zeros_like(h[:n]), h[n:]])
            return torch.bmm(rows, w.transpose(1, 2))[[0, 2]].flatten(0, 1)
        offs = torch.tensor([n, n, 2 * n], dtype=torch.int32)
        return torch._grouped_mm(h, w.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("step", [_func_step, _autograd_step, _value_and_grad_merge_step])
@pytest.mark.parametrize("form", ["linear", "bmm", "grouped_mm"])
def test_a_steady_step_with_an_idle_expert_reads_nothing_from_update(form, step):
    """An expert that never receives a token keeps empty histories: 0.4's `update` then read
    which histories are filled at every step (one `tolist`). Now only its first
    `FILLED_READS` updates do; the idle roles stay decided in the graph (the same bits). The
    emulated grouped GEMM (bmm and grouped_mm forms) reads its offsets on the host (forward,
    grad input, grad weight; `grouped_gemm.bounds`): those 3 per pass only."""
    from fp8fn._core.update import FILLED_READS

    model = _IdleExpertMoE(form)
    fn, params = fp8fn.transform(model, fp8fn.DelayedScaling()), dict(model.named_parameters())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    state = fn.init(x)
    assert list(state) == ["proj", "experts[0]", "experts[1]", "experts[2]"]
    for _ in range(FILLED_READS):
        state = step(fn, params, state, x)
    with CountHostReads() as c:
        new = step(fn, params, state, x)
    passes = 2 if step is _value_and_grad_merge_step else 1
    offsets = 3 * passes if form != "linear" else 0  # bmm runs as the grouped op too
    assert c.reads == ["tolist"] * offsets
    idle = [False, form != "linear", False]  # expert 1: its weight cast unless never called
    assert new.filled == (True,) * 3 + (True,) * 3 + tuple(idle) + (True,) * 3
    ran = [0, 1, 3]  # every role of these rows observed: their histories moved
    assert torch.equal(new.amax_history[ran, :, 1:], state.amax_history[ran, :, :-1])
    assert not new.amax_history[2, [0, 2]].any()  # the idle expert's histories stay empty


class _CastScales:
    """Records the storage address of the scale of every per-tensor float8 cast inside."""

    def __init__(self, monkeypatch):
        from fp8fn._ops import roles, tensorwise
        from fp8fn._torch_private import unwrapped

        self.scales, cast = [], tensorwise.cast_to_fp8

        def recording(hp, scale, *args):
            self.scales.append(unwrapped(scale).untyped_storage().data_ptr())
            return cast(hp, scale, *args)

        for module in (tensorwise, roles):  # roles: the grad_output cast with a computed scale
            monkeypatch.setattr(module, "cast_to_fp8", recording)


def test_filled_histories_cast_with_the_stored_scales_themselves(monkeypatch):
    """Once a state's histories are filled (`update` records it in the tree structure), x, W
    and dY are cast with the stored scales as they are: no value computed from the tensor's
    own amax comes before its cast, so a compiler can take the amax in the cast's pass. At step
    1 (empty histories) the scales are computed (current scaling)."""
    fn, params, x = _mlp_fn()
    state = fn.init(x)
    assert state.filled == (False,) * 6
    stored = state.scale.untyped_storage().data_ptr()
    seen = _CastScales(monkeypatch)
    torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    assert len(seen.scales) == 6 and stored not in seen.scales  # 2 sites x (x, W, dY)
    state = _func_step(fn, params, state, x)
    assert state.filled == (True,) * 6
    for route in (_func_step, _autograd_step):
        stored = state.scale.untyped_storage().data_ptr()
        seen.scales.clear()
        state = route(fn, params, state, x)
        assert seen.scales == [stored] * 6
    assert state.filled == (True,) * 6


def test_filled_follows_the_histories():
    """`filled` is set by `update` for the roles that observed something; a site that did not
    run stays unfilled (and casts with current scaling); `_replace` of the history forgets it."""
    state = _state(("a", "b"), history_len=2)
    obs = observation(state, a=(1.0, 2.0, 0.0))  # a's grad_output not observed, b not at all
    state = fp8fn.update(state, obs)
    assert state.filled == (True, True, False, False, False, False)
    assert saved_and_loaded(state).filled is None  # not saved: found again by the next update
    assert fp8fn.update(saved_and_loaded(state), obs).filled == state.filled
    assert state._replace(amax_history=state.amax_history.clone()).filled is None
    assert state._replace(scale=state.scale.clone()).filled == state.filled
    assert fp8fn.observe(state).filled == state.filled
