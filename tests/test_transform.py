"""fp8fn.transform and `Transformed` (`_transform/transformed.py`): a module as pure init/apply
functions, under torch.func and autograd, in every composition (microbatches, reuse, vmap,
higher-order derivatives, threads)."""

import concurrent.futures
import copy

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    CURRENT_AUTO,
    DELAYED,
    assert_bit_identical,
    autograd_step,
    gelu_mlp,
    loss_of,
    params_of,
    sqnr,
    stepped,
    transformed_mlp,
)
from _models import ReusedLayer, Tied, Transformer
from torch import nn
from torch.utils import _pytree as pytree

import fp8fn


def _zero_obs(state):
    """The observation of a step that observed nothing: zeros of `state`'s structure."""
    return state._replace(
        amax_history=torch.zeros_like(state.amax_history), scale=torch.zeros_like(state.scale)
    )


def test_transform_leaves_module_untouched():
    model = gelu_mlp()
    before = copy.deepcopy(model.state_dict())
    children = [type(m) for m in model.modules()]
    attrs = [sorted(vars(m)) for m in model.modules()]
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda n, m: n == "2")
    x = torch.randn(4, 16)
    state = fn.init(x)
    torch.func.grad(loss_of(fn), argnums=(0, 1))(params_of(model), state, x)
    assert [type(m) for m in model.modules()] == children
    assert [sorted(vars(m)) for m in model.modules()] == attrs
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model(x), nn.Sequential(*model)(x))  # still a plain float32 model


def test_apply_is_pure():
    model, fn, x, params, state = transformed_mlp(batch=4)
    state = stepped(fn, params, state, x)
    snapshot = copy.deepcopy((params, state, x))
    assert type(snapshot[1]) is fp8fn.State and snapshot[1].static == state.static
    out1, out2 = fn.apply(params, state, x), fn.apply(params, state, x)
    assert torch.equal(out1, out2)
    assert_bit_identical((params, state, x), snapshot)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT_AUTO])
@pytest.mark.parametrize(
    "make, x",
    [
        (gelu_mlp, torch.randn(8, 16)),
        (lambda: ReusedLayer(16), torch.randn(8, 16)),
        (lambda: Tied(16, 16), torch.randint(0, 16, (8,))),
    ],
    ids=["mlp", "reused", "tied"],
)
def test_func_and_autograd_routes_are_bit_identical(make, x, recipe):
    model = make()
    fn = fp8fn.transform(model, recipe)
    params, state = params_of(model), fn.init(x)
    for _ in range(3):
        g_func, obs_func = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)
        (_, obs_gv), _ = torch.func.grad_and_value(loss_of(fn), argnums=(0, 1))(params, state, x)
        _, vjp_fn = torch.func.vjp(lambda p, s: loss_of(fn)(p, s, x), params, state)
        g_vjp, obs_vjp = vjp_fn(torch.tensor(1.0))
        g_auto, obs_auto = autograd_step(fn, params, state, x)
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


def test_observations_of_a_state_without_sites_is_the_empty_observation():
    model = gelu_mlp()
    x = torch.randn(8, 16)
    params = params_of(model)
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
    model = gelu_mlp()
    fn = fp8fn.transform(model, DELAYED)
    xs = [torch.randn(8, 16), 3 * torch.randn(8, 16)]
    params, state = params_of(model), fn.init(xs[0])
    obs = [torch.func.grad(loss_of(fn), argnums=1)(params, state, x) for x in xs]
    merged = fp8fn.merge(obs[0], obs[1])
    assert merged["0"].input.amax_history[0] == torch.cat(xs).abs().max()
    assert torch.equal(merged.amax_history, torch.maximum(obs[0].amax_history, obs[1].amax_history))
    assert merged.static == state.static
    # The same through plain autograd: a fresh observed state per microbatch, then merge.
    auto = [autograd_step(fn, params, state, x)[1] for x in xs]
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
    model = gelu_mlp()
    fn = fp8fn.transform(model, DELAYED)
    x1, x2 = torch.randn(8, 16), 3 * torch.randn(8, 16)
    params, state = params_of(model), fn.init(x1)
    params = {k: v.requires_grad_() for k, v in params.items()}  # backward() trains them
    state = stepped(fn, params, state, x1)

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
    model, fn, x, params, state = transformed_mlp(batch=8)

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
    params, state = params_of(model), fn.init(xb[0])

    def batched(p, s, x):
        return torch.func.vmap(fn.apply, in_dims=(None, None, 0))(p, s, x).square().mean()

    for _ in range(2):
        want = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, xb)  # one call
        assert want[1]["fc"].input.amax_history[0] == xb.abs().max()
        assert_bit_identical(torch.func.grad(batched, argnums=(0, 1))(params, state, xb), want)
        assert_bit_identical(autograd_step(fn, params, state, xb, loss=batched), want)
        state = fp8fn.update(state, want[1])


def test_vmap_over_an_ensemble_gives_each_member_its_own_state():
    models = [gelu_mlp() for _ in range(3)]
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
        g_i, obs_i = grad_fn(params_of(m), pytree.tree_map(lambda t: t[i], state), x)
        assert obs["0"].weight.amax_history[i, 0] == m[0].weight.abs().max()
        assert_bit_identical(pytree.tree_map(lambda t: t[i], obs), obs_i)
        for k in g_i:
            torch.testing.assert_close(grads[k][i], g_i[k])


def test_two_transforms_of_one_module_run_concurrently():
    model = gelu_mlp()
    fns = [fp8fn.transform(model, DELAYED), fp8fn.transform(model, CURRENT_AUTO)]
    x = torch.randn(8, 16)
    inputs = [(fn, params_of(model), fn.init(x)) for fn in fns]
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


def test_apply_follows_train_and_eval_of_the_module():
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    fn = fp8fn.transform(model, CURRENT_AUTO)
    x = torch.randn(64, 16)
    params, state = params_of(model), fn.init(x)
    model.eval()
    assert torch.equal(fn.apply(params, state, x), fn.apply(params, state, x))
    model.train()
    assert not torch.equal(fn.apply(params, state, x), fn.apply(params, state, x))


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT_AUTO])
def test_transformer_matches_float32_and_routes_agree(recipe):
    model = Transformer(vocab=64, d_model=32, n_heads=4, n_blocks=2, seq=16)
    fn = fp8fn.transform(model, recipe)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    params, state = params_of(model), fn.init(idx)
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
        assert_bit_identical(autograd_step(fn, params, state, idx, loss=loss), (grads, obs))
        state = fp8fn.update(state, obs)
    if recipe is DELAYED:
        assert bool((state.amax_history[..., :3] > 0).all())
    ref_grads = torch.func.grad(ref_loss)(params)
    out = fn.apply(params, state, idx)
    ref_out = torch.func.functional_call(model, params, (idx,))
    assert sqnr(ref_out, out) >= 25
    for name in ("blocks.0.qkv.weight", "blocks.1.fc2.weight", "head.weight"):
        assert sqnr(ref_grads[name], grads[name]) >= 20, name
