"""The per-expert float8 grouped GEMM (`fp8fn._ops.grouped`) against a float64 per-expert
reference loop written from DESIGN.md's formulas (scale = fmax / amax, saturating cast, GEMM of
the casts divided by both scales)."""

import pytest
import torch

import fp8fn
from fp8fn._ops.grouped import group_amax, grouped_mm

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _q(hp, scale, dtype, fmax):
    """float64 value of `hp * scale` saturated to +-fmax and rounded to `dtype`."""
    return (hp.double() * scale).clamp(-fmax, fmax).to(dtype).double()


def _scale(amax, fmax, margin=0):
    return torch.tensor(fmax / (amax * 2.0**margin), dtype=torch.float64).float().double()


def _reference(x, w, ends, g, stored=None):
    """Per-expert float64 loop: `(out, grad_x, grad_w, observations (E, 3))`."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    gx, gw = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(w.shape, dtype=torch.float64)
    obs = torch.zeros(w.shape[0], 3, dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        xe, ge = x[start:end], g[start:end]
        wa = w[e].abs().max().item()
        obs[e, 1] = wa
        if end > start:
            xa, ga = xe.abs().max().item(), ge.abs().max().item()
            obs[e, 0], obs[e, 2] = xa, ga
            if stored is None:
                xs, ws, gs = _scale(xa, 448.0), _scale(wa, 448.0), _scale(ga, 57344.0)
            else:
                xs, ws, gs = (stored[e, i].double() for i in range(3))
            xq, wq, gq = _q(xe, xs, E4, 448.0), _q(w[e], ws, E4, 448.0), _q(ge, gs, E5, 57344.0)
            out[start:end] = xq @ wq.T / (xs * ws)
            gx[start:end] = gq @ wq / (gs * ws)
            gw[e] = gq.T @ xq / (gs * xs)
        start = end
    return out, gx, gw, obs


def _case(ends, experts=4, k=32, n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = ends[-1]
    x = torch.randn(rows, k, generator=gen) * torch.linspace(0.5, 4.0, rows)[:, None]
    w = torch.randn(experts, n, k, generator=gen) * torch.arange(1.0, experts + 1)[:, None, None]
    g = torch.randn(rows, n, generator=gen)
    return x, w, torch.tensor(ends, dtype=torch.int32), g


def _run(x, w, offs, g, newest=None, stored=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if newest is not None:
        newest = newest.clone().requires_grad_()
    out = grouped_mm(x, w, offs, newest, stored)
    grads = torch.autograd.grad(out, [x, w] + ([newest] if newest is not None else []), g)
    return (out, *grads)


def _close(got, want):
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ends", [[5, 12, 20, 27], [0, 9, 9, 16]])
def test_current_scaling_matches_float64_reference(ends):
    x, w, offs, g = _case(ends)
    out, gx, gw = _run(x, w, offs, g)
    r_out, r_gx, r_gw, _ = _reference(x, w, ends, g)
    _close(out, r_out)
    _close(gx, r_gx)
    _close(gw, r_gw)


def test_delayed_scaling_uses_stored_scales_and_observes_per_expert():
    ends = [6, 6, 15, 22]  # expert 1 receives no token
    x, w, offs, g = _case(ends, seed=1)
    newest = torch.ones(4, 3)
    stored = torch.tensor(
        [[50.0, 30.0, 9000.0], [40.0, 20.0, 8000.0], [60.0, 25.0, 7000.0], [35.0, 10.0, 6000.0]]
    )
    out, gx, gw, obs = _run(x, w, offs, g, newest, stored)
    r_out, r_gx, r_gw, r_obs = _reference(x, w, ends, g, stored)
    _close(out, r_out)
    _close(gx, r_gx)
    _close(gw, r_gw)
    assert torch.equal(obs.double(), r_obs.float().double())


def test_idle_expert_observes_zero_input_and_grad_output():
    """0 = not observed: `update` keeps the idle expert's input and grad_output histories."""
    ends = [7, 7, 7, 12]
    x, w, offs, g = _case(ends, seed=2)
    _, _, gw, obs = _run(x, w, offs, g, torch.zeros(4, 3), torch.zeros(4, 3))
    for e in (1, 2):
        assert obs[e, 0].item() == 0.0 and obs[e, 2].item() == 0.0
        assert obs[e, 1].item() == w[e].abs().max().item()
        assert torch.equal(gw[e], torch.zeros_like(gw[e]))
    assert obs[0, 0].item() == x[:7].abs().max().item()
    assert obs[3, 2].item() == g[7:12].abs().max().item()


