"""FSDP2 (`fully_shard`) with fp8fn on 2 gloo ranks on CPU, against one process.

`test_fsdp_scenario` checks, on both ranks, one scenario of `_fsdp_workers`, all run in one
spawn within `_TIMEOUT_S`, which then saves the checkpoint (`dcp_save`) that a second spawn
resumes from. Below them, the pieces of `float8_all_gather` in one process.
"""

from __future__ import annotations

import types

import _fsdp_workers as workers
import pytest
import torch
from _helpers import assert_bit_identical, saved_and_loaded
from _spawn import assert_ok, spawn_results

import fp8fn
from fp8fn._numerics.fp8 import cast_to_fp8
from fp8fn._parallel.fsdp_gather import (
    GATHER_SCALES,
    Float8GatheredWeight,
    Float8ShardWeight,
    ScalesForCall,
    weight_scales,
)

_TIMEOUT_S = 480  # (the spawn runs 19 scenarios: 136 s on 2 busy cores)


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


@pytest.mark.slow
def test_checkpoint_resume_on_one_rank_is_bit_identical(spawned):
    """The finer recipes' 2-rank checkpoints (float8 all-gathers) resumed on 1 rank take a 3rd
    step bit-identical to the uninterrupted 2-rank run (`_fsdp_workers.dcp_resume_one_rank`)."""
    out_dir, saved = spawned
    assert_ok(saved, "dcp_save", "dcp_save, ")
    resumed = spawn_results(workers.main, 1, out_dir, _TIMEOUT_S, ["dcp_resume_one_rank"])
    assert_ok(resumed, "dcp_resume_one_rank", "dcp_resume_one_rank, ")


# --- the pieces of float8_all_gather, in one process ----------------------------------------------


class _Mesh:
    """What FSDP2's pre-all-gather hook reads of its device mesh: `ndim`, `size()`,
    `get_local_rank()` (and the backward's all-gather again: `get_group()`)."""

    def __init__(self, world: int, rank: int = 0):
        self.ndim, self.world, self.rank = 1, world, rank

    def size(self):
        return self.world

    def get_local_rank(self):
        return self.rank

    def get_group(self):
        return None


def _gather(shards, scale, module=None, rows=None):
    """What FSDP2 does with `Float8ShardWeight` shards of one weight (of `rows` rows; default:
    the shards' rows): the pre-all-gather hook on each (padded to the first's rows, as FSDP2
    does), the all-gather (a concatenation), the post-all-gather hook and the unpadding view."""
    rows = sum(s.shape[0] for s in shards) if rows is None else rows
    outer = (rows, *shards[0].shape[1:])
    world = len(shards)
    token = GATHER_SCALES.set(ScalesForCall({(module, shards[0]._attr): scale}))
    try:
        pre = [
            s.fsdp_pre_all_gather(_Mesh(world, r), outer, None, module, None)
            for r, s in enumerate(shards)
        ]
    finally:
        GATHER_SCALES.reset(token)
    outputs = [torch.cat([p[0][i] for p in pre]) for i in range(len(pre[0][0]))]
    gathered, _ = shards[0].fsdp_post_all_gather(outputs, pre[0][1], torch.float32)
    stride = torch.empty(outer).stride()
    return torch.nn.Parameter(torch.as_strided(gathered, outer, stride, 0))


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
    token = GATHER_SCALES.set(ScalesForCall({(None, "weight"): torch.tensor(64.0)}))
    try:
        inputs, metadata = Float8ShardWeight(data, "fc").fsdp_pre_all_gather(
            _Mesh(1), (4, 8), None, None, None
        )
    finally:
        GATHER_SCALES.reset(token)
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


# --- experts weights `(E, N, K)`: per-expert scales, in one process ------------------------------


def _experts_state(experts: int):
    """A delayed state of one experts weight `w` (sites `w[e]`) whose stored scales differ from
    the current ones, and its per-expert weight scales, float32 `(E,)`."""
    recipe = fp8fn.DelayedScaling(history_len=4)
    state = fp8fn.init_state(recipe, [f"w[{e}]" for e in range(experts)])
    history = state.amax_history.clone()
    history[:, :, 0] = torch.tensor([3.0, 4.0, 0.5]) * torch.arange(1, experts + 1)[:, None]
    state = fp8fn.update(state, state._replace(amax_history=history))
    return recipe, state, state.scale[:, 1]


