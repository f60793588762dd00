"""NVFP4Scaling: the op against a float64 reference built from the quantizers, SQNR, the
unbiasedness of stochastic rounding, and randomness as data (the key in the state)."""

from __future__ import annotations

import dataclasses
import io
import re

import optree
import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_bit_identical, bits, loss_of, mlp_run, outlier_mlp_case, sqnr
from _models import MLP
from torch.utils import _pytree as pytree

import fp8fn
from fp8fn import NVFP4Scaling
from fp8fn._core import keys as fp8keys
from fp8fn._numerics import nvfp4 as nv

ALL_ON = NVFP4Scaling()
FLAGS = [
    NVFP4Scaling(),
    NVFP4Scaling(stochastic_rounding=False),
    NVFP4Scaling(hadamard=False),
    NVFP4Scaling(weight_2d=False),
    NVFP4Scaling(stochastic_rounding=False, hadamard=False, weight_2d=False),
]
FLAG_IDS = ["all", "no_sr", "no_rht", "no_2d", "none"]
U32 = 2.0**-24  # float32 unit roundoff


def _key(value: int) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float64)


def _data(m=37, k=40, n=24, seed=0, dtype=torch.float32):
    """x `(m, k)` with a few outlier channels, weight `(n, k)`, bias `(n,)`, gradient `(m, n)`;
    sizes not multiples of 16 (partial blocks, tiles and Hadamard blocks)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.randn(m, 1, generator=gen).exp()
    x[:, :3] *= 10
    w = torch.randn(n, k, generator=gen) * 0.2
    b = torch.randn(n, generator=gen)
    g = torch.randn(m, n, generator=gen) * torch.randn(m, 1, generator=gen).exp()
    return x.to(dtype), w.to(dtype), b.to(dtype), g.to(dtype)


def _run(x, w, b, g, site_state, recipe):
    """`(out, grad_x, grad_w, grad_b)` of `fp8fn.linear` with output gradient `g`."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    out = fp8fn.linear(x, w, b, site_state, recipe)
    out.backward(g)
    return out.detach(), x.grad, w.grad, None if b is None else b.grad


# -- the float64 reference ------------------------------------------------------------------------


def _q(hp, **kwargs):
    """`hp` quantized (`quantize_nvfp4`) and dequantized, float32: the operand a GEMM sees."""
    return nv.dequantize_nvfp4(*nv.quantize_nvfp4(hp, **kwargs))


def _reference_operands(x, w, g, key, site, recipe, rank=0):
    """The dequantized operands of the three GEMMs, built from the quantizers alone, as the
    recipe documents them: pairs `(a, b)` with the GEMM `a @ b.T`."""
    site = fp8keys.site_id(site)
    sr = recipe.stochastic_rounding
    x, w, g = x.float(), w.float(), g.float()
    w_tiles = _q(w, tile_2d=True)
    output = (_q(x), w_tiles if recipe.weight_2d else _q(w))
    g_bits = nv.random_bits(key, site, 2, g.shape, stream=2 * rank) if sr else None
    w_n = w_tiles.t() if recipe.weight_2d else _q(w.t())  # (k, n), along n
    grad_input = (_q(g, sr_bits=g_bits), w_n)
    g_t, x_t = g.t(), x.t()
    if recipe.hadamard:
        signs = nv.hadamard_signs(key, site, 3)
        g_t, x_t = nv.random_hadamard(g_t, signs), nv.random_hadamard(x_t, signs)
    gt_bits = nv.random_bits(key, site, 3, g_t.shape, stream=2 * rank) if sr else None
    grad_weight = (_q(g_t, sr_bits=gt_bits), _q(x_t))
    return output, grad_input, grad_weight


def _assert_gemm(got, a, b):
    """`got` (float32) is `a @ b.T` computed in float64 up to float32 matmul rounding: the
    classic bound `|err| <= K u (|a| @ |b|.T)`, K the contraction length, plus float32's cast."""
    a, b = a.double(), b.double()
    exact = a @ b.t()
    bound = a.shape[1] * U32 * (a.abs() @ b.abs().t()) + U32 * exact.abs()
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), (err - bound).max()
    return exact


@pytest.mark.parametrize("recipe", FLAGS, ids=FLAG_IDS)
def test_op_matches_float64_reference(recipe):
    x, w, b, g = _data()
    key = _key(123456789)
    out, grad_x, grad_w, grad_b = _run(x, w, b, g, (key, "blocks.0.fc1"), recipe)
    ref = _reference_operands(x, w, g, key.long(), "blocks.0.fc1", recipe)
    (xo, wo), (gi, wi), (gw, xw) = ref
    exact = _assert_gemm(out - b, xo, wo)
    assert not torch.equal(exact.float(), (x @ w.t()).float())  # it did quantize
    _assert_gemm(grad_x, gi, wi)
    _assert_gemm(grad_w, gw, xw)
    assert torch.equal(grad_b, g.sum(0))  # high precision
    # The op's float32 GEMMs are these very products: bit for bit.
    assert torch.equal(bits(out), bits(xo @ wo.t() + b.float()))
    assert torch.equal(bits(grad_x), bits(gi @ wi.t()))
    assert torch.equal(bits(grad_w), bits(gw @ xw.t()))


def test_op_bfloat16_operands_and_leading_dims():
    x, w, b, g = _data(dtype=torch.bfloat16)
    key = _key(7)
    x3, g3 = x.reshape(1, 37, 40), g.reshape(1, 37, 24)
    out, grad_x, grad_w, grad_b = _run(x3, w, b, g3, (key, "fc"), ALL_ON)
    assert out.shape == (1, 37, 24) and out.dtype == torch.bfloat16
    assert grad_x.dtype == grad_w.dtype == grad_b.dtype == torch.bfloat16
    (xo, wo), (gi, wi), (gw, xw) = _reference_operands(x, w, g, key.long(), "fc", ALL_ON)
    assert torch.equal(out[0], (xo @ wo.t() + b.float()).bfloat16())
    assert torch.equal(grad_x[0], (gi @ wi.t()).bfloat16())
    assert torch.equal(grad_w, (gw @ xw.t()).bfloat16())


