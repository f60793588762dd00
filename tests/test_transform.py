"""fp8fn.transform: a module as pure init/apply functions, under torch.func and autograd."""

import concurrent.futures
import copy

import optree
import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    CURRENT_AUTO,
    DELAYED,
    ROLES,
    assert_bit_identical,
    loss_of,
    saved_and_loaded,
    sqnr,
)
from _models import Branchy, ReusedLayer, Tied, Transformer
from torch import nn
from torch.utils import _pytree as pytree

import fp8fn


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)
    )


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.register_buffer("shift", torch.full((8,), 0.5))

    def forward(self, x):
        return self.fc(x) + self.shift


class HashNamed(nn.Module):
    """`fc` and a module named `fc#1`, each called twice, interleaved.

    Sites, in module order then call order: `fc`, `fc#1` (`fc`'s second call), `fc##1` (the
    module `fc#1`), `fc##1#1` (the second call of `fc#1`).
    """

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            self.fc = nn.Linear(16, 16)
            self.add_module("fc#1", nn.Linear(16, 16))

    def forward(self, x):
        other = getattr(self, "fc#1")
        x = F.relu(other(F.relu(self.fc(x))))
        return other(F.relu(self.fc(x)))


def _params(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _zero_obs(state):
    """The observation of a step that observed nothing: zeros of `state`'s structure."""
    return state._replace(
        amax_history=torch.zeros_like(state.amax_history), scale=torch.zeros_like(state.scale)
    )


def _transformed_mlp(batch: int):
    """`(model, fn, x, params, state)`: `_mlp()`, its DELAYED transform, an input
    `(batch, 16)`, detached copies of its parameters and `fn.init(x)`."""
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(batch, 16)
    return model, fn, x, _params(model), fn.init(x)


def _stepped(fn, params, state, x):
    """`state` updated with the observation of one torch.func.grad of `loss_of(fn)` on `x`."""
    return fp8fn.update(state, torch.func.grad(loss_of(fn), argnums=1)(params, state, x))


def _autograd_step(fn, params, state, x, loss=None):
    """Gradients and observations with `loss.backward()`, through `fp8fn.observe`."""
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    s = fp8fn.observe(state)
    (loss or loss_of(fn))(p, s, x).backward()
    return {k: v.grad for k, v in p.items()}, fp8fn.observations(s)


def test_transform_leaves_module_untouched():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    children = [type(m) for m in model.modules()]
    attrs = [sorted(vars(m)) for m in model.modules()]
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda n, m: n == "2")
    x = torch.randn(4, 16)
    state = fn.init(x)
    torch.func.grad(loss_of(fn), argnums=(0, 1))(_params(model), state, x)
    assert [type(m) for m in model.modules()] == children
    assert [sorted(vars(m)) for m in model.modules()] == attrs
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model(x), nn.Sequential(*model)(x))  # still a plain float32 model


def test_init_sites_in_call_order_with_reuse_and_branches():
    x = torch.randn(4, 16)
    assert list(fp8fn.transform(ReusedLayer(16), DELAYED).init(x)) == ["fc", "fc#1", "out"]
    # The branch not taken at init still gets a site; sites follow the module tree.
    assert list(fp8fn.transform(Branchy(16), DELAYED).init(x)) == ["fc1", "extra", "fc2"]
    # Two modules sharing one weight are two sites (and the head tied to the embedding is one).
    ids = torch.randint(0, 16, (4,))
    assert list(fp8fn.transform(Tied(16, 16), DELAYED).init(ids)) == ["a", "b", "head"]


def test_init_does_not_compute_real_activations():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            seen.append(x.device.type)
            return self.fc(x)

    fp8fn.transform(Probe(), DELAYED).init(torch.randn(4, 16))
    assert seen == ["meta"]


def test_init_falls_back_to_real_run_for_data_dependent_models():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)

    x = torch.ones(4, 16)
    assert list(fp8fn.transform(DataDependent(), DELAYED).init(x)) == ["a", "b"]


