"""fp8fn.State: immutable data, its device moves, and the states fp8fn refuses to run on."""

import io
import warnings
from pathlib import Path

import pytest
import torch
from _helpers import DELAYED, assert_bit_identical, loss_of, observation, stepped
from _models import ReusedLayer
from torch import nn

import fp8fn


def _setup():
    model = ReusedLayer(16)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    params = {k: v.detach() for k, v in model.named_parameters()}
    return fn, params, x


def test_the_state_is_immutable_data():
    state = fp8fn.init_state(DELAYED, ["a", "b"])
    with pytest.raises(AttributeError, match=r"fp8fn.State is immutable.*_replace\(scale=\.\.\.\)"):
        state.scale = torch.zeros(2, 3)
    with pytest.raises(AttributeError, match="fp8fn.State is immutable"):
        state.margin = 3
    with pytest.raises(AttributeError, match="fp8fn.State is immutable"):
        del state.sites
    site = state["a"]
    with pytest.raises(AttributeError, match=r"fp8fn.SiteState is immutable.*_replace"):
        site.amax_history = torch.zeros(3, 4)
    assert state["a"] is site and state.static == (("a", "b"), "max", 0)
    new = state._replace(scale=torch.full((2, 3), 2.0))
    assert torch.equal(new["b"].scale, torch.full((3,), 2.0))
    assert torch.equal(site.scale, torch.ones(3))  # the old views did not go stale
    with pytest.raises(TypeError, match=r"fp8fn.State._replace: expected fields .*\['margin'\]"):
        state._replace(margin=2)
    with pytest.raises(KeyError, match=r"no site 'c' among its 2 sites\.\"$"):
        state["c"]
    many = fp8fn.init_state(DELAYED, [f"blocks.{i}.fc1" for i in range(12)])
    with pytest.raises(KeyError, match=r"no site 'blocks.1.fc' among its 12 .* 'blocks.1.fc1'"):
        many["blocks.1.fc"]


def test_state_to_moves_both_tensors_and_device_errors_cite_it():
    state = fp8fn.init_state(DELAYED, ["fc"])
    moved = state.to("meta")
    assert moved.amax_history.device.type == moved.scale.device.type == "meta"
    assert moved.static == state.static and state.amax_history.device.type == "cpu"
    with pytest.raises(ValueError, match=r"Move it: `state = state.to\(device\)`"):
        fp8fn.linear(torch.randn(4, 8), torch.randn(6, 8), None, moved["fc"], DELAYED)


def test_linear_refuses_a_recipe_that_disagrees_with_the_site_state():
    state = fp8fn.init_state(DELAYED, ["fc"])
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    other = fp8fn.DelayedScaling(history_len=4, margin=3, amax_compute="most_recent")
    with pytest.raises(ValueError, match=r"fp8fn.linear: expected `site_state` made for the rec"):
        fp8fn.linear(x, w, None, state["fc"], other)
    site = fp8fn.init_state(other, ["fc"])["fc"]  # it carries its config
    assert site.static == ("most_recent", 3)
    fp8fn.linear(x, w, None, site, other)


def test_an_observation_or_a_bad_scale_where_the_state_belongs_is_refused():
    fn, params, x = _setup()
    state = stepped(fn, params, fn.init(x), x)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    assert torch.equal(obs.scale, torch.zeros_like(obs.scale))
    for bad, name in (
        (obs, "an observation"),
        (state._replace(scale=state.scale.clone().index_fill_(0, torch.tensor([0]), 0.0)), "0"),
        (state._replace(scale=torch.full_like(state.scale, float("nan"))), "NaN"),
        (state._replace(scale=torch.full_like(state.scale, float("inf"))), "inf"),
        (state._replace(scale=-state.scale), "negative"),
    ):
        with pytest.raises(ValueError, match=r"fp8fn.apply: expected the scales of `state` fin"):
            fn.apply(params, bad, x)
        with pytest.raises(ValueError, match=r"fp8fn.apply: expected the scales"):
            torch.func.grad(loss_of(fn), argnums=1)(params, bad, x)
        with pytest.raises(ValueError, match=r"fp8fn.linear: expected the scales of `site_state`"):
            fp8fn.linear(x, params["fc.weight"], None, bad["fc"], DELAYED)
    # A hand-made state with good scales is accepted (checked once).
    good = state._replace(scale=state.scale.clone())
    assert torch.equal(fn.apply(params, good, x), fn.apply(params, state, x))