def test_bias_gradient_in_bfloat16_is_the_float32_sum_rounded_once():
    # The bias gradient is high precision: the output gradient (not its NVFP4 quantization, as
    # a fused bias-gradient kernel would take it) summed over the rows in float32 and rounded
    # to bfloat16 once: within bfloat16's rounding of the float64 sum.
    x, w, b, g = _data(dtype=torch.bfloat16)
    grad_b = _run(x, w, b, g, (_key(7), "fc"), ALL_ON)[3]
    assert grad_b.dtype == torch.bfloat16
    assert torch.equal(grad_b, g.float().sum(0).bfloat16())
    exact = g.double().sum(0)  # bfloat16's rounding, plus float32's summation error
    bound = 2**-8 * exact.abs() + g.shape[0] * 2**-24 * g.double().abs().sum(0)
    assert bool(((grad_b.double() - exact).abs() <= bound).all())


def test_weight_2d_forward_and_grad_input_see_one_quantized_weight():
    # With one-hot inputs and gradients (quantized exactly), the output's columns are the
    # weight the forward used and grad_input's rows the weight the backward used.
    _, w, _, _ = _data(k=40, n=24)
    for recipe, same in ((ALL_ON, True), (NVFP4Scaling(weight_2d=False), False)):
        x, g = torch.eye(40), torch.eye(24)
        forward = fp8fn.linear(x, w, None, (_key(0), "fc"), recipe).t()  # (n, k)
        wr = w.detach().clone().requires_grad_()
        fp8fn.linear(torch.zeros(24, 40), wr, None, (_key(0), "fc"), recipe)
        x_in = torch.zeros(24, 40, requires_grad=True)
        fp8fn.linear(x_in, w, None, (_key(0), "fc"), recipe).backward(g)
        backward = x_in.grad  # (n, k): row j is the weight's row j as grad_input saw it
        assert torch.equal(forward, backward) == same
        assert torch.equal(forward, _q(w, tile_2d=recipe.weight_2d))


def test_op_saves_quantized_operands_not_high_precision():
    x, w, b, _ = _data(m=64, k=48, n=32)
    x, w = x.requires_grad_(), w.requires_grad_()
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fp8fn.linear(x, w, b, (_key(1), "fc"), ALL_ON)
    assert (torch.float32, (64, 48)) not in saved and (torch.float32, (32, 48)) not in saved
    # weight tiles (32, 48) packed two codes a byte, x.T (48, 64) along the tokens, with their
    # e4m3 block scales and float32 tensor scales; the key; and the `()` anchor that tells the
    # backward whether an outer differentiation records it.
    assert sorted(saved, key=str) == sorted(
        [
            (torch.uint8, (32, 24)),
            (torch.float8_e4m3fn, (32, 3)),
            (torch.float32, ()),
            (torch.uint8, (48, 32)),
            (torch.float8_e4m3fn, (48, 4)),
            (torch.float32, ()),
            (torch.int64, ()),
            (torch.float32, ()),
        ],
        key=str,
    )


# -- SQNR -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sqnr_mlp_with_outlier_channels(capsys):
    # The MLP and data of test_finer's SQNR table (outlier channels, tokens of different
    # magnitudes).
    model, x, g = outlier_mlp_case()
    ref_out, ref_grads = mlp_run(model, x, g, lambda i, h, w, b: F.linear(h, w, b))
    key = fp8fn.transform(model, ALL_ON).init(x).key
    rows = {}
    for recipe, name in zip(FLAGS, FLAG_IDS):
        out, grads = mlp_run(
            model, x, g, lambda i, h, w, b: fp8fn.linear(h, w, b, (key, f"layers.{i}"), recipe)
        )
        rows[name] = [sqnr(ref_out, out)] + [sqnr(r, o) for r, o in zip(ref_grads, grads)]
    with capsys.disabled():
        print("\nNVFP4 SQNR dB vs float32: output, grad_weight layer 0, layer 1")
        for name, row in rows.items():
            print(f"  {name:6s}" + "  ".join(f"{v:6.2f}" for v in row))
    # E2M1 has one mantissa bit to e4m3's three: ~12 dB below MXFP8's 25.9 / 14.9 / 25.1 here
    # (layer 0's gradient also carries layer 1's NVFP4 grad_input).
    for row in rows.values():
        assert row[0] >= 13.5 and row[1] >= 7.5 and row[2] >= 11
    # Stochastic rounding trades error for unbiasedness: its gradients are noisier.
    assert rows["no_sr"][1] > rows["all"][1] and rows["no_sr"][2] > rows["all"][2]
    assert rows["all"][0] == rows["no_sr"][0]  # the forward rounds to nearest either way


# -- unbiasedness of stochastic rounding ----------------------------------------------------------


def _sr_expectation_and_variance(hp, **kwargs):
    """E and Var of `dequantize(quantize(hp, sr_bits=uniform))` per element, exactly.

    The scales do not depend on the bits: the data `hp * encode`, clamped to +-6, rounds up
    to the next E2M1 value with probability equal to its fraction of the step, so its mean is
    the clamped value itself (the unrounded value) and its variance `step**2 f (1 - f)`.
    """
    q = nv.quantize_nvfp4(hp, **kwargs)
    lo = nv.dequantize_nvfp4(nv.round_to_e2m1(_scaled(hp, q), torch.zeros_like(hp).long()), *q[1:])
    hi_codes = nv.round_to_e2m1(_scaled(hp, q), torch.full_like(hp, 2**32 - 1).long())
    hi = nv.dequantize_nvfp4(hi_codes, *q[1:])
    scaled = _scaled(hp, q)
    decode = (q.tensor_scale * q.block_scale.float()).repeat_interleave(16, -1)[..., : hp.shape[-1]]
    mean = scaled.double() * decode.double()
    f = torch.where(hi != lo, (mean - lo.double()) / (hi - lo).double(), 0.0)
    var = (hi - lo).double() ** 2 * f * (1 - f)
    return mean, var