def test_saturation_and_bfloat16_output_dtype():
    ends = [3, 8]
    x, w, offs, g = _case(ends, experts=2, seed=3)
    x = x.bfloat16()
    stored = torch.full((2, 3), 1e4)  # far too large: values saturate to +-448
    out = grouped_mm(x, w.bfloat16(), offs, torch.ones(2, 3), stored)
    assert out.dtype == torch.bfloat16
    ref = _reference(x.float(), w.bfloat16().float(), ends, g, stored)[0]
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_rows_past_the_last_group_are_zero_without_gradient():
    x, w, offs, g = _case([4, 9, 9, 14], seed=4)
    x = torch.cat([x, torch.randn(3, x.shape[1])])
    g = torch.cat([g, torch.randn(3, g.shape[1])])
    out, gx, _ = _run(x, w, offs, g)
    assert torch.equal(out[14:], torch.zeros_like(out[14:]))
    assert torch.equal(gx[14:], torch.zeros_like(gx[14:]))
    _close(out[:14], _reference(x[:14], w, [4, 9, 9, 14], g[:14])[0])


def test_torch_func_grad_gives_the_same_gradients_and_observations():
    ends = [3, 10, 10, 18]
    x, w, offs, g = _case(ends, seed=5)
    newest, stored = torch.ones(4, 3), torch.full((4, 3), 20.0)

    def loss(w, newest):
        return (grouped_mm(x, w, offs, newest, stored) * g).sum()

    gw, obs = torch.func.grad(loss, argnums=(0, 1))(w, newest)
    _, _, r_gw, r_obs = _run(x, w, offs, g, newest, stored)
    assert torch.equal(gw, r_gw) and torch.equal(obs, r_obs)


def test_second_order_raises():
    x, w, offs, g = _case([5, 11], experts=2, seed=6)
    w = w.requires_grad_()
    (gw,) = torch.autograd.grad((grouped_mm(x, w, offs) * g).sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="higher-order derivatives"):
        torch.autograd.grad(gw.square().sum(), w)


