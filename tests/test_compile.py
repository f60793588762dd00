"""torch.compile: no graph breaks, compiled training steps that match eager, the torch.func
routes (right numbers or an error, never a dropped backward), the compiled
`fp8fn.value_and_grad` route, dynamic shapes, and fused casts in the generated code."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _helpers import CURRENT, DELAYED, assert_bit_identical
from _models import MLP, Transformer
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fp8fn
import fp8fn._ops.linear
from fp8fn._numerics.fp8 import amax, cast_to_fp8
from fp8fn._ops.tensorwise import LOCAL, Statics, _after_gemm, _Fp8Linear

pytestmark = pytest.mark.slow  # torch.compile: tens of seconds a test on 2 cores
RECIPES = pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _break_reasons() -> dict:
    """{first line of the reason: count} of the graph breaks so far."""
    return {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}


def _autograd_step(apply, params, state, args, loss_fn):
    """Plain autograd: params require grad, `fp8fn.observe(state)`, `.backward()`.

    Returns (loss, grads, obs); obs is None when the state has no sites (stateless recipes).
    """
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    observed = fp8fn.observe(state) if len(state) else state
    loss = loss_fn(apply(params, observed, *args[:-1]), args[-1])
    loss.backward()
    obs = fp8fn.observations(observed) if len(state) else None
    return loss.detach(), {k: v.grad for k, v in params.items()}, obs


def _train(apply, fn, recipe, params, batches, loss_fn, graphs=None):
    """Steps from an empty history, `update` after each; returns per-step (loss, grads, state).

    `graphs`, a list, receives the number of graphs compiled so far after each step.
    """
    state, out = fn.init(*batches[0][:-1]), []
    for args in batches:
        loss, grads, obs = _autograd_step(apply, params, state, args, loss_fn)
        if isinstance(recipe, fp8fn.DelayedScaling):
            state = fp8fn.update(state, obs)
        else:
            assert len(state) == 0 and obs is None
        out.append((loss, grads, state))
        if graphs is not None:
            graphs.append(_graphs())
    return out


def _weighted_sum(out, c):
    return (out * c).sum()


def _params(model):
    return {k: v.detach() for k, v in model.named_parameters()}


# plain autograd: fullgraph, zero graph breaks, same state as eager ------------------------------


def _single_linear_batches():
    gen = torch.Generator().manual_seed(0)
    # Batches of growing magnitude, so the delayed scales differ from the current ones.
    return [
        (torch.randn(8, 32, generator=gen) * (1 + i), torch.randn(8, 16, generator=gen))
        for i in range(4)
    ]


@RECIPES
def test_compile_apply_single_linear_state_bit_identical_to_eager(recipe):
    model = nn.Linear(32, 16)
    fn = fp8fn.transform(model, recipe)
    batches, graphs = _single_linear_batches(), []
    compiled = torch.compile(fn.apply, fullgraph=True)
    got = _train(compiled, fn, recipe, _params(model), batches, _weighted_sum, graphs)
    assert _graph_breaks() == 0
    # one graph, no recompile over the steps; DelayedScaling: step 1 (empty histories, current
    # scaling) and one graph for the steady state (stored scales)
    assert graphs == ([1, 2, 2, 2] if recipe is DELAYED else [1, 1, 1, 1])
    want = _train(fn.apply, fn, recipe, _params(model), batches, _weighted_sum)
    for (loss, grads, state), (loss_e, grads_e, state_e) in zip(got, want):
        assert_bit_identical(state, state_e)
        torch.testing.assert_close(loss, loss_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads, grads_e, rtol=1e-6, atol=1e-6)
    if recipe is DELAYED:
        assert state[""].input.amax_history[3] > 0  # 4 steps observed
        assert state.amax_history.shape == (1, 3, 4)


@pytest.mark.parametrize("route", ["apply", "value_and_grad"])
def test_compile_one_graph_over_steps(route):
    # A transform first applied under compile: its site check must leave no attribute write for
    # dynamo to guard on (one did, and step 2 recompiled).
    model = nn.Linear(32, 16)
    fn = fp8fn.transform(model, DELAYED)
    batches = _single_linear_batches()
    if route == "apply":
        _train(torch.compile(fn.apply, fullgraph=True), fn, DELAYED, _params(model), batches,
               _weighted_sum)  # fmt: skip
    else:
        step = torch.compile(fp8fn.value_and_grad(_func_loss(fn), argnums=(0, 1)))
        state = fn.init(batches[0][0])
        for x, c in batches:
            _, (_, obs) = step(_params(model), state, x, c)
            state = fp8fn.update(state, obs)
    assert _graphs() == 2  # step 1 (empty histories: current scaling), then one for the rest


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
    graphs = []
    compiled = torch.compile(fn.apply, fullgraph=True)
    got = _train(compiled, fn, recipe, _params(model), batches, loss_fn, graphs)
    assert _graph_breaks() == 0
    assert graphs == ([1, 2, 2] if recipe is DELAYED else [1, 1, 1])  # step 1, steady state
    want = _train(fn.apply, fn, recipe, _params(model), batches, loss_fn)
    for (loss, grads, state), (loss_e, grads_e, state_e) in zip(got, want):
        torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads, grads_e, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.amax_history, state_e.amax_history, rtol=1e-5, atol=0)
        torch.testing.assert_close(state.scale, state_e.scale, rtol=1e-5, atol=0)
        assert state.sites == state_e.sites
    if recipe is DELAYED:
        assert bool((state.amax_history[:, 2, 2] > 0).all())  # every grad_output, 3 steps


def _compiled_linear(recipe):
    return torch.compile(lambda x, w, s: fp8fn.linear(x, w, None, s, recipe), fullgraph=True)


def _site_state(recipe):
    """`state["fc"]` after one observed step (stored scales in use), or None when stateless."""
    if not isinstance(recipe, fp8fn.DelayedScaling):
        return None
    state = fp8fn.init_state(recipe, ["fc"])
    history = torch.zeros(1, 3, recipe.history_len)
    history[0, :, 0] = torch.tensor([2.5, 1.5, 0.25])
    return fp8fn.update(state, state._replace(amax_history=history))["fc"]


@RECIPES
def test_compile_linear_without_grad_fullgraph_matches_eager(recipe):
    # No input requires grad: dynamo inlines the autograd.Function's forward.
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    site = _site_state(recipe)
    got = _compiled_linear(recipe)(x, w, site)
    assert _graph_breaks() == 0
    assert torch.equal(got, fp8fn.linear(x, w, None, site, recipe))


# the torch.func routes ---------------------------------------------------------------------------


def _func_loss(fn):
    def via_apply(p, s, x, c):
        return (fn.apply(p, s, x) * c).sum()

    return via_apply


def _func_setup():
    gen = torch.Generator().manual_seed(3)
    x, c = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
    model = nn.Linear(32, 16)
    fn = fp8fn.transform(model, DELAYED)
    state = fn.init(x)

    def via_linear(p, s, x, c):
        return (fp8fn.linear(x, p["weight"], p["bias"], s[""], DELAYED) * c).sum()

    def dropped_backward(p, s, x, c):
        """The same forward math without the autograd.Function: what a dropped backward gives."""
        site = s[""]
        newest, stored = site.amax_history[:, 0], site.scale
        statics = Statics(0, "emulated", LOCAL, None, DELAYED.fast_accum, "linear")
        out = _Fp8Linear.forward(x, p["weight"], p["bias"], newest, stored, statics)[0]
        return (out * c).sum()

    fs = {"apply": _func_loss(fn), "linear": via_linear}
    return _params(model), state, x, c, fs, dropped_backward


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
    assert torch.all(lost_obs.amax_history == 0)
    assert want[1][""].input.amax_history[0] == x.abs().max()
    assert want[1][""].grad_output.amax_history[0] == c.abs().max()


@ROUTES
def test_func_grad_compiled_routes_graph_breaks(route):
    # grad(compile(f)): dynamo refuses every frame under an eager torch.func.grad ("Unsupported
    # functorch tracing attempt") and skips it: no graph break is counted, the op runs eagerly.
    # compile(grad(f)): fp8fn's refusal raises while dynamo traces; dynamo gives up on that
    # frame (no graph break is counted) and runs it eagerly.
    params, state, x, c, fs, _ = _func_setup()
    _grad(torch.compile(fs[route]))(params, state, x, c)
    assert _graph_breaks() == 0
    assert sum(n for r, n in counters["unimplemented"].items() if "functorch" in r) > 0
    torch._dynamo.reset()
    counters.clear()
    torch.compile(_grad(fs[route]))(params, state, x, c)
    assert _graph_breaks() == 0
    assert "Observed exception" in [r.splitlines()[0] for r in counters["unimplemented"]]


@ROUTES
def test_func_grad_of_compiled_fullgraph_raises(route):
    params, state, x, c, fs, _ = _func_setup()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch.func.grad\(compiled_fn\)"):
        _grad(torch.compile(fs[route], fullgraph=True))(params, state, x, c)


@ROUTES
def test_compiled_func_grad_fullgraph_raises_fp8fns_error(route):
    # The refusal in the float8 op raises at trace time, past dynamo: the user sees fp8fn's
    # RuntimeError naming the fix and the API they called, not dynamo's `Unsupported`.
    params, state, x, c, fs, _ = _func_setup()
    api = "linear" if route == "linear" else "apply: layer ''"  # what the user called
    with pytest.raises(
        RuntimeError,
        match=rf"^fp8fn.{api}: torch.compile cannot trace fp8fn's float8 ops inside a "
        r"torch.func transform .* Use fp8fn.value_and_grad",
    ) as e:
        torch.compile(_grad(fs[route]), fullgraph=True)(params, state, x, c)
    assert not isinstance(e.value, torch._dynamo.exc.TorchDynamoException)
    torch._dynamo.reset()
    with torch._dynamo.error_on_graph_break(True), pytest.raises(RuntimeError, match="^fp8fn"):
        torch.compile(_grad(fs[route]))(params, state, x, c)


@ROUTES
def test_compiled_func_grad_without_the_guard_returns_wrong_gradients(route, monkeypatch):
    # Proof that the refusal in fp8fn.linear is what keeps compile(grad(f)) correct: without
    # it dynamo traces the autograd.Function inside torch.func.grad (pytorch#193279) and the
    # result is silently wrong. On torch 2.13 with the packed op, the observations survive but
    # every parameter gradient comes back as zeros (0.1's op gave the dropped-backward numbers).
    monkeypatch.setattr(fp8fn._ops.linear, "refuse_compile_under_func", lambda api: None)
    params, state, x, c, fs, _ = _func_setup()
    grads, obs = torch.compile(_grad(fs[route]))(params, state, x, c)
    assert _graph_breaks() == 0  # nothing stopped dynamo
    want_grads, want_obs = _grad(fs[route])(params, state, x, c)
    assert all(bool((g == 0).all()) for g in grads.values())
    assert all(bool((g != 0).any()) for g in want_grads.values())
    assert_bit_identical(obs, want_obs)


# the compiled fp8fn.value_and_grad route ---------------------------------------------------------

# Grads of the compiled route against eager torch.func.grad_and_value: inductor reorders float32
# sums (bias gradient, loss), so grads agree to this tolerance, not bit for bit.
VALUE_AND_GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _value_and_grad_steps(step, state, params, batches):
    """Train with `step(params, state, *batch) -> (loss, (grads, obs))`; per-step results."""
    out = []
    for batch in batches:
        loss, (grads, obs) = step(params, state, *batch)
        state = fp8fn.update(state, obs)
        out.append((loss, grads, obs, state))
    return out


def _func_grad_and_value(f):
    """Eager `torch.func.grad_and_value`, reordered like `fp8fn.value_and_grad`'s result."""
    grad_and_value = torch.func.grad_and_value(f, argnums=(0, 1))

    def step(*args):
        grads, value = grad_and_value(*args)
        return value, grads

    return step