def _scaled(hp, q):
    """`hp * encode`, clamped to +-6: the data before E2M1 rounding (as `quantize_nvfp4`)."""
    encode = (1.0 / q.tensor_scale) / q.block_scale.float()
    encode = encode.repeat_interleave(16, -1)[..., : hp.shape[-1]]
    return (hp.float() * encode).clamp(-6.0, 6.0)


def test_sr_reference_expectation_is_exact_for_round_up_and_down():
    # The helper's premise: all-zero bits round up (r < frac), all-ones round down.
    hp = torch.tensor([[0.3, -1.3, 2.5, 5.1, 6.0] + [0.0] * 11])  # block scale 1
    mean, var = _sr_expectation_and_variance(hp, tensor_scale=torch.tensor(1.0))
    assert mean[0, :4].tolist() == pytest.approx([0.3, -1.3, 2.5, 5.1], rel=1e-6)
    assert var[0, :4].tolist() == pytest.approx(
        [0.25 * 0.6 * 0.4, 0.25 * 0.6 * 0.4, 1 * 0.5 * 0.5, 4 * 0.55 * 0.45], rel=1e-5
    )


def _draws(x, w, g, keys, recipe, site="fc"):
    """`(grad_x, grad_w)` for each key of `keys` (`(K,)` float64), by vmap over the key."""

    def draw(key):
        _, vjp = torch.func.vjp(lambda x, w: fp8fn.linear(x, w, None, (key, site), recipe), x, w)
        return vjp(g)

    return torch.func.vmap(draw)(keys)


def test_vmap_over_keys_equals_one_key_at_a_time():
    x, w, _, g = _data(m=32, k=24, n=16, seed=3)
    keys = torch.tensor([5.0, 6.0, 2.0**52 - 1], dtype=torch.float64)
    grad_x, grad_w = _draws(x, w, g, keys, ALL_ON)
    for i, key in enumerate(keys):
        _, want_x, want_w, _ = _run(x, w, None, g, (key, "fc"), ALL_ON)
        assert torch.equal(grad_x[i], want_x) and torch.equal(grad_w[i], want_w)
    assert not torch.equal(grad_x[0], grad_x[1]) and not torch.equal(grad_w[0], grad_w[1])


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "rht"])
def test_sr_grad_input_and_grad_weight_are_unbiased(hadamard):
    # Over many keys, the mean of grad_input (grad_weight) converges to the product of the
    # unrounded output gradient with the (fixed, or per-key transformed) quantized other
    # operand. The bound is statistical, from the exact variance of each draw: every entry's
    # mean lies within 6 standard errors (a false alarm has probability < 1e-5 over the whole
    # test), and the standardized errors have unit mean square (they are draws, not noise of
    # the wrong size: a chi-square bound, failure probability < 1e-6).
    x, w, _, g = _data(m=32, k=24, n=16, seed=3)
    recipe = NVFP4Scaling(hadamard=hadamard)
    n_keys = 400
    keys = torch.arange(n_keys, dtype=torch.float64) + 1000
    grad_x, grad_w = _draws(x, w, g, keys, recipe)
    # grad_input: E[Q(g)] @ w and Var(Q(g)) @ w**2 (independent roundings), w (n, k) the
    # weight's tiles, the same for every key.
    w_n = _q(w, tile_2d=True).double()
    mean, var = _sr_expectation_and_variance(g)
    gi_mean, gi_se = mean @ w_n, (var @ w_n**2 / n_keys).sqrt()
    gi_z = (grad_x.double().mean(0) - gi_mean) / gi_se

    # grad_weight: the per-key signs transform both operands; given them, x's rounding is
    # fixed and grad_weight's mean is E[Q(g.T H)] @ Q(x.T H).T.
    def conditional(key):
        g_t, x_t = g.t(), x.t()
        if hadamard:
            signs = nv.hadamard_signs(key.long(), fp8keys.site_id("fc"), 3)
            g_t, x_t = nv.random_hadamard(g_t, signs), nv.random_hadamard(x_t, signs)
        mean, var = _sr_expectation_and_variance(g_t)
        xq = _q(x_t).double()
        return mean @ xq.t(), var @ xq.t() ** 2

    gw_mean, gw_var = torch.func.vmap(conditional)(keys)
    gw_z = (grad_w.double() - gw_mean).sum(0) / gw_var.sum(0).sqrt()  # independent draws
    for z in (gi_z, gw_z):
        assert z.abs().max() < 6
        assert 0.75 < z.square().mean() < 1.3, z.square().mean()
    # Round-to-nearest is biased: its mean over any number of keys is its one value, which the
    # same bound rejects.
    _, grad_x, _, _ = _run(x, w, None, g, (_key(0), "fc"), NVFP4Scaling(stochastic_rounding=False))
    assert ((grad_x.double() - gi_mean) / gi_se).abs().max() > 6


# -- randomness as data: the key in the state -----------------------------------------------------


def _model_and_data(seed=0):
    model = MLP((32, 48, 40, 16), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 20, 32, generator=gen) * torch.randn(2, 20, 1, generator=gen).exp()
    return model, x


def _func_grads(fn, params, state, x):
    return torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)


def _autograd_grads(fn, params, state, x):
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    observed = fp8fn.observe(state)
    loss_of(fn)(params, observed, x).backward()
    return {k: v.grad for k, v in params.items()}, fp8fn.observations(observed)


def test_init_seed_sets_the_key_and_update_advances_it():
    model, x = _model_and_data()
    fn = fp8fn.transform(model, ALL_ON)
    state = fn.init(x, seed=5)
    assert len(state) == 0 and state.key.dtype == torch.float64 and state.key.shape == ()
    assert state.key.item() == fp8keys.seed_key(5) == int(nv.make_key(5)) >> 10
    assert state.key.item() < 2**52 and state.key.item() == int(state.key.item())
    assert fn.init(x, seed=5).key.item() == state.key.item()  # a fresh init: the same key
    assert fn.init(x).key.item() == fp8keys.seed_key(0) != fp8keys.seed_key(5)
    params = dict(model.named_parameters())
    _, obs = _func_grads(fn, params, state, x)
    assert obs.key.item() == 0.0 and obs.key.dtype == torch.float64  # observations carry 0
    new = fp8fn.update(state, obs)
    assert new.key.item() == state.key.item() + 1  # pure: the old state keeps its key
    assert state.key.item() == fp8keys.seed_key(5)
    assert fp8fn.update(new, obs).key.item() == state.key.item() + 2