def test_autocast_casts_x_first_and_outputs_its_dtype():
    x, w, offs, g = _case([6, 13], experts=2, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_mm(x, w, offs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, grouped_mm(x.bfloat16(), w, offs))


def test_nan_in_one_group_is_observed_by_that_expert_only():
    ends = [4, 9, 15]
    x, w, offs, g = _case(ends, experts=3, seed=8)
    x[6, 3] = float("nan")
    _, _, _, obs = _run(x, w, offs, g, torch.ones(3, 3), torch.full((3, 3), 10.0))
    assert obs[1, 0].isnan()
    assert obs[0, 0].item() == x[:4].abs().max().item()
    assert obs[2, 0].item() == x[9:15].abs().max().item()


def test_a_nan_is_observed_where_the_scatter_max_drops_it(monkeypatch):
    """The per-expert amax is a scatter max: on CPU torch's propagates NaN, on CUDA it is an
    atomic max (`gpuAtomicMax`), which need not. `group_amax` marks a group holding a NaN
    itself; here with a scatter max that drops NaN, as an atomic max may."""
    original = torch.Tensor.scatter_reduce

    def dropping_nan(self, dim, index, src, reduce, **kwargs):
        if reduce == "amax":
            src = src.nan_to_num(nan=float("-inf"))
        return original(self, dim, index, src, reduce, **kwargs)

    monkeypatch.setattr(torch.Tensor, "scatter_reduce", dropping_nan)
    rows = torch.tensor([[1.0, -2.0], [float("nan"), 0.5], [-3.0, 0.25], [4.0, 1.0]])
    ids = torch.tensor([0, 1, 1, 3])  # expert 2 empty; the last row past the groups
    got = group_amax(rows, ids, 3)
    assert got[1].isnan() and got[[0, 2]].tolist() == [2.0, 0.0]


# -- stateless recipes per group: rowwise, blockwise, MXFP8; NVFP4 per expert --------------------

ROWWISE, MX = fp8fn.RowwiseScaling(), fp8fn.MXScaling()
MX_FLOOR, BLOCKWISE = fp8fn.MXScaling(scale_rounding="floor"), fp8fn.BlockwiseScaling()
NVFP4 = fp8fn.NVFP4Scaling()
FINER_RECIPES = [ROWWISE, fp8fn.RowwiseScaling(hp_grad_weight=True), MX, MX_FLOOR, BLOCKWISE]


def _bf16_case(ends, experts, k=64, n=96, seed=0, dtype=torch.bfloat16):
    x, w, offs, g = _case(ends, experts, k, n, seed)
    return x.to(dtype), (w * 0.1).to(dtype), offs, g.to(dtype)


def _grads(x, w, offs, g, recipe, random=None):
    """(out, grad_x, grad_w) of the grouped op under `recipe` by plain autograd."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_mm(x, w, offs, recipe=recipe, random=random)
    return (out, *torch.autograd.grad(out, [x, w], g))


def _per_group(x, w, ends, g, linear):
    """The same three tensors from `linear(x_e, w_e) -> (out_e, gx_e, gw_e)` per group."""
    out, gx, gw = (
        torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype),
        torch.zeros_like(x),
        (torch.zeros_like(w)),
    )
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end], gx[start:end], gw[e] = linear(x[start:end], w[e], g[start:end], e)
        start = end
    return out, gx, gw


def _torchao_linear(recipe):
    """Per group: torchao 0.18's emulated dense module for `recipe` on `(x_e, w_e)`."""
    from test_finer import _torchao_module

    def linear(x, w, g, e):
        dense = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(w.dtype)
        with torch.no_grad():
            dense.weight.copy_(w)
        module = _torchao_module(recipe, dense)
        x = x.clone().requires_grad_()
        out = module(x)
        out.backward(g)
        return out, x.grad, module.weight.grad

    return linear


@pytest.mark.parametrize(
    "recipe", FINER_RECIPES[:4], ids=["rowwise", "rowwise_gw_hp", "mx", "mx_floor"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finer_recipes_per_group_match_torchao_dense_per_expert(recipe, dtype):
    """Each group is torchao's emulated dense linear on that expert, bit for bit, an idle
    expert included (groups of any size; for MX torchao's dense module needs multiples of 32)."""
    pytest.importorskip("torchao")
    ends = [32, 96, 96, 128] if isinstance(recipe, fp8fn.MXScaling) else [5, 37, 37, 80]
    x, w, offs, g = _bf16_case(ends, 4, dtype=dtype)
    got = _grads(x, w, offs, g, recipe)
    want = _per_group(x, w, ends, g, _torchao_linear(recipe))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(got[2][2], torch.zeros_like(got[2][2]))  # the idle expert


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp8_matches_torchao_grouped_emulation(rounding):
    """torchao's `_to_mxfp8_then_scaled_grouped_mm` (EMULATED, bfloat16): bit for bit where
    groups are multiples of 32 tokens (its weight-gradient emulation blocks tokens across
    group ends)."""
    pytest.importorskip("torchao")
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    ends = [32, 96, 96, 160]
    x, w, offs, g = _bf16_case(ends, 4, seed=9)
    got = _grads(x, w, offs, g, fp8fn.MXScaling(scale_rounding=rounding))
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    mode = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}[rounding]
    out = _to_mxfp8_then_scaled_grouped_mm(
        xl,
        wl.transpose(-2, -1),
        offs,
        out_dtype=torch.bfloat16,
        kernel_preference=KernelPreference.EMULATED,
        scale_calculation_mode=mode,
    )
    want = (out, *torch.autograd.grad(out, [xl, wl], g))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _mx_float64(hp, dim):
    """float64 value of `hp` quantized in 32-element MX blocks along `dim` (RCEIL, from the
    formulas: scale `2**ceil(log2(amax / 448))`, saturating e4m3), a partial block at the end."""
    t = hp.double().movedim(dim, -1)
    k = t.shape[-1]
    blocks = torch.nn.functional.pad(t, (0, -k % 32)).unflatten(-1, (-1, 32))
    scale = 2.0 ** torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448)).clamp(-127)
    q = (blocks / scale).clamp(-448, 448).to(E4).double() * scale
    return q.flatten(-2)[..., :k].movedim(-1, dim)