def test_value_and_grad_compiled_single_linear_matches_func_grad_and_value():
    model = nn.Linear(32, 16)
    fn = fp8fn.transform(model, DELAYED)
    batches = _single_linear_batches()
    loss = _func_loss(fn)
    state = fn.init(batches[0][0])
    compiled = torch.compile(fp8fn.value_and_grad(loss, argnums=(0, 1)))
    got = _value_and_grad_steps(compiled, state, _params(model), batches)
    want = _value_and_grad_steps(_func_grad_and_value(loss), state, _params(model), batches)
    for (value, grads, obs, state), (value_e, grads_e, obs_e, state_e) in zip(got, want):
        assert_bit_identical(obs, obs_e)
        assert_bit_identical(state, state_e)
        torch.testing.assert_close(value, value_e, **VALUE_AND_GRAD_TOL)
        torch.testing.assert_close(grads, grads_e, **VALUE_AND_GRAD_TOL)
    assert bool((state[""].grad_output.amax_history > 0).all())  # 4 steps observed
    # One graph break, at torch.autograd.grad: dynamo compiles the loss (forward, and through
    # AOTAutograd its backward, fp8fn's included) and runs the wrapper around it eagerly.
    assert _break_reasons() == {
        "using `torch.autograd.grad` with `torch._dynamo.config.trace_autograd_ops=False`": 1
    }
    assert _graphs() == 2  # over the four steps: step 1 (empty histories), then steady state


