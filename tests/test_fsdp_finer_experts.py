"""The finer recipes' float8 all-gather of experts weights `(E, a, b)` in one process: FSDP2
shards the experts (whole experts per rank, the last rank padded when E is odd); every rank's
statistics give each expert's whole grid, the gathered bytes are each expert's whole plane,
and the planes' operands are the op's own quantization of each expert matrix as the GEMM
reads it (stored `(E, N, K)`, or transposed `(E, K, N)` as GPT-OSS and Llama 4 store them),
so the grouped op on FSDP2's gathered weight gives the bits of the op on the weight."""

from __future__ import annotations

import pytest
import torch
from test_fsdp_finer import (
    _IDS,
    RECIPES,
    _assert_same_bits,
    _FakeFsdp2,
    _ShardedParam,
    _weight,
)

import fp8fn
from fp8fn._numerics.fp8 import ceil_div
from fp8fn._ops.grouped_block_scaled import finer_grouped_mm
from fp8fn._ops.rowwise_blockwise_mx import _WEIGHTS
from fp8fn._parallel import planes
from fp8fn._parallel.fsdp_finer import FinerGatheredWeight, FinerScales

_A, _B = 40, 64  # each expert matrix as stored


def _experts(count, seed):
    """`(count, 40, 64)`, the experts' magnitudes apart (special values in expert 1)."""
    parts = [_weight(_A, _B, seed + e, special=e == 1) * 4.0**e for e in range(count)]
    return torch.stack(parts)


def _gemm_view(weight, flipped):
    """The `(E, N, K)` the grouped op reads: the weight, or its transpose when stored `(E, K,
    N)`."""
    return weight.transpose(-2, -1) if flipped else weight


@pytest.mark.parametrize("recipe", RECIPES, ids=_IDS)
@pytest.mark.parametrize("experts", [4, 3])  # even; odd (the last rank's shard padded)
@pytest.mark.parametrize("flipped", [False, True], ids=["stored", "transposed"])
def test_finer_scales_of_experts_are_each_experts_whole_grid(recipe, experts, flipped):
    """`finer_scales` on 2 ranks (its one all-gather simulated): every rank has, for the
    planes of both GEMMs in the stored coordinates, each expert's whole grid, bit for bit."""
    from fp8fn._parallel import fsdp_finer, fsdp_gather

    weight, world = _experts(experts, seed=experts), 2
    wires = {}

    def all_gather_rows(local, group, rows):
        wires[rank] = local
        return torch.cat([wires.get(r, local) for r in range(world)])

    patch = pytest.MonkeyPatch()
    patch.setattr(fsdp_gather, "shard_of", lambda p: p.local)
    patch.setattr(fsdp_finer, "all_gather_rows", all_gather_rows)
    try:
        for rank in [0, 1, 0, 1]:  # the 1st pass records every rank's bytes
            module = torch.nn.Module()
            module.w = _ShardedParam(weight, world, rank)
            module.w.local._flipped = flipped
            plan = fsdp_finer.finer_scales([(module, "w", recipe)])[(module, "w")]
            assert plan.flipped is flipped and plan.shape == weight.shape
            if len(wires) < world:
                continue
            for gemm in (0, 1):
                plane = planes.stored_plane(recipe, gemm, flipped)
                want = torch.stack([planes.quantize(plane, w)[1] for w in weight])
                _assert_same_bits(plan.grids[plane], want)
    finally:
        patch.undo()


def _plan(recipe, weight, flipped):
    """The step's `FinerScales` of an experts weight, as `finer_scales` makes them."""
    grids = {}
    for gemm in (0, 1):
        plane = planes.stored_plane(recipe, gemm, flipped)
        grids[plane] = torch.stack([planes.quantize(plane, w)[1] for w in weight])
    return FinerScales(recipe, tuple(weight.shape), grids, flipped)


