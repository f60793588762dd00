"""fp8fn against independent anchors: the naive reference in `_reference.py`, and torchao 0.18.

Most other tests compare fp8fn with fp8fn (routes, compiled vs eager, checkpoint vs not), where
a bug shared by both sides cancels out. Here every number comes from outside fp8fn:

* one linear layer (`fp8fn.linear`) over several steps, against the reference in float64: the
  output and the three gradients within the reference's rigorous elementwise bound for float32
  arithmetic (about `(k + 4) * 2**-24` of the magnitude `|a| @ |b|`, plus the output dtype's
  rounding); observations, histories and scales exactly (`torch.equal`). A wrong float8 format,
  a stale or ignored scale, a missing saturation is >= 2**-5 of the value, far beyond the
  bound. A dropped margin only moves values below float8's normal range (a power of two in the
  scale is otherwise exact): an identity weight exposes every cast element by element, where
  that shows. The same for the Triton casts (`backend="triton"`);
* whole models (`fn.apply`, 3 SGD steps) on both routes, with checkpointing and compiled,
  against the reference model in float32 arithmetic: losses, gradients, observations,
  histories and scales bit for bit (only the compiled bias gradients, whose float32 sum
  inductor reorders, are held to the summation bound);
* torchao's `Float8Linear` (tensorwise dynamic scaling) against `fp8fn.CurrentScaling`: bit
  for bit where both call `torch._scaled_mm`, within the reference's bound for torchao's
  emulation (`emulate=True` dequantizes each operand before an fp32 matmul, so its roundings
  differ from a scaled matmul's: ~2e-7 relative in float32, a rare double rounding in
  bfloat16), and the same casts bit for bit: only that GEMM arithmetic differs.
"""

from __future__ import annotations

import copy
import math
import os

import _reference as R
import pytest
import torch
import torch.nn.functional as F
from _models import MLP, Transformer
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import fp8fn
from fp8fn._ops.gemm import resolve_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HISTORY_LEN = 4


def _recipe(margin=0, amax_compute="max", history_len=HISTORY_LEN, backend="emulated"):
    return fp8fn.DelayedScaling(
        history_len=history_len, amax_compute=amax_compute, margin=margin, backend=backend
    )


def _fc_site(margin=0, amax_compute="max", backend="emulated"):
    """`(recipe, state, site)` of one call site "fc": `_recipe(...)`, fp8fn's fresh state of
    it and the reference's empty site with the same history length, amax rule and margin."""
    recipe = _recipe(margin, amax_compute, backend=backend)
    return recipe, fp8fn.init_state(recipe, ["fc"]), R.Site(HISTORY_LEN, amax_compute, margin)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


# The Triton casts (DESIGN: fused cast + amax; on CPU under TRITON_INTERPRET=1, set by the
# repository's conftest.py) against the same reference.
TRITON = pytest.mark.skipif(not _triton_available(), reason="needs triton (or its interpreter)")
BACKENDS = ["emulated", pytest.param("triton", marks=TRITON)]


def _wide(gen, shape, low=-12):
    """Gaussian values times 2**j, j uniform in [low, 0]: many magnitudes, many subnormals."""
    scale = torch.exp2(torch.randint(low, 1, shape, generator=gen).double())
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def assert_within(what, actual, value, bound):
    """`actual` within `bound` of the float64 `value`, elementwise; NaN exactly where NaN."""
    a = actual.detach().double()
    assert a.shape == value.shape, (what, a.shape, value.shape)
    nan = torch.isnan(value)
    assert torch.equal(torch.isnan(a), nan), f"{what}: NaN at different positions"
    excess = ((a - value).abs() - bound)[~nan]
    if excess.numel() and excess.max() > 0:
        i = int(excess.argmax())
        a, v, b = a[~nan][i].item(), value[~nan][i].item(), bound[~nan][i].item()
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements beyond the "
            f"reference's bound; worst: fp8fn {a!r}, reference {v!r}, bound {b!r}"
        )


def assert_site(state, name, site: R.Site):
    """fp8fn's history and scales of `name` equal the reference's, exactly."""
    got_h, got_s = state[name].amax_history, state[name].scale
    assert torch.equal(got_h, site.history()), (name, got_h, site.history())
    assert torch.equal(got_s, site.scales()), (name, got_s, site.scales())