def test_value_and_grad_compiled_mlp_matches_func_grad_and_value():
    model = MLP((24, 48, 48, 48, 8))  # 4 fp8 layers
    fn = fp8fn.transform(model, DELAYED)
    batches = _mlp_batches(3)

    def loss(p, s, x, y):
        return F.cross_entropy(fn.apply(p, s, x), y)

    state = fn.init(batches[0][0])
    compiled = torch.compile(fp8fn.value_and_grad(loss, argnums=(0, 1)))
    got = _value_and_grad_steps(compiled, state, _params(model), batches)
    want = _value_and_grad_steps(_func_grad_and_value(loss), state, _params(model), batches)
    for (value, grads, obs, state), (value_e, grads_e, obs_e, state_e) in zip(got, want):
        torch.testing.assert_close(value, value_e, **VALUE_AND_GRAD_TOL)
        torch.testing.assert_close(grads, grads_e, **VALUE_AND_GRAD_TOL)
        torch.testing.assert_close(obs.amax_history, obs_e.amax_history, rtol=1e-5, atol=0)
        torch.testing.assert_close(state.scale, state_e.scale, rtol=1e-5, atol=0)
    assert state.sites == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert _graph_breaks() == 1 and _graphs() == 2  # step 1 (empty histories), steady state