@pytest.mark.parametrize("recipe", RECIPES, ids=_IDS)
@pytest.mark.parametrize("experts", [4, 3])
@pytest.mark.parametrize("flipped", [False, True], ids=["stored", "transposed"])
@pytest.mark.parametrize("regather", [True, False])
def test_gathered_experts_run_the_grouped_op_as_the_weight_does(
    recipe, experts, flipped, regather, monkeypatch
):
    """FSDP2's float8-gathered experts weight: the forward all-gather carries each expert's
    output-GEMM plane; each expert's operands are the op's own quantization of its matrix; the
    grouped op (an expert without tokens included) gives the output, input and weight
    gradients of the op on the weight, bit for bit, with the grad_input plane from FSDP2's
    re-gather (`regather`) or, where FSDP2 does not re-gather, all-gathered by the op once for
    all experts (blockwise: the one plane)."""
    from fp8fn._parallel import fsdp_finer

    weight, world = _experts(experts, seed=10 + experts), 2
    fsdp2 = _FakeFsdp2(weight, world)
    plan, own = _plan(recipe, weight, flipped), []

    class AllGather:  # the op's own all-gather: every rank's experts cast to the plane
        @staticmethod
        def apply(local, group, rows):
            plane = planes.stored_plane(recipe, 1, flipped)
            own.append(plane)
            chunk = ceil_div(experts, world)
            casts = [
                planes.cast_experts(plane, s._tensor, plan.grids[plane][r * chunk :])
                for r, s in enumerate(fsdp2.shards)
            ]
            _assert_same_bits(casts[0].view(torch.uint8), local.view(torch.uint8))
            return torch.cat(casts)[:rows]

    monkeypatch.setattr(fsdp_finer, "AllGather", AllGather)
    gathered = fsdp2.gather(plan)
    assert type(gathered) is FinerGatheredWeight and gathered.shape == weight.shape
    forward_plane = planes.stored_plane(recipe, 0, flipped)
    want = torch.stack([planes.quantize(forward_plane, w)[0] for w in weight])
    _assert_same_bits(gathered._data, want)  # each expert's whole plane
    assert fsdp2.inputs[0][0][0].shape == (ceil_div(experts, world), _A, _B)

    view = _gemm_view(gathered, flipped)
    for e in range(experts):  # anchored to the op's own quantizers (torchao's)
        for gemm in (0, 1) if isinstance(recipe, fp8fn.BlockwiseScaling) else (0,):
            mine = view[e].fp8fn_finer_operand(recipe, gemm)
            theirs = _WEIGHTS[type(recipe)](_gemm_view(weight, flipped)[e], recipe, gemm)
            for a, b in zip(mine, theirs):
                _assert_same_bits(a.contiguous(), b.contiguous(), nan_sign=False)

    n, k = view.shape[1:]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, k, generator=g, requires_grad=True)
    offs = torch.tensor([4, 4, 9, 13][:experts], dtype=torch.int32)  # expert 1 gets no token
    offs[-1] = 13
    results = []
    for w in (gathered, torch.nn.Parameter(weight.clone())):
        out = finer_grouped_mm(x, _gemm_view(w, flipped), offs, recipe, "emulated")
        if w is gathered and regather:  # FSDP2's backward re-gather, into the same weight
            fsdp2.gather(out=gathered)
        out.square().sum().backward()
        results.append((out, x.grad, w.grad))
        x.grad = None
    for a, b in zip(*results):
        _assert_same_bits(a, b)
    refetched = not regather and not isinstance(recipe, fp8fn.BlockwiseScaling)
    assert len(own) == int(refetched), own  # once, for all the experts


def test_gathered_experts_refuse_another_orientation():
    """A plan made for experts read as stored refuses a GEMM that reads them transposed (its
    planes would be the other ones), naming the weight; `note_orientation` refuses both."""
    weight = _experts(2, seed=1)
    gathered = _FakeFsdp2(weight, 2).gather(_plan(fp8fn.MXScaling(), weight, False))
    with pytest.raises(
        RuntimeError,
        match=r"^fp8fn\.float8_all_gather: 'fc' was all-gathered for MXScaling.* read as stored, "
        r"but runs under MXScaling.* read transposed",
    ):
        gathered.transpose(-2, -1)[0].fp8fn_finer_operand(fp8fn.MXScaling(), 0)
    gathered[0].note_orientation()
    with pytest.raises(
        RuntimeError, match=r"^fp8fn\.float8_all_gather: expected experts weight 'fc' to be read"
    ):
        gathered.transpose(-2, -1)[1].note_orientation()


def test_pieces_of_a_shard_keep_its_orientation():
    """FSDP2 makes new shard tensors of a weight (its `load_state_dict` pads a new one and
    narrows it): they keep the orientation `fn.init` saw, so the next all-gather casts the
    same planes."""
    from fp8fn._parallel.fsdp_gather import Float8ShardWeight

    shard = Float8ShardWeight(_experts(2, seed=2), "fc", "gate_up_proj")
    shard._flipped = True
    padded = shard.new_zeros(3, _A, _B)
    for piece in (padded, padded.narrow(0, 0, 2), shard.detach(), shard[:1]):
        assert type(piece) is Float8ShardWeight and piece._flipped is True
        assert (piece._path, piece._attr) == ("fc", "gate_up_proj")
    assert type(shard + 0) is torch.Tensor  # (any other op: plain)