def assert_observed(obs, name, amaxes):
    """An observation of `name`: the amaxes at history position 0 (NaN included), 0 after."""
    got = obs[name].amax_history
    want = torch.tensor(amaxes, dtype=torch.float32)
    assert torch.equal(got[:, 0].isnan(), want.isnan()), (name, got[:, 0], want)
    assert torch.equal(got[:, 0].nan_to_num(), want.nan_to_num()), (name, got[:, 0], want)
    assert not got[:, 1:].any(), (name, got)


def _fp8fn_linear_step(route, x, w, b, state, g, recipe):
    """fp8fn.linear forward and backward for output gradient `g`, on `route`.

    Returns (out, grad_x, grad_w, grad_b, obs)."""
    site = state.sites[0]
    if route == "func":

        def loss(x, w, b, s):
            y = fp8fn.linear(x, w, b, s[site], recipe)
            return (y * g).sum(), y

        grads, y = torch.func.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, b, state)
        return (y, *grads)
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    s = fp8fn.observe(state)
    y = fp8fn.linear(x, w, b, s[site], recipe)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad, fp8fn.observations(s)


def _compare_linear(what, got, ref: R.LinearResult):
    y, gx, gw, gb, obs = got
    assert_within(f"{what} output", y.reshape(ref.fwd.out.shape), ref.fwd.out, ref.fwd.out_bound)
    assert_within(
        f"{what} grad_input",
        gx.reshape(ref.bwd.grad_input.shape),
        ref.bwd.grad_input,
        ref.bwd.grad_input_bound,
    )
    assert_within(f"{what} grad_weight", gw, ref.bwd.grad_weight, ref.bwd.grad_weight_bound)
    assert_within(f"{what} grad_bias", gb, ref.bwd.grad_bias, ref.bwd.grad_bias_bound)
    assert gx.dtype == y.dtype and obs.amax_history.dtype == torch.float32
    assert_observed(obs, "fc", ref.amaxes)


# -- one linear layer, several steps ------------------------------------------------------------