def _with_key(state, value):
    """`state` with the key `value`, entered as a user would: through `unflatten_state`."""
    flat = {**fp8fn.flatten_state(state), "key": _key(value)}
    return fp8fn.unflatten_state(flat, ALL_ON)


def test_update_advances_the_key_modulo_2_52_so_every_step_draws_fresh_bits():
    # 0.3 added one in float64: from 2**53 on the key stopped moving and every later step drew
    # the same bits. The key now stays in [0, 2**52) by construction and cycles through it.
    model, x = _model_and_data()
    fn = fp8fn.transform(model, ALL_ON)
    params = dict(model.named_parameters())
    state = _with_key(fn.init(x), 2**52 - 2)
    _, obs = _func_grads(fn, params, state, x)
    grads, seen = [], []
    for _ in range(4):
        seen.append(state.key.item())
        grads.append(_func_grads(fn, params, state, x)[0]["layers.0.weight"])
        state = fp8fn.update(state, obs)
    assert seen == [2**52 - 2, 2**52 - 1, 0, 1]
    assert all(not torch.equal(a, b) for i, a in enumerate(grads) for b in grads[i + 1 :])


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), -float("inf"), 2.0**63, 1e300, 2.0**53, 2.0**52, 0.5, -1.0],
    ids=["nan", "inf", "-inf", "2**63", "1e300", "2**53", "2**52", "0.5", "-1"],
)
def test_a_key_that_is_not_an_integer_in_range_is_refused_wherever_it_enters(bad):
    # 0.3 accepted all of these; NaN, inf, 2**63 and 1e300 drew identical bits (the int64
    # conversion saturates), and a fraction drew the bits of its integer part.
    model, x = _model_and_data()
    fn = fp8fn.transform(model, ALL_ON)
    params = dict(model.named_parameters())
    good = fn.init(x, seed=3)
    state = good._replace(key=_key(0).fill_(bad))  # e.g. a loaded state, or a key set by hand
    refused = r" to hold integers in \[0, 2\*\*52\), got " + re.escape(repr(bad)) + r"\. Make "
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected `state\.key`" + refused):
        fn.apply(params, state, x)
    with pytest.raises(ValueError, match=r"^fp8fn\.linear: expected the key of `site_state`"):
        fp8fn.linear(_X, _W, None, (state.key, "fc"), ALL_ON)
    _, obs = _func_grads(fn, params, good, x)
    with pytest.raises(ValueError, match=r"^fp8fn\.update: expected `state\.key`" + refused):
        fp8fn.update(state, obs)
    with pytest.raises(ValueError, match=r"^fp8fn\.fold_in: expected `state\.key`" + refused):
        fp8fn.fold_in(state, 0)
    flat = fp8fn.flatten_state(state)
    with pytest.raises(ValueError, match=r"^fp8fn\.unflatten_state: expected `flat\['key'\]`"):
        fp8fn.unflatten_state(flat, ALL_ON)
    # Nothing changed by the refused calls.
    assert torch.equal(bits(state.key), bits(_key(0).fill_(bad)))
    assert torch.equal(bits(flat["key"]), bits(state.key))
    assert fp8fn.update(good, obs).key.item() == good.key.item() + 1  # the good one still works


def test_fold_in_gives_each_microbatch_its_own_bits():
    # 0.3: the microbatches of one step (and two applies of one state) rounded with the same
    # bits, so their rounding errors correlated. fold_in(state, i) derives a key per microbatch.
    model, x = _model_and_data()
    fn = fp8fn.transform(model, lambda n, m: fp8fn.DelayedScaling() if n == "layers.2" else ALL_ON)
    params = dict(model.named_parameters())
    state = fn.init(x, seed=4)
    folded = [fp8fn.fold_in(state, i) for i in (0, 1, 2**40, 2**63 - 1)]
    values = [s.key.item() for s in folded]
    assert len(set(values) | {state.key.item()}) == 5
    assert all(0 <= v < 2**52 and v == int(v) and s.key.dtype == torch.float64
               for v, s in zip(values, folded))  # fmt: skip
    assert fp8fn.fold_in(state, 1).key.item() == values[1]  # pure: the same data, the same key
    assert folded[0].static == state.static and torch.equal(folded[0].scale, state.scale)
    # Independent bits: the grad_input draws of the keys look uncorrelated, pairwise.
    n = 50_000
    draws = [nv.random_bits(s.key.long(), 7, 2, (n,)).double() / 2**32 for s in folded[:2]]
    draws.append(nv.random_bits(state.key.long(), 7, 2, (n,)).double() / 2**32)
    corr = torch.corrcoef(torch.stack(draws))
    assert (corr - torch.eye(3)).abs().max() < 5 / n**0.5
    # Two microbatches: other gradients than one state used twice, the same scales observed.
    (g0, o0), (g1, o1) = (_func_grads(fn, params, s, x) for s in folded[:2])
    assert not torch.equal(g0["layers.0.weight"], g1["layers.0.weight"])
    assert torch.equal(g0["layers.2.weight"], g1["layers.2.weight"])  # the delayed layer's
    assert_bit_identical(o0, o1)
    new = fp8fn.update(state, fp8fn.merge(o0, o1))
    assert new.key.item() == state.key.item() + 1 and fp8fn.fold_in(new, 1).key.item() not in values
    keyless = fp8fn.transform(model, fp8fn.CurrentScaling()).init(x)
    assert fp8fn.fold_in(keyless, 3) is keyless


@pytest.mark.slow
def test_fold_in_compiles_in_one_graph_and_draws_eager_bits():
    torch._dynamo.reset()
    model, x = _model_and_data()
    state = fp8fn.transform(model, ALL_ON).init(x, seed=6)
    compiled = torch.compile(lambda s, i: fp8fn.fold_in(s, i), fullgraph=True)
    for i in (0, 7, 2**40):
        assert torch.equal(bits(compiled(state, i).key), bits(fp8fn.fold_in(state, i).key))


