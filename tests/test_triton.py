"""The fused Triton casts of `fp8fn._kernels.cast`, bit for bit against torch.

On a machine without CUDA the kernels run under `TRITON_INTERPRET=1` (set by the repository's
`conftest.py` before anything imports them), so shapes stay small. The float32 -> float8 rounding
is also checked through a pure-torch twin of the kernel's integer algorithm, on edge values here
and exhaustively (every float32 of magnitude <= the format's max, both signs; ~20 min on 2 cores)
with `FP8FN_EXHAUSTIVE=1`.
"""

import collections
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from _helpers import assert_bit_identical  # noqa: E402

import fp8fn  # noqa: E402
import fp8fn._core.device  # noqa: E402
import fp8fn._kernels.cast as fp8_triton  # noqa: E402
from fp8fn._numerics.fp8 import amax as ref_amax  # noqa: E402
from fp8fn._numerics.fp8 import cast_to_fp8, saturate  # noqa: E402

# The interpreter computes with numpy, which warns on inf and NaN arithmetic: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
HP = pytest.mark.parametrize(
    "hp_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"]
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FORMAT = {E4M3: (7, 3), E5M2: (15, 2)}  # (exponent bias, mantissa bits)


def f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def i32(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=DEVICE)


def u8(fp8: torch.Tensor) -> torch.Tensor:
    return fp8.cpu().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (float8 or float32)."""
    as_bits = lambda t: u8(t) if t.element_size() == 1 else i32(t.cpu())  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same float8 dtype, shape and bits; where `want` is NaN, `got` is NaN of either sign.

    The sign of a NaN product is not portable: x86 keeps it, CUDA's multiply returns a positive
    NaN, and torch's CPU float16 -> float32 conversion drops it.
    """
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.cpu().float().isnan()
    assert torch.equal(u8(got)[~nan], u8(want)[~nan])
    assert got.cpu().float().isnan()[nan].all()