# Per-step factors of the input, the weight and the output gradient: the data's range moves
# against the histories, so stored scales are stale (and saturate: x jumps 16x at step 3).
X_FACTOR, W_FACTOR, G_FACTOR = (1.0, 3.0, 0.5, 8.0), (1.0, 1.1, 1.2, 1.3), (1.0, 0.25, 4.0, 16.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(
    "margin, amax_compute", [(0, "max"), (2, "max"), (2, "most_recent")], ids=str
)
@pytest.mark.parametrize(
    "backend, route",
    [("emulated", "func"), ("emulated", "autograd"), pytest.param("triton", "func", marks=TRITON)],
)
def test_linear_matches_reference_over_steps(backend, route, margin, amax_compute, dtype):
    """Forward, three gradients, observations, histories and scales, for 4 steps from an empty
    state (step 1 casts with current scaling, margin included), with stale stored scales."""
    recipe, state, site = _fc_site(margin, amax_compute, backend)
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(40, 48, generator=gen, dtype=torch.float64) * 0.2
    b = (torch.randn(40, generator=gen) * 0.1).to(dtype)
    for step in range(4):
        x = (_wide(gen, (2, 12, 48)) * X_FACTOR[step]).to(dtype)
        w = (w0 * W_FACTOR[step]).to(dtype)
        g = (_wide(gen, (2, 12, 40)) * G_FACTOR[step] * 1e-2).to(dtype)
        got = _fp8fn_linear_step(route, x, w, b, state, g, recipe)
        ref = R.reference_linear(x, w, b, g, site)
        _compare_linear(f"step {step}", got, ref)
        state = fp8fn.update(state, got[-1])
        site.push(ref.amaxes)
        assert_site(state, "fc", site)
    assert not site["grad_output"].empty() and site["input"].history[3] > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("stepped", [False, True], ids=["step1", "delayed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_casts_are_exposed_elementwise_by_an_identity_weight(backend, stepped, margin, dtype):
    """With `weight = I`, `output` is the dequantized input cast and `grad_input` the
    dequantized output-gradient cast, element by element (one product per sum): a wrong scale,
    margin or format shows on every element, also below the normal range (where a power of
    two in the scale is not exact) and at saturation."""
    recipe, state, site = _fc_site(margin, backend=backend)
    gen = torch.Generator().manual_seed(2)
    w = torch.eye(64, dtype=dtype)
    b = torch.zeros(64, dtype=dtype)
    if stepped:  # a previous step with smaller data: the stored scales now saturate
        x, g = (_wide(gen, (32, 64), -20) * 0.6).to(dtype), (_wide(gen, (32, 64), -20)).to(dtype)
        got = _fp8fn_linear_step("autograd", x, w, b, state, g, recipe)
        state = fp8fn.update(state, got[-1])
        site.push(R.reference_linear(x, w, b, g, site).amaxes)
    x = _wide(gen, (32, 64), -20).to(dtype)
    g = (_wide(gen, (32, 64), -20) * 3.0).to(dtype)
    ref = R.reference_linear(x, w, b, g, site)
    _compare_linear("identity weight", _fp8fn_linear_step("func", x, w, b, state, g, recipe), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
def test_current_scaling_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    x, w = _wide(gen, (24, 32)).to(dtype), (torch.randn(16, 32, generator=gen)).to(dtype)
    b, g = torch.randn(16, generator=gen).to(dtype), _wide(gen, (24, 16)).to(dtype)
    xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
    y = fp8fn.linear(xs, ws, bs, None, fp8fn.CurrentScaling(backend="emulated"))
    (y * g).sum().backward()
    ref = R.reference_linear(x, w, b, g, None)
    assert_within("output", y, ref.fwd.out, ref.fwd.out_bound)
    assert_within("grad_input", xs.grad, ref.bwd.grad_input, ref.bwd.grad_input_bound)
    assert_within("grad_weight", ws.grad, ref.bwd.grad_weight, ref.bwd.grad_weight_bound)
    assert_within("grad_bias", bs.grad, ref.bwd.grad_bias, ref.bwd.grad_bias_bound)


def test_bias_gradient_is_a_float32_sum_under_autocast():
    """Under bf16 autocast the output gradient is bf16 and the bias float32: the bias gradient
    is the float32 sum (DESIGN), not a bf16 sum widened."""
    recipe = _recipe()
    state = fp8fn.init_state(recipe, ["fc"])
    gen = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(256, 32, generator=gen), torch.randn(16, 32, generator=gen), None
    b = torch.randn(16, generator=gen)
    g = torch.randn(256, 16, generator=gen).bfloat16()
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    s = fp8fn.observe(state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8fn.linear(x, w, b, s["fc"], recipe)
    assert y.dtype == torch.bfloat16
    (y * g).sum().backward()
    ref = R.reference_linear(x.detach().bfloat16(), w.detach(), b.detach(), g, R.Site(4))
    assert b.grad.dtype == torch.float32
    assert_within("grad_bias", b.grad, ref.bwd.grad_bias, ref.bwd.grad_bias_bound)
    assert_within("grad_weight", w.grad, ref.bwd.grad_weight, ref.bwd.grad_weight_bound)
    assert_observed(fp8fn.observations(s), "fc", ref.amaxes)


def test_non_finite_amaxes_are_observed_and_not_pushed():
    """An inf in the input and a NaN in the output gradient: observed as such, histories of
    those roles unchanged, and the saturating casts keep the rest finite."""
    recipe, state, site = _fc_site(margin=1)
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    for step in range(3):
        x, g = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
        if step == 1:
            x[2, 3] = math.inf
        if step == 2:
            g[4, 5] = math.nan
        got = _fp8fn_linear_step("autograd", x, w, b, state, g, recipe)
        ref = R.reference_linear(x, w, b, g, site)
        _compare_linear(f"step {step}", got, ref)
        state = fp8fn.update(state, got[-1])
        site.push(ref.amaxes)
        assert_site(state, "fc", site)
    for role in ("input", "grad_output"):  # 3 steps, one of them not pushed
        assert [a > 0 for a in site[role].history] == [True, True, False, False], role


@pytest.mark.parametrize("stepped", [False, True], ids=["empty", "stepped"])
def test_vmap_over_the_batch_is_the_whole_batch_call(stepped):
    """`vmap` over the batch inside `grad`, with one unbatched state: one amax over the whole
    batch (the reference on the flattened batch), not a sum of per-member observations."""
    recipe, state, site = _fc_site()
    gen = torch.Generator().manual_seed(6)
    w, b = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    if stepped:
        obs = [2.0, 1.5, 0.01]
        site.push(obs)
        history = torch.zeros(1, 3, HISTORY_LEN)
        history[0, :, 0] = torch.tensor(obs)
        state = fp8fn.update(state, state._replace(amax_history=history))
    x, g = _wide(gen, (4, 6, 32)).float(), _wide(gen, (4, 6, 16)).float()

    def loss(x, w, b, s):
        y = torch.vmap(lambda xi: fp8fn.linear(xi, w, b, s["fc"], recipe))(x)
        return (y * g).sum(), y

    grads, y = torch.func.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, b, state)
    _compare_linear("vmap", (y, *grads), R.reference_linear(x, w, b, g, site))


def test_microbatches_merge_by_max_over_steps():
    """Two microbatches per step, observations merged with `fp8fn.merge`: the histories are
    the reference's max over the microbatches, never a sum."""
    recipe, state, site = _fc_site(margin=1)
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    for step in range(3):
        obs, amaxes = None, None
        for micro in range(2):
            factor = 2.0 ** (micro - step)
            x, g = torch.randn(8, 32, generator=gen) * factor, torch.randn(8, 16, generator=gen)
            got = _fp8fn_linear_step("func", x, w, b, state, g, recipe)
            ref = R.reference_linear(x, w, b, g, site)
            _compare_linear(f"step {step}.{micro}", got, ref)
            obs = got[-1] if obs is None else fp8fn.merge(obs, got[-1])
            amaxes = R.merge_amaxes(amaxes, ref.amaxes)
        assert_observed(obs, "fc", amaxes)
        state = fp8fn.update(state, obs)
        site.push(amaxes)
        assert_site(state, "fc", site)


@hsettings(max_examples=40)
@given(
    st.lists(
        st.tuples(
            *[st.sampled_from([0.0, math.inf, math.nan, 1e-40, 1e-30, 1e30]) | st.floats(1e-6, 1e6)]
            * 3
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 4),
    st.sampled_from(["max", "most_recent"]),
    st.integers(0, 3),
)
def test_update_matches_reference_sequences(observations, history_len, amax_compute, margin):
    """`fp8fn.update` over any sequence of observations equals the reference's pushes."""
    recipe = _recipe(margin, amax_compute, history_len)
    state = fp8fn.init_state(recipe, ["a"])
    site = R.Site(history_len, amax_compute, margin)
    for amaxes in observations:
        amaxes = [R.to_float32(a) for a in amaxes]
        history = torch.zeros(1, 3, history_len)
        history[0, :, 0] = torch.tensor(amaxes)
        state = fp8fn.update(state, state._replace(amax_history=history))
        site.push(amaxes)
        assert_site(state, "a", site)


# -- whole models, 3 training steps -------------------------------------------------------------


def _mlp_case():
    model = MLP((16, 32, 32, 8), seed=3)

    def batch(step):
        gen = torch.Generator().manual_seed(10 + step)
        x = torch.randn(24, 16, generator=gen) * (1.0, 4.0, 0.5)[step]
        return x, torch.randn(24, 8, generator=gen)

    return model, batch, lambda out, t: (out - t).square().mean()


def _transformer_case():
    model = Transformer(vocab=32, d_model=16, n_heads=2, n_blocks=1, seq=8, seed=4)

    def batch(step):
        gen = torch.Generator().manual_seed(20 + step)
        return tuple(torch.randint(0, 32, (4, 8), generator=gen) for _ in range(2))

    return model, batch, lambda out, t: F.cross_entropy(out.reshape(-1, 32), t.reshape(-1))


CASES = {"mlp": _mlp_case, "transformer": _transformer_case}
LR, STEPS = 0.1, 3


def _fp8fn_step(apply, route, params, state, x, t, loss_of):
    """One step of fp8fn: (loss, grads, obs) on `route`."""
    if route == "func":
        f = lambda p, s: loss_of(apply(p, s, x), t)  # noqa: E731
        (grads, obs), loss = torch.func.grad_and_value(f, argnums=(0, 1))(params, state)
        return loss, grads, obs
    if route == "value_and_grad":
        f = lambda p, s: loss_of(apply(p, s, x), t)  # noqa: E731
        loss, (grads, obs) = fp8fn.value_and_grad(f, argnums=(0, 1))(params, state)
        return loss, grads, obs
    p = {k: v.detach().requires_grad_() for k, v in params.items()}
    s = fp8fn.observe(state)
    loss = loss_of(apply(p, s, x), t)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in p.items()}, fp8fn.observations(s)


def _reference_step(ref: R.ReferenceModel, params, x, t, loss_of):
    p = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = loss_of(ref(p, x), t)
    grads = dict(zip(p, torch.autograd.grad(loss, list(p.values()))))
    return loss.detach(), grads, ref.update()


def _checkpoint_fn(case):
    if case == "mlp":
        return lambda name, module: name.startswith("layers.")
    return lambda name, module: name.startswith("blocks.") and name.count(".") == 1


@pytest.mark.parametrize(
    "case, route, margin, amax_compute, checkpoint",
    [
        ("mlp", "func", 0, "max", False),
        ("mlp", "autograd", 2, "most_recent", False),
        ("mlp", "value_and_grad", 2, "max", True),
        ("transformer", "func", 2, "max", True),
        ("transformer", "autograd", 0, "most_recent", False),
    ],
)
def test_training_matches_reference_model(case, route, margin, amax_compute, checkpoint):
    """3 SGD steps of `fn.apply` and of the reference model from the same parameters: losses,
    gradients, observations, histories and scales bit for bit (the reference does float32
    arithmetic like DESIGN's emulated backend; see `_reference.py`)."""
    model, batch, loss_of = CASES[case]()
    recipe = _recipe(margin, amax_compute)
    fn = fp8fn.transform(model, recipe, checkpoint_fn=_checkpoint_fn(case) if checkpoint else None)
    ref = R.ReferenceModel(model, HISTORY_LEN, amax_compute, margin)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ref_params = dict(params)
    state = fn.init(batch(0)[0])
    for step in range(STEPS):
        x, t = batch(step)
        loss, grads, obs = _fp8fn_step(fn.apply, route, params, state, x, t, loss_of)
        ref_loss, ref_grads, ref_obs = _reference_step(ref, ref_params, x, t, loss_of)
        assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
        for k in ref_grads:
            assert torch.equal(grads[k], ref_grads[k]), (step, k)
        assert list(state.sites) == list(ref.sites)
        for name in state.sites:
            assert_observed(obs, name, ref_obs[name])
        state = fp8fn.update(state, obs)
        for name, site in ref.sites.items():
            assert_site(state, name, site)
        params, ref_params = R.sgd(params, grads, LR), R.sgd(ref_params, ref_grads, LR)
    assert all(not s["grad_output"].empty() for s in ref.sites.values())


@pytest.mark.slow
def test_compiled_apply_with_backward_matches_reference_model():
    """`torch.compile(fn.apply)` and `.backward()`: against the reference model, each step from
    the same parameters. Bit for bit except the bias gradients, whose float32 sum inductor
    reorders: those within the summation bound."""
    _, batch, loss_of = _mlp_case()
    model = MLP((16, 32, 8), seed=3)
    fn = fp8fn.transform(model, _recipe(margin=2))
    ref = R.ReferenceModel(model, HISTORY_LEN, "max", 2)
    apply = torch.compile(fn.apply)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fn.init(batch(0)[0])
    for step in range(STEPS):
        x, t = batch(step)
        loss, grads, obs = _fp8fn_step(apply, "autograd", params, state, x, t, loss_of)
        ref_loss, ref_grads, ref_obs = _reference_step(ref, params, x, t, loss_of)
        assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
        for k in ref_grads:
            if k.endswith(".bias"):
                bound = ref.bias_grad_bound(k.removesuffix(".bias"))
                assert ((grads[k] - ref_grads[k]).double().abs() <= bound).all(), (step, k)
            else:
                assert torch.equal(grads[k], ref_grads[k]), (step, k)
        for name in state.sites:
            assert_observed(obs, name, ref_obs[name])
        state = fp8fn.update(state, obs)
        for name, site in ref.sites.items():
            assert_site(state, name, site)
        params = R.sgd(params, grads, LR)


@pytest.mark.parametrize("route", ["func", "autograd"])
def test_one_state_in_two_applies_is_max_or_refused(route):
    """One state passed to two `apply` calls of one loss: the observation is the reference's
    max over the two calls, or fp8fn refuses; never a silent sum (DESIGN)."""
    model, _, _ = _mlp_case()
    fn = fp8fn.transform(model, _recipe())
    ref = R.ReferenceModel(model, HISTORY_LEN)
    gen = torch.Generator().manual_seed(30)
    x1, x2 = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen) * 3
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fn.init(x1)

    def loss(p, s):
        return fn.apply(p, s, x1).square().mean() + fn.apply(p, s, x2).square().mean()

    try:
        if route == "func":
            obs = torch.func.grad(loss, argnums=1)(params, state)
        else:
            s = fp8fn.observe(state)
            loss(params, s).backward()
            obs = fp8fn.observations(s)
    except RuntimeError as e:
        assert "already" in str(e)
        return
    p = {k: v.detach().requires_grad_() for k, v in params.items()}
    (ref(p, x1).square().mean() + ref(p, x2).square().mean()).backward()
    for name, amaxes in ref.update().items():
        assert_observed(obs, name, amaxes)


# -- torchao 0.18 and backends ------------------------------------------------------------------


def _torchao_linear(linear, emulate):
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=emulate)  # tensorwise dynamic scaling
    model = convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(linear)), config=config)
    assert type(model[0]).__name__ == "Float8Linear"
    return model


