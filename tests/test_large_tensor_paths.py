"""The eager large-tensor paths (2**16 elements or more, CPU): the same values as the small ones.

From 64K elements, eager `amax` takes the larger magnitude of `aminmax`'s two, and the cast
clamps its own float32 temporary in place (`may_overwrite`). A slip in either (the extreme's
sign, a NaN or inf that the in-place pass handles otherwise) is invisible to tests of small
tensors: each case here compares the large path with an independent formula and with the small
path on the same values, bit for bit, in every input dtype (issue 38.10, class C).
"""

import pytest
import torch
from _helpers import CountOps, bits

import fp8fn
from fp8fn._numerics.fp8 import E4M3, E5M2, amax, cast_to_fp8
from fp8fn._ops.gemm import _widen

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [2**16 - 1, 2**16, 3 * 2**16 + 5]  # the small path, the large path from its first size


def _data(n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 3).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", [0, -1, 12345])
def test_amax_whose_extreme_is_negative(dtype, n, where):
    x = _data(n, dtype)
    x[where] = -1000.0  # the largest magnitude, negative (the max is ~15)
    got = amax(x)
    assert got.dtype == torch.float32 and got.item() == 1000.0
    x[where] = 0.0
    x[:] = -x.abs() - 1  # every value negative: the max is -1, the magnitude is not
    assert bits(amax(x)) == bits(x.float().abs().max())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_amax_of_a_large_tensor_with_nan_is_nan_and_zeros_give_plus_zero(dtype, n):
    x = _data(n, dtype)
    x[n // 2] = float("nan")
    assert amax(x).isnan()
    z = -torch.zeros(n, dtype=dtype)  # -0.0 everywhere
    assert bits(amax(z)) == bits(torch.tensor(0.0))


def _reference_cast(x, scale, fmax, dtype):
    """Independent of fp8fn: float32 product, NaN for every non-finite value, clamp, round."""
    p = x.float() * scale
    return torch.where(p.isfinite(), p.clamp(-fmax, fmax), float("nan")).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fp8", [(E4M3, 448.0), (E5M2, 57344.0)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cast_keeps_inf_visible_on_every_path(dtype, fp8, n):
    """+inf, -inf, NaN, values beyond the max and a product that overflows float32: NaN for
    each non-finite one, +-max for the finite, as the small path; the input left as it was."""
    fp8_dtype, fmax = fp8
    x = _data(n, dtype)
    x[[0, 7, n // 2, n - 1]] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e4]).to(
        dtype
    )
    x[n // 3] = -1e4
    scale = torch.tensor(2.0**100 if dtype == torch.float32 else 30.0)
    if dtype == torch.float32:
        x[5] = 3e38  # * 2**100: inf in float32, then NaN
    before = x.clone()
    got = cast_to_fp8(x, scale, fp8_dtype)
    assert torch.equal(bits(x), bits(before))  # the in-place pass touched its own temporary
    assert torch.equal(
        got.view(torch.uint8), _reference_cast(x, scale, fmax, fp8_dtype).view(torch.uint8)
    )
    small = torch.cat([cast_to_fp8(c, scale, fp8_dtype) for c in x.split(1000)])
    assert torch.equal(got.view(torch.uint8), small.view(torch.uint8))
    assert got[0].float().isnan() and got[7].float().isnan()  # inf -> NaN, visible


# each speed path one dispatched op (issue 39.4) -----------------------------------------------


def _e4m3_every_value(rows=256):
    """Every e4m3 byte (NaN, -0 and subnormals included), `rows` times: `(rows, 256)`."""
    return torch.arange(256, dtype=torch.uint8).view(E4M3).repeat(rows, 1)


@pytest.mark.parametrize("path", ["amax", "widen"])
def test_each_speed_path_is_one_op_and_the_aten_ops_under_transforms(path):
    """One dispatched op (`fp8fn::amax_abs`, `fp8fn::widen_e4m3`) where no transform runs; under
    vmap (each member its own value) and where autograd records the tensor, the same function
    as ATen ops; the same bits everywhere, against an independent formula."""
    if path == "amax":
        t = _data(2**16, torch.float32)
        t[77] = -40.0
        run, reference = amax, lambda t: t.abs().max()
    else:
        t = _e4m3_every_value()
        assert _widen(t)[1] == 256.0  # (exact: every e4m3 value / 256 is a float32 normal)
        run, reference = (lambda t: _widen(t)[0]), (lambda t: t.float() / 256)
    ops = CountOps()
    with ops:
        got = run(t)
    assert list(ops.ops) == [f"fp8fn.{'amax_abs' if path == 'amax' else 'widen_e4m3'}"]
    assert torch.equal(bits(got), bits(reference(t)))
    members = torch.stack([t, t.flip(0)])
    with CountOps() as ops:
        batched = torch.vmap(run)(members)
    assert not any(name.startswith("fp8fn.") for name in ops.ops)
    assert torch.equal(bits(batched), bits(torch.stack([reference(m) for m in members])))
    if path == "amax":
        with CountOps() as ops:
            tracked = amax(t.clone().requires_grad_())
        assert "aten.aminmax" in ops.ops and torch.equal(bits(tracked), bits(got))


@pytest.mark.parametrize("op", ["amax_abs", "widen_e4m3"])
def test_speed_path_ops_pass_torch_library_opcheck(op):
    """The fake implementation (shape, dtype and strides, also of a transposed input), the
    registration for autograd and tracing, as torch checks custom ops (its schema check
    compares float8 tensors with an op float8 lacks: the op has no mutation or alias to check)."""
    t = _data(2**16, torch.float32).view(256, 256)
    if op == "widen_e4m3":  # every value but NaN (which the check's comparison takes as a change)
        t = _e4m3_every_value().view(torch.uint8)
        t = torch.where(t & 0x7F == 0x7F, 0, t).view(E4M3)
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for arg in (t, t.t()):
        torch.library.opcheck(getattr(torch.ops.fp8fn, op).default, (arg,), test_utils=checks)


def test_ops_per_linear_at_256_rows_on_the_torch_func_route():
    """The deterministic count of benchmarks/README.md's 'Issue 39: eager overhead' table:
    `fp8fn.linear` (DelayedScaling, emulated) at 256 rows, 256 -> 512, step 2, through
    `torch.func.vjp`: 24 ops forward, 24 backward (30 while the float8 GEMM took its right
    operand as `(n, k)`, `a @ b.T`: the backward's GEMMs transposed each float8 operand, then
    its widening back, 4 views, and the output gradient's cast read its scale twice and made a
    transposed view the emulated path did not use; 34 while the backward's results went
    through the higher-order guard, 4 views, though nothing differentiated them again: vjp's
    dead wrappers said `requires_grad`); 33 and 42 before `fp8fn.linear` knew its
    site's histories filled from `update`'s mark (the stored scales alone, each amax after
    the GEMM: no current scale computed and chosen in the graph), 132 before the speed paths
    were one op each (3 amaxes took 4 ops each, 4 widenings 13 each)."""
    recipe = fp8fn.DelayedScaling(backend="emulated")
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 256, generator=gen), torch.randn(512, 256, generator=gen)
    b, g = torch.randn(512, generator=gen), torch.randn(256, 512, generator=gen)

    def f(x, w, b, s):
        return fp8fn.linear(x, w, b, s["fc"], recipe)

    state = fp8fn.init_state(recipe, ["fc"])
    state = fp8fn.update(state, torch.func.vjp(f, x, w, b, state)[1](g)[3])  # step 2
    with CountOps() as fwd:
        _, vjp = torch.func.vjp(f, x, w, b, state)
    with CountOps() as bwd:
        vjp(g)
    assert (fwd.count, bwd.count) == (24, 24), (fwd.ops, bwd.ops)
    assert fwd.ops["fp8fn.amax_abs"] == 2 and bwd.ops["fp8fn.amax_abs"] == 1
    assert fwd.ops["fp8fn.widen_e4m3"] == 2 and bwd.ops["fp8fn.widen_e4m3"] == 2