@pytest.mark.parametrize("experts", [4, 3])  # even, and uneven (padded) on 2 ranks
def test_gathered_experts_weight_runs_the_grouped_op_as_the_cast_weight_does(experts):
    """The grouped op on an FSDP2-gathered experts weight (e4m3 bytes, one scale per expert)
    gives the bits of the op that casts the whole weight with the same scales: output,
    gradients, observation; so does an expert's `F.linear` (transformers' eager loop)."""
    from fp8fn._ops.grouped import grouped_mm

    g = torch.Generator().manual_seed(4)
    data = torch.randn(experts, 8, 16, generator=g)
    data[experts - 1, 2, 3] = 5.0  # the last expert's amax, in the last shard
    recipe, state, scale = _experts_state(experts)
    shards = [Float8ShardWeight(t, "w", "w") for t in data.split(2)]  # FSDP2's dim-0 shards
    gathered = _gather(shards, scale, rows=experts)
    assert type(gathered) is Float8GatheredWeight and gathered.shape == (experts, 8, 16)
    want = cast_to_fp8(data, scale[:, None, None])
    assert torch.equal(gathered._data.view(torch.uint8), want.view(torch.uint8))
    whole = data.abs().flatten(1).amax(1)
    assert torch.equal(
        gathered._amax, whole if experts % 2 == 0 else torch.cat([whole[:2], torch.zeros(1)])
    )  # padded: rank 0's experts only, until all_reduce

    x = torch.randn(10, 16, generator=g, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 10][:experts], dtype=torch.int32)
    results = []
    for weight in (gathered, torch.nn.Parameter(data.clone())):
        observed = fp8fn.observe(state)
        newest = observed.amax_history[..., 0]
        # as transformers' grouped_mm calls it: the weight transposed, and back (routing)
        w = weight.transpose(-2, -1).transpose(-2, -1)
        out = grouped_mm(x, w, offs, newest, observed.scale, 0, "emulated", recipe=recipe)
        out.square().sum().backward()
        results.append((out, x.grad, weight.grad, fp8fn.observations(observed)))
        x.grad = None
    (out, gx, gw, obs), (out_ref, gx_ref, gw_ref, obs_ref) = results
    for a, b in ((out, out_ref), (gx, gx_ref), (gw, gw_ref)):
        assert torch.equal(a, b)
    assert type(gw) is torch.Tensor and gw.dtype == torch.float32
    if experts % 2 == 0:
        assert_bit_identical(obs, obs_ref)
    else:
        assert torch.equal(obs.amax_history[:2], obs_ref.amax_history[:2])

    one = gathered[1]  # one expert: its bytes, scale and amax
    assert type(one) is Float8GatheredWeight and one._scale.dim() == 0
    assert torch.equal(one._data.view(torch.uint8), want[1].view(torch.uint8))
    outs = []
    for weight in (one, data[1]):
        observed = fp8fn.observe(state)
        out = fp8fn.linear(x, weight, None, observed["w[1]"], recipe)
        out.square().sum().backward()
        outs.append((out, x.grad, fp8fn.observations(observed)["w[1]"]))
        x.grad = None
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert_bit_identical(outs[0][2], outs[1][2])


def test_gathered_experts_weight_is_its_dequantized_value_elsewhere():
    data = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    _, _, scale = _experts_state(4)
    gathered = _gather([Float8ShardWeight(t, "w", "w") for t in data.split(2)], scale)
    dequantized = cast_to_fp8(data, scale[:, None, None]).float() / scale[:, None, None]
    assert torch.equal(gathered + 0, dequantized)  # (a plain forward outside fp8fn.apply)
    assert torch.equal(gathered[torch.tensor([2, 0])] + 0, dequantized[[2, 0]])  # (batched_mm)
    assert torch.equal(gathered.reshape(32, 16) + 0, dequantized.reshape(32, 16))
    assert torch.equal(gathered.transpose(-2, -1)[3].t() + 0, dequantized[3])


