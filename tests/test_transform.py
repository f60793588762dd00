"""fp8fn.transform: a module as pure init/apply functions, under torch.func and autograd."""

import copy
import io
import threading

import optree
import pytest
import torch
import torch.nn.functional as F
from _models import Branchy, ReusedLayer, Tied, Transformer
from torch import nn
from torch.utils import _pytree as pytree

import fp8fn

DELAYED = fp8fn.DelayedScaling(history_len=4)


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


def _params(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _leaves(tree):
    return pytree.tree_leaves(tree, is_leaf=lambda t: t is None)


def _assert_trees_equal(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if x is None or y is None:  # autograd leaves None where torch.func gives zeros
            assert torch.count_nonzero(y if x is None else x) == 0
        else:
            assert torch.equal(x, y)


def _loss(fn):
    return lambda p, s, x: fn.apply(p, s, x).square().mean()


def _autograd_step(fn, params, state, x):
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    s = pytree.tree_map(lambda t: t.clone().requires_grad_(), state)
    _loss(fn)(p, s, x).backward()
    return {k: v.grad for k, v in p.items()}, pytree.tree_map(lambda t: t.grad, s)


def test_transform_leaves_module_untouched():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    children = [type(m) for m in model.modules()]
    attrs = [sorted(vars(m)) for m in model.modules()]
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda n, m: n == "2")
    x = torch.randn(4, 16)
    state = fn.init(x)
    torch.func.grad(_loss(fn), argnums=(0, 1))(_params(model), state, x)
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
    # The branch not taken at init still gets a site (after the called ones).
    assert list(fp8fn.transform(Branchy(16), DELAYED).init(x)) == ["fc1", "fc2", "extra"]
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
    assert list(state) == ["0", "2", "4"]
    s = state["2"].grad_output
    assert s.amax_history.shape == (4,) and s.amax_history.dtype == torch.float32
    assert torch.count_nonzero(s.amax_history) == 0 and s.scale.item() == 1.0
    current = fp8fn.transform(_mlp(), fp8fn.CurrentScaling()).init(torch.randn(4, 16))
    assert current == {}


def test_apply_is_pure():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(4, 16)
    params, state = _params(model), fn.init(x)
    state = fp8fn.update(state, torch.func.grad(_loss(fn), argnums=1)(params, state, x))
    snapshot = copy.deepcopy((params, state, x))
    out1, out2 = fn.apply(params, state, x), fn.apply(params, state, x)
    assert torch.equal(out1, out2)
    _assert_trees_equal((params, state, x), snapshot)


@pytest.mark.parametrize("recipe", [DELAYED, fp8fn.CurrentScaling()])
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
        g_func, obs_func = torch.func.grad(_loss(fn), argnums=(0, 1))(params, state, x)
        (_, obs_gv), _ = torch.func.grad_and_value(_loss(fn), argnums=(0, 1))(params, state, x)
        _, vjp_fn = torch.func.vjp(lambda p, s: _loss(fn)(p, s, x), params, state)
        g_vjp, obs_vjp = vjp_fn(torch.tensor(1.0))
        g_auto, obs_auto = _autograd_step(fn, params, state, x)
        _assert_trees_equal(g_func, g_auto)
        _assert_trees_equal(g_func, g_vjp)
        _assert_trees_equal(obs_func, obs_auto)
        _assert_trees_equal(obs_func, obs_gv)
        _assert_trees_equal(obs_func, obs_vjp)
        _assert_trees_equal(fp8fn.update(state, obs_func), fp8fn.update(state, obs_auto))
        state = fp8fn.update(state, obs_func)
        params = {k: v - 0.1 * g_func[k] for k, v in params.items()}


def test_observations_are_amaxes_of_each_call():
    model = ReusedLayer(16)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    state = fn.init(x)
    obs = torch.func.grad(_loss(fn), argnums=1)(_params(model), state, x)
    with torch.no_grad():
        fc = (model.fc.weight, model.fc.bias)
        h1 = F.relu(fp8fn.linear(x, *fc, state["fc"], DELAYED))
        h2 = F.relu(fp8fn.linear(h1, *fc, state["fc#1"], DELAYED))
    assert obs["fc"].input.amax_history[0] == x.abs().max()
    assert obs["fc#1"].input.amax_history[0] == h1.abs().max()
    assert obs["out"].input.amax_history[0] == h2.abs().max()
    assert obs["fc"].weight.amax_history[0] == model.fc.weight.abs().max()
    assert obs["fc#1"].weight.amax_history[0] == model.fc.weight.abs().max()
    assert torch.count_nonzero(obs["fc"].input.amax_history[1:]) == 0


def test_site_that_did_not_run_keeps_its_state():
    model = Branchy(16)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    params, state = _params(model), fn.init(x)
    for _ in range(2):
        obs = torch.func.grad(_loss(fn), argnums=1)(params, state, x)
        state = fp8fn.update(state, obs)
    assert torch.count_nonzero(state["extra"].input.amax_history) == 0
    assert torch.count_nonzero(state["fc2"].input.amax_history) == 2
    _, auto_obs = _autograd_step(fn, params, state, x)
    assert auto_obs["extra"].input.amax_history is None
    _assert_trees_equal(fp8fn.update(state, auto_obs)["extra"], state["extra"])


def test_gradient_accumulation_merges_by_max():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED)
    xs = [torch.randn(8, 16), 3 * torch.randn(8, 16)]
    params, state = _params(model), fn.init(xs[0])
    obs = [torch.func.grad(_loss(fn), argnums=1)(params, state, x) for x in xs]
    merged = fp8fn.merge(obs[0], obs[1])
    assert merged["0"].input.amax_history[0] == torch.cat(xs).abs().max()
    # The same through plain autograd: torch.autograd.grad per microbatch, then merge.
    auto = []
    for x in xs:
        s = pytree.tree_map(lambda t: t.clone().requires_grad_(), state)
        leaves, spec = pytree.tree_flatten(s)
        grads = torch.autograd.grad(_loss(fn)(params, s, x), leaves, allow_unused=True)
        auto.append(pytree.tree_unflatten(list(grads), spec))
    _assert_trees_equal(fp8fn.merge(*auto), merged)
    new = fp8fn.update(state, merged)
    assert new["0"].input.amax_history[0] == torch.cat(xs).abs().max()


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
    grad_fn = torch.func.grad(_loss(fn), argnums=(0, 1))
    grads, obs = torch.func.vmap(grad_fn, in_dims=(0, 0, None))(params, state, x)
    for i, m in enumerate(models):
        g_i, obs_i = grad_fn(_params(m), pytree.tree_map(lambda t: t[i], state), x)
        assert obs["0"].weight.amax_history[i, 0] == m[0].weight.abs().max()
        _assert_trees_equal(pytree.tree_map(lambda t: t[i], obs), obs_i)
        for k in g_i:
            torch.testing.assert_close(grads[k][i], g_i[k])


