"""fp8fn.optim: AdamW as pure functions, float8 moments block-scaled on the global flat index.

Anchors: an independent float64 AdamW loop and a naive per-block quantizer written from the
formulas of docs/optim.md. Multi-rank, compiled and checkpoint cases: tests/test_optim_slow.py.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from _helpers import assert_bit_identical, bits, saved_and_loaded, sqnr
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8fn
from fp8fn.optim._blocks import block_amax, block_scale, cast, dequantize, quantize
from fp8fn.optim._layout import Layout

E4M3 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- references


def naive_quantize(x: torch.Tensor, block: int):
    """docs/optim.md's formulas, block by block: amax, scale = min(448 / amax, 2**126) in
    float64 rounded to float32, q = e4m3(clamp(x * scale, -448, 448))."""
    flat = x.flatten()
    q, scales = [], []
    for start in range(0, flat.numel(), block):
        chunk = flat[start : start + block]
        amax = chunk.abs().max().item()
        scale = torch.tensor(min(448.0 / amax, 2.0**126) if amax > 0 else 2.0**126)
        q.append((chunk * scale).clamp(-448, 448).to(E4M3))
        scales.append(scale)
    return torch.cat(q).view(x.shape), torch.stack(scales)


def adamw_float64(params, grads_seq, lr, betas, eps, wd):
    """AdamW (torch.optim.AdamW's formula) in float64 over a list of gradient dicts."""
    b1, b2 = betas
    p = {k: v.double() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_seq, 1):
        for k in p:
            g = grads[k].double()
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            step = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
            p[k] = p[k] - lr * (step + wd * p[k])
    return p


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(96, 80, generator=gen),
        "e": torch.randn(50, 100, generator=gen) * 0.1,
        "b": torch.randn(80, generator=gen),
    }


