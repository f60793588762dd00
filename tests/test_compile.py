"""torch.compile: no graph breaks, compiled training steps that match eager, the torch.func
routes (right numbers or an error, never a dropped backward), and fused casts in the code."""

import re

import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_bit_identical
from _models import MLP, Transformer
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fp8fn
import fp8fn._linear
from fp8fn._linear import _Fp8Linear

tree_map = torch.utils._pytree.tree_map
tree_leaves = torch.utils._pytree.tree_leaves
DELAYED = fp8fn.DelayedScaling(history_len=4, backend="emulated")
CURRENT = fp8fn.CurrentScaling(backend="emulated")
RECIPES = pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _autograd_step(apply, params, state, args, loss_fn):
    """Plain autograd: leaves require grad, `.backward()`; returns (loss, grads, obs)."""
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    state = tree_map(lambda t: t.detach().clone().requires_grad_(), state)
    loss = loss_fn(apply(params, state, *args[:-1]), args[-1])
    loss.backward()
    obs = tree_map(lambda t: t.grad, state)
    return loss.detach(), {k: v.grad for k, v in params.items()}, obs


def _train(apply, fn, params, batches, loss_fn):
    """Steps from an empty history, `update` after each; returns per-step (loss, grads, state)."""
    state, out = fn.init(*batches[0][:-1]), []
    for args in batches:
        loss, grads, obs = _autograd_step(apply, params, state, args, loss_fn)
        if isinstance(fn.recipe, fp8fn.DelayedScaling):
            state = fp8fn.update(state, obs)
        else:
            assert all(s is None for s in obs.values())
        out.append((loss, grads, state))
    return out


def _weighted_sum(out, c):
    return (out * c).sum()


def _params(model):
    return {k: v.detach() for k, v in model.named_parameters()}


# plain autograd: fullgraph, zero graph breaks, same state as eager ------------------------------


@RECIPES
def test_compile_apply_single_linear_state_bit_identical_to_eager(recipe):
    model = nn.Linear(32, 16)
    fn = fp8fn.transform(model, recipe)
    gen = torch.Generator().manual_seed(0)
    # Batches of growing magnitude, so the delayed scales differ from the current ones.
    batches = [
        (torch.randn(8, 32, generator=gen) * (1 + i), torch.randn(8, 16, generator=gen))
        for i in range(4)
    ]
    compiled = torch.compile(fn.apply, fullgraph=True)
    got = _train(compiled, fn, _params(model), batches, _weighted_sum)
    assert _graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1  # one graph, no recompile over the steps
    want = _train(fn.apply, fn, _params(model), batches, _weighted_sum)
    for (loss, grads, state), (loss_e, grads_e, state_e) in zip(got, want):
        assert_bit_identical(state, state_e)
        torch.testing.assert_close(loss, loss_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads, grads_e, rtol=1e-6, atol=1e-6)
    if recipe is DELAYED:
        assert state[""].input.amax_history[3] > 0  # 4 steps observed


def _lm_batches(vocab, n, shape):
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, vocab, shape, generator=gen),
            torch.randint(0, vocab, shape, generator=gen),
        )
        for _ in range(n)
    ]


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def _mlp_batches(n):
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(16, 24, generator=gen) * (1 + i), torch.randint(0, 8, (16,), generator=gen))
        for i in range(n)
    ]


@RECIPES
@pytest.mark.parametrize("which", ["mlp", "transformer"])
def test_compile_apply_model_matches_eager(recipe, which):
    if which == "mlp":
        model, batches, loss_fn = MLP((24, 48, 48, 8)), _mlp_batches(3), F.cross_entropy
    else:
        model = Transformer(vocab=32, d_model=32, n_heads=2, n_blocks=2, seq=8)
        batches, loss_fn = _lm_batches(32, 3, (2, 8)), _lm_loss
    fn = fp8fn.transform(model, recipe)
    got = _train(torch.compile(fn.apply, fullgraph=True), fn, _params(model), batches, loss_fn)
    assert _graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1
    want = _train(fn.apply, fn, _params(model), batches, loss_fn)
    for (loss, grads, state), (loss_e, grads_e, state_e) in zip(got, want):
        torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads, grads_e, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state, state_e, rtol=1e-5, atol=0)
    if recipe is DELAYED:
        assert all(s.grad_output.amax_history[2] > 0 for s in state.values())


def _compiled_linear(recipe):
    return torch.compile(lambda x, w, s: fp8fn.linear(x, w, None, s, recipe), fullgraph=True)


@RECIPES
def test_compile_linear_without_grad_fullgraph_matches_eager(recipe):
    # No input requires grad: dynamo inlines the autograd.Function's forward (on torch 2.13 it
    # needs one named parameter per argument there). The no_grad case is in the kernel test.
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    site = fp8fn.init_site_state(recipe)
    got = _compiled_linear(recipe)(x, w, site)
    assert _graph_breaks() == 0
    assert torch.equal(got, fp8fn.linear(x, w, None, site, recipe))


# the torch.func routes ---------------------------------------------------------------------------


def _func_setup():
    gen = torch.Generator().manual_seed(3)
    x, c = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
    model = nn.Linear(32, 16)
    fn = fp8fn.transform(model, DELAYED)
    state = fn.init(x)

    def via_apply(p, s, x, c):
        return (fn.apply(p, s, x) * c).sum()

    def via_linear(p, s, x, c):
        return (fp8fn.linear(x, p["weight"], p["bias"], s[""], DELAYED) * c).sum()

    def dropped_backward(p, s, x, c):
        """The same forward math without the autograd.Function: what a dropped backward gives."""
        leaves = [t for r in s[""] for t in (r.amax_history, r.scale, r.margin)]
        out = _Fp8Linear.forward(x, p["weight"], p["bias"], "emulated", *leaves)[0]
        return (out * c).sum()

    return _params(model), state, x, c, {"apply": via_apply, "linear": via_linear}, dropped_backward


