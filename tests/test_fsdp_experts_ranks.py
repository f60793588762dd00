"""FSDP2's float8 all-gather of an experts weight, its less common paths (issue 38.10, class G),
in one process with test_fsdp's fakes: an expert count the ranks do not divide, seen from every
rank (each casts its own experts with their own scales and observes their amaxes at their own
rows, 0 for the other ranks' experts); two backwards pending while FSDP2 refilled the weight
twice (gradient accumulation), each re-gathering with its own forward's scale. (The re-gather of
`F.linear(x, W[e])` and of the transposed form `x @ W[e]`: test_fsdp.)"""

import pytest
import torch
from test_fsdp import _experts_state, _gather, _Mesh

import fp8fn
from fp8fn._numerics.fp8 import cast_to_fp8
from fp8fn._parallel.fsdp_gather import GATHER_SCALES, Float8ShardWeight, ScalesForCall


@pytest.mark.parametrize(
    "experts, world", [(3, 2), (5, 2), (5, 3), (3, 4)], ids=["3on2", "5on2", "5on3", "3on4-empty"]
)
def test_each_rank_casts_and_observes_its_own_experts(experts, world):
    _, _, scale = _experts_state(experts)  # per-expert weight scales, not powers of two
    data = torch.randn(experts, 8, 16, generator=torch.Generator().manual_seed(6))
    data *= torch.arange(1.0, experts + 1)[:, None, None]
    want = cast_to_fp8(data, scale[:, None, None]).view(torch.uint8)
    rows = -(-experts // world)  # FSDP2: rank r holds rows r * rows ... (the last short, or none)
    token = GATHER_SCALES.set(ScalesForCall({(None, "w"): scale}))
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
        GATHER_SCALES.reset(token)


def test_two_pending_backwards_regather_each_with_its_own_forwards_scale(monkeypatch):
    """Forwards A (scales s1) and B (s2), then a third all-gather (s3) refills the buffer; B's
    backward gathers again with s2, A's then with s1, not B's bytes: A's grad_x bit for bit as
    without refills. One rank (its shard is the whole weight; the all-gather is the identity)."""
    from fp8fn._parallel import fsdp_gather

    class _AllGather:
        @staticmethod
        def apply(local, group, rows):
            return local

    monkeypatch.setattr(fsdp_gather, "AllGather", _AllGather)
    gen = torch.Generator().manual_seed(8)
    data = torch.randn(4, 8, 16, generator=gen)
    recipe, state, s1 = _experts_state(4)
    xs = [torch.randn(5, 16, generator=gen).requires_grad_() for _ in range(2)]

    def loss(weight, x):
        return fp8fn.linear(x, weight[1], None, fp8fn.observe(state)["w[1]"], recipe).square().sum()

    gathered = _gather([Float8ShardWeight(data, "w", "w")], s1)
    (want,) = torch.autograd.grad(loss(gathered, xs[0]), xs[0])
    losses = []
    for x, scale in zip(xs, (s1, 1.5 * s1)):
        gathered._data.copy_(cast_to_fp8(data, scale[:, None, None]))  # FSDP2's refill
        gathered._scale, gathered._again = scale, None
        losses.append(loss(gathered, x))
    gathered._data.copy_(cast_to_fp8(data, 3.0 * s1[:, None, None]))
    gathered._scale, gathered._again = 3.0 * s1, None
    losses[1].backward()
    losses[0].backward()
    assert torch.equal(xs[0].grad, want)