def test_init_state_layout():
    state = fp8fn.transform(_mlp(), DELAYED).init(torch.randn(4, 16))
    assert type(state) is fp8fn.State
    assert list(state) == ["0", "2", "4"] and len(state) == 3
    assert state.static == (("0", "2", "4"), "max", 0)
    assert state.amax_history.dtype == state.scale.dtype == torch.float32
    assert torch.equal(state.amax_history, torch.zeros(3, 3, 4))  # never observed
    assert torch.equal(state.scale, torch.ones(3, 3))
    # A site's rows and a role's entries are views of the two packed tensors.
    site = state["2"]
    assert type(site) is fp8fn.SiteState and site.amax_history.shape == (3, 4)
    assert site.amax_history.data_ptr() == state.amax_history[1].data_ptr()
    s = site.grad_output
    assert type(s) is fp8fn.ScaleState and s.amax_history.shape == (4,) and s.scale.shape == ()
    assert s.amax_history.data_ptr() == state.amax_history[1, 2].data_ptr()
    assert s.scale.data_ptr() == state.scale[1, 2].data_ptr()
    assert fp8fn.SiteState._fields == fp8fn.ScaleState._fields == ("amax_history", "scale")
    # The recipe's static config lives in the tree structure, not in leaves.
    recipe = fp8fn.DelayedScaling(history_len=2, amax_compute="most_recent", margin=3)
    other = fp8fn.transform(_mlp(), recipe).init(torch.randn(4, 16))
    assert other.static == (("0", "2", "4"), "most_recent", 3)
    assert other.amax_history.shape == (3, 3, 2)
    assert pytree.tree_structure(other) != pytree.tree_structure(state)
    # A stateless recipe: a State without sites.
    current = fp8fn.transform(_mlp(), CURRENT_AUTO).init(torch.randn(4, 16))
    assert type(current) is fp8fn.State and len(current) == 0 and list(current) == []
    assert current.amax_history.shape[:2] == (0, 3) and current.scale.shape == (0, 3)


def test_init_names_a_module_whose_name_contains_hash_apart_from_repeated_calls():
    model = HashNamed()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    params, state = _params(model), fn.init(x)
    assert list(state) == ["fc", "fc#1", "fc##1", "fc##1#1"]  # module order, then calls
    assert fn.layers == ["fc", "fc#1"]
    fc, other = model.fc, getattr(model, "fc#1")

    def reference(p, s, x):
        """The model by hand, each call with its own site; also the calls' inputs."""
        w, o = (p["fc.weight"], p["fc.bias"]), (p["fc#1.weight"], p["fc#1.bias"])
        h1 = F.relu(fp8fn.linear(x, *w, s["fc"], DELAYED))
        h2 = F.relu(fp8fn.linear(h1, *o, s["fc##1"], DELAYED))
        h3 = F.relu(fp8fn.linear(h2, *w, s["fc#1"], DELAYED))
        return fp8fn.linear(h3, *o, s["fc##1#1"], DELAYED), (x, h1, h2, h3)

    def ref_loss(p, s, x):
        return reference(p, s, x)[0].square().mean()

    for step in range(3):
        want, inputs = reference(params, state, x)
        assert torch.equal(fn.apply(params, state, x), want)
        obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
        assert_bit_identical(obs, torch.func.grad(ref_loss, argnums=1)(params, state, x))
        assert_bit_identical(_autograd_step(fn, params, state, x)[1], obs)
        # Each site saw its own call: its input, its layer's weight.
        newest = obs.amax_history[..., 0]
        x_, h1, h2, h3 = (h.detach().abs().max() for h in inputs)  # calls: fc, fc#1, fc, fc#1
        assert torch.equal(newest[:, 0], torch.stack([x_, h2, h1, h3]))
        w_fc, w_other = fc.weight.abs().max(), other.weight.abs().max()
        assert torch.equal(newest[:, 1], torch.stack([w_fc, w_fc, w_other, w_other]))
        assert bool((newest > 0).all()) and not obs.amax_history[..., 1:].any()
        state = fp8fn.update(state, obs)
        assert bool((state.amax_history[..., : step + 1] > 0).all())


def test_apply_is_pure():
    model, fn, x, params, state = _transformed_mlp(batch=4)
    state = _stepped(fn, params, state, x)
    snapshot = copy.deepcopy((params, state, x))
    assert type(snapshot[1]) is fp8fn.State and snapshot[1].static == state.static
    out1, out2 = fn.apply(params, state, x), fn.apply(params, state, x)
    assert torch.equal(out1, out2)
    assert_bit_identical((params, state, x), snapshot)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT_AUTO])
@pytest.mark.parametrize(
    "make, x",
    [
        (_mlp, torch.randn(8, 16)),
        (lambda: ReusedLayer(16), torch.randn(8, 16)),
        (lambda: Tied(16, 16), torch.randint(0, 16, (8,))),
    ],
    ids=["mlp", "reused", "tied"],
)
def test_func_and_autograd_routes_are_bit_identical(make, x, recipe):
    model = make()
    fn = fp8fn.transform(model, recipe)
    params, state = _params(model), fn.init(x)
    for _ in range(3):
        g_func, obs_func = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)
        (_, obs_gv), _ = torch.func.grad_and_value(loss_of(fn), argnums=(0, 1))(params, state, x)
        _, vjp_fn = torch.func.vjp(lambda p, s: loss_of(fn)(p, s, x), params, state)
        g_vjp, obs_vjp = vjp_fn(torch.tensor(1.0))
        g_auto, obs_auto = _autograd_step(fn, params, state, x)
        _, (g_vg, obs_vg) = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))(params, state, x)
        assert type(obs_func) is fp8fn.State and obs_func.static == state.static
        assert torch.equal(obs_func.scale, torch.zeros_like(state.scale))
        assert_bit_identical(g_func, g_auto)
        assert_bit_identical(g_func, g_vjp)
        assert_bit_identical(g_func, g_vg)
        assert_bit_identical(obs_func, obs_auto)
        assert_bit_identical(obs_func, obs_gv)
        assert_bit_identical(obs_func, obs_vjp)
        assert_bit_identical(obs_func, obs_vg)
        assert_bit_identical(fp8fn.update(state, obs_func), fp8fn.update(state, obs_auto))
        state = fp8fn.update(state, obs_func)
        params = {k: v - 0.1 * g_func[k] for k, v in params.items()}