def test_update_refuses_swapped_or_state_arguments():
    fn, params, x = _setup()
    state = stepped(fn, params, fn.init(x), x)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    with pytest.raises(ValueError, match=r"fp8fn.update: expected the scales of `state` finite"):
        fp8fn.update(obs, state)
    with pytest.raises(ValueError, match=r"fp8fn.update: expected `obs` an observation .* a sta"):
        fp8fn.update(state, state)
    new = fp8fn.update(state, obs)  # the right order still works
    assert torch.equal(new.amax_history[..., 1], state.amax_history[..., 0])


def test_dropping_the_result_of_update_warns():
    fn, params, x = _setup()
    state = stepped(fn, params, fn.init(x), x)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    fp8fn.update(state, obs)  # the result dropped: the old state is used again
    with pytest.warns(UserWarning, match=r"fp8fn.observe: this state was already updated"):
        fp8fn.observe(state)
    with pytest.warns(UserWarning, match=r"`state = fp8fn.update\(state, obs\)`"):
        torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    new = fp8fn.update(state, obs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kept result is fine
        fp8fn.observe(new)
        fn.apply(params, new, x)


def test_two_runs_from_one_initial_state_do_not_warn():
    # an A/B comparison (or a re-run notebook cell): each run keeps its updates
    fn, params, x = _setup()
    finals = []
    for initial in (
        fn.init(x),
        stepped(fn, params, fn.init(x), x),
    ):  # fresh from init, or updated once
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for scale in (1.0, 2.0):  # two experiments from `initial`, from other weights
                state, weights = initial, {k: v * scale for k, v in params.items()}
                for _ in range(3):
                    obs = torch.func.grad(loss_of(fn), argnums=1)(weights, state, x)
                    state = fp8fn.update(state, obs)
                finals.append(state)
    assert not torch.equal(finals[0].scale, finals[1].scale)
    fp8fn.update(finals[-1], obs)  # a dropped result still warns
    with pytest.warns(UserWarning, match=r"fp8fn.apply: this state was already updated"):
        fn.apply(params, finals[-1], x)


def test_site_order_follows_the_module_tree_not_the_example():
    class Experts(nn.Module):
        """An MoE-like model: which experts run depends on the data."""

        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for i in x[:, 0].abs().argsort().tolist()[:2]:  # two of three, in a data order
                x = self.experts[i % 3](x)
            return x

    model = Experts()
    fn = fp8fn.transform(model, DELAYED)
    orders = set()
    for seed in range(6):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
        orders.add(fn.init(x).sites)
    assert orders == {("experts.0", "experts.1", "experts.2")}


def test_a_flat_state_of_eleven_or_more_layers_comes_back_in_module_order():
    # nn.Sequential names its layers '0', '1', ..., '10', '11': sorted names would give
    # '0', '1', '10', '11', '2', ...; the restored state must be fn.init's, site for site.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(12)))
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(3, 4)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = stepped(fn, params, fn.init(x), x)
    assert state.sites == tuple(str(i) for i in range(12))
    flat = fp8fn.flatten_state(state)
    restored = fp8fn.unflatten_state(flat, DELAYED)
    assert restored.sites == state.sites == fn.init(x).sites
    assert torch.equal(restored.amax_history, state.amax_history)
    assert torch.equal(restored.scale, state.scale)
    # A step after a resume pairs with one that never stopped (update and merge check the sites
    # in order, as all_reduce does across ranks).
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    resumed = fp8fn.update(restored, obs)
    assert torch.equal(resumed.amax_history, fp8fn.update(state, obs).amax_history)


def test_observation_helper_builds_what_update_takes():
    state = fp8fn.init_state(DELAYED, ["a"])
    new = fp8fn.update(state, observation(state, a=(2.0, None, 4.0)))
    assert new["a"].input.amax_history.tolist() == [2.0, 0.0, 0.0, 0.0]
    assert new["a"].weight.amax_history.tolist() == [0.0] * 4


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_state_saved_by_0_3_loads_and_keeps_its_values(weights_only):
    """tests/data/state_v0_3.pt was written by fp8fn 0.3, whose types lived in `fp8fn._state`:
    the private modules moved, the saved names did not, and the values come back bit for bit,
    on both load paths (0.4: `weights_only=False`, needed by any checkpoint that also holds
    non-tensor objects, raised ModuleNotFoundError: No module named 'fp8fn._state')."""
    path = Path(__file__).parent / "data" / "state_v0_3.pt"
    saved = torch.load(path, weights_only=weights_only)
    _assert_saved_values(saved)
    assert saved["nvfp4"].key.item() == 510934918213656.0
    # and a state saved now names the public type, whatever module defines it
    buffer = io.BytesIO()
    torch.save(saved["state"], buffer)
    assert b"fp8fn\nState" in buffer.getvalue() and b"_core" not in buffer.getvalue()


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_state_saved_by_0_4_loads_and_keeps_its_values(weights_only):
    """tests/data/state_v0_4.pt was written by fp8fn 0.4 (commit abd2064, the same model and
    steps as the 0.3 file, NVFP4 seed 3), whose types pickled as `fp8fn.State` with their own
    `__reduce__`: they load on both paths, bit for bit, and round-trip again."""
    path = Path(__file__).parent / "data" / "state_v0_4.pt"
    saved = torch.load(path, weights_only=weights_only)
    _assert_saved_values(
        saved, newest=(1.7610981464385986, 0.35267937183380127, 0.3110616207122803)
    )
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    again = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert torch.equal(again["state"].amax_history, saved["state"].amax_history)
    assert again["nvfp4"].key.item() == saved["nvfp4"].key.item()


def _assert_saved_values(
    saved, newest=(2.149376392364502, 0.35267937183380127, 0.22417442500591278)
):
    """The values of a state file of tests/data: a 2-site delayed state (history 4, margin 1,
    two updates: its two newest entries equal), a site of it, its flat form, an NVFP4 state."""
    state, site, flat, nvfp4 = saved["state"], saved["site"], saved["flat"], saved["nvfp4"]
    assert type(state) is fp8fn.State and type(site) is fp8fn.SiteState
    assert list(state) == ["0", "2"] and state.static == (("0", "2"), "max", 1)
    assert state.amax_history.shape == (2, 3, 4)
    assert state.amax_history[0, :, 0].tolist() == list(newest)
    assert torch.equal(state.amax_history[..., 0], state.amax_history[..., 1])
    assert torch.equal(site.amax_history, state["0"].amax_history)
    assert site.static == ("max", 1)
    assert torch.equal(fp8fn.flatten_state(state)["0.input.scale"], flat["0.input.scale"])
    assert type(nvfp4) is fp8fn.State and nvfp4.key.dtype == torch.float64


def test_unflatten_state_refuses_what_flatten_state_never_makes():
    recipe = fp8fn.DelayedScaling(history_len=4)
    state = fp8fn.init_state(recipe, ["fc"])
    flat = fp8fn.flatten_state(state)
    before = {k: v.clone() for k, v in flat.items()}
    as_lists = {k: v.tolist() for k, v in flat.items()}
    with pytest.raises(
        TypeError,
        match=r"^fp8fn\.unflatten_state: expected a tensor at 'fc\.input\.amax_history', got "
        r"list\. Convert it: torch\.tensor\(value, dtype=torch\.float32\)\.$",
    ):
        fp8fn.unflatten_state(as_lists, recipe)
    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.unflatten_state: expected shape \(16,\) \(the history_len of "
        r"DelayedScaling\(history_len=16, .*\)\) at 'fc\.input\.amax_history', got \(4,\)\. "
        r"Pass the recipe the state was saved with\.$",
    ):
        fp8fn.unflatten_state(flat, fp8fn.DelayedScaling())  # 0.3 made a history of 4
    doubles = {**flat, "fc.weight.scale": flat["fc.weight.scale"].double()}
    with pytest.raises(
        TypeError, match=r"^fp8fn\.unflatten_state: expected torch\.float32 at 'fc\.weight\.scale'"
    ):
        fp8fn.unflatten_state(doubles, recipe)
    with pytest.raises(TypeError, match=r"^fp8fn\.unflatten_state: expected `flat` a dict .*list"):
        fp8fn.unflatten_state(list(flat.items()), recipe)
    with pytest.raises(ValueError, match=r"^fp8fn\.unflatten_state: expected keys .* got 3\.$"):
        fp8fn.unflatten_state({**flat, 3: flat["fc.input.scale"]}, recipe)
    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.unflatten_state: expected no sites under CurrentScaling \(no scaling "
        r"state\), got \['fc\.input\.amax_history', .*\]\. Pass the model's DelayedScaling",
    ):
        fp8fn.unflatten_state(flat, fp8fn.CurrentScaling())
    with pytest.raises(TypeError, match=r"^fp8fn\.unflatten_state: expected `recipe` to be an "):
        fp8fn.unflatten_state(flat, "delayed")
    assert all(torch.equal(flat[k], v) for k, v in before.items())  # nothing changed
    assert_bit_identical(fp8fn.unflatten_state(flat, recipe), state)


def test_unflatten_state_of_a_model_without_delayed_layers_takes_its_recipe():
    # 0.3 refused unflatten_state(flat, NVFP4Scaling()): an NVFP4-only state had to be
    # unflattened with DelayedScaling(history_len=1), the recipe of fn.init's empty state.
    model = nn.Linear(32, 16)
    x = torch.randn(4, 32)
    for recipe in (fp8fn.NVFP4Scaling(), fp8fn.CurrentScaling(), fp8fn.MXScaling()):
        state = fp8fn.transform(model, recipe).init(x, seed=3)
        back = fp8fn.unflatten_state(fp8fn.flatten_state(state), recipe)
        assert_bit_identical(back, state)
        assert back.static == state.static and back.history_len == state.history_len == 1


def test_init_state_takes_a_list_of_sites_not_a_str():
    # 0.3 made the sites 'f' and 'c' of init_state(recipe, "fc").
    with pytest.raises(
        TypeError,
        match=r"^fp8fn\.init_state: expected `sites` a list of str site names, got str 'fc'\. "
        r"For one site: \['fc'\]\.$",
    ):
        fp8fn.init_state(DELAYED, "fc")
    with pytest.raises(TypeError, match=r"`sites` a list of str site names, got int 3\."):
        fp8fn.init_state(DELAYED, 3)
    assert fp8fn.init_state(DELAYED, ("fc" for _ in range(1))).sites == ("fc",)


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize(
    "recipe",
    [
        fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent", margin=1),
        fp8fn.CurrentScaling(),
        fp8fn.RowwiseScaling(hp_grad_weight=True),
        fp8fn.BlockwiseScaling(),
        fp8fn.MXScaling(scale_rounding="floor"),
        fp8fn.NVFP4Scaling(hadamard=False),
    ],
    ids=lambda r: type(r).__name__,
)
def test_a_recipe_saved_by_0_3_or_now_loads_on_both_paths(recipe, weights_only, monkeypatch):
    """A checkpoint holding the recipe beside the state: 0.3 pickled recipes as
    `fp8fn._recipe.<Name>`, now they pickle as `fp8fn.<Name>`; both load, both ways."""
    now = io.BytesIO()
    torch.save({"recipe": recipe}, now)
    assert f"fp8fn\n{type(recipe).__name__}".encode() in now.getvalue()
    monkeypatch.setattr(type(recipe), "__module__", "fp8fn._recipe")  # as 0.3 saved it
    old = io.BytesIO()
    torch.save({"recipe": recipe}, old)
    monkeypatch.undo()
    assert b"fp8fn._recipe\n" in old.getvalue()
    for buffer in (now, old):
        buffer.seek(0)
        assert torch.load(buffer, weights_only=weights_only)["recipe"] == recipe