def test_mxfp8_groups_of_any_size_match_a_float64_reference():
    """Tokens are blocked within each group (a partial block at a group's end), as the GPU
    kernels' per-group padding does: against the formulas in float64."""
    ends = [5, 40, 40, 77]
    x, w, offs, g = _bf16_case(ends, 4, seed=10, dtype=torch.float32)

    def reference(x, w, g, e):
        x, w, g = x.double(), w.double(), g.double()
        return (
            _mx_float64(x, 1) @ _mx_float64(w, 1).T,
            _mx_float64(g, 1) @ _mx_float64(w, 0),
            _mx_float64(g, 0).T @ _mx_float64(x, 0),
        )

    got = _grads(x, w, offs, g, MX)
    want = _per_group(x.double(), w.double(), ends, g.double(), reference)
    for a, b in zip(got, want):
        _close(a, b)


def _fp8fn_linear(recipe, key=None, site="experts"):
    """Per group: the dense `fp8fn.linear` (NVFP4: with the key folded with the expert)."""
    from fp8fn._core.keys import fold_key

    def linear(x, w, g, e):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        random = None if key is None else (fold_key(key, e), site)
        out = fp8fn.linear(x, w, None, random, recipe)
        return (out, *torch.autograd.grad(out, [x, w], g))

    return linear


def test_blockwise_per_group_is_the_dense_op_per_expert():
    """(The dense op's blockwise numerics are anchored to torchao in test_finer.)"""
    ends = [100, 100, 260]
    x, w, offs, g = _bf16_case(ends, 3, k=256, n=160, seed=11)
    got = _grads(x, w, offs, g, BLOCKWISE)
    for a, b in zip(got, _per_group(x, w, ends, g, _fp8fn_linear(BLOCKWISE))):
        assert torch.equal(a, b)


def test_nvfp4_per_expert_folds_the_expert_index_into_the_key():
    ends = [16, 16, 48, 80]
    x, w, offs, g = _bf16_case(ends, 4, seed=12, dtype=torch.float32)
    key = torch.tensor(12345.0, dtype=torch.float64)
    got = _grads(x, w, offs, g, NVFP4, random=(key, "experts"))
    for a, b in zip(got, _per_group(x, w, ends, g, _fp8fn_linear(NVFP4, key))):
        assert torch.equal(a, b)
    # Experts 2 and 3 given the same tokens, weight and gradient draw different bits.
    x[48:80], w[3], g[48:80] = x[16:48], w[2], g[16:48]
    _, _, gw = _grads(x, w, offs, g, NVFP4, random=(key, "experts"))
    assert not torch.equal(gw[2], gw[3])
    _, _, gw_plain = _grads(
        x, w, offs, g, fp8fn.NVFP4Scaling(stochastic_rounding=False, hadamard=False)
    )
    assert torch.equal(gw_plain[2], gw_plain[3])


ALL_RECIPES = [*FINER_RECIPES, NVFP4]
RECIPE_IDS = ["rowwise", "rowwise_gw_hp", "mx", "mx_floor", "blockwise", "nvfp4"]


def _random(recipe):
    return (torch.tensor(7.0, dtype=torch.float64), "e") if recipe is NVFP4 else None


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize(
    "ends",
    [[0, 20, 20, 45], [0, 0, 0, 0], [10, 30, 30, 30]],
    ids=["first_and_third_idle", "all_idle", "rows_past_the_end"],
)
def test_stateless_recipes_idle_experts_and_empty_groups(recipe, ends):
    x, w, _, g = _bf16_case([45], 4, seed=13)
    offs = torch.tensor(ends, dtype=torch.int32)
    out, gx, gw = _grads(x, w, offs, g, recipe, _random(recipe))
    starts = [0] + ends[:-1]
    for e, (s, t) in enumerate(zip(starts, ends)):
        if s == t:
            assert torch.equal(gw[e], torch.zeros_like(gw[e]))
        else:
            assert gw[e].abs().sum() > 0 and out[s:t].abs().sum() > 0
    assert torch.equal(out[ends[-1] :], torch.zeros_like(out[ends[-1] :]))
    assert torch.equal(gx[ends[-1] :], torch.zeros_like(gx[ends[-1] :]))


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=RECIPE_IDS)
def test_stateless_recipes_torch_func_grad_equals_autograd(recipe):
    x, w, offs, g = _bf16_case([9, 40, 40, 64], 4, seed=14)
    random = _random(recipe)

    def loss(x, w):
        return (grouped_mm(x, w, offs, recipe=recipe, random=random).float() * g.float()).sum()

    got = torch.func.grad(loss, argnums=(0, 1))(x, w)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss(xl, wl).backward()
    assert torch.equal(got[0], xl.grad) and torch.equal(got[1], wl.grad)