@pytest.mark.parametrize(
    "data, error, match",
    [
        (-1, ValueError, r"`data` an int in \[0, 2\*\*63\), got -1\. Pass the microbatch's"),
        (2**63, ValueError, r"`data` an int in \[0, 2\*\*63\), got 9223372036854775808\."),
        (1.0, TypeError, r"`data` an int in \[0, 2\*\*63\), got float 1\.0\."),
        (True, TypeError, r"`data` an int in \[0, 2\*\*63\), got bool True\."),
    ],
)
def test_fold_in_errors(data, error, match):
    state = fp8fn.unflatten_state({"key": _key(5)}, ALL_ON)
    with pytest.raises(error, match=r"^fp8fn\.fold_in: expected " + match):
        fp8fn.fold_in(state, data)
    with pytest.raises(TypeError, match=r"^fp8fn\.fold_in: expected `state` to be an fp8fn\."):
        fp8fn.fold_in({"key": _key(5)}, 0)


def test_same_params_state_x_give_bit_identical_grads_on_every_route():
    # Twice, torch.func and plain autograd, fp8fn.value_and_grad, with and without
    # checkpoint_fn: the same random bits everywhere, so the same gradients bit for bit.
    model, x = _model_and_data()
    params = dict(model.named_parameters())
    fn = fp8fn.transform(model, ALL_ON)
    ckpt = fp8fn.transform(model, ALL_ON, checkpoint_fn=lambda name, m: name == "layers")
    ckpt_inner = fp8fn.transform(model, ALL_ON, checkpoint_fn=lambda name, m: name == "layers.1")
    assert ckpt.checkpointed == ["layers"] and ckpt_inner.checkpointed == ["layers.1"]
    state = fn.init(x, seed=1)
    want, obs = _func_grads(fn, params, state, x)
    assert_bit_identical(want, _func_grads(fn, params, state, x)[0])
    assert_bit_identical(want, _autograd_grads(fn, params, state, x)[0])
    _, (grads, obs_vg) = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))(params, state, x)
    assert_bit_identical(want, grads)
    for transformed in (ckpt, ckpt_inner):
        assert_bit_identical(want, _func_grads(transformed, params, state, x)[0])
        assert_bit_identical(want, _autograd_grads(transformed, params, state, x)[0])
    for o in (obs, obs_vg, _autograd_grads(ckpt, params, state, x)[1]):
        assert o.key.item() == 0.0


def test_fresh_transform_and_init_reproduce_step_one_and_the_next_state_rounds_differently():
    model, x = _model_and_data()
    params = dict(model.named_parameters())
    fn = fp8fn.transform(model, ALL_ON)
    state = fn.init(x, seed=3)
    step1, obs = _func_grads(fn, params, state, x)
    fresh = fp8fn.transform(MLP((32, 48, 40, 16), seed=0), ALL_ON)
    assert_bit_identical(step1, _func_grads(fresh, params, fresh.init(x, seed=3), x)[0])
    step2, _ = _func_grads(fn, params, fp8fn.update(state, obs), x)
    other_seed, _ = _func_grads(fn, params, fn.init(x, seed=4), x)
    # The last layer's weight gradient draws bits too (grad_weight SR); its bias gradient is
    # high precision and its output gradient is not rounded: equal.
    for name in ("layers.0.weight", "layers.1.weight", "layers.2.weight", "layers.0.bias"):
        assert not torch.equal(step1[name], step2[name]), name
        assert not torch.equal(step1[name], other_seed[name]), name
    assert torch.equal(step1["layers.2.bias"], step2["layers.2.bias"])
    # Without randomness the key does not matter.
    plain = fp8fn.transform(model, NVFP4Scaling(stochastic_rounding=False, hadamard=False))
    s = plain.init(x)
    a, o = _func_grads(plain, params, s, x)
    assert_bit_identical(a, _func_grads(plain, params, fp8fn.update(s, o), x)[0])


def test_transform_sites_draw_what_linear_draws_with_the_site_name():
    # fp8fn.linear with (state.key, site) is the transform's call of that site, bit for bit;
    # a layer called twice draws other bits on its second call (site "layers.0#1").
    model = MLP((32, 32), seed=0)
    x = torch.randn(24, 32)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(self.inner(x))

    fn = fp8fn.transform(Twice(), ALL_ON)
    state = fn.init(x, seed=9)
    params = dict(fn.module.named_parameters())
    grads, _ = _func_grads(fn, params, state, x)
    w, b = params["inner.layers.0.weight"], params["inner.layers.0.bias"]

    def by_hand(w, b, sites):
        h = x
        for site in sites:
            h = fp8fn.linear(h, w, b, (state.key, site), ALL_ON)
        return h.square().mean()

    want = torch.func.grad(by_hand, argnums=(0, 1))(w, b, ["inner.layers.0", "inner.layers.0#1"])
    assert torch.equal(grads["inner.layers.0.weight"], want[0])
    assert torch.equal(grads["inner.layers.0.bias"], want[1])
    swapped = torch.func.grad(by_hand)(w, b, ["inner.layers.0#1", "inner.layers.0"])
    assert not torch.equal(swapped, want[0])


def test_site_ids_are_stable_and_distinct():
    # FNV-1a of the name: fixed values (the same in every process and run).
    assert fp8keys.site_id("") == 0x811C9DC5
    assert fp8keys.site_id("a") == 0xE40C292C
    assert fp8keys.site_id("blocks.0.attn.qkv") == fp8keys.site_id("blocks.0.attn.qkv")
    names = [f"blocks.{i}.{m}" for i in range(64) for m in ("qkv", "proj", "fc1", "fc2")]
    names += [f"{n}#{k}" for n in names[:8] for k in range(1, 4)]
    assert len({fp8keys.site_id(n) for n in names}) == len(names)
    # Continued from a prefix's id (int or int64 tensor): the whole name's (`fn.apply`'s k-th
    # call of an NVFP4 layer, `path#k`, from its first site's id).
    for start in (fp8keys.site_id("fc"), torch.tensor(fp8keys.site_id("fc"))):
        for k in (1, 2, 13):
            assert int(fp8keys.site_id(f"#{k}", start)) == fp8keys.site_id(f"fc#{k}")