def assert_same_amax(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal float32 `()`, or both NaN (the NaN's payload is not specified)."""
    assert got.dtype == torch.float32 and got.shape == ()
    got, want = got.cpu(), want.cpu()
    assert (got.isnan() and want.isnan()) or torch.equal(i32(got), i32(want)), (got, want)


def twin_saturate_to_fp8(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's `saturate_to_fp8`, step for step in torch int32 ops: float32 -> uint8."""
    bias, mbits = FORMAT[dtype]
    max_bits = i32(torch.tensor(FP8_MAX[dtype])).item()
    bits = i32(y)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    a = torch.where((a > max_bits) & (a < 0x7F800000), max_bits, a)
    shift = 23 - mbits
    lsb = (a >> shift) & 1
    normal = ((a + ((1 << (shift - 1)) - 1) + lsb) >> shift) - ((127 - bias) << mbits)
    e = a >> 23
    sig = (a & 0x7FFFFF) | torch.where(e > 0, 0x800000, 0)
    k = (151 - bias - mbits - e.clamp(min=1)).clamp(1, 31)
    q = sig >> k
    rem = sig & ((1 << k) - 1)
    halfway = 1 << (k - 1)
    up = (rem > halfway) | ((rem == halfway) & ((q & 1) == 1))
    r = torch.where(a < ((128 - bias) << 23), q + up.int(), normal)
    return torch.where(a >= 0x7F800000, 0x7F, r | (sign << 7)).to(torch.uint8)


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 values where a float8 rounding goes wrong if anything does (both signs).

    Every float8 value and every midpoint of neighbours, each with the 4 float32 neighbours on
    either side; the max's neighbours and values far beyond it (saturation); +-0, float32
    subnormals, +-inf and NaNs.
    """
    fp8 = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    pos = fp8[(fp8 >= 0) & fp8.isfinite()].unique()
    mids = (pos[1:] + pos[:-1]) / 2  # exact: one more mantissa bit than float8 has
    centers = torch.cat([pos, mids, torch.tensor([FP8_MAX[dtype] * 1.5, 1e30])])
    near = (i32(centers)[:, None] + torch.arange(-4, 5)).clamp(min=0).flatten()
    special = torch.tensor([0, 1, 2, 0x400000, 0x7FFFFF, 0x7F7FFFFF, 0x7F800000, 0x7FC00000,
                            0x7F800001, 0x7FFFFFFF])  # fmt: skip
    values = f32(torch.cat([near, special]))
    return torch.cat([values, -values])


def strided_values(dtype: torch.dtype, stride: int) -> torch.Tensor:
    """Every `stride`-th float32 from 2**-30 to 1.5 times the format's max, both signs."""
    lo, hi = (i32(torch.tensor(v)).item() for v in (2.0**-30, FP8_MAX[dtype] * 1.5))
    values = f32(torch.arange(lo, hi, stride, dtype=torch.int32))
    return torch.cat([values, -values])


def sample(shape, hp_dtype, seed=0) -> torch.Tensor:
    """Normal values over many binades: some saturate, some land on float8 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-24, 24, shape, generator=g))
    return x.to(hp_dtype).to(DEVICE)


# --- the float32 -> float8 rounding ----------------------------------------------------------


@FP8
def test_twin_matches_torch_on_edge_values(dtype):
    y = torch.cat([edge_values(dtype), strided_values(dtype, 257)])
    want = saturate(y, dtype).view(torch.uint8)
    assert torch.equal(twin_saturate_to_fp8(y, dtype), want)
    # An overflow stays visible: finite values saturate, inf and NaN give NaN (0x7F).
    special = twin_saturate_to_fp8(
        torch.tensor([float("inf"), -float("inf"), -float("nan"), 1e30]), dtype
    )
    assert special[:3].tolist() == [0x7F] * 3 and special[3].view(dtype).float() == FP8_MAX[dtype]


@pytest.mark.skipif(os.environ.get("FP8FN_EXHAUSTIVE") != "1", reason="set FP8FN_EXHAUSTIVE=1")
@FP8
def test_twin_matches_torch_exhaustively(dtype):
    top = i32(torch.tensor(FP8_MAX[dtype])).item()
    for start in range(0, top + 1, 1 << 24):
        y = f32(torch.arange(start, min(start + (1 << 24), top + 1), dtype=torch.int32))
        for signed in (y, -y):
            want = signed.to(dtype).view(torch.uint8)
            assert torch.equal(twin_saturate_to_fp8(signed, dtype), want), start


@FP8
def test_cast_and_amax_rounds_edge_values_like_torch(dtype):
    y = torch.cat([edge_values(dtype), strided_values(dtype, 1 << 14)]).to(DEVICE)
    fp8, amax = fp8_triton.cast_and_amax(y, scalar(1.0), dtype)
    assert_same_fp8(fp8, cast_to_fp8(y, scalar(1.0), dtype))
    assert amax.isnan()  # the edge values hold NaNs


# --- cast_and_amax ----------------------------------------------------------------------------

SHAPES = pytest.mark.parametrize(
    "shape", [(1,), (7,), (1000,), (4097,), (33, 65), (3, 5, 7)], ids=str
)


@SHAPES
@HP
@FP8
def test_cast_and_amax_matches_torch(shape, hp_dtype, dtype):
    hp = sample(shape, hp_dtype)
    scale = scalar(3.0)
    fp8, amax = fp8_triton.cast_and_amax(hp, scale, dtype)
    assert fp8.shape == hp.shape and fp8.dtype == dtype
    assert_same_fp8(fp8, cast_to_fp8(hp, scale, dtype))
    assert_same_amax(amax, ref_amax(hp))


@HP
@FP8
def test_cast_and_amax_special_values(hp_dtype, dtype):
    special = [0.0, -0.0, float("inf"), -float("inf"), 1e30, -1e30, 1e-30, -1e-30, 2.0**-20]
    hp = torch.tensor(special * 3, dtype=hp_dtype, device=DEVICE)
    for scale in (1.0, 2.0**-10, 2.0**10):
        fp8, amax = fp8_triton.cast_and_amax(hp, scalar(scale), dtype)
        assert_same_fp8(fp8, cast_to_fp8(hp, scalar(scale), dtype))
        assert_same_amax(amax, ref_amax(hp))
    with_nan = torch.cat([hp, torch.tensor([float("nan"), -float("nan")], dtype=hp_dtype)])
    fp8, amax = fp8_triton.cast_and_amax(with_nan.to(DEVICE), scalar(1.0), dtype)
    assert_same_fp8(fp8, cast_to_fp8(with_nan, scalar(1.0), dtype))
    assert amax.isnan()


@FP8
def test_cast_and_amax_all_zero_and_empty(dtype):
    for hp in (torch.zeros(5000, device=DEVICE), torch.empty(0, 3, device=DEVICE)):
        fp8, amax = fp8_triton.cast_and_amax(hp, scalar(5.0), dtype)
        assert fp8.shape == hp.shape
        assert_same_fp8(fp8, cast_to_fp8(hp, scalar(5.0), dtype))
        assert_same_amax(amax, torch.tensor(0.0))


def test_cast_and_amax_makes_input_contiguous():
    hp = sample((40, 30), torch.float32).t()
    fp8, amax = fp8_triton.cast_and_amax(hp, scalar(0.5), E4M3)
    assert_same_fp8(fp8, cast_to_fp8(hp, scalar(0.5), E4M3))
    assert_same_amax(amax, ref_amax(hp))


# --- delayed_cast and current_cast ------------------------------------------------------------


@HP
@FP8
@pytest.mark.parametrize("newest", [0.0, 7.0, float("nan")], ids=["empty", "observed", "nan"])
def test_delayed_cast_matches_torch(hp_dtype, dtype, newest):
    hp = sample((4097,), hp_dtype, seed=1)
    stored = scalar(0.75)
    for margin in (0, 2, 3):
        fp8, scale, inverse, amax = fp8_triton.delayed_cast(
            hp, scalar(newest), stored, margin, dtype
        )
        current = fp8fn.compute_scale(ref_amax(hp), FP8_MAX[dtype], margin)
        want_scale = torch.where(scalar(newest) > 0, stored, current)
        assert torch.equal(i32(scale.cpu()), i32(want_scale.cpu())), (scale, want_scale)
        assert torch.equal(i32(inverse.cpu()), i32(want_scale.reciprocal().cpu()))
        assert_same_fp8(fp8, cast_to_fp8(hp, want_scale, dtype))
        assert_same_amax(amax, ref_amax(hp))


@HP
@FP8
def test_delayed_cast_of_a_filled_history_is_the_stored_scale_in_one_pass(hp_dtype, dtype):
    hp = sample((33, 65), hp_dtype, seed=8)
    stored = scalar(0.75)
    for transpose in (False, True):
        t = {"transpose": transpose}
        filled = fp8_triton.delayed_cast(hp, None, stored, 1, dtype, filled=True, **t)
        observed = fp8_triton.delayed_cast(hp, scalar(7.0), stored, 1, dtype, **t)
        assert len(filled) == len(observed) == 4 + transpose
        assert all(same_bits(a, b) for a, b in zip(filled, observed))
        assert torch.equal(filled[-3], stored)
        assert_same_fp8(filled[0], cast_to_fp8(hp, stored, dtype))
        assert_same_amax(filled[-1], ref_amax(hp))


@pytest.mark.parametrize("newest", [None, 0.0, 7.0], ids=["current", "empty", "observed"])
def test_casts_write_the_linears_observation(newest):
    """With `observe=(input_amax, weight_amax)` the amax output is the float32 `(3,)`
    `[input_amax, weight_amax, amax]`, the two copied bit for bit (a NaN's payload too)."""
    hp = sample((20, 12), torch.bfloat16, seed=9)
    nan = torch.tensor(0x7FC01234, dtype=torch.int32).view(torch.float32)
    for before in ((scalar(3.5), scalar(0.0)), (nan.to(DEVICE), scalar(float("inf")))):
        for transpose in (False, True):
            t = {"transpose": transpose, "observe": before}
            if newest is None:
                out = fp8_triton.current_cast(hp, 0, E5M2, **t)
                plain = fp8_triton.current_cast(hp, 0, E5M2, transpose=transpose)
            else:
                out = fp8_triton.delayed_cast(hp, scalar(newest), scalar(2.0), 0, E5M2, **t)
                plain = fp8_triton.delayed_cast(
                    hp, scalar(newest), scalar(2.0), 0, E5M2, transpose=transpose
                )
            want = torch.stack([*before, ref_amax(hp)])
            assert out[-1].shape == (3,) and torch.equal(i32(out[-1].cpu()), i32(want.cpu()))
            assert all(same_bits(a, b) for a, b in zip(out[:-1], plain[:-1]))


@HP
@FP8
@pytest.mark.parametrize("margin", [0, 1, 2, 3])
def test_current_cast_matches_torch(hp_dtype, dtype, margin):
    hp = sample((33, 65), hp_dtype, seed=2)
    fp8, scale, inverse, amax = fp8_triton.current_cast(hp, margin, dtype)
    want_scale = fp8fn.compute_scale(ref_amax(hp), FP8_MAX[dtype], margin)
    assert torch.equal(i32(scale.cpu()), i32(want_scale.cpu()))
    assert torch.equal(i32(inverse.cpu()), i32(want_scale.reciprocal().cpu()))
    assert_same_fp8(fp8, cast_to_fp8(hp, want_scale, dtype))
    assert_same_amax(amax, ref_amax(hp))


@FP8
def test_current_cast_scale_matches_compute_scale_on_edge_amaxes(dtype):
    f32_max = torch.finfo(torch.float32).max
    amaxes = [0.0, 2.0**-149, 1e-40, 2.0**-126, 1e-30, 1e-3, 1.0, 448.0, 3e38, f32_max,
              float("inf"), float("nan")]  # fmt: skip
    margins = [0, 1, 2, 3, 64]
    for a in amaxes:
        hp = torch.tensor([a, -a / 2], device=DEVICE)
        for margin in margins:
            _, scale, inverse, amax = fp8_triton.current_cast(hp, margin, dtype)
            want = fp8fn.compute_scale(torch.tensor(a), FP8_MAX[dtype], margin)
            assert torch.equal(i32(scale.cpu()), i32(want.cpu())), (a, margin, scale, want)
            # reciprocals of the extreme scales: inf (of 2**-149), float32 subnormals
            assert torch.equal(i32(inverse.cpu()), i32(want.reciprocal())), (a, margin, inverse)
            assert_same_amax(amax, torch.tensor(a))


@FP8
def test_scaled_casts_of_empty_tensors_use_scale_one(dtype):
    hp = torch.empty(0, device=DEVICE)
    fp8, scale, inverse, amax = fp8_triton.current_cast(hp, 0, dtype)
    assert fp8.shape == (0,) and scale.item() == inverse.item() == 1.0 and amax.item() == 0.0
    fp8, scale, inverse, amax = fp8_triton.delayed_cast(hp, scalar(0.0), scalar(9.0), 0, dtype)
    assert scale.item() == inverse.item() == 1.0 and amax.item() == 0.0
    for newest, filled in ((scalar(1.0), False), (None, True)):
        _, scale, inverse, amax = fp8_triton.delayed_cast(
            hp, newest, scalar(8.0), 0, dtype, filled=filled
        )
        assert (scale.item(), inverse.item(), amax.item()) == (8.0, 0.125, 0.0)


# --- transposed copies ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (65, 130), (64, 64), (0, 3)], ids=str)
def test_transpose_writes_a_contiguous_transposed_copy(shape):
    hp = sample(shape, torch.bfloat16, seed=3)
    calls = [
        lambda: fp8_triton.cast_and_amax(hp, scalar(2.0), E5M2, transpose=True),
        lambda: fp8_triton.delayed_cast(hp, scalar(0.0), scalar(2.0), 1, E5M2, transpose=True),
        lambda: fp8_triton.delayed_cast(hp, scalar(1.0), scalar(2.0), 1, E5M2, transpose=True),
        lambda: fp8_triton.delayed_cast(hp, None, scalar(2.0), 1, E4M3, transpose=True,
                                        filled=True),
        lambda: fp8_triton.current_cast(hp, 0, E4M3, transpose=True),
    ]  # fmt: skip
    for call in calls:
        fp8, fp8_t, *_ = call()
        plain = fp8_triton.cast_and_amax(hp, scalar(1.0), fp8.dtype)  # any scale: shape check
        assert fp8.shape == hp.shape and fp8_t.shape == hp.t().shape
        assert fp8_t.is_contiguous() and plain[0].dtype == fp8_t.dtype
        assert torch.equal(u8(fp8_t), u8(fp8).t())
    fp8, fp8_t, scale, inverse, amax = calls[1]()
    assert_same_fp8(fp8, cast_to_fp8(hp, scale, E5M2))


# --- errors -----------------------------------------------------------------------------------


def test_casts_reject_bad_arguments():
    hp = torch.ones(4, device=DEVICE)
    with pytest.raises(TypeError, match="expected `hp` float32, bfloat16 or float16"):
        fp8_triton.current_cast(hp.double(), 0, E4M3)
    with pytest.raises(ValueError, match="expected `dtype` torch.float8_e4m3fn"):
        fp8_triton.current_cast(hp, 0, torch.int8)
    with pytest.raises(ValueError, match="`transpose=True` needs a 2D `hp`"):
        fp8_triton.current_cast(hp, 0, E5M2, transpose=True)
    for margin, error in ((-1, ValueError), (65, ValueError), (0.5, TypeError), (True, TypeError),
                          ("1", TypeError), (scalar(1.0), TypeError)):  # fmt: skip
        with pytest.raises(error, match="expected `margin` an int from 0 to 64"):
            fp8_triton.current_cast(hp, margin, E4M3)
    with pytest.raises(TypeError, match="expected `scale` a float32 `\\(\\)` tensor"):
        fp8_triton.cast_and_amax(hp, torch.tensor(1.0, dtype=torch.float64), E4M3)
    with pytest.raises(TypeError, match="expected `stored` a float32"):
        fp8_triton.delayed_cast(hp, scalar(0.0), torch.ones(2, device=DEVICE), 0, E4M3)
    with pytest.raises(TypeError, match="expected `stored` a float32 `\\(\\)` tensor, got None"):
        fp8_triton.delayed_cast(hp, scalar(0.0), None, 0, E4M3, filled=True)
    with pytest.raises(TypeError, match="expected `newest` a float32 `\\(\\)` tensor, got None"):
        fp8_triton.delayed_cast(hp, None, scalar(1.0), 0, E4M3)
    with pytest.raises(TypeError, match="expected `weight_amax` a float32 `\\(\\)` tensor"):
        fp8_triton.current_cast(hp, 0, E5M2, observe=(scalar(1.0), torch.ones(3)))


# --- dispatch, launches, compile, torch.func --------------------------------------------------


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.funcs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_each_cast_is_one_dispatched_op_of_one_or_two_launches(monkeypatch):
    import fp8fn._kernels.triton_jit as kernels

    launched = []

    def count(kernel):
        launched.append(kernel)
        return kernel

    monkeypatch.setattr(kernels, "wrap_triton", count)
    hp, s = sample((8, 8), torch.float32), scalar(1.0)
    calls = [
        (lambda: fp8_triton.cast_and_amax(hp, s, E4M3), 1),
        (lambda: fp8_triton.delayed_cast(hp, s, s, 0, E4M3, transpose=True), 2),
        (lambda: fp8_triton.delayed_cast(hp, s, s, 0, E4M3, transpose=True, filled=True), 1),
        (lambda: fp8_triton.current_cast(hp, 0, E5M2, observe=(s, s)), 2),
    ]
    for call, launches in calls:
        launched.clear()
        with _CountOps() as mode:
            call()
        assert mode.ops == ["fp8fn.scaled_cast.default"]
        assert len(launched) == launches


@pytest.mark.slow
def test_delayed_cast_compiles_without_graph_breaks():
    # Under the interpreter the ops are opaque custom ops (an interpreted kernel cannot be traced
    # into the graph); with CUDA they are triton_ops whose kernels Inductor sees. Either way the
    # graph must hold the op and give eager's bits.
    def f(hp, newest, stored):
        fp8, scale, _, amax = fp8_triton.delayed_cast(hp, newest, stored, 0, E4M3)
        return fp8.float() / scale, amax

    hp = sample((16, 24), torch.bfloat16, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for newest in (0.0, 1.0):
        got, want = compiled(hp, scalar(newest), scalar(8.0)), f(hp, scalar(newest), scalar(8.0))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["emulated", "float8"])
def test_triton_linear_compiles_to_eagers_bits(monkeypatch, gemm):
    """`fp8fn.linear` with backend="triton", forward and backward compiled in one graph
    (fullgraph), over 2 steps (empty histories, then stored scales): the input and weight
    gradients and the observations are eager's, bit for bit."""
    if gemm == "float8":
        _float8_gemms(monkeypatch)
    recipe = fp8fn.DelayedScaling(backend="triton")
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((32, 48), (16, 48), (16,)))

    def loss(x, w, state):
        return fp8fn.linear(x, w, b, state["fc"], recipe).square().sum()

    torch._dynamo.reset()
    runs = []
    for f in (loss, torch.compile(loss, fullgraph=True)):
        state, steps = fp8fn.observe(fp8fn.init_state(recipe, ["fc"])), []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (x, w)]
            f(*leaves, state).backward()
            obs = fp8fn.observations(state)
            steps.append([leaves[0].grad, leaves[1].grad, obs.amax_history])
            state = fp8fn.observe(fp8fn.update(state, obs))
        runs.append(steps)
    assert_bit_identical(*runs)


def test_ops_pass_opcheck():
    hp, s = sample((16, 24), torch.float16, seed=5).clamp(-6e4, 6e4), scalar(2.0)  # no inf:
    fp8_triton.current_cast(hp, 0, E4M3)  # registers the ops           (opcheck finds NaN != NaN)
    op = torch.ops.fp8fn.scaled_cast.default
    torch.library.opcheck(op, (hp, None, s, 0.0, E5M2, True, True, None, None))
    torch.library.opcheck(op, (hp, scalar(0.0), s, 0.0, E4M3, False, False, None, None))
    torch.library.opcheck(op, (hp, None, None, 1.0, E5M2, True, False, s, s))


class _FakeQuant(torch.autograd.Function):
    """Quantize-dequantize: delayed e4m3 cast forward, current e5m2 cast (transposed) backward."""

    @staticmethod
    def forward(x, newest, stored):
        fp8, scale, inverse, _ = fp8_triton.delayed_cast(x, newest, stored, 0, E4M3)
        return fp8.float() * inverse

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        fp8, fp8_t, scale, inverse, _ = fp8_triton.current_cast(grad, 0, E5M2, transpose=True)
        return fp8_t.float().t() * inverse, None, None


def test_casts_work_in_an_autograd_function_under_torch_func_grad():
    x = sample((8, 16), torch.float32, seed=6)
    newest, stored = scalar(1.0), scalar(16.0)
    weight = sample((8, 16), torch.float32, seed=7)
    grad = torch.func.grad(lambda x: (_FakeQuant.apply(x, newest, stored) * weight).sum())(x)
    want_scale = fp8fn.compute_scale(ref_amax(weight), FP8_MAX[E5M2])
    want = cast_to_fp8(weight, want_scale, E5M2).float() * want_scale.reciprocal()
    assert torch.equal(grad, want)


# the triton backend of the op ------------------------------------------------------------------


@pytest.mark.parametrize("recipe_cls", [fp8fn.DelayedScaling, fp8fn.CurrentScaling])
def test_triton_backend_is_bit_identical_to_emulated_over_steps(recipe_cls):
    """The whole op (casts by Triton, matmuls emulated on CPU) on both routes, several steps."""
    runs = {}
    for backend in ("emulated", "triton"):
        recipe = recipe_cls(backend=backend)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 8)
        )
        fn = fp8fn.transform(model, recipe)
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(16, 64, generator=gen) for _ in range(3)]
        params = {k: v.detach() for k, v in model.named_parameters()}
        state = fn.init(xs[0])
        history = []
        for x in xs:
            grads, obs = torch.func.grad(
                lambda p, s: fn.apply(p, s, x).square().sum(), argnums=(0, 1)
            )(params, state)
            leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
            observed = fp8fn.observe(state)
            fn.apply(leaves, observed, x).square().sum().backward()
            assert all(torch.equal(grads[k], leaves[k].grad) for k in grads)
            assert torch.equal(obs.amax_history, fp8fn.observations(observed).amax_history)
            history.append((grads, obs.amax_history))
            state = fp8fn.update(state, obs)
            params = {k: v - 1e-3 * grads[k] for k, v in params.items()}
        runs[backend] = (history, state)
    (emulated, state_e), (triton, state_t) = runs["emulated"], runs["triton"]
    assert torch.equal(state_e.amax_history, state_t.amax_history)
    assert torch.equal(state_e.scale, state_t.scale)
    for (grads_e, obs_e), (grads_t, obs_t) in zip(emulated, triton):
        assert torch.equal(obs_e, obs_t)
        assert all(torch.equal(grads_e[k], grads_t[k]) for k in grads_e)