def test_value_and_grad_compiled_fullgraph_raises_at_autograd_grad():
    # fullgraph=True cannot hold the whole step: torch.autograd.grad is a graph break.
    model = nn.Linear(32, 16)
    fn = fp8fn.transform(model, DELAYED)
    x, c = _single_linear_batches()[0]
    step = torch.compile(fp8fn.value_and_grad(_func_loss(fn), argnums=(0, 1)), fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="torch.autograd.grad"):
        step(_params(model), fn.init(x), x, c)


# dynamic shapes ----------------------------------------------------------------------------------


def _dynamic_two_layers():
    model = MLP((24, 48, 8))  # two fp8 layers
    fn = fp8fn.transform(model, DELAYED)
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(n, 24, generator=gen), torch.randn(n, 8, generator=gen))
               for n in (16, 12, 20)]  # fmt: skip
    return model, fn, batches


def _check_dynamic_two_layers():
    model, fn, batches = _dynamic_two_layers()
    compiled = torch.compile(fn.apply, dynamic=True)
    graphs = []
    got = _train(compiled, fn, DELAYED, _params(model), batches, _weighted_sum, graphs)
    want = _train(fn.apply, fn, DELAYED, _params(model), batches, _weighted_sum)
    for (loss, grads, state), (loss_e, grads_e, state_e) in zip(got, want):
        torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads, grads_e, rtol=1e-4, atol=1e-5)
        assert_bit_identical(state, state_e)
    assert _graph_breaks() == 0
    assert graphs[1] == graphs[-1]  # batch 12 then 20: no recompile for a new batch size