def _grads(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w": (96, 80), "e": (50, 100), "b": (80,)}
    return [{k: torch.randn(s, generator=gen) * 0.01 for k, s in shapes.items()} for _ in range(n)]


def _run(opt, params, grads_seq):
    state = opt.init(params)
    for grads in grads_seq:
        params, state = opt.update(grads, state, params)
    return params, state


# ----------------------------------------------------------------------------- the quantizer


def _plain(shape) -> Layout:
    shape = tuple(shape)
    return Layout(shape, shape, (0,) * len(shape), 0)


values = st.sampled_from(["normal", "zeros", "tiny", "huge", "outlier", "subnormal"])


def _tensor(kind: str, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "tiny":
        return x * 1e-30
    if kind == "huge":
        return x * 1e30
    if kind == "subnormal":
        return x * 1e-40
    if kind == "outlier":
        flat = x.flatten().clone()
        flat[:: max(1, flat.numel() // 3)] *= 1e4  # one large value in some blocks
        return flat.view(shape)
    return x


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 300),
    block=st.sampled_from([1, 7, 32, 128, 256]),
    kind=values,
    seed=st.integers(0, 2**16),
)
def test_quantize_is_the_naive_per_block_formula_bit_for_bit(rows, cols, block, kind, seed):
    x = _tensor(kind, (rows, cols), seed)
    q, scale = quantize(x, _plain(x.shape), block, "e4m3")
    want_q, want_scale = naive_quantize(x, block)
    assert torch.equal(bits(scale), bits(want_scale))
    assert torch.equal(bits(q), bits(want_q))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = dequantize(q, scale, _plain(x.shape), block)
    assert torch.isfinite(back).all()
    rel = (back - x).abs() <= x.abs() * 2.0**-4 + 2.0**-9 / scale.repeat_interleave(block)[
        : x.numel()
    ].view(x.shape)  # half an e4m3 ulp, or below the block's smallest subnormal
    assert rel.all()


def _shards(x: torch.Tensor, cuts) -> list[tuple[torch.Tensor, Layout]]:
    """`x` cut into row ranges at `cuts` (FSDP2's Shard(0)) with their layouts."""
    out, bounds = [], [0, *cuts, x.shape[0]]
    row = math.prod(x.shape[1:])
    for a, b in zip(bounds, bounds[1:]):
        local = x[a:b]
        shape = tuple(local.shape)
        out.append((local, Layout(tuple(x.shape), shape, (a, 0), a * row)))
    return out


def _column_shards(x: torch.Tensor, cut: int) -> list[tuple[torch.Tensor, Layout]]:
    """`x` cut into two column ranges (Shard(1)): listed indices, not one range."""
    out = []
    for a, b in ((0, cut), (cut, x.shape[1])):
        local = x[:, a:b].contiguous()
        out.append((local, Layout(tuple(x.shape), tuple(local.shape), (0, a), None)))
    return out


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(2, 12),
    cols=st.integers(2, 70),
    block=st.sampled_from([5, 32, 128]),
    kind=values,
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_shards_cut_through_blocks_quantize_as_the_whole_tensor(
    rows, cols, block, kind, seed, data
):
    """The amax of a block cut by a shard is the max over the shards' parts (what the
    all-reduce computes): every shard's bytes equal the whole tensor's, row and column cuts."""
    x = _tensor(kind, (rows, cols), seed)
    q, scale = quantize(x, _plain(x.shape), block, "e4m3")
    cut = data.draw(st.integers(1, rows - 1))
    col = data.draw(st.integers(1, cols - 1))
    for shards, pieces in (
        (_shards(x, [cut]), lambda q: torch.tensor_split(q, [cut])),
        (_column_shards(x, col), lambda q: torch.tensor_split(q, [col], dim=1)),
    ):
        amax = torch.stack([block_amax(s, lay, block) for s, lay in shards]).amax(0)
        shard_scale = block_scale(amax, "e4m3")
        assert torch.equal(bits(shard_scale), bits(scale))
        whole = pieces(dequantize(q, scale, _plain(x.shape), block))
        for (s, lay), want, want_back in zip(shards, pieces(q), whole):
            shard_q = cast(s, shard_scale, lay, block, "e4m3")
            assert torch.equal(bits(shard_q), bits(want))
            back = dequantize(shard_q, shard_scale, lay, block)
            assert torch.equal(bits(back), bits(want_back))


# ----------------------------------------------------------------------------- AdamW


def test_fp32_moments_follow_a_float64_adamw_loop():
    params, grads = _params(), _grads(20)
    opt = fp8fn.optim.adamw(1e-2, (0.9, 0.99), 1e-8, 0.1)
    got, state = _run(opt, params, grads)
    want = adamw_float64(params, grads, 1e-2, (0.9, 0.99), 1e-8, 0.1)
    for k in params:
        assert sqnr(want[k], got[k]) > 100, k  # float32 rounding only
    assert int(state.count) == 20 and int(state.skipped) == 0


def test_fp32_moments_match_torch_adamw():
    params, grads = _params(), _grads(10)
    got, _ = _run(fp8fn.optim.adamw(1e-2, (0.9, 0.99), 1e-8, 0.1), params, grads)
    torch_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = torch.optim.AdamW(torch_params.values(), 1e-2, (0.9, 0.99), 1e-8, 0.1, foreach=False)
    for g in grads:
        for k, p in torch_params.items():
            p.grad = g[k].clone()
        ref.step()
    for k in params:
        torch.testing.assert_close(got[k], torch_params[k].detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("moments, floor_db", [("bf16", 35.0), ("fp8", 22.0)])
def test_low_precision_moments_stay_close_to_the_float64_loop(moments, floor_db):
    """The parameter change after 20 steps against float64 (SQNR of the change, not of the
    parameter, which would hide the error)."""
    params, grads = _params(), _grads(20)
    opt = fp8fn.optim.adamw(1e-2, (0.9, 0.99), 1e-8, 0.0, moments=moments, min_size=64)
    got, state = _run(opt, params, grads)
    want = adamw_float64(params, grads, 1e-2, (0.9, 0.99), 1e-8, 0.0)
    for k in params:
        assert sqnr(want[k] - params[k].double(), got[k] - params[k]) > floor_db, k
    assert isinstance(state.mu["w"], fp8fn.optim.QuantizedMoment) == (moments == "fp8")


def test_fp8_state_is_e4m3_bytes_with_one_scale_per_block_and_small_tensors_fp32():
    params = {"w": torch.randn(64, 129), "b": torch.randn(4095)}
    state = fp8fn.optim.adamw(moments="fp8").init(params)
    mu = state.mu["w"]
    assert mu.data.dtype == E4M3 and mu.data.shape == (64, 129)
    assert mu.scale.dtype == torch.float32 and mu.scale.shape == (math.ceil(64 * 129 / 128),)
    assert state.nu["b"].dtype == torch.float32  # 4095 < min_size 4096
    g = {"w": torch.randn(64, 129), "b": torch.randn(4095)}
    _, state = fp8fn.optim.adamw(moments="fp8").update(g, state, params)
    for moment, first in (
        (state.mu["w"], (1 - 0.9) * g["w"]),
        (state.nu["w"], (1 - 0.999) * g["w"] * g["w"]),
    ):
        want_q, want_scale = naive_quantize(first, 128)
        assert torch.equal(bits(moment.data), bits(want_q))
        assert torch.equal(bits(moment.scale), bits(want_scale))


def test_update_changes_nothing_passed_in():
    params, grads = _params(), _grads(1)[0]
    opt = fp8fn.optim.adamw(1e-2, moments="fp8", min_size=64)
    state = opt.init(params)
    before = [t.clone() for t in torch.utils._pytree.tree_leaves((params, grads, state))]
    opt.update(grads, state, params)
    after = torch.utils._pytree.tree_leaves((params, grads, state))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, after))


def test_schedule_and_tensor_lr_give_the_float_lr_bits():
    params, grads = _params(), _grads(3)
    want, _ = _run(fp8fn.optim.adamw(3e-3), params, grads)
    for lr in (torch.tensor(3e-3), lambda count: 3e-3, lambda count: torch.tensor(3e-3)):
        got, _ = _run(fp8fn.optim.adamw(lr), params, grads)
        assert_bit_identical(got, want)


def test_non_finite_gradient_skips_the_step_and_never_reaches_the_moments():
    params, grads = _params(), _grads(2)
    opt = fp8fn.optim.adamw(1e-2, moments="fp8", min_size=64)
    p1, s1 = opt.update(grads[0], opt.init(params), params)
    for bad in (float("nan"), float("inf"), 1e25):  # 1e25: (1 - b2) * g * g overflows
        g = {k: v.clone() for k, v in grads[1].items()}
        g["b"][3] = bad
        p2, s2 = opt.update(g, s1, p1)
        assert_bit_identical(p2, p1)
        assert_bit_identical((s2.mu, s2.nu, s2.count), (s1.mu, s1.nu, s1.count))
        assert int(s2.skipped) == 1
        assert all(torch.isfinite(t.float()).all() for t in torch.utils._pytree.tree_leaves(s2))


def test_state_is_a_pytree_for_torch_and_optree_and_saves():
    params = _params()
    opt = fp8fn.optim.adamw(moments="fp8", min_size=64, master=None)
    state = opt.init(params)
    leaves, spec = torch.utils._pytree.tree_flatten(state)
    assert len(leaves) == 2 + 2 * 3 * 2  # count, skipped; mu, nu: 3 x (bytes, scales)
    assert len(optree.tree_leaves(state, namespace="fp8fn")) == len(leaves)
    rebuilt = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert rebuilt.config == state.config
    assert_bit_identical(saved_and_loaded(state), state)
    with pytest.raises(AttributeError):
        state.count = 3


def test_vmap_member_is_the_member_alone():
    members = [_params(s) for s in range(3)]
    grads = [_grads(1, seed=10 + s)[0] for s in range(3)]
    opt = fp8fn.optim.adamw(1e-2, moments="fp8", min_size=64)
    stack = lambda trees: torch.utils._pytree.tree_map(lambda *t: torch.stack(t), *trees)  # noqa: E731
    states = [opt.init(p) for p in members]
    out = torch.func.vmap(opt.update)(stack(grads), stack(states), stack(members))
    for i in range(3):
        alone = opt.update(grads[i], states[i], members[i])
        assert_bit_identical(torch.utils._pytree.tree_map(lambda t: t[i], out), alone)


def test_bf16_sr_is_unbiased_deterministic_and_advances_its_key():
    params = {"w": torch.full((64, 64), 1.0, dtype=torch.bfloat16)}
    grads = {"w": torch.full((64, 64), 1.0, dtype=torch.bfloat16)}
    opt = fp8fn.optim.adamw(1e-3, weight_decay=0.0, master="bf16-sr")
    state = opt.init(params, seed=3)
    out, new = opt.update(grads, state, params)
    again, _ = opt.update(grads, state, params)
    assert_bit_identical(out, again)
    assert out["w"].dtype == torch.bfloat16
    # 1 - 1e-3 lies between the bfloat16 neighbours 0.99609375 and 1.0: the mean is kept
    assert abs(out["w"].double().mean().item() - (1 - 1e-3)) < 1e-4
    assert set(out["w"].unique().tolist()) == {0.99609375, 1.0}
    assert float(new.key) == float(state.key) + 1
    other, _ = opt.update(grads, opt.init(params, seed=4), params)
    assert not torch.equal(other["w"], out["w"])


def test_clip_by_global_norm_is_the_norm_of_the_norms():
    grads = _grads(1)[0]
    clipped, norm = fp8fn.optim.clip_by_global_norm(grads, 0.05)
    total = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    assert norm.item() == pytest.approx(total, rel=1e-6)
    for k, g in grads.items():
        assert torch.equal(clipped[k], g * (0.05 / (norm + 1e-6)))
    same, _ = fp8fn.optim.clip_by_global_norm(grads, 1e3)
    assert_bit_identical(same, grads)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_raises_fp8fn_optim_errors():
    params, grads = _params(), _grads(1)[0]
    opt = fp8fn.optim.adamw(moments="fp8", min_size=64)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"fp8fn\.optim\.update: expected `grads` with the"):
        opt.update({"w": grads["w"]}, state, params)
    with pytest.raises(ValueError, match=r"expected the gradient at \['b'\] to be a plain"):
        opt.update({**grads, "b": torch.zeros(3)}, state, params)
    with pytest.raises(TypeError, match=r"fp8fn\.optim\.update: expected the state this"):
        opt.update(grads, {"mu": 0}, params)
    with pytest.raises(ValueError, match=r"expected a state of MomentConfig\(moments='fp8', bl"):
        fp8fn.optim.adamw(moments="fp8", block=64, min_size=64).update(grads, state, params)
    with pytest.raises(ValueError, match=r"got one of MomentConfig\(moments='fp8'"):
        fp8fn.optim.adamw(min_size=64).update(grads, state, params)
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.complex64)):
        with pytest.raises(TypeError, match=r"fp8fn\.optim\.init: expected floating-point"):
            opt.init({"w": bad})
    with pytest.raises(TypeError, match=r"expected bfloat16 params with master='bf16-sr'"):
        fp8fn.optim.adamw(master="bf16-sr").init(params)
    with pytest.raises(ValueError, match=r"fp8fn\.optim\.adamw: expected `moments` one of"):
        fp8fn.optim.adamw(moments="fp4")
    with pytest.raises(ValueError, match=r"fp8fn\.optim\.adamw: expected `block` an int >= 1"):
        fp8fn.optim.adamw(block=0)
    other = opt.init({**params, "b": torch.zeros(7)})
    with pytest.raises(ValueError, match=r"`state.mu` at \['b'\] to be block-scaled float8 of"):
        opt.update(grads, other, params)