def test_state_round_trips_through_torch_save_and_flat_dicts():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(4, 16)
    params, state = _params(model), fn.init(x)
    state = fp8fn.update(state, torch.func.grad(_loss(fn), argnums=1)(params, state, x))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    _assert_trees_equal(loaded, state)
    assert type(loaded["0"]) is fp8fn.SiteState
    flat = fp8fn.flatten_state(state)
    assert "2.grad_output.amax_history" in flat
    _assert_trees_equal(fp8fn.unflatten_state(flat), state)
    assert torch.equal(fn.apply(params, fp8fn.unflatten_state(flat), x), fn.apply(params, state, x))
    other = ReusedLayer(16)
    with pytest.raises(ValueError, match=r"fp8fn.apply: `state` does not belong.*'fc'"):
        fp8fn.transform(other, DELAYED).apply(_params(other), fp8fn.unflatten_state(flat), x)
    with pytest.raises(ValueError, match="fp8fn.unflatten_state: expected keys"):
        fp8fn.unflatten_state({"0.inputs.scale": torch.ones(())})
    with pytest.raises(ValueError, match=r"fp8fn.unflatten_state: missing keys \['0.input.margin"):
        fp8fn.unflatten_state({k: v for k, v in flat.items() if k != "0.input.margin"})


def test_state_flattens_identically_under_optree_and_torch_pytree():
    state = fp8fn.transform(_mlp(), DELAYED).init(torch.randn(4, 16))
    a, b = optree.tree_leaves(state), pytree.tree_leaves(state)
    assert len(a) == len(b) == 3 * 3 * 4
    assert all(x is y and x.is_floating_point() for x, y in zip(a, b))


def test_two_transforms_of_one_module_run_concurrently():
    model = _mlp()
    fns = [fp8fn.transform(model, DELAYED), fp8fn.transform(model, fp8fn.CurrentScaling())]
    x = torch.randn(8, 16)
    inputs = [(fn, _params(model), fn.init(x)) for fn in fns]
    expected = [torch.func.grad(_loss(fn), argnums=(0, 1))(p, s, x) for fn, p, s in inputs]
    results = [None, None]

    def work(i):
        fn, p, s = inputs[i]
        for _ in range(20):
            results[i] = torch.func.grad(_loss(fn), argnums=(0, 1))(p, s, x)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, e in zip(results, expected):
        _assert_trees_equal(r, e)


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


