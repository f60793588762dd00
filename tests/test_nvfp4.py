"""NVFP4 numerics (`_numerics/nvfp4.py`): torchao 0.18 parity, 2-D tiles, SR, RHT, random bits."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import bits as _bits
from _helpers import same, sqnr
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fp8fn._numerics import nvfp4 as nv

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    ao_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

E4M3 = torch.float8_e4m3fn
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
THRESHOLD = 2688 * 2.0**-121  # below this amax fp8fn's tensor scale is clamped (not torchao's)
SETTINGS = settings(max_examples=30, deadline=None)
ONE = torch.tensor(1.0)


def torchao_nvfp4(hp, tensor_scale):
    """torchao 0.18's (codes unpacked, e4m3 block scales, dequantized in hp's dtype)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale, packed = ao.nvfp4_quantize(hp, 16, tensor_scale)
        t = ao.NVFP4Tensor.to_nvfp4(hp, per_tensor_scale=tensor_scale)
        return ao_kernels.unpack_uint4(packed), scale, t.dequantize(hp.dtype)


def assert_matches_torchao(hp, tensor_scale, q):
    codes, scale, deq = torchao_nvfp4(hp, tensor_scale)
    assert same(q.block_scale, scale.view(q.block_scale.shape))
    # Codes in a block with a NaN scale carry no value (torchao's come from NaN payload bits).
    valid = ~scale.float().isnan().view(q.block_scale.shape).repeat_interleave(16, -1)
    assert torch.equal(q.codes[valid], codes[valid])
    assert same(nv.dequantize_nvfp4(*q, dtype=hp.dtype), deq)


SPECIALS = [0.0, -0.0, 6.0, -448.0, 2688.0, 1e-30, 2.0**-140, 3e38, -3e38, 0.25, 0.75, 5.0]