def test_ranks_fold_into_rounding_bits_but_share_hadamard_signs(monkeypatch):
    # Data-parallel ranks round their own gradients independently (rank r draws stream 2r);
    # the Hadamard signs are one per site and key on every rank. Rank 0 is a single process.
    x, w, b, g = _data()
    key = _key(11)
    single = _run(x, w, b, g, (key, "fc"), ALL_ON)
    monkeypatch.setattr(fp8keys, "process_rank", lambda: 0)
    assert_bit_identical(single, _run(x, w, b, g, (key, "fc"), ALL_ON))
    monkeypatch.setattr(fp8keys, "process_rank", lambda: 1)
    rank1 = _run(x, w, b, g, (key, "fc"), ALL_ON)
    assert torch.equal(rank1[0], single[0])  # the forward draws nothing
    assert not torch.equal(rank1[1], single[1]) and not torch.equal(rank1[2], single[2])
    ref = _reference_operands(x, w, g, key.long(), "fc", ALL_ON, rank=1)
    assert torch.equal(rank1[1], ref[1][0] @ ref[1][1].t())
    assert torch.equal(rank1[2], ref[2][0] @ ref[2][1].t())
    rht_only = NVFP4Scaling(stochastic_rounding=False)
    monkeypatch.setattr(fp8keys, "process_rank", lambda: 0)
    rank0 = _run(x, w, b, g, (key, "fc"), rht_only)
    monkeypatch.setattr(fp8keys, "process_rank", lambda: 1)
    assert_bit_identical(rank0, _run(x, w, b, g, (key, "fc"), rht_only))


# -- the key as a state leaf ----------------------------------------------------------------------


def test_key_is_a_third_leaf_only_when_present_in_both_pytree_libraries():
    model, x = _model_and_data()
    keyless = fp8fn.transform(model, fp8fn.DelayedScaling()).init(x)
    keyed = fp8fn.transform(model, ALL_ON).init(x)
    assert keyless.key is None
    for state, n in ((keyless, 2), (keyed, 3)):
        assert len(pytree.tree_leaves(state)) == n
        assert len(optree.tree_leaves(state, namespace="fp8fn")) == n
        leaves, spec = pytree.tree_flatten(state)
        back = pytree.tree_unflatten(leaves, spec)
        assert (back.key is None) == (state.key is None) and back.static == state.static
        leaves, spec = optree.tree_flatten(state, namespace="fp8fn")
        assert optree.tree_unflatten(spec, leaves).key is state.key
    assert pytree.tree_structure(keyless) != pytree.tree_structure(keyless._replace(key=_key(1)))
    # torch.func.grad over a keyless state: still exactly two leaves, no key.
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    _, obs = _func_grads(fn, dict(model.named_parameters()), keyless, x)
    assert obs.key is None


def test_state_with_key_saves_loads_flattens_and_moves():
    model = MLP((32, 48, 16), seed=0)
    x = torch.randn(8, 32)
    fn = fp8fn.transform(model, lambda n, m: ALL_ON if n == "layers.0" else fp8fn.DelayedScaling())
    state = fn.init(x, seed=2)
    assert list(state) == ["layers.1"] and state.key.item() == fp8keys.seed_key(2)
    assert repr(state).endswith("margin=0, key=())")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_bit_identical(loaded, state)
    flat = fp8fn.flatten_state(state)
    assert list(flat)[-1] == "key" and flat["key"].dtype == torch.float64
    assert_bit_identical(fp8fn.unflatten_state(flat, fp8fn.DelayedScaling()), state)
    only_key = fp8fn.transform(model, ALL_ON).init(x, seed=2)
    assert fp8fn.flatten_state(only_key) == {"key": only_key.key}
    empty = fp8fn.DelayedScaling(history_len=1)  # fn.init's empty state has history 1
    assert_bit_identical(fp8fn.unflatten_state({"key": only_key.key}, empty), only_key)
    moved = state.to("meta")
    assert moved.key.device.type == "meta" and moved.amax_history.device.type == "meta"


def test_merge_keeps_the_observation_key_and_update_advances_the_state_key():
    model, x = _model_and_data()
    fn = fp8fn.transform(model, lambda n, m: fp8fn.DelayedScaling() if n == "layers.2" else ALL_ON)
    state = fn.init(x, seed=1)
    params = dict(model.named_parameters())
    _, obs_a = _func_grads(fn, params, state, x)
    _, obs_b = _func_grads(fn, params, state, x * 2)
    merged = fp8fn.merge(obs_a, obs_b)
    assert merged.key.item() == 0.0
    seen = [o["layers.2"].input.amax_history[0] for o in (obs_a, obs_b)]
    assert seen[1] > seen[0] and merged["layers.2"].input.amax_history[0] == seen[1]
    new = fp8fn.update(state, merged)
    assert new.key.item() == state.key.item() + 1
    assert new["layers.2"].input.amax_history[0] == seen[1]


def test_mixing_recipes_last_layer_in_high_precision():
    # The paper keeps the last layers in high precision: a recipe function returns None there.
    # NVFP4 layers draw from the key, delayed layers observe amaxes, the last layer is F.linear.
    model, x = _model_and_data()
    params = dict(model.named_parameters())

    delayed = fp8fn.DelayedScaling()

    def recipe(name, module):
        if name == "layers.2":  # the last layer: high precision
            return None
        return delayed if name == "layers.1" else ALL_ON

    fn = fp8fn.transform(model, recipe)
    assert fn.recipes == {"layers.0": ALL_ON, "layers.1": fp8fn.DelayedScaling()}
    state = fn.init(x, seed=7)
    assert list(state) == ["layers.1"] and state.key is not None
    grads, obs = _func_grads(fn, params, state, x)
    assert obs.key.item() == 0.0 and bool((obs["layers.1"].amax_history[:, 0] > 0).all())

    def by_hand(p, s):
        site = (s.key, "layers.0")
        h = fp8fn.linear(x, p["layers.0.weight"], p["layers.0.bias"], site, ALL_ON)
        h = F.relu(h)
        h = fp8fn.linear(h, p["layers.1.weight"], p["layers.1.bias"], s["layers.1"], delayed)
        h = F.linear(F.relu(h), p["layers.2.weight"], p["layers.2.bias"])
        return h.square().mean()

    assert_bit_identical((grads, obs), torch.func.grad(by_hand, argnums=(0, 1))(params, state))
    # The last layer really is high precision: its input and output match F.linear exactly.
    seen = {}
    handle = model.layers[2].register_forward_hook(lambda m, i, o: seen.update(i=i[0], o=o))
    try:
        fn.apply(params, state, x)
    finally:
        handle.remove()
    want = F.linear(seen["i"], params["layers.2.weight"], params["layers.2.bias"])
    assert torch.equal(seen["o"], want)