def test_observations_are_amaxes_of_each_call():
    model = ReusedLayer(16)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    state = fn.init(x)
    params = _params(model)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    fc = (params["fc.weight"], params["fc.bias"])

    def by_hand(p, s, x):
        h1 = F.relu(fp8fn.linear(x, *fc, s["fc"], DELAYED))
        h2 = F.relu(fp8fn.linear(h1, *fc, s["fc#1"], DELAYED))
        return fp8fn.linear(h2, p["out.weight"], p["out.bias"], s["out"], DELAYED), h1, h2

    with torch.no_grad():
        _, h1, h2 = by_hand(params, state, x)
    assert obs["fc"].input.amax_history[0] == x.abs().max()
    assert obs["fc#1"].input.amax_history[0] == h1.abs().max()
    assert obs["out"].input.amax_history[0] == h2.abs().max()
    assert obs["fc"].weight.amax_history[0] == model.fc.weight.abs().max()
    assert obs["fc#1"].weight.amax_history[0] == model.fc.weight.abs().max()
    assert obs["out"].weight.amax_history[0] == model.out.weight.abs().max()
    # The whole packed observation, grad_output amaxes included, is the calls' by hand.
    want = torch.func.grad(lambda p, s, x: by_hand(p, s, x)[0].square().mean(), argnums=1)(
        params, state, x
    )
    assert_bit_identical(obs, want)
    assert bool((obs.amax_history[..., 0] > 0).all())
    assert torch.count_nonzero(obs.amax_history[..., 1:]) == 0
    assert torch.count_nonzero(obs.scale) == 0


def test_site_that_did_not_run_keeps_its_state():
    model = Branchy(16)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    params, state = _params(model), fn.init(x)
    assert list(state) == ["fc1", "extra", "fc2"]
    for _ in range(2):
        obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
        assert torch.count_nonzero(obs["extra"].amax_history) == 0
        state = fp8fn.update(state, obs)
    assert torch.equal(state["extra"].amax_history, torch.zeros(3, 4))
    assert torch.equal(state["extra"].scale, torch.ones(3))
    assert bool((state.amax_history[[0, 2], :, :2] > 0).all())
    assert torch.count_nonzero(state.amax_history[..., 2:]) == 0
    _, auto_obs = _autograd_step(fn, params, state, x)
    assert torch.count_nonzero(auto_obs["extra"].amax_history) == 0
    updated = fp8fn.update(state, auto_obs)
    assert_bit_identical(updated["extra"], state["extra"])
    assert not torch.equal(updated["fc1"].amax_history, state["fc1"].amax_history)


def test_observations_of_a_state_without_sites_is_the_empty_observation():
    model = _mlp()
    x = torch.randn(8, 16)
    params = _params(model)
    for checkpoint_fn in (lambda name, m: name == "", None):
        fn = fp8fn.transform(model, CURRENT_AUTO, checkpoint_fn=checkpoint_fn)
        state = fn.init(x)
        s = fp8fn.observe(state)
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss_of(fn)(p, s, x).backward()
        obs = fp8fn.observations(s)
        assert_bit_identical(obs, torch.func.grad(loss_of(fn), argnums=1)(params, state, x))
        assert_bit_identical(fp8fn.update(state, obs), state)


def test_gradient_accumulation_merges_by_max():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED)
    xs = [torch.randn(8, 16), 3 * torch.randn(8, 16)]
    params, state = _params(model), fn.init(xs[0])
    obs = [torch.func.grad(loss_of(fn), argnums=1)(params, state, x) for x in xs]
    merged = fp8fn.merge(obs[0], obs[1])
    assert merged["0"].input.amax_history[0] == torch.cat(xs).abs().max()
    assert torch.equal(merged.amax_history, torch.maximum(obs[0].amax_history, obs[1].amax_history))
    assert merged.static == state.static
    # The same through plain autograd: a fresh observed state per microbatch, then merge.
    auto = [_autograd_step(fn, params, state, x)[1] for x in xs]
    assert_bit_identical(fp8fn.merge(*auto), merged)
    # And with torch.autograd.grad on the observed state's history.
    grads = []
    for x in xs:
        s = fp8fn.observe(state)
        (g,) = torch.autograd.grad(loss_of(fn)(params, s, x), s.amax_history)
        grads.append(_zero_obs(state)._replace(amax_history=g))
    assert_bit_identical(fp8fn.merge(*grads), merged)
    new = fp8fn.update(state, merged)
    assert new["0"].input.amax_history[0] == torch.cat(xs).abs().max()
    assert torch.equal(new.amax_history[..., 0], merged.amax_history[..., 0])