@st.composite
def matrices(draw, *, multiple_of_16=True, infinities=False, min_dims=2, max_dims=3):
    """A float32 tensor of 1 to 3 blocks per row, with values from the whole float32 range."""
    ndim = draw(st.integers(min_dims, max_dims))
    lead = [draw(st.integers(1, 3)) for _ in range(ndim - 1)]
    k = 16 * draw(st.integers(1, 3)) if multiple_of_16 else draw(st.integers(1, 50))
    floats = st.floats(width=32, allow_nan=False, allow_infinity=infinities)
    elements = st.one_of(st.floats(-10.0, 10.0, width=32), floats, st.sampled_from(SPECIALS))
    n = math.prod(lead) * k
    values = draw(st.lists(elements, min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float32).view(*lead, k)


# -- torchao parity --------------------------------------------------------------------------------


@SETTINGS
@given(hp=matrices(infinities=True), bf16=st.booleans())
def test_quantize_matches_torchao_single_level(hp, bf16):
    """torchao without a tensor scale == fp8fn with tensor_scale 1: codes, scales, dequant."""
    hp = hp.bfloat16() if bf16 else hp
    assert_matches_torchao(hp, None, nv.quantize_nvfp4(hp, ONE))


@SETTINGS
@given(hp=matrices(infinities=True), bf16=st.booleans())
def test_quantize_matches_torchao_two_level(hp, bf16):
    """The dynamic tensor scale amax / 2688 and everything after it, as torchao's."""
    hp = hp.bfloat16() if bf16 else hp
    amax = hp.abs().amax()
    assume(amax >= THRESHOLD)
    q = nv.quantize_nvfp4(hp)
    tensor_scale = ao.per_tensor_amax_to_scale(amax)
    assert same(q.tensor_scale, tensor_scale)
    assert_matches_torchao(hp, tensor_scale, q)


@SETTINGS
@given(hp=matrices(), shift=st.integers(-30, 30))
def test_quantize_matches_torchao_given_tensor_scale(hp, shift):
    """A tensor scale not from this tensor (a delayed one): block scales clamp at 448, 2**-6."""
    amax = hp.abs().amax()
    assume(amax >= THRESHOLD * 2.0**30)
    tensor_scale = ao.per_tensor_amax_to_scale(amax) * 2.0**shift
    assert_matches_torchao(hp, tensor_scale, nv.quantize_nvfp4(hp, tensor_scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_torchao_on_dense_data(dtype):
    """Many blocks of heavy-tailed data, for the rare values where the order of operations
    shows (a division instead of torchao's reciprocal multiply, amax / (6 * ts), ...)."""
    gen = torch.Generator().manual_seed(0)
    hp = torch.randn(256, 256, generator=gen) * (torch.randn(256, 256, generator=gen) * 2).exp()
    hp = hp.to(dtype)
    assert_matches_torchao(hp, None, nv.quantize_nvfp4(hp, ONE))
    tensor_scale = ao.per_tensor_amax_to_scale(hp.abs().amax())
    assert_matches_torchao(hp, tensor_scale, nv.quantize_nvfp4(hp))
    for shift in (-7.3, 5.1):  # a tensor scale that is not a power of two away
        scale = tensor_scale * 2.0**shift
        assert_matches_torchao(hp, scale, nv.quantize_nvfp4(hp, scale))


def _neighbours_f32(values, n):
    """`values` (float32) and their n float32 neighbours on each side."""
    out, up, down = [values], values, values
    for _ in range(n):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        out += [up, down]
    return torch.cat(out)


def test_quantize_matches_torchao_near_rounding_boundaries():
    """Block amaxes and data within a few ulps of e4m3 and E2M1 midpoints, where the order of
    torchao's operations decides: `amax / 6 / ts` (not `amax / (6 * ts)`) and
    `x * ((1 / ts) / scale)` (not `x * (1 / (ts * scale))`, not `x / (ts * scale)`)."""
    ts = ao.per_tensor_amax_to_scale(torch.tensor(2688.0 * 1.37))
    top = torch.zeros(1, 16)
    top[0, 0] = 2688.0 * 1.37
    # Block scales: amax near (e4m3 midpoint) * 6 * ts.
    e4m3 = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    e4m3 = e4m3[(e4m3 >= 2**-5) & (e4m3 <= 256)].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    amax = _neighbours_f32((mids.double() * 6 * ts.double()).float(), 6)
    scale_rows = F.pad(amax[:, None], (0, 15))
    # Data: each block's amax sets a block scale; the other 15 elements sit near E2M1 midpoints.
    big = _neighbours_f32(torch.linspace(0.05, 1.3, 40) * 2688, 0)
    scale = ((big / 6.0 / ts).clamp(2.0**-6, 448.0).to(E4M3)).float()
    encode = (1.0 / ts) / scale
    e2m1_mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = _neighbours_f32((e2m1_mids[None, :] / encode[:, None]).flatten(), 2).view(5, 40, 7)
    near = F.pad(near.permute(1, 0, 2).reshape(40, 35), (0, 10))  # 3 blocks of 15 per amax
    data_rows = torch.cat([big[:, None, None].expand(40, 3, 1), near.view(40, 3, 15)], -1)
    hp = torch.cat([top, scale_rows, data_rows.reshape(-1, 16)])
    q = nv.quantize_nvfp4(hp)
    assert same(q.tensor_scale, ts)
    assert_matches_torchao(hp, ts, q)
    # The alternatives differ on these inputs, so the test pins torchao's order.
    blocks_amax = hp.abs().amax(-1, keepdim=True)
    alt_scale = (blocks_amax / (6.0 * ts)).clamp(2.0**-6, 448.0).to(E4M3)
    assert not torch.equal(_bits(alt_scale), _bits(q.block_scale))
    s = q.block_scale.float()
    for y in (hp * (1.0 / (ts * s)), hp / (ts * s)):
        assert not torch.equal(nv.round_to_e2m1(y.clamp(-6, 6)), q.codes)


@SETTINGS
@given(hp=matrices(multiple_of_16=False, min_dims=1, max_dims=4))
def test_quantize_partial_block_is_zero_padding(hp):
    """k % 16 != 0 (torchao refuses it): as torchao on the zero-padded tensor, sliced."""
    k = hp.shape[-1]
    padded = F.pad(hp, (0, -k % 16)).reshape(-1, 16 * math.ceil(k / 16))
    q = nv.quantize_nvfp4(hp, ONE)
    codes, scale, deq = torchao_nvfp4(padded, None)
    assert same(q.block_scale.reshape(scale.shape), scale)
    assert torch.equal(q.codes.reshape(-1, k), codes[:, :k])
    assert same(nv.dequantize_nvfp4(*q).reshape(-1, k), deq[:, :k])


def test_round_to_e2m1_matches_torchao_on_every_kind_of_float():
    """RTNE to E2M1 == torchao's f32_to_f4_unpacked on random bit patterns and every tie."""
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31, (200_000,), generator=gen, dtype=torch.int64)
    y = patterns.to(torch.int32).view(torch.float32)
    mid = (GRID[1:] + GRID[:-1]).float() / 2
    near = torch.cat([mid, GRID.float(), torch.tensor([2.0**-149, 1e-30, 7.0, 1e30])])
    near = torch.cat([near, torch.nextafter(near, near + 1), torch.nextafter(near, near - 1)])
    y = torch.cat([y[~y.isnan()], near, -near, torch.tensor([float("inf"), -float("inf")])])
    assert torch.equal(nv.round_to_e2m1(y), ao_kernels.f32_to_f4_unpacked(y.clamp(-6, 6)))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    assert nv.round_to_e2m1(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 14]


def test_e2m1_values_and_packing_match_torchao():
    codes = torch.arange(16, dtype=torch.uint8)
    values = nv.e2m1_to_float32(codes)
    assert values.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert same(values, ao_kernels.f4_unpacked_to_f32(codes))
    assert torch.signbit(values[8])
    codes = torch.randint(0, 16, (3, 32), dtype=torch.uint8)
    packed = nv.pack_e2m1(codes)
    assert packed.shape == (3, 16) and torch.equal(packed, ao_kernels.pack_uint4(codes))
    assert torch.equal(nv.unpack_e2m1(packed), codes)
    x = torch.randn(4, 32)
    _, ao_packed = ao.nvfp4_quantize(x, 16, None)
    assert torch.equal(nv.pack_e2m1(nv.quantize_nvfp4(x, ONE).codes), ao_packed)


# -- zeros, tiny, NaN, inf -----------------------------------------------------------------------


def test_zero_tensor_quantizes_to_zeros_with_finite_scales():
    """torchao: amax 0 -> tensor scale 0 -> block scales 0 / 0 = NaN. fp8fn: 2**-121."""
    hp = torch.zeros(2, 32)
    hp[1] = -0.0
    q = nv.quantize_nvfp4(hp)
    assert q.tensor_scale.item() == 2.0**-121
    assert q.block_scale.float().eq(2.0**-6).all()
    assert q.codes[0].eq(0).all() and q.codes[1].eq(8).all()
    assert same(nv.dequantize_nvfp4(*q), hp)
    _, ao_scale, ao_deq = torchao_nvfp4(hp, ao.per_tensor_amax_to_scale(hp.abs().amax()))
    assert ao_scale.float().isnan().all() and ao_deq.isnan().all()


@pytest.mark.parametrize("amax, bound", [(3e-34, 0.1), (1e-37, 0.1), (1e-38, 0.3), (1e-40, 1.0)])
def test_tiny_tensor_stays_finite(amax, bound):
    """Below amax 2688 * 2**-121 the tensor scale is clamped: the result stays finite, as
    accurate as for normal data (relative error 0.087 here) down to ~1e-37; coarser below,
    where block scales reach their 2**-6 clamp; float32 subnormals (1e-40) flush to zero."""
    gen = torch.Generator().manual_seed(1)
    hp = torch.randn(8, 64, generator=gen)
    hp = hp / hp.abs().max() * amax
    q = nv.quantize_nvfp4(hp)
    assert q.tensor_scale.item() == 2.0**-121
    deq = nv.dequantize_nvfp4(*q).double()
    assert deq.isfinite().all()
    x = hp.double()
    assert (deq - x).norm() / x.norm() <= bound
    if bound == 1.0:
        assert deq.eq(0).all()


def test_nan_marks_its_block_and_dynamic_scale_marks_the_tensor():
    hp = torch.randn(2, 48)
    hp[0, 20] = float("nan")
    q = nv.quantize_nvfp4(hp, ONE)
    nan_scale = q.block_scale.float().isnan()
    assert nan_scale.tolist() == [[False, True, False], [False, False, False]]
    assert q.block_scale.view(torch.uint8)[0, 1].item() == 0x7F
    deq = nv.dequantize_nvfp4(*q)
    assert deq[0, 16:32].isnan().all() and deq[:, :16].isfinite().all()
    assert nv.dequantize_nvfp4(*nv.quantize_nvfp4(hp)).isnan().all()  # amax NaN: all NaN


def test_inf_saturates_with_a_given_scale_and_is_nan_with_a_dynamic_one():
    """As torchao: with a fixed tensor scale, inf -> block scale 448, code 7 (6 * 448 * ts):
    the overflow is hidden. With the dynamic scale (inf) every element dequantizes to NaN."""
    hp = torch.randn(2, 32)
    hp[1, 3] = -float("inf")
    q = nv.quantize_nvfp4(hp, ONE)
    assert q.codes[1, 3].item() == 15 and q.block_scale[1, 0].float().item() == 448.0
    assert nv.dequantize_nvfp4(*q)[1, 3].item() == -2688.0
    q = nv.quantize_nvfp4(hp)
    assert q.tensor_scale.isinf() and nv.dequantize_nvfp4(*q).isnan().all()


def test_block_scale_clamps_at_e4m3_smallest_normal():
    """torchao quirk kept: a block far below the tensor amax gets scale 2**-6, not an e4m3
    subnormal, so its values are quantized coarsely."""
    hp = torch.zeros(1, 32)
    hp[0, 0] = 2688.0  # tensor scale 1
    hp[0, 16:] = torch.linspace(0.001, 0.01, 16)  # amax / 6 = 0.0017, an e4m3 subnormal
    q = nv.quantize_nvfp4(hp)
    assert q.tensor_scale.item() == 1.0
    assert q.block_scale.float().tolist() == [[448.0, 2.0**-6]]
    assert nv.dequantize_nvfp4(*q)[0, 16:].unique().tolist() == [0.0, 2.0**-7]


# -- 2-D tiles -----------------------------------------------------------------------------------


@SETTINGS
@given(
    lead=st.lists(st.integers(1, 2), max_size=1),
    m=st.integers(1, 40),
    k=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
)
def test_tile_2d_transpose_is_the_same_quantization(lead, m, k, seed, bf16):
    """quantize(W, tile_2d) dequantized and transposed == quantize(W.T, tile_2d) dequantized."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, m, k, generator=gen) * torch.randn(*lead, m, k, generator=gen).exp()
    w = w.bfloat16() if bf16 else w
    a = nv.quantize_nvfp4(w, tile_2d=True)
    b = nv.quantize_nvfp4(w.transpose(-1, -2), tile_2d=True)
    assert torch.equal(a.codes.transpose(-1, -2), b.codes)
    assert same(nv.dequantize_nvfp4(*a).transpose(-1, -2), nv.dequantize_nvfp4(*b))
    # Each tile's scale is repeated on its rows: scale rows within a tile are equal.
    tiles = a.block_scale.float()
    assert torch.equal(tiles, tiles[..., ::16, :].repeat_interleave(16, -2)[..., :m, :])


def test_tile_2d_scale_is_the_tile_amax_scale():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 72, generator=gen)
    q = nv.quantize_nvfp4(w, tile_2d=True)
    padded = F.pad(w, (0, 8, 0, 8))
    for i in range(3):
        for j in range(5):
            amax = padded[16 * i : 16 * i + 16, 16 * j : 16 * j + 16].abs().max()
            expected = (amax / 6.0 / q.tensor_scale).clamp(2.0**-6, 448.0).to(E4M3)
            assert torch.equal(_bits(q.block_scale[16 * i, j]), _bits(expected))


def test_tile_2d_equals_1d_when_each_row_holds_its_tile_amax():
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(32, 48, generator=gen) * 2 - 1) * torch.where(torch.arange(32) < 16, 1, 0.4)[
        :, None
    ]
    w[:, ::16] = torch.where(torch.arange(32) < 16, 3.0, 0.5)[:, None]  # every row: tile amax
    a, b = nv.quantize_nvfp4(w, tile_2d=True), nv.quantize_nvfp4(w)
    assert torch.equal(a.codes, b.codes) and same(a.block_scale, b.block_scale)


# -- stochastic rounding -------------------------------------------------------------------------


def _neighbours(y):
    """float64 grid neighbours (lo <= |y| <= hi) of the scaled magnitudes `|y|` (<= 6)."""
    a = y.double().abs().clamp(max=6.0)
    lo = GRID[torch.searchsorted(GRID, a, right=True) - 1]
    hi = GRID[torch.searchsorted(GRID, a, right=False).clamp(max=7)]
    return lo, hi


def _scaled(hp, q):
    """The float32 scaled data `clamp(hp * encode)` that the quantizer rounds."""
    encode = (1.0 / q.tensor_scale) / q.block_scale.float()
    return (hp.float() * encode.repeat_interleave(16, -1)[..., : hp.shape[-1]]).clamp(-6, 6)


def _e2m1_reference(y, bits=None):
    """E2M1 codes of float32 `y` from the definition, in float64: |y| clamped to 6 (NaN: 0),
    the nearest grid value with ties to the even code, or (`bits` `r`, Python ints) the
    upper neighbour when `r < frac * 2**32`, `frac` the position between the neighbours."""
    a = y.double().abs().clamp(max=6.0).nan_to_num(0.0)
    lo = (GRID[None, :] <= a[:, None]).sum(1) - 1  # the largest grid index <= a
    hi = torch.clamp(lo + (GRID[lo] < a).long(), max=7)
    frac = ((a - GRID[lo]) / (GRID[hi] - GRID[lo]).clamp(min=0.5)).tolist()  # exact
    up = []
    for i, f in enumerate(frac):
        if bits is None:  # nearest; a tie (f == 0.5) goes to the even index
            up.append(f > 0.5 or (f == 0.5 and lo[i].item() % 2 == 1))
        else:
            up.append(bits[i] < f * 2**32)
    code = lo + torch.tensor(up, dtype=torch.long)
    return (code + 8 * torch.signbit(y).long()).to(torch.uint8)


def test_round_to_e2m1_matches_a_float64_reference_at_the_edges():
    """RTNE and SR against `_e2m1_reference`: every grid value, midpoint and their float32
    neighbours, E2M1's subnormals (0.25, 0.5, 0.75), float32 subnormals, 6 and above, inf,
    NaN of both signs, -0.0; SR with the bits just below, at and above `frac * 2**32`."""
    grid = GRID.float()
    mid = (grid[1:] + grid[:-1]) / 2
    edges = torch.cat([grid, mid, torch.tensor([2.0**-149, 2.0**-126, 1e-30, 5.9, 6.5, 1e30])])
    edges = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
    specials = torch.tensor([float("inf"), float("nan"), 0.0])
    y = torch.cat([edges, -edges, specials, -specials])
    assert torch.equal(nv.round_to_e2m1(y), _e2m1_reference(y))
    # SR: for each value, bits at the threshold ceil(frac * 2**32) and one either side
    a = y.double().abs().clamp(max=6.0).nan_to_num(0.0)
    lo = (GRID[None, :] <= a[:, None]).sum(1) - 1
    hi = torch.clamp(lo + (GRID[lo] < a).long(), max=7)
    frac = ((a - GRID[lo]) / (GRID[hi] - GRID[lo]).clamp(min=0.5)).tolist()
    for offset in (-1, 0, 1):
        bits = [min(max(math.ceil(f * 2**32) + offset, 0), 2**32 - 1) for f in frac]
        codes = nv.round_to_e2m1(y, torch.tensor(bits))
        assert torch.equal(codes, _e2m1_reference(y, bits))
    gen = torch.Generator().manual_seed(19)  # and random float32 bit patterns with random bits
    y = torch.randint(-(2**31), 2**31, (20_000,), generator=gen).to(torch.int32).view(torch.float32)
    bits = torch.randint(0, 2**32, y.shape, generator=gen)
    assert torch.equal(nv.round_to_e2m1(y), _e2m1_reference(y))
    assert torch.equal(nv.round_to_e2m1(y, bits), _e2m1_reference(y, bits.tolist()))


@SETTINGS
@given(hp=matrices(multiple_of_16=False, infinities=True), tile_2d=st.booleans(), sr=st.booleans())
def test_quantize_dequantize_is_dequantize_of_quantize(hp, tile_2d, sr):
    """The round trip without codes is `dequantize_nvfp4(*quantize_nvfp4(...))` bit for bit,
    RTNE and SR, blocks and tiles, partial blocks, inf and NaN (a NaN block stays NaN)."""
    if sr:
        hp = hp.clone()
        hp.view(-1)[::7] = float("nan")
    bits = nv.random_bits(nv.make_key(20), 0, 2, hp.shape) if sr else None
    expected = nv.dequantize_nvfp4(*nv.quantize_nvfp4(hp, tile_2d=tile_2d, sr_bits=bits))
    assert same(nv.quantize_dequantize_nvfp4(hp, tile_2d=tile_2d, sr_bits=bits), expected)
    y = torch.cat([hp.flatten(), -hp.flatten(), torch.tensor([float("nan"), -float("nan")])])
    values = nv.e2m1_to_float32(nv.round_to_e2m1(y))
    assert same(nv.round_to_e2m1_values(y), values)


def test_sr_leaves_representable_values_unchanged():
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    codes[:, ::16] = 7  # each block's amax is 6 * its scale, so every value is exact
    scale = 2.0 ** torch.randint(-5, 6, (8, 4), generator=gen).float()
    hp = nv.e2m1_to_float32(codes) * scale.repeat_interleave(16, -1)
    rtne = nv.quantize_nvfp4(hp, ONE)
    assert torch.equal(nv.dequantize_nvfp4(*rtne), hp)
    for bits in (torch.zeros_like(codes, dtype=torch.int64), torch.full(hp.shape, 2**32 - 1)):
        assert torch.equal(nv.quantize_nvfp4(hp, ONE, sr_bits=bits).codes, rtne.codes)
    bits = nv.random_bits(nv.make_key(4), 0, 2, hp.shape)
    assert torch.equal(nv.quantize_nvfp4(hp, ONE, sr_bits=bits).codes, rtne.codes)


def test_sr_extreme_bits_round_away_from_and_toward_zero():
    """bits 0: up whenever the fraction is > 0 (away from zero); bits 2**32 - 1: never up."""
    gen = torch.Generator().manual_seed(5)
    hp = torch.randn(16, 64, generator=gen)
    q = nv.quantize_nvfp4(hp)
    lo, hi = _neighbours(_scaled(hp, q))
    up = nv.quantize_nvfp4(hp, sr_bits=torch.zeros(hp.shape, dtype=torch.int64))
    down = nv.quantize_nvfp4(hp, sr_bits=torch.full(hp.shape, 2**32 - 1))
    assert torch.equal(nv.e2m1_to_float32(up.codes).abs().double(), hi)
    assert torch.equal(nv.e2m1_to_float32(down.codes).abs().double(), lo)
    assert (hi > lo).float().mean() > 0.9  # the test saw inexact values


def test_sr_rounds_up_with_probability_exactly_the_fraction():
    """Over 256 evenly spaced bit patterns, a value m/256 of a step above a grid point rounds
    up exactly m times (no bias beyond the 2**-32 granularity)."""
    m = torch.arange(256)
    y = 2.0 + m / 256.0  # on [2, 4) the step is 1: fraction m / 256
    bits = torch.arange(256) * 2**24  # 0, 2**24, ..., 2**32 - 2**24
    codes = nv.round_to_e2m1(y[:, None].expand(256, 256), bits.expand(256, 256))
    ups = (codes == 5).sum(1)
    assert torch.equal(ups, m) and codes.le(5).all() and codes.ge(4).all()


def _hoeffding(ranges_sq, n, failure=1e-7):
    """Deviation bound of a mean of n draws of a sum of independent bounded terms: with
    probability >= 1 - failure (for all elements together), |mean - E| <= bound."""
    return torch.sqrt(ranges_sq * math.log(2 * ranges_sq.numel() / failure) / (2 * n))


def _exact_scale_matrix(rows, k, seed):
    """Blocks whose amax is 6 * 2**e: block scale 2**e exactly, so quantization is exact but
    for the rounding of the data (E[SR(x)] = x)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-3, 4, (rows, k // 16), generator=gen).double()
    x = (torch.rand(rows, k, generator=gen, dtype=torch.float64) * 12 - 6).float().double()
    x[:, ::16] = 6.0 * torch.where(torch.rand(rows, k // 16, generator=gen) < 0.5, 1.0, -1.0)
    return (x * scale.repeat_interleave(16, -1)).float(), scale.repeat_interleave(16, -1)


def test_sr_is_unbiased():
    """Mean over N draws of dequantize(SR(x)) -> x within a Hoeffding bound per element, and a
    total z-score within 5; round-to-nearest-even fails the same bound."""
    n = 4096
    x, scale = _exact_scale_matrix(4, 64, seed=6)
    draws = x.expand(n, *x.shape)
    bits = nv.random_bits(nv.make_key(6), 0, 2, draws.shape)
    deq = nv.dequantize_nvfp4(*nv.quantize_nvfp4(draws, ONE, sr_bits=bits)).double()
    mean = deq.mean(0)
    lo, hi = _neighbours(x.double() / scale)
    lo, hi = lo * scale, hi * scale
    width = hi - lo
    granularity = width * 2.0**-32
    assert ((mean - x.double()).abs() <= _hoeffding(width**2, n) + granularity).all()
    var = (hi - x.double().abs()) * (x.double().abs() - lo)
    z = (mean - x.double()).sum() / torch.sqrt(var.sum() / n)
    assert z.abs() < 5
    assert (width > 0).float().mean() > 0.9  # the test saw inexact values
    rtne = nv.dequantize_nvfp4(*nv.quantize_nvfp4(x, ONE)).double()
    assert ((rtne - x.double()).abs() > _hoeffding(width**2, n)).any()


def test_sr_is_unbiased_except_where_a_rounded_down_block_scale_saturates():
    """Any data, dynamic scales: the mean converges to clamp(x * encode, -6, 6) * decode, which
    is x (to float32 rounding) wherever |x * encode| <= 6. The block amax saturates when its
    e4m3 scale rounded down: a bias SR inherits from the scales (RTNE clips it too)."""
    n = 4096
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, generator=gen)
    draws = x.expand(n, *x.shape)
    q = nv.quantize_nvfp4(draws, sr_bits=nv.random_bits(nv.make_key(7), 0, 2, draws.shape))
    mean = nv.dequantize_nvfp4(*q).double().mean(0)
    rtne = nv.quantize_nvfp4(x)
    assert same(q.block_scale[0], rtne.block_scale) and same(q.tensor_scale, rtne.tensor_scale)
    decode = (q.tensor_scale * rtne.block_scale.float()).double().repeat_interleave(16, -1)
    y = _scaled(x, rtne).double()
    expected = y * decode
    lo, hi = _neighbours(y)
    width = (hi - lo) * decode
    slack = 1e-6 * x.double().abs()  # the float32 product code * decode
    assert ((mean - expected).abs() <= _hoeffding(width**2, n) + slack).all()
    unclipped = (x.double().abs() * (decode.reciprocal())) <= 6 * (1 - 1e-6)
    assert torch.allclose(expected[unclipped], x.double()[unclipped], rtol=1e-6, atol=0)
    assert (~unclipped).any()  # some block amax did saturate (the bias is real)


def test_sr_product_is_unbiased():
    """Mean over N draws of dequantize(SR(a)) @ b -> a @ b (Hoeffding bound per output)."""
    n = 4096
    a, scale = _exact_scale_matrix(8, 64, seed=8)
    b = torch.randn(64, 16, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    draws = a.expand(n, *a.shape)
    bits = nv.random_bits(nv.make_key(8), 1, 2, draws.shape)
    deq = nv.dequantize_nvfp4(*nv.quantize_nvfp4(draws, ONE, sr_bits=bits)).double()
    mean = (deq @ b).mean(0)
    lo, hi = _neighbours(a.double() / scale)
    width = (hi - lo) * scale
    ranges_sq = (width**2) @ (b**2)
    exact = a.double() @ b
    assert ((mean - exact).abs() <= _hoeffding(ranges_sq, n) + 1e-9).all()
    var = ((hi * scale - a.double().abs()) * (a.double().abs() - lo * scale)) @ (b**2)
    assert ((mean - exact).sum() / torch.sqrt(var.sum() / n)).abs() < 5
    rtne = nv.dequantize_nvfp4(*nv.quantize_nvfp4(a, ONE)).double() @ b
    assert ((rtne - exact).abs() > _hoeffding(ranges_sq, n)).any()


def test_sr_bits_use_the_low_32_bits_of_any_integer_dtype():
    x = torch.randn(4, 32)
    bits = nv.random_bits(nv.make_key(10), 0, 2, x.shape)
    expected = nv.quantize_nvfp4(x, sr_bits=bits).codes
    as_int32 = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)
    assert torch.equal(nv.quantize_nvfp4(x, sr_bits=as_int32).codes, expected)
    assert torch.equal(nv.quantize_nvfp4(x, sr_bits=bits + 2**40).codes, expected)


# -- random Hadamard transform -------------------------------------------------------------------


def _sylvester16():
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / 4


def test_hadamard_is_signs_times_sylvester():
    signs = nv.hadamard_signs(nv.make_key(11), 0, 1).double()
    matrix = torch.diag(signs) @ _sylvester16()
    assert torch.equal(nv.random_hadamard(torch.eye(16, dtype=torch.float64), signs), matrix)
    assert torch.equal(matrix @ matrix.T, torch.eye(16, dtype=torch.float64))
    x = torch.randn(5, 48, dtype=torch.float64)
    expected = (x.view(5, 3, 16) @ matrix).view(5, 48)
    assert torch.allclose(nv.random_hadamard(x, signs), expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("k", [64, 50])
def test_hadamard_on_both_operands_leaves_the_product_unchanged(k):
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(32, k, generator=gen, dtype=torch.float64)
    b = torch.randn(24, k, generator=gen, dtype=torch.float64)
    signs = nv.hadamard_signs(nv.make_key(12), 3, 1)
    ah, bh = nv.random_hadamard(a, signs), nv.random_hadamard(b, signs)
    assert ah.shape == (32, 16 * math.ceil(k / 16)) and ah.dtype == torch.float64
    assert torch.allclose(ah @ bh.T, a @ b.T, rtol=0, atol=1e-12)
    back = nv.random_hadamard(ah, signs, inverse=True)
    assert torch.allclose(back[:, :k], a, rtol=0, atol=1e-15)
    assert (back[:, k:].abs() < 1e-15).all()


def test_hadamard_low_precision_inputs_give_float32():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    signs = nv.hadamard_signs(nv.make_key(13), 0, 1)
    y = nv.random_hadamard(x, signs)
    assert y.dtype == torch.float32
    assert torch.equal(y, nv.random_hadamard(x.float(), signs))


# -- randomness as data ----------------------------------------------------------------------------


def test_random_bits_golden_values():
    """The generator is part of the format of a saved state: pin its output."""
    key = nv.make_key(0)
    assert key.item() == 4073552104164651883
    assert nv.random_bits(key, 3, 2, (6,)).tolist() == [
        2634249955,
        1527267120,
        2454801365,
        1181896488,
        3458314082,
        3817887176,
    ]
    signs = nv.hadamard_signs(key, 3, 2).tolist()
    assert signs == [1, 1, -1, -1, -1, 1, -1, 1, -1, -1, -1, -1, -1, -1, -1, 1]


def test_random_bits_deterministic_and_shaped():
    key = nv.make_key(14)
    a = nv.random_bits(key, 5, 2, (3, 4, 5))
    assert a.shape == (3, 4, 5) and a.dtype == torch.int64
    assert torch.equal(a, nv.random_bits(key.clone(), 5, 2, (3, 4, 5)))
    assert torch.equal(a, nv.random_bits(key, torch.tensor(5), torch.tensor(2), (3, 4, 5)))
    assert torch.equal(a.flatten(), nv.random_bits(key, 5, 2, (60,)))
    assert a.min() >= 0 and a.max() < 2**32


def _chi2_ok(counts):
    """chi-square of `counts` against uniform within 6 sigma of its mean (df = bins - 1)."""
    expected = counts.sum() / counts.numel()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    df = counts.numel() - 1
    return abs(chi2 - df) < 6 * math.sqrt(2 * df)


def test_random_bits_look_uniform():
    n = 100_000
    bits = nv.random_bits(nv.make_key(15), 7, 2, (n,))
    for shift in (0, 12, 24):  # low, middle and top byte
        assert _chi2_ok(torch.bincount((bits >> shift) & 255, minlength=256).double())
    ones = ((bits[:, None] >> torch.arange(32)) & 1).sum(0).double()
    assert ((ones - n / 2).abs() < 5 * math.sqrt(n / 4)).all()
    u = bits.double() / 2**32
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 5 / math.sqrt(n)
    assert not _chi2_ok(torch.bincount(torch.arange(n) & 255, minlength=256).double())


@pytest.mark.parametrize(
    "other",
    [(16, 7, 2, 0), (15, 8, 2, 0), (15, 7, 1, 0), (15, 7, 2, 1), (2**32 + 15, 7, 2, 0)],
    ids=["key", "site", "role", "stream", "key_high_bits"],
)
def test_random_bits_of_other_inputs_look_independent(other):
    n = 100_000
    base = nv.random_bits(torch.tensor(15), 7, 2, (n,))
    key, site, role, stream = other
    bits = nv.random_bits(torch.tensor(key), site, role, (n,), stream=stream)
    assert (bits == base).sum() <= 2
    u, v = base.double() / 2**32, bits.double() / 2**32
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 5 / math.sqrt(n)
    joint = (base >> 28) * 16 + (bits >> 28)
    assert _chi2_ok(torch.bincount(joint, minlength=256).double())


def test_mul32_and_mix32_are_exact_32_bit_arithmetic():
    gen = torch.Generator().manual_seed(16)
    x = torch.cat([torch.randint(0, 2**32, (10_000,), generator=gen), torch.tensor([0, 2**32 - 1])])
    for c in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        assert nv._mul32(x, c).tolist() == [(v * c) % 2**32 for v in x.tolist()]
    mixed = nv.mix32(torch.arange(100_000))
    assert mixed.unique().numel() == 100_000 and mixed.max() < 2**32


def _random_bits_reference(key, site, role, stream, counters):
    """`random_bits` from its definition in Python ints (exact 32-bit arithmetic)."""

    def mix(x):
        x ^= x >> 16
        x = x * 0x7FEB352D % 2**32
        x ^= x >> 15
        x = x * 0x846CA68B % 2**32
        return x ^ (x >> 16)

    lane_a, lane_b = 0x243F6A88, 0x13198A2E
    for word in (key % 2**32, (key >> 32) % 2**32, site % 2**32, role % 2**32, stream):
        lane_a, lane_b = mix(lane_a ^ word), mix(lane_b ^ word ^ 0x85A308D3)
    out = []
    for i in counters:
        high = (i >> 32) % 2**32 * 0x9E3779B9 % 2**32
        out.append(mix(mix(lane_a ^ (i % 2**32)) ^ lane_b ^ high))
    return out


@pytest.mark.parametrize("key", [0, 4073552104164651883, 2**63 - 1, -5])
def test_random_bits_match_a_python_int_reference(key):
    """The int32 wrap-around arithmetic gives the exact 32-bit hash: counters in order (odd
    length, past the vector width), and given counters with high words, negative ones."""
    k = torch.tensor(key)
    bits = nv.random_bits(k, 2**32 + 7, -3, (5, 7), stream=6)
    assert bits.flatten().tolist() == _random_bits_reference(key, 2**32 + 7, -3, 6, range(35))
    counters = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 3, 2**63 - 1, -1, -(2**63)]
    index = torch.tensor(counters)
    bits = nv.random_bits(k, 5, 2, index.shape, index=index)
    assert bits.tolist() == _random_bits_reference(key, 5, 2, 0, counters)


def test_make_key():
    key = nv.make_key(3)
    assert 0 <= key.item() < 2**62 and nv.make_key(3).item() == key.item()
    keys = sorted(nv.make_key(s).item() for s in range(1000))
    assert min(b - a for a, b in zip(keys, keys[1:])) > 2**32  # 2**32 steps never overlap


@pytest.mark.slow
def test_random_bits_compiled_equal_eager():
    torch._dynamo.reset()
    compiled = torch.compile(nv.random_bits, fullgraph=True)
    for key in (nv.make_key(17), torch.tensor(-5), torch.tensor(2**63 - 1)):
        assert torch.equal(compiled(key, 3, 2, (64, 48)), nv.random_bits(key, 3, 2, (64, 48)))
    signs = torch.compile(nv.hadamard_signs, fullgraph=True)(nv.make_key(17), 3, 1)
    assert torch.equal(signs, nv.hadamard_signs(nv.make_key(17), 3, 1))


@pytest.mark.slow
def test_quantize_compiled_equal_eager():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(32, 80, generator=gen) * torch.randn(32, 80, generator=gen).exp()
    bits = nv.random_bits(nv.make_key(18), 0, 2, x.shape)

    def run(x, bits):
        q = nv.quantize_nvfp4(x, sr_bits=bits)
        t = nv.quantize_nvfp4(x, tile_2d=True)
        return q, nv.dequantize_nvfp4(*q), t

    eager, compiled = run(x, bits), torch.compile(run, fullgraph=True)(x, bits)
    for e, c in zip(
        torch.utils._pytree.tree_leaves(eager), torch.utils._pytree.tree_leaves(compiled)
    ):
        assert same(c, e)


# -- errors --------------------------------------------------------------------------------------


def test_errors():
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match=r"quantize_nvfp4: expected a floating-point tensor"):
        nv.quantize_nvfp4(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"at least 2 dims for tile_2d=True, got shape \(32,\)"):
        nv.quantize_nvfp4(x[0], tile_2d=True)
    with pytest.raises(ValueError, match=r"`tensor_scale` to be a 0-dim .* got \(1,\)"):
        nv.quantize_nvfp4(x, torch.ones(1))
    with pytest.raises(TypeError, match=r"`sr_bits` to be an integer tensor, got torch.float32"):
        nv.quantize_nvfp4(x, sr_bits=torch.rand(4, 32))
    with pytest.raises(ValueError, match=r"`sr_bits` of shape \(4, 32\).*got \(32,\)"):
        nv.quantize_nvfp4(x, sr_bits=torch.zeros(32, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"random_bits: expected `key` to be a 0-dim int64"):
        nv.random_bits(torch.tensor(1, dtype=torch.int32), 0, 0, (4,))
    with pytest.raises(ValueError, match=r"random_hadamard: expected `signs` of shape \(16,\)"):
        nv.random_hadamard(x, torch.ones(8))


# -- accuracy ------------------------------------------------------------------------------------


def test_sqnr_on_gaussian_data():
    """SQNR (dB) of quantize -> dequantize of torch.randn(256, 256) against float32."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    key = nv.make_key(0)
    signs = nv.hadamard_signs(key, 0, 1)
    xh = nv.random_hadamard(x, signs)
    figures = {
        "rtne": sqnr(x, nv.dequantize_nvfp4(*nv.quantize_nvfp4(x))),
        "tile_2d": sqnr(x, nv.dequantize_nvfp4(*nv.quantize_nvfp4(x, tile_2d=True))),
        "sr": sqnr(
            x,
            nv.dequantize_nvfp4(*nv.quantize_nvfp4(x, sr_bits=nv.random_bits(key, 0, 2, x.shape))),
        ),
        "rht": sqnr(
            x,
            nv.random_hadamard(nv.dequantize_nvfp4(*nv.quantize_nvfp4(xh)), signs, inverse=True),
        ),
    }
    print(figures)
    assert (
        figures["rtne"] > 20
        and figures["rht"] > 20
        and figures["tile_2d"] > 18.5
        and figures["sr"] > 16.5
    )
    assert figures["sr"] < figures["rtne"] - 2  # SR trades variance for no bias
    assert figures["tile_2d"] < figures["rtne"]  # one scale per 256 elements, not 16