def test_triton_observation_under_nested_transforms_is_the_emulated_ones():
    """The observation the output gradient's cast writes in the backward is made at the
    backward's functorch level: `fp8fn.checkpoint` under `torch.func.grad` (a nested level),
    grad of vmap over the batch (one amax) and vmap of grad (per example) give the emulated
    backend's bits."""
    runs = {}
    for backend in ("emulated", "triton"):
        recipe = fp8fn.DelayedScaling(backend=backend)
        state = fp8fn.init_state(recipe, ["fc"])
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(8, 16, generator=gen), torch.randn(12, 16, generator=gen)

        def f(w, s, x):
            return fp8fn.linear(x, w, None, s["fc"], recipe)

        def rows(w, s):
            return torch.vmap(lambda xx: f(w, s, xx))(x.view(2, 4, 16)).sum()

        out = []
        for _ in range(2):  # empty histories, then stored scales
            grads = torch.func.grad(
                lambda w, s: fp8fn.checkpoint(f, w, s, x).square().sum(), argnums=(0, 1)
            )(w, state)
            out += [grads, torch.func.grad(rows, argnums=(0, 1))(w, state)]
            out.append(torch.vmap(lambda r: torch.func.grad(lambda w: f(w, state, r).sum())(w))(
                x[:, None]
            ))  # fmt: skip
            state = fp8fn.update(state, grads[1])
        runs[backend] = out
    assert_bit_identical(runs["triton"], runs["emulated"])