def test_reusing_one_observed_state_is_refused_and_copies_merge_by_max():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED)
    x1, x2 = torch.randn(8, 16), 3 * torch.randn(8, 16)
    params, state = _params(model), fn.init(x1)
    params = {k: v.requires_grad_() for k, v in params.items()}  # backward() trains them
    state = _stepped(fn, params, state, x1)

    def two_views(p, s, x1, x2):
        return loss_of(fn)(p, s, x1) + loss_of(fn)(p, s, x2)

    # One state, two forward passes, both observed: autograd would sum; refused on every route.
    with pytest.raises(RuntimeError, match="fp8fn.apply: this state was already"):
        torch.func.grad(two_views, argnums=(0, 1))(params, state, x1, x2)
    with pytest.raises(RuntimeError, match="fp8fn.apply: this state was already"):
        fp8fn.value_and_grad(two_views, argnums=(0, 1))(params, state, x1, x2)
    with pytest.raises(RuntimeError, match="fp8fn.apply: this state was already"):
        two_views(params, fp8fn.observe(state), x1, x2)
    # Microbatches that reuse one observed state.
    s = fp8fn.observe(state)
    loss_of(fn)(params, s, x1).backward()
    with pytest.raises(RuntimeError, match="fp8fn.apply: this state was already"):
        loss_of(fn)(params, s, x2)
    # Not observed (no gradient recorded for it): reuse is fine.
    with torch.no_grad():
        assert torch.equal(fn.apply(params, s, x1), fn.apply(params, state, x1))
    torch.func.grad(two_views, argnums=0)(params, state, x1, x2)

    # The documented fix: one copy per forward pass, merged by max, is the max of the calls.
    single = [torch.func.grad(loss_of(fn), argnums=1)(params, state, x) for x in (x1, x2)]
    want = _zero_obs(state)._replace(
        amax_history=torch.maximum(single[0].amax_history, single[1].amax_history)
    )
    assert want["0"].input.amax_history[0] == torch.cat([x1, x2]).abs().max()
    assert not torch.equal(want.amax_history, single[0].amax_history)
    assert not torch.equal(want.amax_history, single[1].amax_history)

    def two_copies(p, s1, s2, x1, x2):
        return loss_of(fn)(p, s1, x1) + loss_of(fn)(p, s2, x2)

    o1, o2 = torch.func.grad(two_copies, argnums=(1, 2))(params, state, state, x1, x2)
    assert_bit_identical(fp8fn.merge(o1, o2), want)
    _, (o1, o2) = fp8fn.value_and_grad(two_copies, argnums=(1, 2))(params, state, state, x1, x2)
    assert_bit_identical(fp8fn.merge(o1, o2), want)
    s1, s2 = fp8fn.observe(state), fp8fn.observe(state)
    two_copies(params, s1, s2, x1, x2).backward()
    assert_bit_identical(fp8fn.merge(fp8fn.observations(s1), fp8fn.observations(s2)), want)
    # Microbatches: a fresh observed copy each.
    s1 = fp8fn.observe(state)
    loss_of(fn)(params, s1, x1).backward()
    s2 = fp8fn.observe(state)
    loss_of(fn)(params, s2, x2).backward()
    assert_bit_identical(fp8fn.merge(fp8fn.observations(s1), fp8fn.observations(s2)), want)