# ----------------------------------------------------------------------------- torch.optim


def _module_run(opt_cls_kwargs, steps, model=None, opt=None):
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(70, 90), torch.nn.Linear(90, 3))
    opt = opt or fp8fn.optim.AdamW(model.parameters(), **opt_cls_kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 70, generator=gen)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(moments="fp8", min_size=64),
        dict(moments="bf16"),
        dict(moments="fp32", weight_decay=0.0),
    ],
)
def test_torch_optim_adapter_is_the_pure_update(kwargs):
    model, opt = _module_run(dict(lr=1e-2, **kwargs), 3)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(70, 90), torch.nn.Linear(90, 3))
    params = {k: p.detach().clone() for k, p in ref.named_parameters()}
    pure = fp8fn.optim.adamw(1e-2, **kwargs)
    state = pure.init(params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 70, generator=gen)
        grads = torch.func.grad(lambda p: torch.func.functional_call(ref, p, (x,)).square().sum())(
            params
        )
        params, state = pure.update(grads, state, params)
    for k, p in model.named_parameters():
        assert torch.equal(bits(p.detach()), bits(params[k])), k


def test_torch_optim_state_dict_round_trips_bit_for_bit():
    kwargs = dict(lr=1e-2, moments="fp8", min_size=64)
    model, opt = _module_run(kwargs, 2)
    saved = saved_and_loaded(opt.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == E4M3
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _module_run(kwargs, 1, model, opt)  # the uninterrupted third step (on the first batch)
    truth = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    fresh = fp8fn.optim.AdamW(model.parameters(), **kwargs)
    fresh.load_state_dict(saved)
    for i, p in enumerate(model.parameters()):
        assert fresh.state[p].keys() == saved["state"][i].keys()
        for key, value in fresh.state[p].items():
            assert torch.equal(bits(value), bits(saved["state"][i][key])), key
    _module_run(kwargs, 1, model, fresh)
    for k, v in model.state_dict().items():
        assert torch.equal(bits(v), bits(truth[k])), k


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 200),
    block=st.sampled_from([1, 16, 128, 256]),
    kind=values,
    seed=st.integers(0, 2**16),
)
def test_first_step_moments_are_the_naive_quantizer_of_the_first_terms(
    rows, cols, block, kind, seed
):
    """Any shape (not a multiple of the block) and value range: after one step the float8
    moments are the naive per-block quantizer of `(1 - b1) g` and `(1 - b2) g g`, the params
    finite, and a second step keeps every moment finite."""
    g = _tensor(kind, (rows, cols), seed).clamp(-1e15, 1e15)
    params = {"w": torch.ones(rows, cols)}
    opt = fp8fn.optim.adamw(1e-3, moments="fp8", block=block, min_size=1)
    params, state = opt.update({"w": g}, opt.init(params), params)
    zero = torch.zeros_like(g)  # b * 0 + x: a -0.0 term becomes +0.0, as in the update
    for moment, first in (
        (state.mu["w"], 0.9 * zero + (1 - 0.9) * g),
        (state.nu["w"], 0.999 * zero + (1 - 0.999) * g * g),
    ):
        want_q, want_scale = naive_quantize(first, block)
        assert torch.equal(bits(moment.data), bits(want_q))
        assert torch.equal(bits(moment.scale), bits(want_scale))
    params, state = opt.update({"w": g}, state, params)
    assert torch.isfinite(params["w"]).all()
    for t in torch.utils._pytree.tree_leaves(state):
        assert torch.isfinite(t.float()).all()


def test_bf16_sr_resumes_bit_identical_from_a_saved_state():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 80, generator=gen).bfloat16()}
    grads = [{"w": torch.randn(64, 80, generator=gen).bfloat16()} for _ in range(3)]
    opt = fp8fn.optim.adamw(1e-2, moments="fp8", min_size=64, master="bf16-sr")
    state = opt.init(params, seed=1)
    for g in grads[:2]:
        params, state = opt.update(g, state, params)
    saved = saved_and_loaded((params, state))
    truth = opt.update(grads[2], state, params)
    assert_bit_identical(opt.update(grads[2], saved[1], saved[0]), truth)
    assert float(saved[1].key) == float(opt.init(params, seed=1).key) + 2
