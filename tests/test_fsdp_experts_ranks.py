"""FSDP2's float8 all-gather of an experts weight, its less common paths (issue 38.10, class G),
in one process with test_fsdp's fakes: an expert count the ranks do not divide, seen from every
rank (each casts its own experts with their own scales and observes their amaxes at their own
rows, 0 for the other ranks' experts). (The backward's re-gather, of `F.linear(x, W[e])` and of
the transposed form `x @ W[e]`: test_fsdp.)"""

import pytest
import torch
from test_fsdp import _experts_state, _Mesh

from fp8fn._numerics.fp8 import cast_to_fp8
from fp8fn._parallel.fsdp_gather import SCALES, Float8ShardWeight, ScalesForCall


@pytest.mark.parametrize(
    "experts, world", [(3, 2), (5, 2), (5, 3), (3, 4)], ids=["3on2", "5on2", "5on3", "3on4-empty"]
)
def test_each_rank_casts_and_observes_its_own_experts(experts, world):
    _, _, scale = _experts_state(experts)  # per-expert weight scales, not powers of two
    data = torch.randn(experts, 8, 16, generator=torch.Generator().manual_seed(6))
    data *= torch.arange(1.0, experts + 1)[:, None, None]
    want = cast_to_fp8(data, scale[:, None, None]).view(torch.uint8)
    rows = -(-experts // world)  # FSDP2: rank r holds rows r * rows ... (the last short, or none)
    token = SCALES.set(ScalesForCall({(None, "w"): scale}))
    try:
        for r in range(world):
            shard = data[r * rows : (r + 1) * rows]
            hook = Float8ShardWeight(shard, "w", "w").fsdp_pre_all_gather
            (fp8,), (got_scale, amax, _) = hook(_Mesh(world, r), data.shape, None, None, None)
            assert got_scale is scale
            assert fp8.shape == (rows, 8, 16)  # padded to the first shard's rows
            here = slice(r * rows, r * rows + shard.shape[0])
            assert torch.equal(fp8[: shard.shape[0]], want[here]), r
            assert not fp8[shard.shape[0] :].any()
            own = torch.zeros(experts)
            own[here] = data[here].abs().flatten(1).amax(1)
            assert torch.equal(amax, own), r
    finally:
        SCALES.reset(token)