def test_higher_order_derivatives_through_apply_are_refused():
    model, fn, x, params, state = _transformed_mlp(batch=8)

    def gradient_penalty(p, s, x):
        return torch.func.grad(lambda x: loss_of(fn)(p, s, x))(x).square().sum()

    # (0.4 named fp8fn.linear, which the user did not call)
    message = r"^fp8fn\.apply: layer '\d': higher-order derivatives through float8 casts"
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(gradient_penalty)(params, state, x)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(loss_of(fn)(p, state, xg), xg, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        gx.square().sum().backward()


@pytest.mark.parametrize(
    "recipe",
    [fp8fn.CurrentScaling(), fp8fn.RowwiseScaling(), fp8fn.MXScaling(), fp8fn.NVFP4Scaling()],
    ids=["current", "rowwise", "mx", "nvfp4"],
)
def test_a_second_derivative_through_apply_names_apply_under_every_recipe(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    fn, x = fp8fn.transform(model, recipe), torch.randn(16, 64, requires_grad=True)
    out = fn.apply(dict(model.named_parameters()), fn.init(x), x)
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: layer '\d': higher-order deriv"):
        gx.square().sum().backward()


def test_vmap_over_the_batch_observes_the_whole_batch():
    model = ReusedLayer(16)
    fn = fp8fn.transform(model, DELAYED)
    xb = torch.randn(4, 8, 16)
    params, state = _params(model), fn.init(xb[0])

    def batched(p, s, x):
        return torch.func.vmap(fn.apply, in_dims=(None, None, 0))(p, s, x).square().mean()

    for _ in range(2):
        want = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, xb)  # one call
        assert want[1]["fc"].input.amax_history[0] == xb.abs().max()
        assert_bit_identical(torch.func.grad(batched, argnums=(0, 1))(params, state, xb), want)
        assert_bit_identical(_autograd_step(fn, params, state, xb, loss=batched), want)
        state = fp8fn.update(state, want[1])


def test_buffers_come_from_module_unless_given():
    model = WithBuffer()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(4, 16)
    params, state = _params(model), fn.init(x)
    default = fn.apply(params, state, x)
    given = fn.apply({**params, "shift": torch.zeros(8)}, state, x)
    assert torch.allclose(default - given, torch.full_like(default, 0.5))


def test_vmap_over_an_ensemble_gives_each_member_its_own_state():
    models = [_mlp() for _ in range(3)]
    for i, m in enumerate(models):
        with torch.no_grad():
            m[0].weight.mul_(i + 1)
    fn = fp8fn.transform(models[0], DELAYED)
    x = torch.randn(8, 16)
    params, _ = torch.func.stack_module_state(models)
    state = pytree.tree_map(lambda t: torch.stack([t] * 3), fn.init(x))
    assert type(state) is fp8fn.State and state.amax_history.shape == (3, 3, 3, 4)
    grad_fn = torch.func.grad(loss_of(fn), argnums=(0, 1))
    grads, obs = torch.func.vmap(grad_fn, in_dims=(0, 0, None))(params, state, x)
    assert type(obs) is fp8fn.State and obs.static == state.static
    assert obs.amax_history.shape == (3, 3, 3, 4) and obs.scale.shape == (3, 3, 3)
    for i, m in enumerate(models):
        g_i, obs_i = grad_fn(_params(m), pytree.tree_map(lambda t: t[i], state), x)
        assert obs["0"].weight.amax_history[i, 0] == m[0].weight.abs().max()
        assert_bit_identical(pytree.tree_map(lambda t: t[i], obs), obs_i)
        for k in g_i:
            torch.testing.assert_close(grads[k][i], g_i[k])


def test_state_round_trips_through_torch_save_and_flat_dicts():
    model, fn, x, params, state = _transformed_mlp(batch=4)
    state = _stepped(fn, params, state, x)
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
        fp8fn.transform(other, DELAYED).apply(_params(other), unflat, x)
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
    params = _params(model)
    obs = torch.func.grad(lambda p, s: fn.apply(p, s, x).sum(), argnums=1)(params, state)
    assert type(obs) is fp8fn.State and pytree.tree_structure(obs) == spec
    assert len(optree.tree_leaves(obs, namespace="fp8fn")) == 2
    assert bool((obs.amax_history[..., 0] > 0).all())


def test_two_transforms_of_one_module_run_concurrently():
    model = _mlp()
    fns = [fp8fn.transform(model, DELAYED), fp8fn.transform(model, CURRENT_AUTO)]
    x = torch.randn(8, 16)
    inputs = [(fn, _params(model), fn.init(x)) for fn in fns]
    expected = [torch.func.grad(loss_of(fn), argnums=(0, 1))(p, s, x) for fn, p, s in inputs]

    def work(i):
        fn, p, s = inputs[i]
        return [torch.func.grad(loss_of(fn), argnums=(0, 1))(p, s, x) for _ in range(20)]

    # Futures re-raise a thread's exception here, and every iteration's result is checked.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(work, i) for i in range(2)]
        results = [f.result() for f in futures]
    for runs, e in zip(results, expected):
        for r in runs:
            assert_bit_identical(r, e)


def test_filter_fn_keeps_layers_in_high_precision():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED, filter_fn=lambda name, m: name != "4")
    x = torch.randn(4, 16)
    state = fn.init(x)
    assert list(state) == ["0", "2"] and fn.layers == ["0", "2"]
    params = _params(model)
    hidden = fp8fn.transform(model[:4], DELAYED).apply(
        {k: v for k, v in params.items() if not k.startswith("4.")}, state, x
    )
    expected = F.linear(hidden, params["4.weight"], params["4.bias"])
    assert torch.equal(fn.apply(params, state, x), expected)


