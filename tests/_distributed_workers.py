"""Scenarios that `tests/test_distributed.py` runs on 2 gloo ranks (not a test module).

`main(rank, world_size, port, out_dir)` initializes the process group, runs every scenario in
`SCENARIOS` in order (the ranks must call the same collectives), and writes
`out_dir/rank{rank}.json`: `{scenario: "ok" | traceback}` plus `"_measured"` numbers for the report.
Single-process references are computed on each rank itself, without collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import CountHostReads, assert_bit_identical, bits, observation
from _models import MLP, _seeded
from _spawn import assert_state_same_on_all_ranks, run_scenarios, same_on_all_ranks
from torch import nn

import fp8fn

WORLD = 2
BATCH = 8  # global batch; each rank gets BATCH // WORLD rows
RECIPE = fp8fn.DelayedScaling(history_len=4)
MEASURED: dict = {}  # scenario -> numbers, written to the report


def _data(seed: int = 0, outlier_row: int = 6):
    """The global batch `(BATCH, 16)` with an outlier in one row (so in one rank's shard)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 16, generator=g)
    x[outlier_row, 3] = 40.0
    return x


def _shard(x, rank):
    n = x.shape[0] // WORLD
    return x[rank * n : (rank + 1) * n]


def _sq_loss(out, n_global):
    """The rank's part of the global mean of squares: sum over its rows / the global count."""
    return out.square().sum() / (n_global * out.shape[-1])


# --- fp8fn.all_reduce itself -------------------------------------------------------------------


def all_reduce_is_merge_over_ranks(rank):
    """Max over ranks, inf/NaN not observed, 0 stays 0, pure; equals merge of the ranks' obs."""
    state = fp8fn.init_state(RECIPE, ["a", "b", "c"])
    per_rank = [
        observation(state, a=(1.0, float("inf"), 0.0), b=(float("nan"), 2.0, None), c=(5.0,)),
        observation(state, a=(3.0, 4.0, 0.0), b=(float("nan"), 1.0, 7.0), c=(float("inf"),)),
    ]
    obs = per_rank[rank]
    before = (obs.amax_history.clone(), obs.scale.clone())
    out = fp8fn.all_reduce(obs)
    assert_bit_identical(out, fp8fn.merge(*per_rank))
    assert out.amax_history[:, :, 0].tolist() == [[3.0, 4.0, 0.0], [0.0, 2.0, 7.0], [5.0, 0, 0]]
    assert torch.equal(out.amax_history[..., 1:], torch.zeros(3, 3, 3))  # not observed stays 0
    # pure: the input is unchanged (NaN and inf included) and shares no memory with the result
    assert torch.equal(bits(obs.amax_history), bits(before[0]))
    assert torch.equal(bits(obs.scale), bits(before[1]))
    assert out.amax_history.data_ptr() != obs.amax_history.data_ptr()
    assert out.static == obs.static and type(out) is fp8fn.State
    # it composes: update gives the same state on every rank
    assert_state_same_on_all_ranks(fp8fn.update(state, out))


def all_reduce_one_collective(rank):
    """One `all_reduce` call for 512 sites (and for a stacked ensemble), whatever the sites:
    the observation and a 4-float tag of its structure, the same collective on every call."""
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append((tuple(tensor.shape), kwargs.get("op")))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        state = fp8fn.init_state(RECIPE, [f"s{i}" for i in range(512)])
        base = torch.rand(512, 3, 4, generator=torch.Generator().manual_seed(0))
        obs = state._replace(amax_history=base * (rank + 1))
        out = fp8fn.all_reduce(obs)
        again = fp8fn.all_reduce(obs)
        stacked = state._replace(
            amax_history=torch.rand(3, 512, 3, 4), scale=torch.zeros(3, 512, 3)
        )
        out_stacked = fp8fn.all_reduce(stacked)
    finally:
        dist.all_reduce = original
    packed = ((512 * 3 * 4 + 512 * 3 + 4,), dist.ReduceOp.MAX)
    stacked_packed = ((3 * (512 * 3 * 4 + 512 * 3) + 4,), dist.ReduceOp.MAX)
    assert calls == [packed, packed, stacked_packed], calls
    assert out_stacked.amax_history.shape == (3, 512, 3, 4)
    assert out_stacked.scale.shape == (3, 512, 3)
    assert torch.equal(out.amax_history, base * 2)  # rank 1's
    assert_bit_identical(again, out)


def all_reduce_structure_mismatch(rank):
    """Ranks whose observations differ in structure get a clear error on every rank, instead of
    maxima of unrelated sites or an aborted collective: other sizes (site count, history_len)
    on a group's first reduce (a ValueError, read on the host), and the same size (site order,
    margin, amax_compute) on any reduce, also where every rank has reduced its structure before
    (later reduces check in the graph, without a host read: a RuntimeError on CPU). The ranks
    reduce normally afterwards."""
    import pytest

    def other(i, **config):
        return fp8fn.init_state(fp8fn.DelayedScaling(history_len=4, **config), ["a", "b", "c"][:i])

    for mine in (
        other(2 + rank),
        fp8fn.init_state(fp8fn.DelayedScaling(history_len=4 + rank), ["a"]),
    ):
        with pytest.raises(ValueError, match="same structure on every rank"):
            fp8fn.all_reduce(observation(mine), group=dist.new_group([0, 1]))
    seen = other(2)
    fp8fn.all_reduce(observation(seen))  # agreed on both ranks
    for mine in (
        fp8fn.init_state(RECIPE, ["a", "b"] if rank == 0 else ["b", "a"]),
        other(2, margin=rank),
        other(2, amax_compute=("max", "most_recent")[rank]),
    ):
        with pytest.raises(RuntimeError, match=r"^fp8fn\.all_reduce: expected observations of"):
            fp8fn.all_reduce(observation(mine))
    out = fp8fn.all_reduce(seen._replace(amax_history=torch.full((2, 3, 4), rank + 1.0)))
    assert torch.equal(out.amax_history, torch.full((2, 3, 4), 2.0))


def all_reduce_steady_state_step_reads_nothing_on_the_host(rank):
    """A data-parallel step (observe, apply, backward, `all_reduce`, `update`) after the first
    reads no tensor value on the host (each read a device sync on a GPU: `bool(t)`, `.item()`,
    `.cpu()`, `torch.equal`, ...) and runs exactly one collective, `all_reduce`'s; the state
    stays the same on every rank."""
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    model = MLP((16, 32, 32, 8), seed=1)
    fn = fp8fn.transform(model, RECIPE)
    x = _shard(_data(), rank)
    state = fn.init(x)
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    group = dist.new_group([0, 1])  # its first reduce (the structure check) comes in step 1

    def step(state):
        observed = fp8fn.observe(state)
        _sq_loss(fn.apply(params, observed, x), BATCH).backward()
        return fp8fn.update(state, fp8fn.all_reduce(fp8fn.observations(observed), group=group))

    reads = []
    dist.all_reduce = counting
    try:
        for _ in range(4):
            calls.clear()
            with CountHostReads() as c:
                new = step(state)
            reads.append(c.reads)
            state = new
    finally:
        dist.all_reduce = original
    assert reads[0] and reads[1:] == [[], [], []], reads  # step 1: the structure, on the host
    packed = (state.amax_history.numel() + state.scale.numel() + 4,)
    assert calls == [packed], calls  # the last step's one collective
    assert_state_same_on_all_ranks(state)
    MEASURED["all_reduce_route_host_reads_per_step"] = [len(r) for r in reads]


def all_reduce_errors(rank):
    """Errors name the API, what was expected and got, and how to fix it."""
    import pytest

    state = fp8fn.init_state(RECIPE, ["a"])
    with pytest.raises(TypeError, match=r"fp8fn.all_reduce: expected `obs` to be an fp8fn.State"):
        fp8fn.all_reduce({"a": state.amax_history})
    with pytest.raises(TypeError, match=r"fp8fn.all_reduce: expected `group` to be None"):
        fp8fn.all_reduce(state, group="world")
    bad = state._replace(amax_history=state.amax_history.double())
    with pytest.raises(TypeError, match=r"fp8fn.all_reduce: expected `obs.amax_history` to be fl"):
        fp8fn.all_reduce(bad)
    # a group that does not hold this rank (dist.new_group is collective: every rank makes both)
    only = [dist.new_group([0]), dist.new_group([1])]
    with pytest.raises(ValueError, match=r"expected a `group` that contains this rank, got one"):
        fp8fn.all_reduce(state, group=only[1 - rank])
    # a backend with no collective for the tensor's device: torch says only "No backend type
    # associated with device type cpu"
    cuda_only = dist.new_group([0, 1], backend="cuda:gloo")
    with pytest.raises(
        ValueError,
        match=r"expected `obs` on a device that the backend of `group` "
        r"\(.*gloo.*\) reduces \(cuda\), got cpu",
    ):
        fp8fn.all_reduce(state, group=cuda_only)


def all_reduce_subgroup(rank):
    """`group` restricts the max to its ranks: singleton groups keep each rank's own obs."""
    state = fp8fn.init_state(RECIPE, ["a", "b"])
    obs = observation(state, a=(1.0 + rank, 2.0 - rank, 0.0), b=(0.0, 0.0, 3.0 * rank))
    own = [dist.new_group([0]), dist.new_group([1])][rank]
    both = dist.new_group([0, 1])
    assert_bit_identical(fp8fn.all_reduce(obs, group=own), fp8fn.merge(obs, obs))
    assert_bit_identical(fp8fn.all_reduce(obs, group=both), fp8fn.all_reduce(obs))
    assert fp8fn.all_reduce(obs, group=both).amax_history[:, :, 0].tolist() == [
        [2.0, 2.0, 0.0],
        [0.0, 0.0, 3.0],
    ]


# --- a data-parallel functional loop (torch.func.grad, grads all-reduced by the user) -----------


def _functional_step(fn, params, state, x, n_global):
    def loss(p, s):
        return _sq_loss(fn.apply(p, s, x), n_global)

    return torch.func.grad(loss, argnums=(0, 1))(params, state)


def functional_data_parallel(rank):
    """States bit-identical on all ranks after every step; with delayed scales in use, a step's
    observations are bit-identical to one process on the global batch (max of maxes), with an
    outlier in one rank's shard only."""
    x = _data()
    model = MLP((16, 32, 32, 8), seed=1)
    fn = fp8fn.transform(model, RECIPE)
    state = fn.init(x)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    # The very first step (empty histories: each rank casts its shard with its own amax).
    _, obs_ref = _functional_step(fn, params, state, x, BATCH)
    _, obs = _functional_step(fn, params, state, _shard(x, rank), BATCH)
    obs = fp8fn.all_reduce(obs)
    # The amaxes of tensors that no cast touched before them are exact: the first layer's input,
    # every weight, the last layer's output gradient.
    first, last = obs.amax_history[0, 0, 0], obs.amax_history[-1, 2, 0]
    assert first == 40.0 and first == obs_ref.amax_history[0, 0, 0]
    assert torch.equal(obs.amax_history[:, 1, 0], obs_ref.amax_history[:, 1, 0])
    assert last == obs_ref.amax_history[-1, 2, 0]
    rel = (obs.amax_history - obs_ref.amax_history).abs() / obs_ref.amax_history.clamp_min(1e-30)
    MEASURED["first_step_max_rel_diff_interior_amaxes"] = rel.max().item()
    assert rel.max() < 0.15  # the others may differ: each rank casts with its own current scale

    # From then on every cast uses the shared delayed scales: bit-identical to one process.
    state = fp8fn.update(state, obs_ref)
    ref_params, ref_state = dict(params), state
    lr = 0.05
    for step in range(3):
        grads_ref, obs_ref = _functional_step(fn, ref_params, ref_state, x, BATCH)
        grads, obs = _functional_step(fn, params, state, _shard(x, rank), BATCH)
        flat = torch.cat([g.flatten() for g in grads.values()])  # the user's grad all-reduce
        dist.all_reduce(flat)
        grads = dict(zip(grads, flat.split([g.numel() for g in grads.values()])))
        obs = fp8fn.all_reduce(obs)
        if step == 0:  # same params, same scales: the observation of the global batch, exactly
            assert_bit_identical(obs.amax_history, obs_ref.amax_history)
        state, ref_state = fp8fn.update(state, obs), fp8fn.update(ref_state, obs_ref)
        params = {k: p - lr * grads[k].view_as(p) for k, p in params.items()}
        ref_params = {k: p - lr * grads_ref[k] for k, p in ref_params.items()}
        assert_state_same_on_all_ranks(state)
        for p in params.values():
            assert same_on_all_ranks(p)
    diff = max((params[k] - ref_params[k]).abs().max().item() for k in params)
    MEASURED["functional_params_max_abs_diff_3_steps"] = diff
    assert diff < 1e-5
    torch.testing.assert_close(state.amax_history, ref_state.amax_history, rtol=1e-5, atol=0)


# --- DDP ---------------------------------------------------------------------------------------


def _train_autograd(module, fn, x, state, steps, n_global, reduce=False, unshard=None):
    """`steps` of SGD through `fn.apply` with the module's own parameters and loss.backward()."""
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    for _ in range(steps):
        if unshard is not None:
            unshard()
        observed = fp8fn.observe(state)
        loss = fn.apply(dict(module.named_parameters()), observed, x).square().mean()
        loss.backward()
        obs = fp8fn.observations(observed)
        if reduce:
            obs = fp8fn.all_reduce(obs)
            assert_state_same_on_all_ranks(fp8fn.update(state, obs))
        opt.step()
        opt.zero_grad()
        state = fp8fn.update(state, obs)
    return state


def _warm(state, obs):
    """`state` after one process's observation `obs` (the same sites, named without the
    wrapper's prefix), seen as a rank sees it: a rank that differentiates its local mean sees
    WORLD x the output gradients of the global mean (with the global amax, its gradients would
    saturate)."""
    history = obs.amax_history.clone()
    history[:, 2] *= WORLD  # exact: a power of two
    renamed = fp8fn.State(history, obs.scale, state.sites, state.amax_compute)
    return fp8fn.update(state, renamed)


def ddp_transform_of_ddp_module(rank):
    """`fp8fn.transform(ddp_model)` + `loss.backward()`: DDP averages the gradients (its forward
    runs, so its reducer expects them); params match one process; states equal on all ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = _data()
    for cold in (True, False):
        ref = MLP((16, 32, 32, 8), seed=1)
        ref_fn = fp8fn.transform(ref, RECIPE)
        ref_state = ref_fn.init(x)
        obs0 = _functional_step(ref_fn, dict(ref.named_parameters()), ref_state, x, BATCH)[1]
        ref_state = ref_state if cold else fp8fn.update(ref_state, obs0)
        ref_state = _train_autograd(ref, ref_fn, x, ref_state, 4, BATCH)

        model = MLP((16, 32, 32, 8), seed=1)
        ddp = DDP(model)
        fn = fp8fn.transform(ddp, RECIPE)
        state = fn.init(_shard(x, rank))
        assert list(state) == ["module." + s for s in obs0]  # the wrapper's path is in the name
        assert len(list(ddp.parameters())) == len(list(model.parameters()))  # state: no param
        state = state if cold else _warm(state, obs0)
        state = _train_autograd(ddp, fn, _shard(x, rank), state, 4, BATCH, reduce=True)
        assert_state_same_on_all_ranks(state)
        for p in model.parameters():
            assert same_on_all_ranks(p.detach())
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        MEASURED[f"ddp_params_max_abs_diff_4_steps_{'cold' if cold else 'warm'}"] = diff
        # cold: the first step casts each shard with its own amax (current scaling)
        assert diff < (5e-3 if cold else 1e-5), diff
        if not cold:  # each rank differentiates its local mean: WORLD x the global gradient
            torch.testing.assert_close(
                state.amax_history[:, 2], WORLD * ref_state.amax_history[:, 2], rtol=1e-5, atol=0
            )
            torch.testing.assert_close(state.amax_history[:, :2], ref_state.amax_history[:, :2])


def ddp_transform_of_inner_module_refused(rank):
    """`fp8fn.transform(ddp_model.module)` would bypass DDP's forward, so its reducer would not
    average the gradients (each rank would keep its own): refused, naming the fix."""
    import pytest
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = MLP((16, 32, 8), seed=1)
    ddp = DDP(model)
    with pytest.raises(ValueError, match=r"^fp8fn\.transform: `module` is the module inside a Dis"):
        fp8fn.transform(ddp.module, RECIPE)
    fp8fn.transform(ddp, RECIPE)  # the DDP model itself is fine


# --- FSDP2 -------------------------------------------------------------------------------------


class Net(nn.Module):
    """fc1 -> relu -> LayerNorm -> fc2; sites `fc1`, `fc2` (the LayerNorm stays high precision)."""

    def __init__(self, seed=1):
        super().__init__()
        with _seeded(seed):
            self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.ln(F.relu(self.fc1(x))))


def _fully_shard(model):
    from torch.distributed.fsdp import fully_shard

    for m in (model.fc1, model.ln, model.fc2):
        fully_shard(m)
    fully_shard(model)


def _unshard_all(model):
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.unshard()


def fsdp2_unshard_route_still_trains(rank):
    """The 0.2 route, `unshard()` of every FSDP module before each step (it keeps the whole model
    unsharded on every rank; `tests/test_fsdp.py` covers the sharded route): the weight amax is
    the whole weight's, params match one process, states equal on all ranks."""
    x = _data()
    ref = Net()
    ref_fn = fp8fn.transform(ref, RECIPE)
    ref_state = ref_fn.init(x)
    full_weights = [ref.fc1.weight.detach().clone(), ref.fc2.weight.detach().clone()]
    ref_obs = _functional_step(ref_fn, dict(ref.named_parameters()), ref_state, x, BATCH)[1]
    ref_state = _train_autograd(ref, ref_fn, x, fp8fn.update(ref_state, ref_obs), 3, BATCH)

    model = Net()
    _fully_shard(model)
    fn = fp8fn.transform(model, RECIPE)
    assert type(model.fc1.weight).__name__ == "DTensor"
    assert model.fc1.weight.to_local().shape == (16, 16)  # half of fc1's rows on each rank
    _unshard_all(model)
    state = fn.init(_shard(x, rank))
    # one step by hand: the weight amax is the whole weight's (max over the shards)
    observed = fp8fn.observe(state)
    _unshard_all(model)
    fn.apply(dict(model.named_parameters()), observed, _shard(x, rank)).square().mean().backward()
    obs = fp8fn.all_reduce(fp8fn.observations(observed))
    for i, w in enumerate(full_weights):
        assert obs.amax_history[i, 1, 0] == w.abs().max()
    assert torch.equal(obs.amax_history[:, 1, 0], ref_obs.amax_history[:, 1, 0])
    assert type(model.fc1.weight.grad).__name__ == "DTensor"  # reduce-scattered into the shard
    for p in model.parameters():
        p.grad = None

    # 3 steps of SGD from the state warmed by one process's observation (as the reference)
    unshard = lambda: _unshard_all(model)  # noqa: E731
    state = _train_autograd(
        model, fn, _shard(x, rank), _warm(state, ref_obs), 3, BATCH, True, unshard
    )
    assert_state_same_on_all_ranks(state)
    full = [p.full_tensor() for p in model.parameters()]
    diff = max((p - q).abs().max().item() for p, q in zip(full, ref.parameters()))
    MEASURED["fsdp2_params_max_abs_diff_3_steps_warm"] = diff
    assert diff < 1e-5, diff
    torch.testing.assert_close(state.amax_history[:, :2], ref_state.amax_history[:, :2])


SCENARIOS = [
    all_reduce_is_merge_over_ranks,
    all_reduce_one_collective,
    all_reduce_structure_mismatch,
    all_reduce_steady_state_step_reads_nothing_on_the_host,
    all_reduce_errors,
    all_reduce_subgroup,
    functional_data_parallel,
    ddp_transform_of_ddp_module,
    ddp_transform_of_inner_module_refused,
    fsdp2_unshard_route_still_trains,
]


def main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    run_scenarios(rank, world_size, port, out_dir, SCENARIOS, MEASURED, group_timeout_s=30)