def test_compile_apply_dynamic_two_layers_with_backward():
    # 0.1 raised dynamo's `AssertionError: lift_tracked_freevar_to_input should not be called on
    # root SubgraphTracer` here: under dynamic=True (torch 2.13: `specialize_float=False`) a float
    # module global read inside the op's forward became a symbolic float through `.item()` in
    # the first layer's autograd.Function subgraph, and the second layer's subgraph reused it.
    _check_dynamic_two_layers()


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
    site = _site_state(recipe)
    with torch.no_grad():
        out, (code,) = run_and_get_code(_compiled_linear(recipe), x, w, site)
    assert torch.equal(out, fp8fn.linear(x, w, None, site, recipe))
    kernels, reading_x = _kernels_reading(code, (64, 128))
    _, reading_w = _kernels_reading(code, (32, 128))
    assert len(kernels) == 2, kernels
    assert reading_x == reading_w == kernels[:1]
    # The amax is an inf-norm reduction (`linalg_vector_norm`).
    assert all(op in kernels[0] for op in ("linalg_vector_norm", "mul", "clamp", "_to_copy"))
    assert code.count("extern_kernels.mm(") == 1


@pytest.mark.parametrize("special", [None, float("nan"), float("inf"), -float("inf")])
def test_amax_by_rows_is_the_flat_amax_bit_for_bit(special):
    # Compiled, a steady-state cast that also writes its tensor transposed takes the amax by
    # rows, then over the rows (so that it joins the cast's loop): the flat amax's value and
    # dtype, special values included (NaN payload too); float32's max of magnitudes as the
    # reference value.
    t = torch.randn(48, 40, dtype=torch.bfloat16) * 1e3
    if special is not None:
        t[7, 3] = special
    by_rows = _after_gemm(None, t, True)
    assert_bit_identical(by_rows, amax(t))
    torch.testing.assert_close(by_rows, t.float().abs().max(), rtol=0, atol=0, equal_nan=True)
    assert_bit_identical(_after_gemm(None, t[:0], True), torch.tensor(0.0))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_compiled_cast_gives_the_eager_bytes_for_special_values(dtype):
    # Compiled, `saturate` selects NaN with a vectorized compare (not `nan_to_num`, whose
    # inductor loop is scalar) after the clamp: every byte as eager, inf and NaN of either sign
    # as the positive NaN (0x7F); finite values beyond the format's max saturated.
    nan, inf = float("nan"), float("inf")
    hp = torch.tensor([nan, -nan, inf, -inf, 1e30, -1e30, 448.0, 6e4, -0.0, 0.0, 1e-10, 3.3] * 8)
    scale = torch.tensor(2.0)
    eager = cast_to_fp8(hp, scale, dtype).view(torch.uint8)
    compiled = torch.compile(cast_to_fp8, fullgraph=True)(hp, scale, dtype).view(torch.uint8)
    assert torch.equal(compiled, eager)
    assert eager[:4].tolist() == [0x7F] * 4
    assert eager[4:6].tolist() == [0x7E, 0xFE] if dtype == torch.float8_e4m3fn else [0x7B, 0xFB]