def test_recipe_function_picks_a_recipe_per_layer():
    model = _mlp()
    seen = []

    def recipe(name, module):
        seen.append((name, module))
        return {"0": DELAYED, "2": CURRENT_AUTO}.get(name)  # "4": None, high precision

    fn = fp8fn.transform(model, recipe)
    assert [n for n, _ in seen] == ["0", "2", "4"]
    assert all(m is model[int(n)] for n, m in seen)  # the user's layers, not the copies
    assert fn.layers == ["0", "2"] and fn.recipes == {"0": DELAYED, "2": CURRENT_AUTO}
    x = torch.randn(8, 16)
    params, state = _params(model), fn.init(x)
    assert list(state) == ["0"] and state.static == (("0",), "max", 0)  # stateful layers only

    def by_hand(p, s, x):
        h = F.gelu(fp8fn.linear(x, p["0.weight"], p["0.bias"], s["0"], DELAYED))
        h = F.gelu(fp8fn.linear(h, p["2.weight"], p["2.bias"], None, CURRENT_AUTO))
        return F.linear(h, p["4.weight"], p["4.bias"])

    for _ in range(3):
        assert torch.equal(fn.apply(params, state, x), by_hand(params, state, x))
        got = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)
        want = torch.func.grad(lambda p, s, x: by_hand(p, s, x).square().mean(), argnums=(0, 1))(
            params, state, x
        )
        assert_bit_identical(got, want)
        assert_bit_identical(_autograd_step(fn, params, state, x), want)
        state = fp8fn.update(state, got[1])
        params = {k: v - 0.1 * got[0][k] for k, v in params.items()}
    assert bool((state.amax_history[..., :3] > 0).all())
    # A layer whose recipe is None stays high precision: its output is F.linear's.
    h = fp8fn.transform(model[:4], recipe).apply(
        {k: v for k, v in params.items() if not k.startswith("4.")}, state, x
    )
    assert torch.equal(
        fn.apply(params, state, x), F.linear(h, params["4.weight"], params["4.bias"])
    )
    # All None: no fp8 layer, no site, the model itself.
    with pytest.warns(UserWarning, match="fp8fn.transform: no layer was converted"):
        plain = fp8fn.transform(model, lambda name, module: None)
    assert plain.layers == [] and len(plain.init(x)) == 0
    assert torch.equal(
        plain.apply(params, plain.init(x), x), torch.func.functional_call(model, params, (x,))
    )
    # filter_fn chooses first: the recipe function sees only the layers it keeps.
    seen.clear()
    fp8fn.transform(model, recipe, filter_fn=lambda name, m: name != "2")
    assert [n for n, _ in seen] == ["0", "4"]


def test_recipe_function_errors_name_the_problem():
    model = _mlp()
    longer = fp8fn.DelayedScaling(history_len=8)
    with pytest.raises(ValueError, match="fp8fn.transform: all DelayedScaling layers"):
        fp8fn.transform(model, lambda name, m: DELAYED if name == "0" else longer)
    with pytest.raises(ValueError, match="fp8fn.transform"):
        fp8fn.transform(
            model, lambda name, m: fp8fn.DelayedScaling(history_len=4, margin=int(name))
        )
    with pytest.raises(ValueError, match="fp8fn.transform"):
        fp8fn.transform(
            model,
            lambda name, m: fp8fn.DelayedScaling(
                history_len=4, amax_compute="max" if name == "0" else "most_recent"
            ),
        )
    with pytest.raises(TypeError, match="fp8fn.transform: expected the recipe of layer '0'"):
        fp8fn.transform(model, lambda name, m: "delayed")
    # The same config in several layers (one packed state) is fine, CurrentScaling alongside.
    fn = fp8fn.transform(model, lambda name, m: CURRENT_AUTO if name == "2" else DELAYED)
    assert list(fn.init(torch.randn(2, 16))) == ["0", "4"]