def test_triton_backend_casts_are_one_op_each():
    recipe = fp8fn.DelayedScaling(backend="triton")
    state = fp8fn.init_state(recipe, ["fc"])
    x, w = torch.randn(16, 32), torch.randn(8, 32)
    casts = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            casts.append(str(func))
            return func(*args, **(kwargs or {}))

    loss = lambda w, s: fp8fn.linear(x, w, None, s["fc"], recipe).sum()  # noqa: E731
    state = fp8fn.update(state, torch.func.grad(loss, argnums=1)(w, state))
    with Count():
        torch.func.grad(loss, argnums=(0, 1))(w, state)
    assert casts.count("fp8fn.scaled_cast.default") == 3  # x, weight, grad_output: one op each
    assert not any("vector_norm" in c or "clamp" in c for c in casts)  # no torch-side cast


def _float8_gemms(monkeypatch):
    """Run the op's GEMMs on torch's float8 GEMM, as on a CUDA device of compute capability
    9.0: the CPU takes the CUDA path (the seam `fp8fn.testing.cuda_path_on_cpu` sets; here
    without its dispatch mode, which torch.compile refuses and which would add to the op
    counts; tests/test_cuda_paths.py checks these calls). CPU's reference kernel stands in for
    CUDA's: exact, slow, fine at these shapes."""
    monkeypatch.setattr(fp8fn._core.device, "_cpu_as_cuda", (9, 0))