@RECIPES
def test_compiled_linear_saves_only_float8_copies_and_scalars(recipe):
    # AOTAutograd picks what the compiled backward keeps; it must still be the float8 copies
    # (1 byte per element of x and weight), not a float32 widening of them.
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(32, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _compiled_linear(recipe)(x, w, _site_state(recipe))
    big = sorted((str(t.dtype), t.numel()) for t in saved if t.dim() > 0 and t.numel() > 3)
    assert big == [("torch.float8_e4m3fn", 32 * 128), ("torch.float8_e4m3fn", 64 * 128)]
    assert all(t.numel() <= 3 for t in saved if t.dtype != torch.float8_e4m3fn)


def test_compile_apply_of_multihead_attention_matches_eager():
    """nn.MultiheadAttention's projections in fp8 under torch.compile(fullgraph=True): one graph,
    the eager bits (self- and cross-attention: the packed weight split inside)."""
    from test_converted_layers import _Attention

    model = _Attention()
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(history_len=4))
    gen = torch.Generator().manual_seed(0)
    x, memory = torch.randn(3, 5, 16, generator=gen), torch.randn(3, 7, 16, generator=gen)
    params = {k: v.detach() for k, v in model.named_parameters()}
    for args in ((x,), (x, memory)):
        state = fn.init(*args)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn.apply, fullgraph=True)
        assert_bit_identical(compiled(params, state, *args), fn.apply(params, state, *args))
        assert _graph_breaks() == 0


@pytest.mark.slow
def test_compiled_transformer_backward_with_two_threads():
    """The transformer's compiled delayed step with 2 intra-op threads (run in a subprocess: a
    wrong kernel aborts the process). Widening a transposed float8 view in the emulated GEMM
    made inductor fuse the embedding's backward scatter-add into a 2-D tiled transposed store,
    whose parallel (atomic) index is wrong in torch 2.13 (pytorch/pytorch#191837,
    tools/inductor_repro_embedding_tile.py): heap corruption, or wrong embedding gradients.

    The subprocess uses inductor's usual cache: torch 2.13 keys its FX graph (and AOTAutograd)
    cache entries on the thread count the C++ kernels were generated for
    (`FxGraphHashDetails.cpp_runtime_thread_count`), so the 1-thread graphs compiled by the
    tests here are not reused; a 2-thread graph cached by an earlier run has this run's key
    (graph, torch version, config) and runs the same kernels. On 2 cores: 136 s with an empty
    cache, 66 s beside the 1-thread kernels (those of the same source are shared), 23 s with
    the 2-thread graphs cached."""
    case = "tests/test_compile.py::test_compile_apply_model_matches_eager[transformer-delayed]"
    env = {**os.environ, "FP8FN_TEST_THREADS": "2", "OMP_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", case],
        cwd=pathlib.Path(__file__).parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout, result.stdout[-3000:]


def _kernels_reading_input(numel: int) -> int:
    """How many of the kernels inductor generated since `metrics.reset()` read a graph input
    of `numel` elements: a forward input (`primals_*`) or a tensor the backward receives (one
    the forward saved, named for the node that made it), not a buffer the same graph wrote
    (`buf*`)."""
    from torch._inductor import metrics
    from torch._inductor.dependencies import MemoryDep

    return sum(
        any(
            isinstance(dep, MemoryDep)
            and not dep.name.startswith("buf")
            and dep.get_numel() == numel
            for dep in node.read_writes.reads
        )
        for node, _ in metrics.nodes_num_elem
        if not node.is_extern()
    )


def _kernels_writing(dtype: torch.dtype) -> int:
    """How many of the kernels inductor generated since `metrics.reset()` write a buffer of
    `dtype`."""
    from torch._inductor import metrics

    return sum(
        any(buf.node.get_dtype() == dtype for buf in node.get_outputs())
        for node, _ in metrics.nodes_num_elem
        if not node.is_extern()
    )