def test_apply_errors_name_the_problem():
    model, fn, x, params, state = _transformed_mlp(batch=4)
    with pytest.raises(
        ValueError, match=r"fp8fn.apply: .*unexpected \['extra'\]\. Key them as the model is now"
    ):
        fn.apply({**params, "extra": torch.ones(1)}, state, x)
    with pytest.raises(TypeError, match=r"expected tensors in `params`, got \{'0.bias': 'list'\}"):
        fn.apply({**params, "0.bias": [0.0] * 32}, state, x)
    with pytest.raises(TypeError, match="fp8fn.apply: expected `params` to be a dict"):
        fn.apply(list(params.values()), state, x)
    for not_a_state in (list(state.values()), dict(state.items())):
        with pytest.raises(TypeError, match="fp8fn.apply: expected `state` to be an fp8fn.State"):
            fn.apply(params, not_a_state, x)
    with pytest.raises(ValueError, match=r"missing sites \['2'\]"):
        fn.apply(params, fp8fn.init_state(DELAYED, ["0", "4"]), x)
    with pytest.raises(ValueError, match=r"unknown sites \['9'\]"):
        fn.apply(params, fp8fn.init_state(DELAYED, ["0", "2", "4", "9"]), x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: `state` was made for another recipe"):
        fn.apply(params, state._replace(amax_history=torch.zeros(3, 3, 5)), x)
    for recipe in (
        fp8fn.DelayedScaling(history_len=4, margin=1),
        fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent"),
    ):
        with pytest.raises(ValueError, match="fp8fn.apply: `state` was made for another recipe"):
            fn.apply(params, fp8fn.init_state(recipe, list(state)), x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: expected `state.amax_history` of shape"):
        fn.apply(params, state._replace(scale=torch.ones(3, 2)), x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: expected `state.amax_history` of shape"):
        fn.apply(params, state._replace(amax_history=torch.zeros(2, 3, 4)), x)
    with pytest.raises(TypeError, match=r"fp8fn.apply: expected `state.amax_history` to be fl"):
        fn.apply(params, state._replace(amax_history=state.amax_history.double()), x)
    model = ReusedLayer(16)
    reused = fp8fn.transform(model, DELAYED)
    short = fp8fn.init_state(DELAYED, ["fc", "out"])
    with pytest.raises(ValueError, match=r"site 'fc#1' is not in `state`"):
        reused.apply(_params(model), short, x)


def test_transform_errors_name_the_problem():
    class LoRA(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    # a subclass with its own forward (Llama 4's router) is left in high precision, reported
    with pytest.warns(UserWarning, match="no layer was converted"):
        lora = fp8fn.transform(nn.Sequential(LoRA(4, 4)), DELAYED)
    with pytest.warns(UserWarning, match=r"high precision, 100.0% .*'0.weight' \(F.linear\)"):
        lora.init(torch.randn(2, 4))
    with pytest.raises(TypeError, match="fp8fn.transform: expected `module` to be an nn.Module"):
        fp8fn.transform(lambda x: x, DELAYED)
    with pytest.raises(TypeError, match="fp8fn.transform: expected `recipe`"):
        fp8fn.transform(_mlp(), "delayed")
    with pytest.raises(TypeError, match=r"got the class DelayedScaling\. Pass an instance: fp8fn"):
        fp8fn.transform(_mlp(), fp8fn.DelayedScaling)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"filter_fn": 3},
            TypeError,
            r"^fp8fn\.transform: expected `filter_fn` to be a function \(name, module\) -> bool, "
            r"got int\. Pass e\.g\. `filter_fn=lambda name, module: \.\.\.`\.$",
        ),
        (
            {"checkpoint_fn": 3},
            TypeError,
            r"^fp8fn\.transform: expected `checkpoint_fn` to be a function \(name, module\) -> "
            r"bool, got int\. Pass e\.g\. `checkpoint_fn=lambda name, module: \.\.\.`\.$",
        ),
        (
            {"filter_fn": nn.Linear},
            TypeError,
            r"^fp8fn\.transform: expected `filter_fn` to be a function .* got type Linear\.",
        ),
        (
            {"filter_fn": lambda name: True},
            TypeError,
            r"^fp8fn\.transform: expected `filter_fn` to be a function \(name, module\) -> bool, "
            r"got .*<lambda>\(name\), which cannot be called with 2 positional arguments "
            r"\(too many positional arguments\)\. Give it the parameters \(name, module\)\.$",
        ),
        (
            {"checkpoint_fn": lambda name, module, depth: True},
            TypeError,
            r"^fp8fn\.transform: expected `checkpoint_fn` .* got "
            r".*<lambda>\(name, module, depth\), which cannot be called with 2 positional "
            r"arguments \(missing a required argument: 'depth'\)\.",
        ),
        (
            {"recipe": lambda name: DELAYED},
            TypeError,
            r"^fp8fn\.transform: expected `recipe` to be a function \(name, module\) -> recipe or "
            r"None, got .*<lambda>\(name\), which cannot be called with 2 positional arguments",
        ),
        (
            {"recipe": lambda name, m: 3},
            TypeError,
            r"^fp8fn\.transform: expected the recipe of layer '0' to be an fp8fn recipe "
            r"\(e\.g\. fp8fn\.DelayedScaling\(\)\) or None, got int\.$",
        ),
    ],
    ids=[
        "filter_fn-int",
        "checkpoint_fn-int",
        "filter_fn-class",
        "filter_fn-arity",
        "checkpoint_fn-arity",
        "recipe-arity",
        "recipe-returns-int",
    ],
)
def test_transform_refuses_bad_choice_functions_before_touching_the_module(kwargs, error, match):
    model = _mlp()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    kwargs = {"recipe": DELAYED, **kwargs}
    with pytest.raises(error, match=match):
        fp8fn.transform(model, **kwargs)
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before