def _torchao_case(dtype):
    """`(x (32, 64), linear 64 -> 48, g (32, 48))` in `dtype`, the same on every call."""
    gen = torch.Generator().manual_seed(40)
    linear = torch.nn.Linear(64, 48).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    x = _wide(gen, (32, 64)).to(dtype)
    g = torch.randn(32, 48, generator=gen).to(dtype)
    return x, linear, g


def _run_both(dtype, emulate, backend):
    x, linear, g = _torchao_case(dtype)
    model = _torchao_linear(linear, emulate)
    xa = x.clone().requires_grad_()
    ya = model(xa)
    ya.backward(g)
    theirs = (ya.detach(), xa.grad, model[0].weight.grad, model[0].bias.grad)
    xs, w, b = (t.detach().clone().requires_grad_() for t in (x, linear.weight, linear.bias))
    y = fp8fn.linear(xs, w, b, None, fp8fn.CurrentScaling(backend=backend))
    y.backward(g)
    ours = (y.detach(), xs.grad, w.grad, b.grad)
    return ours, theirs, R.reference_linear(x, w.detach(), b.detach(), g, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_current_scaling_scaled_mm_is_torchao_bit_for_bit(dtype):
    """torchao's Float8Linear calling `torch._scaled_mm` (emulate=False, CPU kernel) and
    `fp8fn.CurrentScaling(backend="scaled_mm")`: output and three gradients identical."""
    ours, theirs, _ = _run_both(dtype, emulate=False, backend="scaled_mm")
    for name, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", ["scaled_mm", "emulated"])
def test_torchao_emulation_and_fp8fn_within_the_reference_bound(backend, dtype):
    """torchao's `emulate=True` (dequantize each operand, then an fp32 matmul) and fp8fn both lie
    within the reference's float32 bound; in float32 within 1e-6 of each other, relative to the
    output's magnitude (measured: ~2e-7)."""
    ours, theirs, ref = _run_both(dtype, emulate=True, backend=backend)
    values = (ref.fwd.out, ref.bwd.grad_input, ref.bwd.grad_weight, ref.bwd.grad_bias)
    bounds = (ref.fwd.out_bound, ref.bwd.grad_input_bound, ref.bwd.grad_weight_bound)
    bounds += (ref.bwd.grad_bias_bound,)
    for name, a, b, v, bound in zip(("out", "gi", "gw", "gb"), ours, theirs, values, bounds):
        assert_within(f"fp8fn {name}", a, v, bound)
        assert_within(f"torchao {name}", b, v, bound)
        if dtype == torch.float32:
            assert ((a - b).abs() <= 1e-6 * v.abs().max()).all(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torchao_emulation_is_fp8fn_casts_dequantized_before_the_matmul(dtype):
    """torchao's `emulate=True` is CurrentScaling's casts (e4m3 `x` and weight, e5m2 output
    gradient, the same float32 scales) bit for bit, multiplied as `mm(a_fp8.float() / a_scale,
    b_fp8.float() / b_scale)`: each operand divided by its scale and rounded to float32 before
    the matmul. fp8fn's emulated backend multiplies the float8 values and scales the sums,
    `(a_fp8 @ b_fp8.T) * (1 / a_scale * 1 / b_scale)` (`_matmul`'s contract, torch._scaled_mm's
    arithmetic): the three GEMMs differ in float32's last bits (the scales are not powers of
    two), the bias gradient does not; in bfloat16 both round to the same values but for a rare
    double rounding (not bit-identical either)."""
    from fp8fn._numerics.fp8 import amax, cast_to_fp8, scale_from_amax

    def cast(t, fp8_dtype):
        scale = scale_from_amax(amax(t), torch.finfo(fp8_dtype).max, 0)
        return cast_to_fp8(t, scale, fp8_dtype).float(), scale

    def torchao_mm(a, b):
        (a_fp8, a_scale), (b_fp8, b_scale) = a, b
        return torch.mm(a_fp8 / a_scale, b_fp8 / b_scale).to(dtype)

    def fp8fn_mm(a, b):
        (a_fp8, a_scale), (b_fp8, b_scale) = a, b
        return (torch.mm(a_fp8, b_fp8) * (a_scale.reciprocal() * b_scale.reciprocal())).to(dtype)

    x, linear, g = _torchao_case(dtype)
    w, b = linear.weight.detach(), linear.bias.detach()
    xc, wc = cast(x, torch.float8_e4m3fn), cast(w, torch.float8_e4m3fn)
    gc = cast(g, torch.float8_e5m2)
    xt, wt, gt = ((t.t(), s) for t, s in (xc, wc, gc))
    ours, theirs, _ = _run_both(dtype, emulate=True, backend="emulated")
    for mm, results in ((torchao_mm, theirs), (fp8fn_mm, ours)):
        out, grad_input, grad_weight, grad_bias = results
        assert torch.equal(out, mm(xc, wt) + b)
        assert torch.equal(grad_input, mm(gc, wc))
        assert torch.equal(grad_weight, mm(gt, xc))
        assert torch.equal(grad_bias, g.float().sum(0).to(dtype))
    differ = [int((o != t).sum()) for o, t in zip(ours[:3], theirs[:3])]
    if dtype == torch.float32:  # measured: 1071 / 1536, 1615 / 2048, 2463 / 3072
        assert all(n > 0 for n in differ)
    else:  # measured: 0, 0, 2 / 3072 (grad_weight: 1 ulp at 0.39, 11 ulps at 2e-7, a cancellation)
        assert all(n <= o.numel() // 100 for n, o in zip(differ, ours))


@pytest.mark.parametrize(
    "capability, want", [((8, 9), "scaled_mm"), ((9, 0), "scaled_mm"), ((8, 6), "emulated")]
)
def test_auto_backend_follows_the_device_capability(monkeypatch, capability, want):
    asked = []

    def fake_capability(device=None):
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", fake_capability)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for per_tensor in (fp8fn.DelayedScaling, fp8fn.CurrentScaling):
        assert resolve_backend(per_tensor(), cuda) == want
        assert asked, "the capability was not consulted"
        assert resolve_backend(per_tensor(), cpu) == "emulated"
        for explicit in ("emulated", "scaled_mm", "triton"):
            assert resolve_backend(per_tensor(backend=explicit), cpu) == explicit
            if want == "emulated" and explicit != "emulated":  # no float8 GEMM below sm_89
                match = rf"{per_tensor.__name__}\(backend='{explicit}'\).*got cuda:0 \(sm_86\)"
                with pytest.raises(ValueError, match=match):
                    resolve_backend(per_tensor(backend=explicit), cuda)
            else:
                assert resolve_backend(per_tensor(backend=explicit), cuda) == explicit
    # The finer recipes: emulated until their GEMMs have run on a GPU.
    for finer in (fp8fn.RowwiseScaling(), fp8fn.BlockwiseScaling(), fp8fn.MXScaling()):
        assert resolve_backend(finer, cuda) == resolve_backend(finer, cpu) == "emulated"
    rowwise = fp8fn.RowwiseScaling(backend="scaled_mm")
    assert resolve_backend(rowwise, cpu) == "scaled_mm"  # the CPU's slow reference kernel
    if want == "scaled_mm":
        assert resolve_backend(rowwise, cuda) == "scaled_mm"
    else:
        with pytest.raises(ValueError, match="compute capability >= 8.9 .* got cuda:0"):
            resolve_backend(rowwise, cuda)


def test_hypothesis_profile_follows_ci():
    """conftest.py: the `ci` profile (derandomized, repeatable) exactly when `CI` is set."""
    from hypothesis import settings

    if os.environ.get("HYPOTHESIS_PROFILE"):
        pytest.skip("profile chosen explicitly")
    if os.environ.get("CI"):
        assert settings.default.derandomize and settings.default.print_blob
        assert settings.default.deadline is None
    else:
        assert not settings.default.derandomize