def test_triton_casts_before_float8_gemms_write_every_transposed_copy(monkeypatch):
    """Where the GEMMs run on torch's float8 GEMM, each Triton cast also writes, in the same pass,
    the transposed copy its backward GEMM wants row-major (x for grad_weight, the weight for
    grad_input, the output gradient for grad_weight): no GEMM copies an operand, with the same
    bits as "scaled_mm", whose GEMMs transpose by a copy."""
    _float8_gemms(monkeypatch)
    transposes = []
    real = fp8_triton.delayed_cast

    def spy(*args, **kwargs):
        transposes.append(kwargs.get("transpose", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8fn._kernels.cast, "delayed_cast", spy)
    runs, copies = {}, {}
    for backend in ("scaled_mm", "triton"):
        recipe = fp8fn.DelayedScaling(backend=backend)
        state = fp8fn.init_state(recipe, ["fc"])
        gen = torch.Generator().manual_seed(2)  # dims of 16s: the float8 GEMM pads nothing
        x, w, b = (torch.randn(s, generator=gen) for s in ((32, 48), (16, 48), (16,)))
        loss = lambda x, w, b, s: fp8fn.linear(x, w, b, s["fc"], recipe).square().sum()  # noqa: E731
        state = fp8fn.update(state, torch.func.grad(loss, argnums=3)(x, w, b, state))
        with _CountOps() as mode:
            runs[backend] = torch.func.grad(loss, argnums=(0, 1, 2, 3))(x, w, b, state)
        copies[backend] = mode.ops.count("aten.clone.default")
    assert transposes == [True] * 6  # x, weight, grad_output, in both steps
    assert copies == {"scaled_mm": 3, "triton": 0}  # "scaled_mm" copies x, W and the gradient
    assert_bit_identical(runs["triton"], runs["scaled_mm"])


@pytest.mark.parametrize("gemm", ["emulated", "float8"])
def test_triton_backend_on_a_transform_is_one_pass_per_tensor_at_steady_state(monkeypatch, gemm):
    """`fn.apply` knows which histories are filled (`State.filled`): from step 2 each of a
    site's three casts is one kernel launch (the stored scale; no second pass). Bit for bit the
    emulated (or "scaled_mm") backend's outputs, gradients and observations over 3 steps."""
    import fp8fn._kernels.triton_jit as kernels

    if gemm == "float8":
        _float8_gemms(monkeypatch)
    launches = []
    real = kernels.wrap_triton
    monkeypatch.setattr(kernels, "wrap_triton", lambda k: launches.append(k) or real(k))
    runs = {}
    for backend in ("emulated" if gemm == "emulated" else "scaled_mm", "triton"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(24, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)
        )
        fn = fp8fn.transform(model, fp8fn.DelayedScaling(backend=backend))
        gen = torch.Generator().manual_seed(3)
        xs = [torch.randn(12, 24, generator=gen) * (1 + step) for step in range(3)]
        params = {k: v.detach() for k, v in model.named_parameters()}
        state, steps = fn.init(xs[0]), []
        for x in xs:
            launches.clear()
            grads, obs = torch.func.grad(
                lambda p, s: fn.apply(p, s, x).square().sum(), argnums=(0, 1)
            )(params, state)
            steps.append((grads, obs, len(launches)))
            state = fp8fn.update(state, obs)
        runs[backend] = steps
    *_, triton = runs.values()
    assert [launches for *_, launches in triton] == [12, 6, 6]  # 2 sites x 3 casts x (2, 1, 1)
    for (grads_a, obs_a, _), (grads_b, obs_b, _) in zip(*runs.values()):
        assert_bit_identical((grads_a, obs_a), (grads_b, obs_b))


def _non_view_ops(ops) -> collections.Counter:
    """The ops of `_CountOps.funcs` that are not views, by name (torch's float8 GEMM, whatever its
    overload's name, as "scaled_mm")."""
    names = [str(f.overloadpacket) for f in ops if not f.is_view]
    return collections.Counter("scaled_mm" if "scaled_mm" in n else n for n in names)


def _ops_per_linear(route: str) -> tuple[collections.Counter, collections.Counter]:
    """Non-view ops of one linear forward and backward, as `benchmarks/overhead.py` counts ops
    per linear: a middle layer `(64, 64)` (x, weight and bias require grad), step 2 (the stored
    scales in use), on plain autograd (`observe`, `backward`) or torch.func (`vjp`)."""
    recipe = fp8fn.DelayedScaling(backend="triton")
    gen = torch.Generator().manual_seed(0)
    x, w, b, g = (torch.randn(s, generator=gen) for s in ((64, 64), (64, 64), (64,), (64, 64)))
    state = fp8fn.observe(fp8fn.init_state(recipe, ["fc"]))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    fp8fn.linear(*leaves, state["fc"], recipe).backward(g)
    state = fp8fn.update(state, fp8fn.observations(state))
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    if route == "autograd":
        state = fp8fn.observe(state)
        with _CountOps() as fwd:
            out = fp8fn.linear(x, w, b, state["fc"], recipe)
        with _CountOps() as bwd:
            out.backward(g)
        observed = fp8fn.observations(state)
    else:
        x, w, b = x.detach(), w.detach(), b.detach()
        f = lambda x, w, b, s: fp8fn.linear(x, w, b, s["fc"], recipe)  # noqa: E731
        with _CountOps() as fwd:
            _, vjp = torch.func.vjp(f, x, w, b, state)
        with _CountOps() as bwd:
            *_, observed = vjp(g)
    want = torch.stack([ref_amax(x), ref_amax(w), ref_amax(g)])
    assert torch.equal(observed["fc"].amax_history[:, 0], want)
    return _non_view_ops(fwd.funcs), _non_view_ops(bwd.funcs)


@pytest.mark.parametrize("route", ["autograd", "func"])
@pytest.mark.parametrize("gemm", ["float8", "emulated"])
def test_ops_per_linear_on_the_triton_path(monkeypatch, gemm, route):
    """Pinned: the non-view ops of one linear forward + backward with backend="triton" (0.4
    before the fused observation, reciprocals and transposed copies: 16 and 17 with float8
    GEMMs; 26 and 27 emulated). With torch's float8 GEMM (a GPU's path): 3 casts, 3 GEMMs, the
    bias add and its gradient, and outside the op the state rows' `select_backward`s (and
    torch.func's `zeros_like`). No reciprocal, stack, copy or clone."""
    if gemm == "float8":
        _float8_gemms(monkeypatch)
    fwd, bwd = _ops_per_linear(route)
    float8 = gemm == "float8"
    gemms = {"scaled_mm": 1} if float8 else {"aten.mm": 1, "aten._to_copy": 2, "aten.mul": 2}
    assert fwd == {"fp8fn.scaled_cast": 2, "aten.add": 1, **gemms}
    gemms = {k: 2 * v for k, v in gemms.items()}
    outside = {"aten.select_backward": 2, **({"aten.zeros_like": 1} if route == "func" else {})}
    assert bwd == {"fp8fn.scaled_cast": 1, "aten.sum": 1, **outside, **gemms}
    total = fwd.total() + bwd.total()
    assert total == {"float8": 10, "emulated": 22}[gemm] + (route == "func")
