"""FSDP2 (`fully_shard`) with fp8fn on 2 gloo ranks on CPU, against one process.

`test_fsdp_scenario` checks, on both ranks, one scenario of `_fsdp_workers`, all run in one
spawn within `_TIMEOUT_S`, which then saves the checkpoint (`dcp_save`) that a second spawn
resumes from. Below them, the pieces of `float8_all_gather` in one process.
"""

from __future__ import annotations

import _fsdp_workers as workers
import pytest
import torch
from _helpers import assert_bit_identical, saved_and_loaded
from _spawn import assert_ok, spawn_results

import fp8fn
from fp8fn._numerics.fp8 import cast_to_fp8
from fp8fn._parallel.fsdp_gather import (
    SCALES,
    Float8GatheredWeight,
    Float8ShardWeight,
    ScalesForCall,
)

_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """(its directory, `{rank: {scenario: "ok" | traceback}}`) of one spawn running every
    scenario, then `dcp_save`, whose checkpoint and uninterrupted run stay in the directory
    (spawning is the expensive part, so the module's tests share it)."""
    out_dir = tmp_path_factory.mktemp("fsdp_workers")
    names = [s.__name__ for s in workers.SCENARIOS] + [workers.dcp_save.__name__]
    return out_dir, spawn_results(workers.main, workers.WORLD, out_dir, _TIMEOUT_S, names)


@pytest.fixture(scope="module")
def results(spawned):
    """`{rank: {scenario: "ok" | traceback}}` of the shared spawn."""
    return spawned[1]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_fsdp_scenario(results, scenario):
    assert_ok(results, scenario)


@pytest.mark.slow
def test_checkpoint_resume_on_the_same_ranks_is_bit_identical(spawned):
    """A run saved after 2 steps with torch.distributed.checkpoint and resumed in fresh processes
    takes a 3rd step bit-identical to the uninterrupted run (see `_fsdp_workers.dcp_resume`)."""
    out_dir, saved = spawned
    assert_ok(saved, "dcp_save", "dcp_save, ")
    resumed = spawn_results(workers.main, workers.WORLD, out_dir, _TIMEOUT_S, ["dcp_resume"])
    assert_ok(resumed, "dcp_resume", "dcp_resume, ")


# --- the pieces of float8_all_gather, in one process ----------------------------------------------


class _Mesh:
    """What FSDP2's pre-all-gather hook reads of its device mesh: `ndim`, `size()`."""

    def __init__(self, world: int):
        self.ndim, self.world = 1, world

    def size(self):
        return self.world


def _gather(shards, scale, module=None):
    """What FSDP2 does with `Float8ShardWeight` shards of one weight: the pre-all-gather hook on
    each, the all-gather (a concatenation), the post-all-gather hook and the unpadding view."""
    outer = (sum(s.shape[0] for s in shards), *shards[0].shape[1:])
    token = SCALES.set(ScalesForCall({module: scale}))
    try:
        pre = [s.fsdp_pre_all_gather(_Mesh(len(shards)), outer, None, module, None) for s in shards]
    finally:
        SCALES.reset(token)
    outputs = [torch.cat([p[0][i] for p in pre]) for i in range(len(pre[0][0]))]
    gathered, _ = shards[0].fsdp_post_all_gather(outputs, pre[0][1], torch.float32)
    return torch.nn.Parameter(torch.as_strided(gathered, outer, (outer[1], 1), 0))


def test_float8_all_gather_wraps_the_linear_weights_only():
    model = workers.Net()
    attention = torch.nn.MultiheadAttention(16, 2)
    model.attention = attention
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert fp8fn.float8_all_gather(model) is model
    weights = [model.get_submodule(p).weight for p in ("blocks.0.fc1", "blocks.2.fc2", "head")]
    assert all(isinstance(w, torch.nn.Parameter) for w in weights)
    assert all(type(w) is Float8ShardWeight for w in weights)
    assert type(model.blocks[0].ln.weight) is torch.nn.Parameter  # not a linear weight
    assert type(model.blocks[0].fc1.bias) is torch.nn.Parameter
    assert not isinstance(attention.out_proj.weight, Float8ShardWeight)  # MHA uses it itself
    fp8fn.float8_all_gather(model)  # again: nothing changes
    assert model.blocks[0].fc1.weight is weights[0]
    # state dicts and checkpoints see plain tensors with the same values
    loaded = saved_and_loaded(model.state_dict())
    assert all(type(v) is torch.Tensor for v in loaded.values())
    assert all(torch.equal(loaded[k], v) for k, v in before.items())


def test_shard_weight_behaves_as_its_data():
    data = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    weight = torch.nn.Parameter(Float8ShardWeight(data.clone(), "fc"))
    x = torch.randn(3, 4)
    out = torch.nn.functional.linear(x, weight)
    assert type(out) is torch.Tensor and torch.equal(out, torch.nn.functional.linear(x, data))
    top, bottom = weight.detach().split(3)  # FSDP2's sharding keeps the class
    assert type(top) is Float8ShardWeight and torch.equal(bottom._tensor, data[3:])
    grad = torch.ones_like(data)
    weight.grad = grad
    torch.optim.SGD([weight], lr=0.5).step()  # in place, through the class
    assert isinstance(weight, Float8ShardWeight) and torch.equal(weight._tensor, data - 0.5)
    with torch.no_grad():
        weight.copy_(data)  # as a checkpoint load does
    assert torch.equal(weight._tensor, data)


