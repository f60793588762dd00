"""Experts in float8 through `fp8fn.transform`: tiny transformers 5.x MoE models (built from a
config, no download) against float32, the three experts implementations, the forms user code
calls (`torch._grouped_mm`, `F.grouped_mm`, `torch.bmm`, `F.linear` on `W[e]`) against the
float64 per-expert reference of `test_moe.py`, per-expert state, and what is reported."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import sqnr
from _moe_models import ARCHS, batch, build, train
from test_moe import _reference
from torch import nn
from torch.utils import _pytree as pytree

import fp8fn
from fp8fn._ops.grouped import grouped_mm

pytest.importorskip("transformers")


def _experts_only(name, module):
    return "experts" in name and name.endswith("_proj")


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_trains_in_float8_on_both_routes(arch):
    model = build(arch)
    ref, ref_grads, _ = train(model)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    with warnings.catch_warnings(record=True) as record:  # routers: high precision, unreported
        warnings.simplefilter("always")
        losses, _, state = train(model, fn=fn)
    assert not [w for w in record if str(w.message).startswith("fp8fn")]
    auto, _, _ = train(model, fn=fn, route="autograd")
    assert losses == pytest.approx(ref, rel=0.05)
    assert auto == pytest.approx(losses, rel=1e-6)
    experts = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert experts and set(experts) <= set(fn.layers)
    assert all(f"{n}[0]" in state for n in experts)
    assert len(pytree.tree_leaves(state)) == 2
    # each expert weight's gradient, with the experts alone in float8 (the rest float32)
    only = fp8fn.transform(model, fp8fn.DelayedScaling(), filter_fn=_experts_only)
    _, grads, _ = train(model, steps=1, fn=only)
    for n in experts:
        assert sqnr(ref_grads[n], grads[n]) >= 12.0, n


def _mixtral_run(implementation, steps=2):
    model = build("mixtral", implementation)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(), filter_fn=_experts_only)
    losses, grads, state = train(model, steps=steps, fn=fn)
    return fn, losses, grads, state


def test_experts_implementations_run_alike():
    """eager (F.linear on W[e]), batched_mm (bmm on the copy W[ids]) and grouped_mm: the same
    sites and per-expert scales; the same losses and gradients up to float32 summation order."""
    runs = {impl: _mixtral_run(impl) for impl in ("eager", "batched_mm", "grouped_mm")}
    _, losses, grads, state = runs["grouped_mm"]
    for impl in ("eager", "batched_mm"):
        _, other_losses, other_grads, other_state = runs[impl]
        assert other_state.sites == state.sites
        assert other_losses == pytest.approx(losses, rel=1e-5)
        torch.testing.assert_close(other_state.scale, state.scale, rtol=1e-5, atol=0)
        for n, g in grads.items():
            torch.testing.assert_close(other_grads[n], g, rtol=1e-4, atol=1e-6)


def test_summary_gives_each_weight_and_its_share():
    model = build("mixtral")
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    with pytest.raises(RuntimeError, match=r"expected `fn.init\(...\)` first"):
        fn.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the routers are high precision by default: no warning
        fn.init(batch())
    lines = fn.summary().splitlines()
    assert lines[0] == "float8: 57,344 of 57,600 matmul weight elements (99.6%)"
    row = next(r for r in lines if r.startswith("model.layers.0.mlp.experts.gate_up_proj "))
    assert row.split()[1:] == ["16,384", "28.4%", "float8", "DelayedScaling,", "per", "expert"]
    assert lines[-1] == (
        "model.layers.1.mlp.gate.weight                    128    0.2%  "
        "high precision (F.linear; router or gate, by default)"
    )


def test_summary_names_nvfp4_experts_as_they_are():
    # 4-bit experts are NVFP4 in their rows and not counted in the float8 share
    def recipe(name, module):
        if "experts" in name:
            return fp8fn.NVFP4Scaling()
        return None if name.endswith(("gate.weight", "lm_head")) else fp8fn.DelayedScaling()

    fn = fp8fn.transform(build("mixtral"), recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the routers chosen out (asked with the weight's name)
        fn.init(batch())
    lines = fn.summary().splitlines()
    assert lines[0] == (
        "float8: 6,144 of 57,600 matmul weight elements (10.7%); NVFP4 (4-bit): 49,152 (85.3%)"
    )
    row = next(r for r in lines if r.startswith("model.layers.1.mlp.experts.down_proj "))
    assert row.split()[1:] == ["8,192", "14.2%", "NVFP4", "NVFP4Scaling,", "per", "expert"]


def test_routers_chosen_out_are_not_reported():
    model = build("mixtral")
    fn = fp8fn.transform(
        model,
        fp8fn.DelayedScaling(),
        filter_fn=lambda name, module: not name.endswith("gate.weight"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn.init(batch())
    assert "(F.linear; chosen)" in fn.summary()


def test_no_converted_layer_names_experts_weights_and_what_filter_fn_is_asked():
    # filter_fn rejecting the module path of the experts: their weights are asked by name
    model = build("qwen3_moe")
    with pytest.warns(
        UserWarning,
        match=r"no layer was converted.*experts weights \(3-D.*with the weight's name for an "
        r"experts weight \(e.g. 'model.layers.0.mlp.experts.gate_up_proj'",
    ):
        fp8fn.transform(model, fp8fn.DelayedScaling(), filter_fn=lambda n, m: n.endswith("experts"))


def test_flatten_names_experts_and_resume_is_bit_identical(tmp_path):
    model = build("qwen3_moe")
    recipe = fp8fn.DelayedScaling()
    fn = fp8fn.transform(model, recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, state = train(model, steps=2, fn=fn)
    flat = fp8fn.flatten_state(state)
    assert "model.layers.1.mlp.experts.down_proj[3].grad_output.scale" in flat
    torch.save(flat, tmp_path / "state.pt")
    resumed = fp8fn.unflatten_state(torch.load(tmp_path / "state.pt", weights_only=True), recipe)
    fresh = fp8fn.transform(model, recipe)  # a new process: no init
    params, ids = dict(model.named_parameters()), batch()

    def step(fn, state):
        def f(p, s):
            return fn.apply(p, s, ids, labels=ids).loss

        return torch.func.grad(f, argnums=(0, 1))(params, state)

    (grads, obs), (grads2, obs2) = step(fn, state), step(fresh, resumed)
    assert torch.equal(obs.amax_history, obs2.amax_history)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert resumed.sites == state.sites and torch.equal(resumed.scale, state.scale)


class _Experts(nn.Module):
    """User code: 3-D weight `(E, N, K)` run by one of the GEMM forms fp8fn converts."""

    def __init__(self, form, experts=4, n=24, k=32):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(experts, n, k, generator=gen))
        self.form = form

    def forward(self, x, ends):
        w, offs = self.w, torch.tensor(ends, dtype=torch.int32)
        if self.form == "grouped_mm":
            return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
        if self.form == "_grouped_mm":
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        starts = [0, *ends[:-1]]
        if self.form == "linear_loop":
            return torch.cat([F.linear(x[s:t], w[e]) for e, (s, t) in enumerate(zip(starts, ends))])
        if self.form == "unbind_matmul":
            return torch.cat([x[s:t] @ we.t() for we, s, t in zip(w.unbind(0), starts, ends)])
        if self.form == "bmm_ids":
            sizes = torch.diff(offs, prepend=offs[:1] * 0)
            ids = torch.repeat_interleave(torch.arange(len(ends)), sizes)
            return torch.bmm(w[ids], x.unsqueeze(-1)).squeeze(-1)
        assert self.form == "bmm_experts"  # equal groups, batch e = expert e
        rows = ends[0]
        out = torch.bmm(x.view(len(ends), rows, -1), w.transpose(1, 2))
        return out.reshape(len(ends) * rows, -1)


_FORMS = ["grouped_mm", "_grouped_mm", "linear_loop", "unbind_matmul", "bmm_ids", "bmm_experts"]


@pytest.mark.parametrize("form", _FORMS)
@pytest.mark.parametrize("recipe", [fp8fn.DelayedScaling(), fp8fn.CurrentScaling()])
def test_user_gemm_forms_match_the_float64_reference(form, recipe):
    ends = [6, 12, 18, 24] if form == "bmm_experts" else [5, 5, 13, 20]
    module = _Experts(form)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(ends[-1], 32, generator=gen), torch.randn(ends[-1], 24, generator=gen)
    fn = fp8fn.transform(module, recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = fn.init(x, ends)
    assert fn.layers == ["w"]
    assert list(state) == ([f"w[{e}]" for e in range(4)] if state.sites else [])

    def f(p, s):
        return (fn.apply(p, s, x, ends) * g).sum()

    (grads, obs) = torch.func.grad(f, argnums=(0, 1))(dict(module.named_parameters()), state)
    out = fn.apply(dict(module.named_parameters()), state, x, ends)
    r_out, _, r_gw, r_obs = _reference(x, module.w.detach(), ends, g)
    torch.testing.assert_close(out.double(), r_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["w"].double(), r_gw, rtol=1e-5, atol=1e-5)
    if state.sites:
        newest = obs.amax_history[..., 0].double()
        torch.testing.assert_close(newest, r_obs.float().double(), rtol=0, atol=0)


@pytest.mark.parametrize("form", ["grouped_mm", "linear_loop", "bmm_ids"])
def test_idle_expert_keeps_its_input_and_grad_output_histories(form):
    """Expert 1 receives no token in 3 steps: 0 = not observed, so `update` keeps its input
    and grad_output histories (empty here) while the others fill theirs."""
    module = _Experts(form)
    fn = fp8fn.transform(module, fp8fn.DelayedScaling(history_len=4))
    ends, gen = [5, 5, 13, 20], torch.Generator().manual_seed(2)
    state = fn.init(torch.randn(20, 32), ends)
    params = dict(module.named_parameters())
    for _ in range(3):
        x = torch.randn(20, 32, generator=gen)
        obs = torch.func.grad(lambda s: fn.apply(params, s, x, ends).sum())(state)
        state = fp8fn.update(state, obs)
    idle, busy = state["w[1]"], state["w[2]"]
    assert not idle.input.amax_history.any() and not idle.grad_output.amax_history.any()
    assert busy.input.amax_history[:3].all() and busy.grad_output.amax_history[:3].all()
    assert idle.weight.amax_history[0].item() == module.w[1].abs().max().item()


def test_64_experts_stay_two_leaves_and_update_is_unchanged():
    module = _Experts("grouped_mm", experts=64)
    ends = list(range(1, 65))
    fn = fp8fn.transform(module, fp8fn.DelayedScaling())
    state = fn.init(torch.randn(64, 32), ends)
    assert len(state) == 64 and len(pytree.tree_leaves(state)) == 2
    assert state.amax_history.shape == (64, 3, 16)


_STATELESS = [
    fp8fn.RowwiseScaling(),
    fp8fn.BlockwiseScaling(),
    fp8fn.MXScaling(),
    fp8fn.NVFP4Scaling(),
]


def _recipe_id(recipe):
    return type(recipe).__name__


@pytest.mark.parametrize("recipe", _STATELESS, ids=_recipe_id)
@pytest.mark.parametrize("route", ["func", "autograd"])
def test_experts_stateless_recipes_run_the_grouped_op(recipe, route):
    """Rowwise, blockwise, MXFP8 per group and NVFP4 per expert (key folded with the expert,
    at the weight's site) through `transform`: bit for bit the grouped op called directly
    (anchored per expert in test_moe.py); the per-expert loop `F.linear(x, W[e])`: bit for bit
    the dense op per expert (NVFP4: at the site `w[e]`; the loop has no empty group: the dense
    NVFP4 op refuses an empty `x`)."""
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(20, 32, generator=gen), torch.randn(20, 24, generator=gen)
    for form, ends in (("grouped_mm", [5, 5, 13, 20]), ("linear_loop", [5, 9, 13, 20])):
        offs = torch.tensor(ends, dtype=torch.int32)
        module = _Experts(form)
        fn = fp8fn.transform(module, recipe)
        state = fn.init(x, ends, seed=5)
        assert fn.layers == ["w"] and list(state) == []
        assert (state.key is not None) == isinstance(recipe, fp8fn.NVFP4Scaling)
        w = module.w.detach().requires_grad_()
        xr = x.clone().requires_grad_()
        if form == "grouped_mm":
            random = (state.key, "w") if state.key is not None else None
            want = grouped_mm(xr, w, offs, recipe=recipe, random=random)
        else:
            want = torch.cat(
                [
                    fp8fn.linear(
                        xr[s:t],
                        w[e],
                        None,
                        recipe=recipe,
                        site_state=None if state.key is None else (state.key, f"w[{e}]"),
                    )
                    for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends))
                ]
            )
        want_gx, want_gw = torch.autograd.grad((want * g).sum(), (xr, w))
        if route == "func":

            def f(p, xx):
                return (fn.apply(p, state, xx, ends) * g).sum()

            got_gw, got_gx = torch.func.grad(f, argnums=(0, 1))({"w": module.w}, x)
            got_gw = got_gw["w"]
            out = fn.apply({"w": module.w}, state, x, ends)
        else:
            xa, wa = x.clone().requires_grad_(), module.w.detach().requires_grad_()
            out = fn.apply({"w": wa}, state, xa, ends)
            got_gx, got_gw = torch.autograd.grad((out * g).sum(), (xa, wa))
        assert torch.equal(out, want), form
        assert torch.equal(got_gx, want_gx) and torch.equal(got_gw, want_gw), form
        exact = torch.cat(
            [
                x[s:t] @ module.w.detach()[e].t()
                for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends))
            ]
        )
        assert sqnr(exact, out) >= (12.0 if isinstance(recipe, fp8fn.NVFP4Scaling) else 25.0)


@pytest.mark.parametrize("recipe", _STATELESS, ids=_recipe_id)
def test_mixtral_trains_with_a_stateless_recipe_on_its_experts(recipe):
    """A recipe function gives the experts `recipe`, the rest DelayedScaling: 3 steps within a
    few percent of float32 on both routes; the grouped_mm implementation (the grouped op) next
    to the eager one (the dense op per expert) within float32 summation order (NVFP4: other
    random draws, hence within a few percent)."""

    def choose(name, module):
        return recipe if "experts" in name else fp8fn.DelayedScaling()

    runs = {}
    for implementation in ("grouped_mm", "eager"):
        model = build("mixtral", implementation)
        fn = fp8fn.transform(model, choose)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the routers' high-precision GEMMs
            losses, _, state = train(model, fn=fn)
            auto, _, _ = train(model, fn=fn, route="autograd")
        assert auto == pytest.approx(losses, rel=1e-6)
        assert fn.recipes["model.layers.0.mlp.experts.gate_up_proj"] is recipe
        assert not any("experts" in n for n in state.sites)
        runs[implementation] = losses
    ref, _, _ = train(build("mixtral"))
    assert runs["grouped_mm"] == pytest.approx(ref, rel=0.05)
    close = 0.05 if isinstance(recipe, fp8fn.NVFP4Scaling) else 1e-4
    assert runs["eager"] == pytest.approx(runs["grouped_mm"], rel=close)


def test_experts_sites_apart_in_the_state_raise():
    module = _Experts("grouped_mm")
    recipe = fp8fn.DelayedScaling()
    fn = fp8fn.transform(module, recipe)
    x, ends = torch.randn(20, 32), [5, 5, 13, 20]
    state = fn.init(x, ends)
    flat = fp8fn.flatten_state(state)
    order = ["w[0]", "w[2]", "w[1]", "w[3]"]
    shuffled = {k: flat[k] for s in order for k in flat if k.startswith(s + ".")}
    with pytest.raises(
        ValueError,
        match=r"expected the sites of the 4 experts of 'w' \(call 0\) "
        r"in `state`, one after another, got them apart",
    ):
        fn.apply(dict(module.named_parameters()), fp8fn.unflatten_state(shuffled, recipe), x, ends)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_checkpoint_fn_on_decoder_layers_is_bit_identical_with_float8_experts(implementation):
    model = build("mixtral", implementation)
    ids, params = batch(), dict(model.named_parameters())
    runs = []
    for checkpoint_fn in (None, lambda name, module: name.count(".") == 2 and "layers" in name):
        fn = fp8fn.transform(model, fp8fn.DelayedScaling(), checkpoint_fn=checkpoint_fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the routers' high-precision GEMMs
            state = fn.init(ids, use_cache=False)

        def f(p, s, fn=fn):
            return fn.apply(p, s, ids, labels=ids, use_cache=False).loss

        runs.append(torch.func.grad(f, argnums=(0, 1))(params, state))
    assert fn.checkpointed == ["model.layers.0", "model.layers.1"]
    (grads, obs), (grads2, obs2) = runs
    assert torch.equal(obs.amax_history, obs2.amax_history)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)


def test_grouped_mm_with_arguments_by_position_and_keyword():
    class Keywords(_Experts):
        def forward(self, x, ends):
            offs = torch.tensor(ends, dtype=torch.int32)
            a = torch._grouped_mm(x, self.w.transpose(-2, -1), offs)
            return a + torch._grouped_mm(input=x, mat2=self.w.transpose(-2, -1), offs=offs)

    module, ends = Keywords("grouped_mm"), [5, 5, 13, 20]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 32, generator=gen)
    fn = fp8fn.transform(module, fp8fn.CurrentScaling())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn.init(x, ends)
    out = fn.apply(dict(module.named_parameters()), fn.init(x, ends), x, ends)
    one = grouped_mm(x, module.w.detach(), torch.tensor(ends, dtype=torch.int32))
    assert torch.equal(out, one + one)


def test_conv_weights_are_not_asked_about_and_run_as_they_are():
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.Flatten(), nn.Linear(8 * 6, 5))
    asked = []

    def filter_fn(name, module):
        asked.append(name)
        return True

    fn = fp8fn.transform(model, fp8fn.DelayedScaling(), filter_fn=filter_fn)
    x = torch.randn(2, 4, 8)
    state = fn.init(x)
    assert asked == ["2"] and fn.layers == ["2"] and list(state) == ["2"]
    assert "0.weight" not in fn.summary()


class _Routed(nn.Module):
    """A router `nn.Linear(32, 4)` next to a 3-D experts weight `(4, 24, 32)` (top-1), inside
    a model whose head `nn.Linear(24, 1)` is a dense layer with one output."""

    def __init__(self):
        super().__init__()
        self.block = nn.Module()
        self.block.router = nn.Linear(32, 4)
        self.block.w = nn.Parameter(torch.randn(4, 24, 32) / 32**0.5)
        self.head = nn.Linear(24, 1)

    def forward(self, x):
        ids = self.block.router(x).argmax(-1)
        order = torch.argsort(ids, stable=True)
        offs = torch.bincount(ids, minlength=4).cumsum(0).int()
        y = F.grouped_mm(x[order], self.block.w.transpose(-2, -1), offs=offs)
        return self.head(y[torch.argsort(order)])


def test_routers_and_gates_next_to_experts_stay_in_high_precision():
    """Qwen2-MoE's routers (`mlp.gate`, calling `F.linear` on their own weight) and
    `shared_expert_gate` `nn.Linear(32, 1)`, and a user router `nn.Linear(32, 4)`, next to 4
    experts: high precision by default, listed as router or gate, not warned about (nothing to
    act on); a dense `nn.Linear(24, 1)` elsewhere runs in float8; `filter_fn` choosing them out
    lists them as chosen; a recipe function chooses for them."""
    model = build("qwen2_moe")
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn.init(batch())
    assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in fn.layers)
    rows = {r.split()[0]: r for r in fn.summary().splitlines()[2:]}
    for name in ("model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate.weight"):
        assert rows[name].endswith("high precision (F.linear; router or gate, by default)")
    chosen_out = fp8fn.transform(
        model,
        fp8fn.DelayedScaling(),
        filter_fn=lambda name, module: not name.endswith(("mlp.gate.weight", "shared_expert_gate")),
    )
    chosen_out.init(batch())
    rows = {r.split()[0]: r for r in chosen_out.summary().splitlines()[2:]}
    for name in ("model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate.weight"):
        assert rows[name].endswith("high precision (F.linear; chosen)")
    chosen = fp8fn.transform(model, lambda name, module: fp8fn.DelayedScaling())
    assert "model.layers.0.mlp.shared_expert_gate" in chosen.layers

    routed = _Routed()
    fn = fp8fn.transform(routed, fp8fn.CurrentScaling())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn.init(torch.randn(20, 32))
    assert fn.layers == ["head", "block.w"]
    x = torch.randn(20, 32)
    out = fn.apply(dict(routed.named_parameters()), fn.init(x), x)
    ids = routed.block.router(x).argmax(-1)  # the router in float32: the same experts chosen
    y = torch.zeros(20, 24)
    for e in ids.unique().tolist():  # each expert's rows, current scaling per expert
        y[ids == e] = fp8fn.linear(
            x[ids == e], routed.block.w[e], None, None, recipe=fp8fn.CurrentScaling()
        )
    want = fp8fn.linear(
        y, routed.head.weight, routed.head.bias, None, recipe=fp8fn.CurrentScaling()
    )
    torch.testing.assert_close(out, want, rtol=0, atol=0)