def test_vmap_over_a_batch_and_over_an_ensemble_of_states():
    model = MLP((32, 48, 16), seed=0)
    params = dict(model.named_parameters())
    fn = fp8fn.transform(model, ALL_ON)
    xs = torch.randn(3, 20, 32)
    state = fn.init(xs[0], seed=0)
    grad = torch.func.grad(loss_of(fn))
    # Over the batch, state unbatched: each example as if alone.
    per_example = torch.func.vmap(grad, in_dims=(None, None, 0))(params, state, xs)
    for i in range(3):
        for k in params:
            assert torch.equal(per_example[k][i], grad(params, state, xs[i])[k])
    # An ensemble: stacked states, one key each.
    states = [fn.init(xs[0], seed=s) for s in range(3)]
    stacked = pytree.tree_map(lambda *t: torch.stack(t), *states)
    assert stacked.key.shape == (3,)
    ensemble = torch.func.vmap(grad, in_dims=(None, 0, None))(params, stacked, xs[0])
    for i in range(3):
        for k in params:
            assert torch.equal(ensemble[k][i], grad(params, states[i], xs[0])[k])
    assert not torch.equal(ensemble["layers.0.weight"][0], ensemble["layers.0.weight"][1])


# -- user errors ----------------------------------------------------------------------------------


def test_recipe_defaults_frozen_and_invalid():
    r = NVFP4Scaling()
    assert (r.stochastic_rounding, r.hadamard, r.weight_2d, r.backend) == (True, True, True, "auto")
    assert r.random and not NVFP4Scaling(stochastic_rounding=False, hadamard=False).random
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.hadamard = False
    for field in ("stochastic_rounding", "hadamard", "weight_2d"):
        with pytest.raises(
            TypeError, match=rf"^fp8fn\.NVFP4Scaling: expected `{field}` to be a bool, got int 1\."
        ):
            NVFP4Scaling(**{field: 1})
    with pytest.raises(ValueError, match=r"^fp8fn\.NVFP4Scaling: expected `backend` in .*'triton'"):
        NVFP4Scaling(backend="triton")


_X, _W = torch.randn(4, 32), torch.randn(8, 32)


@pytest.mark.parametrize(
    "site_state, error, match",
    [
        (None, TypeError, r"`site_state` to be a pair `\(key, site\)` under NVFP4Scaling\(.*got "),
        ((_key(1),), TypeError, r"`site_state` to be a pair `\(key, site\)` .*got tuple\."),
        ((1, "fc"), TypeError, r"the key of `site_state` to be a float64 \(\) tensor, got int\."),
        (
            (torch.tensor(1), "fc"),
            TypeError,
            r"the key of `site_state` to be a float64 \(\) tensor, got torch\.int64 \(\)\.",
        ),
        (
            (torch.zeros(2, dtype=torch.float64), "fc"),
            TypeError,
            r"the key of `site_state` to be a float64 \(\) tensor, got torch\.float64 \(2,\)\.",
        ),
        ((_key(1), 3), TypeError, r"the site of `site_state` to be a str, got int\."),
        (
            (_key(1).to("meta"), "fc"),
            ValueError,
            r"the key on the device of `x`, cpu, got meta\. Move the state",
        ),
    ],
)
def test_linear_site_state_errors(site_state, error, match):
    with pytest.raises(error, match=r"^fp8fn\.linear: expected " + match):
        fp8fn.linear(_X, _W, None, site_state, ALL_ON)


def test_linear_without_randomness_takes_no_site_state_and_refuses_empty():
    plain = NVFP4Scaling(stochastic_rounding=False, hadamard=False)
    out = fp8fn.linear(_X, _W, None, None, plain)
    assert torch.equal(out, fp8fn.linear(_X, _W, None, (_key(3), "fc"), plain))
    with pytest.raises(ValueError, match=r"^fp8fn\.linear: expected non-empty `x` and `weight` "):
        fp8fn.linear(torch.randn(0, 32), _W, None, None, plain)


def test_init_apply_update_merge_errors():
    model, x = _model_and_data()
    fn = fp8fn.transform(model, ALL_ON)
    params = dict(model.named_parameters())
    with pytest.raises(TypeError, match=r"^fp8fn\.init: expected `seed` to be an int, got float"):
        fn.init(x, seed=1.0)
    with pytest.raises(TypeError, match=r"^fp8fn\.init: expected `seed` to be an int, got bool"):
        fn.init(x, seed=True)
    state = fn.init(x)
    keyless = fp8fn.transform(model, fp8fn.CurrentScaling()).init(x)
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected `state` with a random key"):
        fn.apply(params, keyless, x)
    with pytest.raises(TypeError, match=r"^fp8fn\.apply: expected `state\.key` to be float64"):
        fn.apply(params, state._replace(key=torch.tensor(1)), x)
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected `state\.key` of shape \(\)"):
        fn.apply(params, state._replace(key=torch.zeros(2, dtype=torch.float64)), x)
    with pytest.raises(TypeError, match=r"^fp8fn\.State\._replace: expected fields amax_history"):
        state._replace(seed=1)
    _, obs = _func_grads(fn, params, state, x)
    with pytest.raises(ValueError, match=r"^fp8fn\.update: `obs` has a random key .* `state` has"):
        fp8fn.update(keyless, obs)
    with pytest.raises(ValueError, match=r"^fp8fn\.merge: `obs_a` has a random key .* `obs_b`"):
        fp8fn.merge(obs, keyless)
    with pytest.raises(ValueError, match=r"^fp8fn\.update: expected `obs` an observation .* key"):
        fp8fn.update(state, state)
    with pytest.raises(ValueError, match=r"^fp8fn\.update: expected `obs` an observation .* key"):
        fp8fn.update(state, fp8fn.update(state, obs))  # a state where the observation belongs