def _grad(f):
    return torch.func.grad(f, argnums=(0, 1))


ROUTES = pytest.mark.parametrize("route", ["apply", "linear"])


@ROUTES
def test_func_grad_compiled_routes_match_eager_and_differ_from_dropped_backward(route):
    params, state, x, c, fs, dropped = _func_setup()
    f = fs[route]
    want = _grad(f)(params, state, x, c)
    for got in (
        _grad(torch.compile(f))(params, state, x, c),
        torch.compile(_grad(f))(params, state, x, c),
    ):
        assert_bit_identical(got, want)
    # The equality has teeth: differentiating the forward math instead of fp8fn's backward
    # gives other parameter gradients and no observations at all.
    lost_grads, lost_obs = _grad(dropped)(params, state, x, c)
    assert not torch.allclose(lost_grads["weight"], want[0]["weight"], rtol=1e-3, atol=1e-3)
    assert torch.all(lost_obs[""].input.amax_history == 0)
    assert want[1][""].input.amax_history[0] == x.abs().max()
    assert want[1][""].grad_output.amax_history[0] == c.abs().max()


@ROUTES
def test_func_grad_of_compiled_fullgraph_raises(route):
    params, state, x, c, fs, _ = _func_setup()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch.func.grad\(compiled_fn\)"):
        _grad(torch.compile(fs[route], fullgraph=True))(params, state, x, c)


@ROUTES
def test_compiled_func_grad_fullgraph_raises(route):
    # The refusal in fp8fn.linear makes dynamo break the graph, which fullgraph turns into an
    # error (on torch 2.13 dynamo's message names `maybe_current_level`, not fp8fn).
    params, state, x, c, fs, _ = _func_setup()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="maybe_current_level"):
        torch.compile(_grad(fs[route]), fullgraph=True)(params, state, x, c)


@ROUTES
def test_compiled_func_grad_without_the_guard_drops_the_backward(route, monkeypatch):
    # Proof that the refusal in fp8fn.linear is what keeps compile(grad(f)) correct: without
    # it dynamo traces the autograd.Function and differentiates its forward (pytorch#193279),
    # giving exactly the dropped-backward numbers.
    monkeypatch.setattr(fp8fn._linear, "_refuse_compile_under_func", lambda: None)
    params, state, x, c, fs, dropped = _func_setup()
    grads, obs = torch.compile(_grad(fs[route]))(params, state, x, c)
    # Eagerly, the emulated matmul widens e4m3 through integer ops (no gradient); traced, it
    # converts with `.float()`: differentiate the traced form.
    monkeypatch.setattr(fp8fn._matmul, "_widen", lambda fp8: (fp8.float(), 1.0))
    lost_grads, lost_obs = _grad(dropped)(params, state, x, c)
    want_grads, want_obs = _grad(fs[route])(params, state, x, c)
    torch.testing.assert_close(grads, lost_grads)
    assert not torch.allclose(grads["weight"], want_grads["weight"], rtol=1e-3, atol=1e-3)
    assert all(torch.all(o.amax_history == 0) for o in obs[""])
    assert want_obs[""].input.amax_history[0] > 0


# fused casts in the generated code -------------------------------------------------------------


def _kernels_reading(code: str, shape: tuple) -> tuple[list[str], list[str]]:
    """(all cpp kernel calls, those reading the graph input of `shape`) in `call` of `code`."""
    name = re.search(rf"assert_size_stride\((\w+), \({shape[0]}, {shape[1]}\)", code).group(1)
    call = code[code.index("def call(") :]
    calls = re.findall(r"(cpp_fused_\w+)\(([^)]*)\)", call)
    return [k for k, _ in calls], [k for k, a in calls if re.search(rf"\b{name}\b", a)]


@RECIPES
def test_compiled_forward_casts_in_one_fused_kernel(recipe):
    # x (64, 128) and weight (32, 128): one kernel computes both amaxes, the scales, and the
    # saturating fp8 casts (as a reduction loop then a cast loop over the same input); then the
    # matmul; then one kernel applies the dequantization scales. No standalone abs, amax,
    # multiply, clamp or convert kernels.
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    site = fp8fn.init_site_state(recipe)
    with torch.no_grad():
        out, (code,) = run_and_get_code(_compiled_linear(recipe), x, w, site)
    assert torch.equal(out, fp8fn.linear(x, w, None, site, recipe))
    kernels, reading_x = _kernels_reading(code, (64, 128))
    _, reading_w = _kernels_reading(code, (32, 128))
    assert len(kernels) == 2, kernels
    assert reading_x == reading_w == kernels[:1]
    assert all(op in kernels[0] for op in ("abs", "amax", "mul", "clamp", "_to_copy"))
    assert code.count("extern_kernels.mm(") == 1


@RECIPES
def test_compiled_linear_saves_only_float8_copies_and_scalars(recipe):
    # AOTAutograd picks what the compiled backward keeps; it must still be the float8 copies
    # (1 byte per element of x and weight), not a float32 widening of them.
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(32, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _compiled_linear(recipe)(x, w, fp8fn.init_site_state(recipe))
    big = sorted((str(t.dtype), t.numel()) for t in saved if t.dim() > 0)
    assert big == [("torch.float8_e4m3fn", 32 * 128), ("torch.float8_e4m3fn", 64 * 128)]
    assert all(t.numel() == 1 for t in saved if t.dim() == 0)
