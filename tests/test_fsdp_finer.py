"""The finer recipes' float8 all-gather in one process: each rank's shard cast with the whole
weight's scales gives, bit for bit, the bytes and scales of casting the whole weight
(`fp8fn/_parallel/planes.py`), whatever the shard cut splits; and the plane's operand is the
one the op's own quantizers make (those are torchao's, `tests/test_reference.py`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fsdp import _Mesh

import fp8fn
from fp8fn._numerics.fp8 import ceil_div
from fp8fn._ops.rowwise_blockwise_mx import _WEIGHTS
from fp8fn._parallel import planes
from fp8fn._parallel.fsdp_finer import FinerGatheredWeight, FinerScales
from fp8fn._parallel.fsdp_gather import GATHER_SCALES, Float8ShardWeight, ScalesForCall

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


# --- FSDP2's hooks and the op, in one process --------------------------------------------------


def _plan(recipe, weight):
    """The step's `FinerScales` of `weight` as `finer_scales` makes them on every rank: the
    statistics of the whole weight's groups, for the planes of both GEMMs."""
    n, k = weight.shape
    grids = {}
    for gemm in (0, 1):
        plane = planes.plane_of(recipe, gemm)
        grids[plane] = planes.quantize(plane, weight)[1]
    return FinerScales(recipe, (n, k), grids)


class _FakeFsdp2:
    """What FSDP2 does with `Float8ShardWeight` shards of one weight on `world` ranks: each
    rank's pre-all-gather hook (in `apply`'s forward: `plan` in `GATHER_SCALES`; outside: the
    backward re-gather), the all-gather (a concatenation), the post-all-gather hook (a new
    unsharded weight, or `out` refilled: its bytes rewritten in place), and the unpadding
    view. `inputs` records each all-gather's inputs. (An experts weight `(E, a, b)`: the same,
    along its experts.)"""

    def __init__(self, weight, world):
        n = weight.shape[0]
        rows = ceil_div(n, world)
        self.shards = [Float8ShardWeight(t, "fc") for t in weight.split(rows)]
        self.shards += [Float8ShardWeight(weight[n:], "fc")] * (world - len(self.shards))
        self.shape, self.world, self.inputs = tuple(weight.shape), world, []

    def gather(self, plan=None, out=None):
        token = GATHER_SCALES.set(None if plan is None else ScalesForCall({(None, "weight"): plan}))
        try:
            pre = [
                s.fsdp_pre_all_gather(_Mesh(self.world, r), self.shape, None, None, None)
                for r, s in enumerate(self.shards)
            ]
        finally:
            GATHER_SCALES.reset(token)
        self.inputs.append([p[0] for p in pre])
        outputs = [torch.cat([p[0][i] for p in pre]) for i in range(len(pre[0][0]))]
        if out is not None:
            out._data.view(torch.uint8).copy_(outputs[0][: self.shape[0]])
            assert (
                self.shards[0].fsdp_post_all_gather(outputs, pre[0][1], torch.float32, out=out)
                is None
            )
            return out
        gathered, _ = self.shards[0].fsdp_post_all_gather(outputs, pre[0][1], torch.float32)
        stride = torch.empty(self.shape).stride()
        return torch.nn.Parameter(torch.as_strided(gathered, self.shape, stride, 0))


@pytest.mark.parametrize("recipe", RECIPES, ids=_IDS)
@pytest.mark.parametrize("n", [64, 37])  # even; uneven (padded), cuts inside groups
@pytest.mark.parametrize("regather", [True, False])
def test_gathered_weight_runs_the_op_as_the_weight_does(recipe, n, regather, monkeypatch):
    """The finer op on FSDP2's float8-gathered weight gives the bits of the op on the weight
    itself: output, input, weight and bias gradients. The forward all-gather carries the output
    GEMM's plane only: the bytes of the whole weight's plane; the backward takes the grad_input
    GEMM's plane from FSDP2's re-gather (`regather`), or, where FSDP2 does not re-gather (the
    root; reshard_after_forward=False), all-gathers it itself once (blockwise: the one plane,
    no all-gather)."""
    from fp8fn._parallel import fsdp_finer

    k, world = 48, 2
    weight = _weight(n, k, seed=n)
    fsdp2 = _FakeFsdp2(weight, world)
    own = []

    class AllGather:  # the op's own all-gather: every rank's shard cast to the plane it needs
        @staticmethod
        def apply(local, group, rows):
            plane = planes.plane_of(recipe, 1)
            own.append(plane)
            casts = [
                planes.cast_rows(plane, s._tensor, r * ceil_div(n, world), n, plan.grids[plane])
                for r, s in enumerate(fsdp2.shards)
            ]
            assert torch.equal(casts[0].view(torch.uint8), local.view(torch.uint8))
            return torch.cat(casts)[:rows]

    monkeypatch.setattr(fsdp_finer, "AllGather", AllGather)
    plan = _plan(recipe, weight)
    gathered = fsdp2.gather(plan)
    assert type(gathered) is FinerGatheredWeight and gathered.dtype == torch.float32
    rows_plane = planes.plane_of(recipe, 0)
    want_fp8, _ = planes.quantize(rows_plane, weight)
    _assert_same_bits(gathered._data, want_fp8)  # the output GEMM's plane, bit for bit
    assert len(fsdp2.inputs[0][0]) == 1  # the bytes alone: one input per rank, of the padded shard
    assert fsdp2.inputs[0][0][0].shape == (ceil_div(n, world), k)

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, k, generator=g, requires_grad=True)
    bias = torch.randn(n, generator=g, requires_grad=True)
    results = []
    for w in (gathered, torch.nn.Parameter(weight.clone())):
        out = fp8fn.linear(x, w, bias, None, recipe)
        if w is gathered and regather:  # FSDP2's backward re-gather, into the same weight
            fsdp2.gather(out=gathered)
            grad_plane = planes.plane_of(recipe, 1)
            _assert_same_bits(gathered._data, planes.quantize(grad_plane, weight)[0])
        out.square().sum().backward()
        results.append((out, x.grad, w.grad, bias.grad))
        x.grad = bias.grad = None
    for a, b in zip(*results):
        _assert_same_bits(a, b)
    refetched = not regather and not isinstance(recipe, fp8fn.BlockwiseScaling)
    assert len(own) == int(refetched), own