# -- torch.compile --------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_apply_and_value_and_grad_equal_eager_over_steps():
    # No recompile across steps (the key is a tensor input, not a constant), the same random
    # bits as eager.
    from torch._dynamo.testing import CompileCounterWithBackend

    model = MLP((32, 32, 32), seed=0)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(0))
    params = dict(model.named_parameters())
    fn = fp8fn.transform(model, ALL_ON)
    state = fn.init(x, seed=1)
    forward = torch.compile(fn.apply, fullgraph=True)
    assert torch.equal(bits(forward(params, state, x)), bits(fn.apply(params, state, x)))
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1)), backend=counter)
    eager = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))
    previous = frames = None
    for _ in range(2):
        loss, (grads, obs) = step(params, state, x)
        want_loss, (want, want_obs) = eager(params, state, x)
        assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
        # The weight gradients come from the NVFP4 GEMMs: the same bits. The bias gradients
        # are high-precision sums of the output gradient, which inductor reduces in another
        # order (measured: within 4e-9).
        for name in ("layers.0.weight", "layers.1.weight"):
            assert torch.equal(bits(grads[name]), bits(want[name])), name
        for name in ("layers.0.bias", "layers.1.bias"):
            torch.testing.assert_close(grads[name], want[name], rtol=1e-6, atol=1e-7)
        assert obs.key.item() == want_obs.key.item() == 0.0
        assert previous is None or not torch.equal(grads["layers.0.weight"], previous)
        previous = grads["layers.0.weight"]
        state = fp8fn.update(state, obs)
        # value_and_grad's graphs (torch.autograd.grad is a graph break), compiled once.
        assert frames is None or counter.frame_count == frames
        frames = counter.frame_count


# -- data parallel: 2 gloo ranks ------------------------------------------------------------------


def _dp_setup():
    """A model whose last layer is delayed (sites to all_reduce), the rest NVFP4; data."""
    model = MLP((32, 48, 16), seed=0)
    delayed = fp8fn.DelayedScaling()
    fn = fp8fn.transform(model, lambda n, m: delayed if n == "layers.1" else ALL_ON)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    return model, fn, x


def _dp_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist
    from _spawn import init_gloo

    init_gloo(rank, world_size, port, timeout_s=30)
    try:
        model, fn, x = _dp_setup()
        params = dict(model.named_parameters())
        state = fn.init(x, seed=0)
        shard = x[rank * 8 : (rank + 1) * 8]
        for _ in range(2):  # two steps: the key advances in lockstep
            grads, obs = _func_grads(fn, params, state, shard)
            state = fp8fn.update(state, fp8fn.all_reduce(obs))
        same, _ = _func_grads(fn, params, state, x)  # the same data on both ranks
        torch.save({"shard": grads, "same": same, "state": state}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_ranks_keep_one_key_and_round_independently(tmp_path, monkeypatch):
    from _spawn import spawn_ranks

    spawn_ranks(_dp_worker, 2, tmp_path, 300)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # The state is the same on both ranks after all_reduce and update, the key advanced twice.
    assert_bit_identical(got[0]["state"], got[1]["state"])
    assert got[0]["state"].key.item() == fp8keys.seed_key(0) + 2
    # On the same data the ranks round the gradients independently ...
    same = [g["same"] for g in got]
    assert not torch.equal(same[0]["layers.0.weight"], same[1]["layers.0.weight"])
    assert torch.equal(same[0]["layers.1.bias"], same[1]["layers.1.bias"])  # nothing rounded
    # ... exactly as documented: rank r draws what a single process with rank r draws.
    model, fn, x = _dp_setup()
    params = dict(model.named_parameters())
    for rank in range(2):
        monkeypatch.setattr(fp8keys, "process_rank", lambda: rank)
        want, _ = _func_grads(fn, params, got[rank]["state"], x)
        assert_bit_identical(same[rank], want)


def test_higher_order_derivatives_are_refused():
    x, w, _, _ = _data()
    site = (_key(1), "fc")

    def first(w, x):
        return fp8fn.linear(x, w, None, site, ALL_ON).square().sum()

    want = torch.func.grad(first)(w, x)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.linear: higher-order derivatives"):
        torch.func.grad(lambda w: torch.func.grad(first)(w, x).sum())(w)
    wr = w.detach().clone().requires_grad_()
    (gw,) = torch.autograd.grad(first(wr, x), wr, create_graph=True)
    # The first-order result under create_graph is the plain one, bit for bit.
    assert_bit_identical(gw.detach(), want)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.linear: higher-order derivatives"):
        gw.sum().backward()
    # A linear loss: the output gradient is constant, and still the weight gradient's
    # dependence on x is not defined through the casts.
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fp8fn.linear(xr, wr, None, site, ALL_ON).sum()
    (gw,) = torch.autograd.grad(loss, wr, create_graph=True)
    plain = torch.func.grad(lambda w: fp8fn.linear(x, w, None, site, ALL_ON).sum())(w)
    assert_bit_identical(gw.detach(), plain)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.linear: higher-order derivatives"):
        torch.autograd.grad(gw.sum(), xr)


def test_autocast_routes_agree_and_the_op_keeps_its_precision():
    model, x = _model_and_data()
    params = dict(model.named_parameters())
    fn = fp8fn.transform(model, ALL_ON)
    state = fn.init(x, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        func, _ = _func_grads(fn, params, state, x)
        plain, _ = _autograd_grads(fn, params, state, x)
        out = fn.apply(params, state, x)
    assert out.dtype == torch.bfloat16
    assert_bit_identical(func, plain)