class _GroupedExperts(torch.nn.Module):
    """A user module with a 3-D weight `(E, N, K)` run with `torch._grouped_mm`."""

    def __init__(self, experts=4, n=8, k=16):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(experts, n, k))
        self.pos = torch.nn.Parameter(torch.zeros(1, 3, k))  # one row on dim 0: not experts

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offs)


def test_float8_all_gather_wraps_the_experts_weights_filter_fn_chooses():
    model = torch.nn.Sequential(_GroupedExperts(), torch.nn.Linear(8, 8))
    fp8fn.float8_all_gather(model)
    assert isinstance(model[0].w, torch.nn.Parameter) and type(model[0].w) is Float8ShardWeight
    assert (model[0].w._path, model[0].w._attr) == ("0.w", "w")
    assert type(model[0].pos) is torch.nn.Parameter  # (1, 3, 16): a ViT's pos_embed shape
    assert isinstance(model[1].weight, Float8ShardWeight)
    asked = []
    model = torch.nn.Sequential(_GroupedExperts(), torch.nn.Linear(8, 8))
    fp8fn.float8_all_gather(model, lambda name, m: asked.append((name, type(m))) or name != "0.w")
    assert ("0.w", _GroupedExperts) in asked and ("1", torch.nn.Linear) in asked
    assert type(model[0].w) is torch.nn.Parameter  # left out: gathered in high precision
    assert isinstance(model[1].weight, Float8ShardWeight)


def test_float8_all_gather_leaves_the_router_next_to_experts_out():
    """A router (`nn.Linear` with at most E outputs beside the experts), which transform keeps
    in high precision, is not chosen; a linear layer elsewhere is."""

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = torch.nn.Linear(16, 4), _GroupedExperts()
            self.head = torch.nn.Sequential(torch.nn.Linear(8, 4))

    model = fp8fn.float8_all_gather(MoE())
    assert type(model.router.weight) is torch.nn.Parameter
    assert isinstance(model.experts.w, Float8ShardWeight)
    assert isinstance(model.head[0].weight, Float8ShardWeight)


def test_float8_all_gather_refuses_a_tied_experts_weight():
    model = torch.nn.Sequential(_GroupedExperts(), _GroupedExperts())
    model[1].w = model[0].w
    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.float8_all_gather: expected the weight of "
        r"experts weight '0\.w' to be held by chosen nn\.Linear layers or experts "
        r"modules only, got it tied to '1\.w' \(_GroupedExperts\)",
    ):
        fp8fn.float8_all_gather(model)
    assert type(model[0].w) is torch.nn.Parameter  # nothing changed


def test_transform_refuses_a_float8_gathered_experts_weight_with_another_recipe():
    model = fp8fn.float8_all_gather(_GroupedExperts())

    def recipe(name, module):
        return fp8fn.NVFP4Scaling() if name == "w" else fp8fn.DelayedScaling()

    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.transform: expected experts weight 'w', whose "
        r"weight is all-gathered in float8 \(fp8fn\.float8_all_gather\), to use "
        r"DelayedScaling, CurrentScaling, RowwiseScaling, BlockwiseScaling, MXScaling, got "
        r"NVFP4Scaling \(not gathered in float8: NVFP4Scaling, whose FP4 weight planes FSDP2 "
        r"gathers in high precision\)\. Leave it out",
    ):
        fp8fn.transform(model, recipe)
    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.transform: parameter 'w' is all-gathered in "
        r"float8 \(fp8fn\.float8_all_gather\), but its layer \(or experts weight\) "
        r"does not run in float8",
    ):
        fp8fn.transform(model, fp8fn.DelayedScaling(), filter_fn=lambda name, m: name != "w")
    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.transform: expected the float8_all_gather weig"
        r"ht of experts weight 'w' to be sharded by FSDP2",
    ):
        fp8fn.transform(model, fp8fn.CurrentScaling())