def test_apply_errors_name_the_problem():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(4, 16)
    params, state = _params(model), fn.init(x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: .*missing \['0.bias'\]"):
        fn.apply({k: v for k, v in params.items() if k != "0.bias"}, state, x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: .*unexpected \['extra'\]"):
        fn.apply({**params, "extra": torch.ones(1)}, state, x)
    with pytest.raises(TypeError, match="fp8fn.apply: expected `params` to be a dict"):
        fn.apply(list(params.values()), state, x)
    with pytest.raises(TypeError, match="fp8fn.apply: expected `state` to be the dict"):
        fn.apply(params, list(state.values()), x)
    with pytest.raises(ValueError, match=r"missing sites \['2'\]"):
        fn.apply(params, {k: v for k, v in state.items() if k != "2"}, x)
    with pytest.raises(ValueError, match=r"unknown sites \['9'\]"):
        fn.apply(params, {**state, "9": state["0"]}, x)
    bad = dict(state)
    bad["2"] = bad["2"]._replace(weight=bad["2"].weight._replace(amax_history=torch.zeros(5)))
    with pytest.raises(ValueError, match=r"state\['2'\].weight.amax_history of shape \(4,\)"):
        fn.apply(params, bad, x)
    model = ReusedLayer(16)
    reused = fp8fn.transform(model, DELAYED)
    short = {k: v for k, v in reused.init(x).items() if k != "fc#1"}
    with pytest.raises(ValueError, match=r"site 'fc#1' is not in `state`"):
        reused.apply(_params(model), short, x)


def test_transform_errors_name_the_problem():
    class LoRA(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="fp8fn.transform: layer 'fc' is a LoRA"):
        fp8fn.transform(_with_child("fc", LoRA(4, 4)), DELAYED)
    with pytest.raises(TypeError, match="fp8fn.transform: expected `module` to be an nn.Module"):
        fp8fn.transform(lambda x: x, DELAYED)
    with pytest.raises(TypeError, match="fp8fn.transform: expected `recipe`"):
        fp8fn.transform(_mlp(), "delayed")


def _with_child(name, child):
    parent = nn.Module()
    parent.add_module(name, child)
    return parent


def _sqnr(ref, x):
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


@pytest.mark.parametrize("recipe", [DELAYED, fp8fn.CurrentScaling()])
def test_transformer_matches_float32_and_routes_agree(recipe):
    model = Transformer(vocab=64, d_model=32, n_heads=4, n_blocks=2, seq=16)
    fn = fp8fn.transform(model, recipe)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    params, state = _params(model), fn.init(idx)
    sites = [f"blocks.{i}.{n}" for i in range(2) for n in ("qkv", "out", "fc1", "fc2")]
    assert fn.layers == sites + ["head"]
    assert list(state) == (fn.layers if recipe is DELAYED else [])

    def loss(p, s):
        return F.cross_entropy(fn.apply(p, s, idx).flatten(0, 1), idx.flatten())

    def ref_loss(p):
        return F.cross_entropy(
            torch.func.functional_call(model, p, (idx,)).flatten(0, 1), idx.flatten()
        )

    for _ in range(3):
        grads, obs = torch.func.grad(loss, argnums=(0, 1))(params, state)
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        s = pytree.tree_map(lambda t: t.clone().requires_grad_(), state)
        loss(p, s).backward()
        _assert_trees_equal(grads, {k: v.grad for k, v in p.items()})
        _assert_trees_equal(obs, pytree.tree_map(lambda t: t.grad, s))
        state = fp8fn.update(state, obs)
    ref_grads = torch.func.grad(ref_loss)(params)
    out = fn.apply(params, state, idx)
    ref_out = torch.func.functional_call(model, params, (idx,))
    assert _sqnr(ref_out, out) >= 25
    for name in ("blocks.0.qkv.weight", "blocks.1.fc2.weight", "head.weight"):
        assert _sqnr(ref_grads[name], grads[name]) >= 20, name


def test_apply_follows_train_and_eval_of_the_module():
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    fn = fp8fn.transform(model, fp8fn.CurrentScaling())
    x = torch.randn(64, 16)
    params, state = _params(model), fn.init(x)
    model.eval()
    assert torch.equal(fn.apply(params, state, x), fn.apply(params, state, x))
    model.train()
    assert not torch.equal(fn.apply(params, state, x), fn.apply(params, state, x))


def test_empty_submodules_are_copied_once():
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(), nn.Linear(16, 8))
    model.alias = model[1]
    fn = fp8fn.transform(model, DELAYED)
    assert fn._copy.alias is fn._copy[1] and fn._copy[1] is not model[1]
