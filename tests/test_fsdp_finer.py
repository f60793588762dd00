"""The finer recipes' float8 all-gather in one process: each rank's shard cast with the whole
weight's scales gives, bit for bit, the bytes and scales of casting the whole weight
(`fp8fn/_numerics/planes.py`), whatever the shard cut splits; and the plane's operand is the
one the op's own quantizers make (those are torchao's, `tests/test_reference.py`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8fn
from fp8fn._numerics import planes
from fp8fn._numerics.fp8 import ceil_div
from fp8fn._ops.block_scaled import _WEIGHTS

RECIPES = [
    fp8fn.RowwiseScaling(),
    fp8fn.RowwiseScaling(hp_grad_weight=True),
    fp8fn.MXScaling(),
    fp8fn.MXScaling(scale_rounding="floor"),
    fp8fn.BlockwiseScaling(),
]
_IDS = ["rowwise", "rowwise_gw_hp", "mx_rceil", "mx_floor", "blockwise"]


def _weight(n, k, seed, dtype=torch.float32, special=False):
    """`(n, k)` with magnitudes over many binades; `special`: a zero row, a tiny block, inf and
    NaN elements."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g))
    if special:
        w[0] = 0.0
        w[n // 2, : k // 2] *= 2.0**-140
        w[n - 1, k - 1] = float("inf")
        w[n // 3, 0] = float("nan")
    return w.to(dtype)


def _ranks_cast(plane, weight, world):
    """What `world` FSDP2 ranks make of `weight` `(n, k)`: each holds rows `r * ceil(n /
    world)` on (the last ones may hold fewer, or none), takes its pieces' statistics, all
    ranks assemble the same grid from every rank's pieces, and each casts its rows; the rows
    gathered. Returns `(e4m3 (n, k), grid)` and checks the grids agree."""
    n, k = weight.shape
    rows = ceil_div(n, world)
    shards = [(r * rows, weight[r * rows : (r + 1) * rows]) for r in range(world)]
    pieces = [(first, planes.piece_stats(plane, s, first, n)) for first, s in shards]
    grid = planes.assemble(plane, pieces, n, k)
    fp8 = torch.cat([planes.cast_rows(plane, s, first, n, grid) for first, s in shards])
    return fp8, grid


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers (NaN payloads and signs included), for bit-for-bit checks."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_bits(a, b, nan_sign: bool = True):
    """`a` and `b` bit for bit; `nan_sign=False`: a NaN's sign bit aside (a NaN scale made
    through `log2` comes out with either sign)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if not nan_sign and a.is_floating_point():
        nan = a.float().isnan()
        assert torch.equal(nan, b.float().isnan())
        assert torch.equal(_bits(a)[~nan], _bits(b)[~nan])
        return
    assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("recipe", RECIPES, ids=_IDS)
@pytest.mark.parametrize("gemm", [0, 1])
@pytest.mark.parametrize("shape", [(256, 128), (96, 80), (7, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plane_operand_is_the_gemms_own_quantization(recipe, gemm, shape, dtype):
    """The whole plane's operand (bytes and scales, and under rowwise the bytes' layout)
    equals, bit for bit, the weight operand the finer op's GEMM quantizes itself, with a zero
    row, a tiny block, inf and NaN (whose sign bit may differ)."""
    weight = _weight(*shape, seed=sum(shape) + gemm, dtype=dtype, special=True)
    plane = planes.plane_of(recipe, gemm)
    got = planes.operand(plane, *planes.quantize(plane, weight))
    want = _WEIGHTS[type(recipe)](weight, recipe, gemm)
    for a, b in zip(got, want):
        _assert_same_bits(a, b, nan_sign=False)
    if isinstance(recipe, fp8fn.RowwiseScaling):  # its GEMM reads the bytes in their layout
        assert got[0].stride() == want[0].stride()  # (MX and blockwise pad them to blocks first)


@given(
    recipe=st.sampled_from(RECIPES),
    gemm=st.sampled_from([0, 1]),
    n=st.integers(1, 300),
    k=st.integers(1, 70),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    special=st.booleans(),
)
def test_shards_cast_with_the_whole_weights_scales_are_the_whole_cast(
    recipe, gemm, n, k, world, seed, special
):
    """Even, padded (uneven) and empty shards, cuts inside a block or a column: the ranks'
    bytes and the assembled grid are those of the one-process cast, bit for bit."""
    weight = _weight(n, k, seed, special=special and n >= 3 and k >= 2)
    plane = planes.plane_of(recipe, gemm)
    fp8, grid = _ranks_cast(plane, weight, world)
    want_fp8, want_grid = planes.quantize(plane, weight)
    _assert_same_bits(fp8, want_fp8)
    _assert_same_bits(grid, want_grid)