def test_choice_functions_with_defaults_or_star_args_are_accepted():
    fn = fp8fn.transform(
        _mlp(),
        lambda *args: DELAYED,
        filter_fn=lambda name, module, extra=None: name != "2",
        checkpoint_fn=lambda name, module, **kw: False,
    )
    assert fn.layers == ["0", "4"]


@pytest.mark.parametrize(
    "recipe, x, error, match",
    [
        (
            fp8fn.MXScaling(),
            torch.ones(2, 32, dtype=torch.float16),
            TypeError,
            r"expected `x` and `weight` in float32 or bfloat16 under MXScaling, got float16",
        ),
        (
            fp8fn.NVFP4Scaling(),
            torch.ones(0, 32),
            ValueError,
            r"expected non-empty `x` and `weight` under NVFP4Scaling, got x \(0, 32\)",
        ),
    ],
    ids=["mx-float16", "nvfp4-empty"],
)
def test_op_errors_through_apply_name_apply_and_the_layer(recipe, x, error, match):
    model = nn.Sequential(nn.Linear(32, 16)).to(x.dtype)
    fn = fp8fn.transform(model, recipe)
    state = fn.init(torch.ones(2, 32, dtype=x.dtype))
    with pytest.raises(error, match=r"^fp8fn\.apply: layer '0': " + match):
        fn.apply(_params(model), state, x)


def _with_child(name, child):
    parent = nn.Module()
    parent.add_module(name, child)
    return parent


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT_AUTO])
def test_transformer_matches_float32_and_routes_agree(recipe):
    model = Transformer(vocab=64, d_model=32, n_heads=4, n_blocks=2, seq=16)
    fn = fp8fn.transform(model, recipe)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    params, state = _params(model), fn.init(idx)
    sites = [f"blocks.{i}.{n}" for i in range(2) for n in ("qkv", "out", "fc1", "fc2")]
    assert fn.layers == sites + ["head"]
    assert list(state) == (fn.layers if recipe is DELAYED else [])

    def loss(p, s, x):
        return F.cross_entropy(fn.apply(p, s, x).flatten(0, 1), x.flatten())

    def ref_loss(p):
        return F.cross_entropy(
            torch.func.functional_call(model, p, (idx,)).flatten(0, 1), idx.flatten()
        )

    for _ in range(3):
        grads, obs = torch.func.grad(loss, argnums=(0, 1))(params, state, idx)
        assert_bit_identical(_autograd_step(fn, params, state, idx, loss=loss), (grads, obs))
        state = fp8fn.update(state, obs)
    if recipe is DELAYED:
        assert bool((state.amax_history[..., :3] > 0).all())
    ref_grads = torch.func.grad(ref_loss)(params)
    out = fn.apply(params, state, idx)
    ref_out = torch.func.functional_call(model, params, (idx,))
    assert sqnr(ref_out, out) >= 25
    for name in ("blocks.0.qkv.weight", "blocks.1.fc2.weight", "head.weight"):
        assert sqnr(ref_grads[name], grads[name]) >= 20, name


def test_apply_follows_train_and_eval_of_the_module():
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    fn = fp8fn.transform(model, CURRENT_AUTO)
    x = torch.randn(64, 16)
    params, state = _params(model), fn.init(x)
    model.eval()
    assert torch.equal(fn.apply(params, state, x), fn.apply(params, state, x))
    model.train()
    assert not torch.equal(fn.apply(params, state, x), fn.apply(params, state, x))


def test_tied_parameters_given_under_every_name():
    model = Tied(16, 16)
    fn = fp8fn.transform(model, DELAYED)
    ids = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(0))
    state = fn.init(ids)
    params = _params(model)
    every = dict(model.named_parameters(remove_duplicate=False))
    assert {"b.weight", "head.weight"} <= every.keys() - params.keys()
    want_out = fn.apply(params, state, ids)
    assert torch.equal(fn.apply(every, state, ids), want_out)  # the same tensors: fine
    # value_and_grad keeps a tensor given twice as one leaf: each name gets its gradient.
    _, (want, want_obs) = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))(params, state, ids)
    _, (grads, obs) = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))(every, state, ids)
    assert_bit_identical(obs, want_obs)
    assert all(torch.equal(grads[k], want[k]) for k in want)
    assert torch.equal(grads["head.weight"], want["emb.weight"])
    # torch.func.grad wraps each name on its own: two tensors for one tied parameter.
    with pytest.raises(ValueError, match=r"gives the tied tensor 'a.weight' twice, as 'b.weight'"):
        torch.func.grad(loss_of(fn))(every, state, ids)