def test_float8_gathered_current_scales_share_one_margin_in_one_batch(one_rank_mesh):
    """Step 1 (empty histories): the weight scales of every float8-gathered weight are computed
    in one batch when they share a margin, here 2: each is `448 / (amax * 2**2)` of the whole
    weight (per expert for an experts weight), in float64 then float32, bit for bit."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.a, model.b, model.e = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), _GroupedExperts(3)
    with torch.no_grad():
        model.b.weight.mul_(7)
        model.e.w.mul_(torch.tensor([1.0, 30.0, 0.01]).reshape(3, 1, 1))
    fully_shard(fp8fn.float8_all_gather(model), mesh=one_rank_mesh)
    names = ["a", "b", "e.w[0]", "e.w[1]", "e.w[2]"]
    state = fp8fn.init_state(fp8fn.DelayedScaling(margin=2), names)
    weights = [(model.a, "weight", 0), (model.b, "weight", 1), (model.e, "w", 2)]
    scales = weight_scales([(m, attr, row, 2) for m, attr, row in weights], state)
    for module, attr, _ in weights:
        amax = getattr(module, attr).full_tensor().detach().abs().amax(dim=(-2, -1))
        assert torch.equal(scales[(module, attr)], (448 / (amax.double() * 2**2)).float())


def test_float8_gathered_experts_scales_refuse_sites_apart_in_the_state():
    """The all-gather casts expert `e` with state row `first + e`: a state whose experts' sites
    are apart (here `w[0], w[2], w[1]`, amaxes 1, 100, 2) is refused, not cast with another
    expert's scale (expert 2 would saturate under expert 1's 224)."""
    from fp8fn._transform.fsdp import Fsdp2, _Gathered

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(3, 4, 8))
    recipe = fp8fn.DelayedScaling(history_len=4)
    state = fp8fn.init_state(recipe, ["w[0]", "w[2]", "w[1]"])
    history = state.amax_history.clone()
    history[:, 1, 0] = torch.tensor([1.0, 100.0, 2.0])
    state = fp8fn.update(state, state._replace(amax_history=history))
    gathered = _Gathered("w", module, "w", recipe, "w[0]")
    calls = types.SimpleNamespace(module=module, gathered=[gathered])
    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.apply: expected the sites of the 3 experts "
        r"of 'w' \(call 0\) in `state`, one after another, got "
        r"them apart",
    ):
        Fsdp2._weight_scales(calls, state)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "transposed"])
def test_experts_backward_regathers_once_whichever_experts_received_tokens(monkeypatch, transposed):
    """transformers' eager loop calls `F.linear(x, W[e])` only for the experts that received
    tokens, which differ between ranks. When FSDP2 refilled the weight with another forward's
    scale before the backward, the backward all-gathers the whole weight again once, whichever
    experts ran (it did once per expert: ranks routing differently issued different numbers of
    collectives, a hang), and takes the bytes of its own forward's scale. `transposed`: the form
    `x @ W[e]` of a `(E, K, N)` weight, K = N (a re-gather not transposed back would not fail on
    the shapes)."""
    from fp8fn._parallel import fsdp_gather

    g = torch.Generator().manual_seed(6)
    data = torch.randn(4, 16 if transposed else 8, 16, generator=g)
    recipe, state, scale = _experts_state(4)
    gathers = []

    class AllGather:  # one process: the whole weight, cast with the forward's scale
        @staticmethod
        def apply(local, group, rows):
            gathers.append(rows)
            return cast_to_fp8(data, scale[:, None, None])

    monkeypatch.setattr(fsdp_gather, "AllGather", AllGather)
    x = torch.randn(5, 16, generator=g)

    def expert(w, e):
        return w[e].t() if transposed else w[e]

    for hit in ([0, 1, 2, 3], [1, 3]):
        grads = []
        for refill in (False, True):
            gathered = _gather([Float8ShardWeight(t, "w", "w") for t in data.split(2)], scale)
            xl = x.clone().requires_grad_()
            observed = fp8fn.observe(state)
            out = sum(
                fp8fn.linear(xl, expert(gathered, e), None, observed[f"w[{e}]"], recipe)
                .square()
                .sum()
                for e in hit
            )
            if refill:  # FSDP2 refilled the buffer in place, with another forward's scale
                gathered._data.copy_(cast_to_fp8(data, 2 * scale[:, None, None]))
                gathered._scale, gathered._again = 2 * scale, None
            gathers.clear()
            out.backward()
            grads.append((xl.grad, len(gathers)))
        (want, none), (got, once) = grads
        assert (none, once) == (0, 1)
        assert torch.equal(got, want)