@pytest.mark.parametrize("rows", [8, 7])  # even, and uneven (padded) on 2 ranks
def test_gathered_weight_runs_the_op_as_the_cast_weight_does(rows):
    """The op on an FSDP2-gathered float8 weight gives the bits of the op that casts the whole
    weight with the same scale: output, gradients, observation."""
    g = torch.Generator().manual_seed(1)
    data = torch.randn(rows, 16, generator=g)
    data[rows - 1, 3] = 5.0  # the amax, in the last shard
    recipe = fp8fn.DelayedScaling(history_len=4)
    state = fp8fn.init_state(recipe, ["fc"])
    history = state.amax_history.clone()
    history[0, :, 0] = torch.tensor([3.0, 4.0, 0.5])  # stored scales differ from current ones
    state = fp8fn.update(state, state._replace(amax_history=history))
    scale = state["fc"].weight.scale
    shards = [Float8ShardWeight(t, "fc") for t in data.chunk(2)]
    gathered = _gather(shards, scale)
    assert type(gathered) is Float8GatheredWeight and gathered.shape == (rows, 16)
    assert torch.equal(gathered._data.view(torch.uint8), cast_to_fp8(data, scale).view(torch.uint8))
    whole = data.abs().max() if rows % 2 == 0 else data[:4].abs().max()  # padded: own amax
    assert torch.equal(gathered._amax, whole)

    x = torch.randn(5, 16, generator=g, requires_grad=True)
    bias = torch.randn(rows, generator=g, requires_grad=True)
    results = []
    for weight in (gathered, torch.nn.Parameter(data.clone())):
        observed = fp8fn.observe(state)
        out = fp8fn.linear(x, weight, bias, observed["fc"], recipe)
        out.square().sum().backward()
        results.append((out, x.grad, weight.grad, bias.grad, fp8fn.observations(observed)))
        x.grad = bias.grad = None
    (out, gx, gw, gb, obs), (out_ref, gx_ref, gw_ref, gb_ref, obs_ref) = results
    for a, b in ((out, out_ref), (gx, gx_ref), (gw, gw_ref), (gb, gb_ref)):
        assert torch.equal(a, b)
    assert type(gw) is torch.Tensor and gw.dtype == torch.float32  # high-precision weight grad
    if rows % 2 == 0:
        assert_bit_identical(obs, obs_ref)
    else:  # the weight's observation is the shard's amax until all_reduce
        assert torch.equal(obs.amax_history[0, 1, 0], data[:4].abs().max())


def test_one_rank_gathers_one_input_with_the_whole_weights_amax():
    """FSDP2 on one rank copies only the first all-gather input (issue 31: torchrun with one
    process crashed): the float8 bytes alone, the amax in the metadata."""
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    token = SCALES.set(ScalesForCall({None: torch.tensor(64.0)}))
    try:
        inputs, metadata = Float8ShardWeight(data, "fc").fsdp_pre_all_gather(
            _Mesh(1), (4, 8), None, None, None
        )
    finally:
        SCALES.reset(token)
    assert len(inputs) == 1 and inputs[0].dtype == torch.uint8 and inputs[0].shape == (4, 8)
    gathered = _gather([Float8ShardWeight(data, "fc")], torch.tensor(64.0))
    assert torch.equal(gathered._amax, data.abs().max())


def test_gathered_weight_is_its_dequantized_value_elsewhere():
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    scale = torch.tensor(64.0)
    gathered = _gather([Float8ShardWeight(data, "fc")], scale)
    dequantized = cast_to_fp8(data, scale).float() / scale
    assert torch.equal(gathered + 0, dequantized)  # (a plain forward outside fp8fn.apply)
    assert torch.equal((gathered * 1).t(), dequantized.t())
    with pytest.raises(RuntimeError, match=r"^fp8fn\.float8_all_gather: the gathered float8 weig"):
        with torch.no_grad():
            gathered.add_(1.0)


def test_float8_all_gather_outside_apply_before_any_apply_raises():
    shard = Float8ShardWeight(torch.randn(4, 8), "blocks.0.fc1")
    with pytest.raises(RuntimeError, match=r"^fp8fn\.float8_all_gather: 'blocks.0.fc1' was all-g"):
        shard.fsdp_pre_all_gather(_Mesh(1), (4, 8), None, None, None)


def test_transform_refuses_float8_all_gather_without_fully_shard():
    model = fp8fn.float8_all_gather(workers.Net())
    with pytest.raises(ValueError, match=r"^fp8fn\.transform: expected the float8_all_gather weig"):
        fp8fn.transform(model, fp8fn.DelayedScaling())