def test_mxfp8_refuses_float16():
    x, w, offs, _ = _bf16_case([8, 16], 2, dtype=torch.float16)
    with pytest.raises(
        TypeError,
        match=r"expected `x` and `weight` in float32 or bfloat16 under "
        r"MXScaling, got float16",
    ):
        grouped_mm(x, w, offs, recipe=MX)


def test_nvfp4_refuses_a_missing_key():
    x, w, offs, _ = _bf16_case([8, 16], 2)
    with pytest.raises(TypeError, match=r"expected `site_state` to be a pair `\(key, site\)`"):
        grouped_mm(x, w, offs, recipe=NVFP4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_current_scaling_is_the_dense_op_per_expert(dtype):
    """Per expert, the dense `fp8fn.linear` under CurrentScaling (anchored to torchao's
    tensorwise `Float8Linear` in test_reference), bit for bit, an idle expert included."""
    ends = [7, 7, 40, 72]
    x, w, offs, g = _bf16_case(ends, 4, seed=15, dtype=dtype)
    got = _grads(x, w, offs, g, None)
    want = _per_group(x, w, ends, g, _fp8fn_linear(fp8fn.CurrentScaling(backend="emulated")))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=RECIPE_IDS)
def test_custom_ops_that_torch_compile_runs_are_the_dense_op_per_expert(recipe):
    """The stateless recipes' per-group GEMMs as torch.compile runs them, custom ops
    (`fp8fn::finer_grouped_*`, `fp8fn::nvfp4_grouped_*`; eagerly the same functions run
    directly): the recipe survives the trip through the ops' arguments, idle experts and rows
    past `offs[-1]` get zeros, NVFP4 expert e draws with the key folded with e."""
    from fp8fn._core.keys import fold_key, site_id
    from fp8fn._ops.grouped_block_scaled import _recipe_args

    ends = [0, 20, 20, 45]  # expert 0 and 2 idle, rows 45..49 past the end
    x, w, _, g = _bf16_case([50], 4, seed=15)
    offs = torch.tensor(ends, dtype=torch.int32)
    ops = torch.ops.fp8fn
    if recipe is NVFP4:
        key = torch.tensor(7.0, dtype=torch.float64)
        expert_keys = torch.stack([fold_key(key, e) for e in range(4)]).to(torch.int64)
        args = (recipe.stochastic_rounding, recipe.hadamard, recipe.weight_2d, site_id("e"), 0)
        rows, weights, linear = (
            ops.nvfp4_grouped_rows,
            ops.nvfp4_grouped_weights,
            (_fp8fn_linear(recipe, key, "e")),
        )
        rows_args, weights_args = (expert_keys,), (expert_keys, *args)
    else:
        args = (*_recipe_args(recipe), "emulated")
        rows, weights, linear = (
            ops.finer_grouped_rows,
            ops.finer_grouped_weights,
            (_fp8fn_linear(recipe)),
        )
        rows_args, weights_args = (), args
    got = (
        rows(x, w, offs, *rows_args, 0, *args),
        rows(g, w, offs, *rows_args, 1, *args),
        weights(g, x, offs, *weights_args),
    )
    for a, b in zip(got, _per_group(x, w, ends, g, linear)):
        assert torch.equal(a.to(b.dtype), b)
    torch.library.opcheck(rows, (g, w, offs, *rows_args, 1, *args))
    torch.library.opcheck(weights, (g, x, offs, *weights_args))


def test_custom_op_arguments_carry_every_field_of_the_stateless_recipes():
    """A recipe field the ops' arguments left out would silently take its default under
    torch.compile (`backend` is resolved before and passed on its own)."""
    import dataclasses

    from fp8fn._ops.grouped_block_scaled import _recipe, _recipe_args

    carried = {
        fp8fn.RowwiseScaling: {"hp_grad_weight", "fast_accum"},
        fp8fn.BlockwiseScaling: {"block_size"},
        fp8fn.MXScaling: {"block_size", "scale_rounding"},
        fp8fn.NVFP4Scaling: {"stochastic_rounding", "hadamard", "weight_2d"},
    }
    for cls, names in carried.items():
        assert {f.name for f in dataclasses.fields(cls)} - {"backend"} == names
    for recipe in FINER_RECIPES:
        assert _recipe(*_recipe_args(recipe)) == dataclasses.replace(recipe, backend="auto")