@pytest.mark.parametrize(
    "recipe", RECIPES[:1] + RECIPES[2:3] + RECIPES[4:], ids=["rowwise", "mx", "blockwise"]
)
def test_gathered_weight_is_its_dequantized_plane_elsewhere(recipe):
    weight = _weight(40, 64, seed=3)
    gathered = _FakeFsdp2(weight, 2).gather(_plan(recipe, weight))
    dequantized = gathered + 0  # a plain forward outside fp8fn.apply
    assert type(dequantized) is torch.Tensor and dequantized.shape == (40, 64)
    error = (dequantized - weight).norm() / weight.norm()
    assert 0 < error < 0.05, error
    with pytest.raises(RuntimeError, match=r"^fp8fn\.float8_all_gather: the gathered float8 weig"):
        with torch.no_grad():
            gathered.add_(1.0)


class _FakeMesh:
    """A 1-D device mesh of `world` ranks seen from `rank` (what `finer_scales` reads)."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def size(self):
        return self.world

    def get_local_rank(self):
        return self.rank

    def get_group(self):
        return "group"


class _ShardedParam:
    """What `finer_scales` reads of an FSDP2-sharded parameter on `rank`: its mesh, its whole
    shape and (through `shard_of`, patched) this rank's rows, FSDP2's dim-0 chunk."""

    def __init__(self, whole, world, rank):
        rows = ceil_div(len(whole), world)
        self.device_mesh, self.shape = _FakeMesh(world, rank), whole.shape
        self.local = Float8ShardWeight(whole[rank * rows : (rank + 1) * rows], "w")


@settings(max_examples=30)  # (each example runs `finer_scales` 2 x world times)
@given(
    recipes=st.lists(st.sampled_from(RECIPES), min_size=1, max_size=3),
    shapes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 70)), min_size=3, max_size=3),
    world=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_finer_scales_on_every_rank_are_the_whole_weights(recipes, shapes, world, seed):
    """`finer_scales` on `world` ranks (its one all-gather simulated: the ranks' wire bytes,
    concatenated), several weights and recipes at once: every rank assembles, for both planes of
    every weight, the statistics of the whole weight's groups, bit for bit, whatever the ranks'
    rows (padded, empty) and the groups the cuts split."""
    from fp8fn._parallel import fsdp_finer, fsdp_gather

    weights = [_weight(n, k, seed + i) for i, (n, k) in enumerate(shapes[: len(recipes)])]
    wires, rank = {}, [0]

    def all_gather_rows(local, group, rows):  # every rank's bytes, in rank order
        assert group == "group" and rows == world
        wires[rank[0]] = local
        return torch.cat([wires.get(r, local) for r in range(world)])

    patch = pytest.MonkeyPatch()  # (not the fixture: hypothesis reruns the function body)
    patch.setattr(fsdp_gather, "shard_of", lambda p: p.local)
    patch.setattr(fsdp_finer, "all_gather_rows", all_gather_rows)
    try:
        for rank[0] in list(range(world)) * 2:  # the 1st pass records every rank's bytes
            modules = [torch.nn.Module() for _ in weights]
            for m, w in zip(modules, weights):
                m.w = _ShardedParam(w, world, rank[0])
            entries = [(m, "w", r) for m, r in zip(modules, recipes)]
            scales = fsdp_finer.finer_scales(entries)
            if len(wires) < world:
                continue
            for m, w, recipe in zip(modules, weights, recipes):
                for gemm in (0, 1):
                    plane = planes.plane_of(recipe, gemm)
                    want = planes.quantize(plane, w)[1]
                    _assert_same_bits(scales[(m, "w")].grids[plane], want)
    finally:
        patch.undo()


def test_a_gathered_weight_keeps_its_kind_of_recipe():
    """FSDP2 refills the unsharded weight its first all-gather made: a weight first gathered
    for a per-tensor recipe and then for a finer one (or the other way) raises, naming it."""
    weight = _weight(8, 32, seed=5)
    fsdp2 = _FakeFsdp2(weight, 2)
    per_tensor = fsdp2.gather(torch.tensor(8.0))  # (a per-tensor scale in GATHER_SCALES)
    with pytest.raises(
        RuntimeError,
        match=r"^fp8fn\.float8_all_gather: 'fc' was all-gathered for a per-tensor recipe first",
    ):
        fsdp2.gather(_plan(fp8fn.MXScaling(), weight), out=per_tensor)
    fsdp2 = _FakeFsdp2(weight, 2)
    finer = fsdp2.gather(_plan(fp8fn.MXScaling(), weight))
    with pytest.raises(
        RuntimeError,
        match=r"^fp8fn\.float8_all_gather: 'fc' was all-gathered for a finer recipe first",
    ):
        fsdp2.gather(torch.tensor(8.0), out=finer)
    with pytest.raises(
        RuntimeError, match=r"^fp8fn\.float8_all_gather: 'fc' was all-gathered for MXScaling"
    ):
        fp8fn.linear(torch.randn(2, 32), finer, None, None, fp8fn.RowwiseScaling())