@pytest.mark.parametrize("plain", [False, True], ids=["parameter", "plain"])
def test_compiled_middle_layer_reads_x_w_and_dy_once(plain, monkeypatch):
    # A middle layer (x needs its gradient) at steady state on the scaled_mm path: the compiled
    # step (forward and backward graphs) reads the bf16 weight in one kernel, which also writes
    # both float8 layouts and takes the amax, whether the weight is the module's Parameter
    # (which the partitioner would rather re-read in the backward than save the float8 copy)
    # or a plain tensor; x in one kernel (its cast and amax; grad_weight's transposed copy
    # loads the float8 bytes, `_stored`: 2 kernels read x without it); the output gradient dY
    # in one kernel, which writes both its e5m2 layouts and takes its amax by rows
    # (`_both_layouts`: 2 kernels read dY and 2 write e5m2 without it); the step is eager's,
    # bit for bit (output gradient, weight gradient, observations).
    from torch._inductor import metrics

    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)  # count compiles
    torch._logging.set_logs(inductor_metrics=True)  # inductor counts reads per kernel
    try:
        torch.manual_seed(0)
        model = nn.Linear(48, 80, bias=False).to(torch.bfloat16)  # weight 3840 elements
        x = torch.randn(32, 48, dtype=torch.bfloat16)  # 1536; output 2560
        recipe = fp8fn.DelayedScaling(backend="scaled_mm")
        fn = fp8fn.transform(model, recipe)
        state = fn.init(x)
        params = dict(model.named_parameters())
        if plain:
            params = {k: v.detach().requires_grad_() for k, v in params.items()}
        observed = fp8fn.observe(state)
        fn.apply(params, observed, x).float().square().mean().backward()
        state = fp8fn.update(state, fp8fn.observations(observed))

        def step(run):
            xi = x.clone().requires_grad_()
            for p in params.values():
                p.grad = None
            observed = fp8fn.observe(state)
            run(params, observed, xi).float().square().mean().backward()
            return xi.grad, params["weight"].grad, fp8fn.observations(observed)

        eager = step(fn.apply)
        metrics.reset()
        compiled = step(torch.compile(fn.apply, fullgraph=True))
        # the weight (80, 48), x (32, 48), dY (32, 80); dY's two e5m2 layouts: one kernel
        assert [_kernels_reading_input(n) for n in (80 * 48, 32 * 48, 32 * 80)] == [1, 1, 1]
        assert _kernels_writing(torch.float8_e5m2) == 1
    finally:
        torch._logging.set_logs()
    assert_bit_identical(compiled, eager)


def test_compiled_hidden_layer_reads_its_output_gradient_once(monkeypatch):
    # A hidden layer (Linear, ReLU, Linear) at steady state on the scaled_mm path: one kernel
    # reads what the layer's output gradient dY is made of (the next layer's grad_input and the
    # saved output h, for the ReLU's mask), writes both e5m2 layouts of dY, takes its amax by
    # rows and recomputes the next layer's transposed float8 input from h (without
    # `_both_layouts`, 3 kernels write e5m2: the hidden dY's layouts in two). The step is
    # eager's, bit for bit.
    from torch._inductor import metrics

    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    torch._logging.set_logs(inductor_metrics=True)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(48, 80, bias=False), nn.ReLU(), nn.Linear(80, 16))
        model = model.to(torch.bfloat16)
        x = torch.randn(32, 48, dtype=torch.bfloat16)  # h: (32, 80), 2560 elements
        fn = fp8fn.transform(model, fp8fn.DelayedScaling(backend="scaled_mm"))
        params = dict(model.named_parameters())
        state = fn.init(x)
        observed = fp8fn.observe(state)
        fn.apply(params, observed, x).float().square().mean().backward()
        state = fp8fn.update(state, fp8fn.observations(observed))

        def step(run):
            for p in params.values():
                p.grad = None
            observed = fp8fn.observe(state)
            run(params, observed, x).float().square().mean().backward()
            return [p.grad for p in params.values()], fp8fn.observations(observed)

        eager = step(fn.apply)
        metrics.reset()
        compiled = step(torch.compile(fn.apply, fullgraph=True))
        # h: the kernel that makes the hidden layer's dY (ReLU mask), and the next layer's x
        # amax, which the partitioner recomputes from h as a flat loop; e5m2: a kernel a layer
        assert (_kernels_reading_input(32 * 80), _kernels_writing(torch.float8_e5m2)) == (2, 2)
    finally:
        torch._logging.set_logs()
    assert_bit_identical(compiled, eager)
