"""Scenarios that `tests/test_fsdp.py` runs on 2 gloo ranks: FSDP2 (not a test module).

`main(rank, world_size, port, out_dir, names)` initializes the process group, runs the scenarios
named in `names` in order (the ranks must call the same collectives), and writes
`out_dir/rank{rank}.json`: `{scenario: "ok" | traceback}` plus `"_measured"` numbers.

The reference for "one process on the global batch" is one process that runs the global batch as
`WORLD` microbatches, the rank shards, in order: each microbatch's loss is its own mean (as each
rank's loss is), observations are merged (max, as `all_reduce`), and the accumulated gradient is
divided by `WORLD` (FSDP2 averages over the ranks). Every rank then sees exactly the output
gradients and weights of the reference, so states are compared bit for bit. (With one GEMM over
the whole batch, a mean loss would give each rank `WORLD` x the output gradient, and the weight
gradient's float32 sums would run in another order.)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from _helpers import assert_bit_identical
from _models import _seeded
from _sharded_workers import probe_subnormal
from _spawn import assert_state_same_on_all_ranks, run_scenarios
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fp8fn

WORLD = 2
BATCH = 8  # global batch; each rank gets BATCH // WORLD rows
RECIPE = fp8fn.DelayedScaling(history_len=4)
LR = 0.1
MEASURED: dict = {}  # scenario -> numbers, written to the report


class Block(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))), without the LayerNorm for `norm=False`; sites `fc1`, `fc2`."""

    def __init__(self, d: int, hidden: int, norm: bool = True):
        super().__init__()
        self.ln = nn.LayerNorm(d) if norm else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """`n_blocks` residual MLP blocks and a head; sites `blocks.{i}.fc1`, `blocks.{i}.fc2`,
    `head`. Input `(batch, d)`, output `(batch, out)`."""

    def __init__(self, seed=1, d=16, hidden=32, out=8, n_blocks=3, norm=True):
        super().__init__()
        with _seeded(seed):
            self.blocks = nn.ModuleList(Block(d, hidden, norm) for _ in range(n_blocks))
            self.head = nn.Linear(d, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fully_shard(model, **kwargs):
    """FSDP2 the usual way: each block, then the root (which holds the head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _batch(step: int, d: int = 16):
    """The global batch of `step`, `(BATCH, d)`, with an outlier in rank 1's rows."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, d, generator=g)
    x[BATCH - 2, 3] = 20.0 + step
    return x


def _shard(x, rank):
    return x.chunk(WORLD)[rank]


def _full(t):
    """The whole tensor of a (possibly sharded) parameter, detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _params_worst_rel_diff(model, ref_params, label: str) -> float:
    """The worst relative difference of the model's whole parameters from `ref_params` (the
    one process's after 3 steps), recorded with whether all are bit-identical under `label`."""
    worst, exact = 0.0, True
    for name, p in model.named_parameters():
        full, want = _full(p), ref_params[name]
        worst = max(worst, ((full - want).norm() / want.norm()).item())
        exact = exact and torch.equal(full, want)
    MEASURED[f"{label}_params_worst_rel_diff_3_steps"] = worst
    MEASURED[f"{label}_params_bit_identical_3_steps"] = exact
    return worst


def _loss(out):
    return out.square().mean()  # each rank's own mean, as data-parallel trainers write it


def rank_step(model, fn, state, x, opt=None, probe=None):
    """One step on this rank's rows: observe, apply with the module's own (sharded) parameters,
    backward (FSDP2 reduce-scatters), `fp8fn.all_reduce`, optimizer step, `update`."""
    observed = fp8fn.observe(state)
    params = dict(model.named_parameters())
    given = dict(params)
    out = fn.apply(params, observed, x)
    assert all(params[k] is t for k, t in given.items()), "apply changed the caller's dict"
    if probe is not None:
        probe(params)
    _loss(out).backward()
    obs = fp8fn.all_reduce(fp8fn.observations(observed))
    if opt is not None:
        opt.step()
    model.zero_grad()
    return fp8fn.update(state, obs)


def reference_step(model, fn, state, x, opt=None):
    """One step of the single process on the global batch `x` (see the module docstring)."""
    obs = None
    for part in x.chunk(WORLD):
        observed = fp8fn.observe(state)
        _loss(fn.apply(dict(model.named_parameters()), observed, part)).backward()
        seen = fp8fn.observations(observed)
        obs = seen if obs is None else fp8fn.merge(obs, seen)
    if opt is not None:
        for p in model.parameters():
            p.grad /= WORLD  # FSDP2 averages over the ranks (exact: a power of two)
        opt.step()
    model.zero_grad()
    return fp8fn.update(state, obs)


def _reference(steps, recipe=RECIPE, **net):
    """(params, states): the single process after warming and after each of `steps` steps."""
    model = Net(**net)
    fn = fp8fn.transform(model, recipe)
    state = fn.init(_batch(0, model.head.in_features))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = reference_step(model, fn, state, _batch(0, model.head.in_features))  # warm
    states = [state]
    for step in range(steps):
        state = reference_step(model, fn, state, _batch(1 + step, model.head.in_features), opt)
        states.append(state)
    return {k: v.detach().clone() for k, v in model.named_parameters()}, states


# --- 1. FSDP2 the usual way --------------------------------------------------------------------


def fsdp2_the_usual_way(rank):
    """fully_shard per block and root, transform, fn.init, torch.optim, observe/observations,
    `fn.apply(dict(model.named_parameters()), observed, x)`, no manual unshard. FSDP2's hooks
    unshard each block just in time and reshard it after; after 3 steps the params match one
    process and the states are bit-identical on every rank and to one process."""
    from torch.distributed.tensor import DTensor

    ref_params, ref_states = _reference(3)
    model = _fully_shard(Net())
    fn = fp8fn.transform(model, RECIPE)
    assert type(model.blocks[0].fc1.weight) is DTensor
    assert model.blocks[0].fc1.weight.to_local().shape == (16, 16)  # half the rows per rank
    state = fn.init(_shard(_batch(0), rank))  # runs the model for real (FSDP2 all-gathers)
    assert list(state) == list(ref_states[0])
    # init leaves every parameter sharded (FSDP2 alone would keep the root unsharded after a
    # forward without backward, and an optimizer made now would hold the unsharded tensors)
    assert all(type(p) is DTensor for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    # What each layer holds while the model runs: the first block is resharded (its weight a
    # DTensor shard again, the unsharded weight's storage freed) by the time the last block and
    # the head run.
    seen, unsharded = [], []

    def record(name):
        def hook(module, args):
            first = model.blocks[0].fc1.weight
            if name == "blocks.0":
                unsharded.append(first)
            own = module.fc1.weight if isinstance(module, Block) else module.weight
            freed = unsharded[0].untyped_storage().nbytes() == 0
            seen.append((name, type(first), type(own), freed))

        return hook

    handles = [
        b.register_forward_pre_hook(record(f"blocks.{i}")) for i, b in enumerate(model.blocks)
    ]
    handles.append(model.head.register_forward_pre_hook(record("head")))

    def probe(params):  # the optimizer's parameters are the shards (FSDP2 reshards the root
        assert all(type(p) is DTensor for p in params.values())  # after the backward)

    state = rank_step(model, fn, state, _shard(_batch(0), rank))  # warm
    assert_bit_identical(state, ref_states[0])
    for h in handles:
        h.remove()
    assert [s[0] for s in seen] == ["blocks.0", "blocks.1", "blocks.2", "head"], seen
    assert seen[0][1:] == (nn.Parameter, nn.Parameter, False), seen  # block 0 unsharded for itself
    assert seen[2][1:] == (DTensor, nn.Parameter, True), seen  # resharded when the last one runs
    assert seen[3][1:] == (DTensor, nn.Parameter, True), seen  # (the root: unsharded)

    for step in range(3):
        state = rank_step(model, fn, state, _shard(_batch(1 + step), rank), opt, probe)
        assert type(model.blocks[0].fc1.weight) is DTensor
        assert_state_same_on_all_ranks(state)
        assert_bit_identical(state, ref_states[1 + step])
    worst = _params_worst_rel_diff(model, ref_params, "fsdp2")
    assert worst < 1e-5, worst


def fsdp2_transform_before_fully_shard(rank):
    """transform, then fully_shard: apply finds FSDP2 at its first call and leaves its slots to
    it, so an evaluation without backward (the root stays gathered) and the next step work;
    states stay bit-identical to one process."""
    _, ref_states = _reference(1)
    model = Net()
    fn = fp8fn.transform(model, RECIPE)
    _fully_shard(model)
    state = fn.init(_shard(_batch(0), rank))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = rank_step(model, fn, state, _shard(_batch(0), rank))
    with torch.no_grad():
        fn.apply(dict(model.named_parameters()), state, _shard(_batch(1), rank))
    state = rank_step(model, fn, state, _shard(_batch(1), rank), opt)
    assert_bit_identical(state, ref_states[1])


# --- 2. float8 weight all-gather ---------------------------------------------------------------


class CommCounter(TorchDispatchMode):
    """The c10d collectives run inside it: `[(op, bytes this rank sends)]`."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func.__name__.split(".")[0] != "barrier":
            name = func.__name__.split(".")[0]
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if name in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input)
                sent = tensors[1].nbytes
            else:  # in place: allreduce_ and the like
                sent = sum(t.nbytes for t in tensors if t.dim() > 0 or t.dtype.is_floating_point)
            self.log.append((name, sent))
        return func(*args, **kwargs)

    def summary(self) -> dict:
        """`{op: [count, bytes]}`."""
        out: dict = {}
        for name, sent in self.log:
            count, total = out.get(name, (0, 0))
            out[name] = [count + 1, total + sent]
        return out


def _float32_step_collectives(net: dict, x, steps: int) -> CommCounter:
    """The collectives of the last of `steps` SGD steps of `Net(**net)` under FSDP2 in float32
    (`x(step)`: this rank's batch of the step)."""
    plain = _fully_shard(Net(**net))
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for step in range(steps):
        with CommCounter() as comm:
            _loss(plain(x(step))).backward()
            opt.step()
            plain.zero_grad()
    return comm


def _gathered_model(**net):
    return _fully_shard(fp8fn.float8_all_gather(Net(**net)))


def fp8_all_gather_delayed(rank):
    """float8_all_gather before fully_shard: FSDP2 gathers each weight as the e4m3 bytes of the
    whole weight cast with the state's scale (the backward re-gather the same bytes); states
    stay bit-identical to one process (fp32 all-gather) on every rank, params match."""
    from torch.distributed.tensor import DTensor

    from fp8fn._numerics.fp8 import cast_to_fp8
    from fp8fn._parallel.fsdp_gather import Float8GatheredWeight, Float8ShardWeight

    ref_params, ref_states = _reference(3)
    model = _gathered_model()
    fn = fp8fn.transform(model, RECIPE)
    weight = model.blocks[0].fc1.weight
    assert type(weight) is DTensor and type(weight._local_tensor) is Float8ShardWeight
    assert type(model.blocks[0].ln.weight._local_tensor) is torch.Tensor  # only linear weights
    state = fn.init(_shard(_batch(0), rank))
    assert all(type(p) is DTensor for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    layers = {p: model.get_submodule(p) for p in fn.layers}

    forward, backward = {}, {}

    def record(into, path):
        def hook(module, *args):
            w = module.weight
            assert type(w) is Float8GatheredWeight, (path, type(w), into is backward)
            into[path] = (w._data.view(torch.uint8).clone(), w._scale.clone(), w._amax.clone())

        return hook

    for path, layer in layers.items():
        layer.register_forward_pre_hook(record(forward, path))
        layer.register_full_backward_pre_hook(record(backward, path))

    with CommCounter() as comm:  # the first step: empty weight histories
        state = rank_step(model, fn, state, _shard(_batch(0), rank))
    assert_bit_identical(state, ref_states[0])
    amax_reduce = [b for n, b in comm.log if n == "allreduce_" and b == 4 * len(layers)]
    assert len(amax_reduce) == 1, comm.log  # the shards' amaxes of all weights, at once

    for step in range(3):
        full = {path: _full(layer.weight) for path, layer in layers.items()}
        scales = {path: state[path].weight.scale for path in layers}
        state = rank_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
        for path in layers:
            data, scale, whole_amax = forward[path]
            assert torch.equal(scale, scales[path])
            assert torch.equal(data, cast_to_fp8(full[path], scale).view(torch.uint8)), path
            assert torch.equal(whole_amax, full[path].abs().max())
            if path != "head":  # the root stays gathered for the backward
                assert_bit_identical(backward.pop(path), forward[path])
        assert_state_same_on_all_ranks(state)
        assert_bit_identical(state, ref_states[1 + step])
    worst = _params_worst_rel_diff(model, ref_params, "fp8_gather")
    assert worst < 1e-5, worst


def fp8_all_gather_bytes_and_collectives(rank):
    """On a model whose weights dominate, FSDP2 all-gathers at most 0.35x the bytes of the same
    FSDP2 model in float32, with the same all-gathers and reduce-scatters, plus exactly one
    all_reduce a step (fp8fn.all_reduce of the observations; at the first step one more, of
    the weights' amaxes)."""
    net = dict(d=64, hidden=256, out=64, seed=2)
    n_layers = 7

    def x(step):
        return _shard(_batch(step, 64), rank)

    fp32 = _float32_step_collectives(net, x, steps=2).summary()

    model = _gathered_model(**net)
    fn = fp8fn.transform(model, RECIPE)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = fn.init(x(0))
    with CommCounter() as first:
        state = rank_step(model, fn, state, x(0), opt)
    with CommCounter() as comm:
        state = rank_step(model, fn, state, x(1), opt)
    fp8 = comm.summary()
    obs_bytes = state.amax_history.nbytes + state.scale.nbytes + 16  # and the structure tag
    assert set(fp8) == {"_allgather_base_", "_reduce_scatter_base_", "allreduce_"}, fp8
    assert set(fp32) == {"_allgather_base_", "_reduce_scatter_base_"}, fp32
    assert fp8["_allgather_base_"][0] == fp32["_allgather_base_"][0]  # FSDP2's own
    assert fp8["_reduce_scatter_base_"] == fp32["_reduce_scatter_base_"]  # float32 gradients
    assert fp8["allreduce_"] == [1, obs_bytes], fp8

    # exactly, per rank: half of each weight in e4m3 + its amax's 4 bytes, half of every other
    # parameter in float32; the blocks gathered for the forward and again for the backward, the
    # root (the head) once
    def sent(module, gathered):
        own = [p for n, p in module.named_parameters() if not n.startswith("blocks.")]
        weights = [p for p in own if p.dim() == 2 and gathered]
        rest = sum(p.numel() for p in own) - sum(w.numel() for w in weights)
        return sum(w.numel() // WORLD + 4 for w in weights) + rest * 4 // WORLD

    for gathered, got in ((False, fp32), (True, fp8)):
        want = sum(2 * sent(b, gathered) for b in model.blocks) + sent(model, gathered)
        assert got["_allgather_base_"][1] == want, (gathered, got, want)
    ratio = fp8["_allgather_base_"][1] / fp32["_allgather_base_"][1]
    assert ratio <= 0.35, ratio
    amax_reduces = [b for n, b in first.log if n == "allreduce_" and b == 4 * n_layers]
    assert len(amax_reduces) == 1, first.log
    MEASURED["bytes_per_step"] = {
        "fp32_all_gather_sent_per_rank": fp32["_allgather_base_"][1],
        "fp8_all_gather_sent_per_rank": fp8["_allgather_base_"][1],
        "ratio": ratio,
        "collectives_fp32": fp32,
        "collectives_fp8": fp8,
        "first_step_fp8": first.summary(),
    }


def fp8_all_gather_residual_model_bytes(rank):
    """Issue 28's model (3 blocks x + fc2(gelu(fc1(x))) of Linear(32, 64) and Linear(64, 32), no
    LayerNorm, a Linear(32, 8) head), SGD: per rank and steady-state step, FSDP2 all-gathers
    13,636 bytes against float32's 50,832 (0.268x): each block 2,248 bytes (its two e4m3 weight
    halves, 1,024 + 1,024, the halves of its float32 biases, 192, and two 4-byte amaxes) for the
    forward and again for the backward, the root once, 148 (the head's e4m3 half, 128, its
    bias's half, 16, one amax). Also: exactly one all_reduce, and no host read."""
    from _helpers import CountHostReads

    net = dict(d=32, hidden=64, out=8, n_blocks=3, norm=False, seed=3)

    def x(step):
        return _shard(_batch(step, 32), rank)

    def all_gathers(comm):
        return [b for n, b in comm.log if n == "_allgather_base_"]

    fp32 = _float32_step_collectives(net, x, steps=3)
    assert all_gathers(fp32) == [528] + [8384] * 6, fp32.log

    model = _fully_shard(fp8fn.float8_all_gather(Net(**net)))
    fn = fp8fn.transform(model, RECIPE)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = fn.init(x(0))
    for step in range(4):
        with CommCounter() as fp8, CountHostReads() as reads:
            state = rank_step(model, fn, state, x(step), opt)
        if step >= 2:  # steady state: every history filled
            assert all_gathers(fp8) == [148] + [2248] * 6, fp8.log
            assert [n for n, _ in fp8.log].count("allreduce_") == 1, fp8.log
            assert reads.reads == [], reads.reads
    ratio = sum(all_gathers(fp8)) / sum(all_gathers(fp32))
    assert ratio <= 0.30, ratio
    # A state whose filled histories are not known (`_replace` forgets): the weight scales are
    # chosen by reading the histories, with the same result.
    unknown = state._replace(amax_history=state.amax_history.clone())
    assert unknown.filled is None
    with CountHostReads() as reads:
        from_values = rank_step(model, fn, unknown, x(4))
    assert reads.reads, reads.reads
    assert_bit_identical(from_values, rank_step(model, fn, state, x(4)))
    MEASURED["residual_model_bytes_per_step"] = {
        "fp32": sum(all_gathers(fp32)),
        "fp8": sum(all_gathers(fp8)),
        "ratio": ratio,
    }


def fp8_all_gather_uneven(rank):
    """A weight whose rows do not split evenly (the head, 7 rows on 2 ranks) is gathered padded;
    its observation is this rank's shard's amax until all_reduce; states stay bit-identical to
    one process, params match."""
    from fp8fn._numerics.fp8 import amax

    ref_params, ref_states = _reference(3, out=7)
    model = _gathered_model(out=7)
    fn = fp8fn.transform(model, RECIPE)
    assert model.head.weight.to_local().shape == ((4, 16) if rank == 0 else (3, 16))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = fn.init(_shard(_batch(0), rank))
    observed = fp8fn.observe(state)
    _loss(fn.apply(dict(model.named_parameters()), observed, _shard(_batch(0), rank))).backward()
    own = fp8fn.observations(observed)
    head = state.sites.index("head")
    with torch.no_grad():
        shard_amax = amax(model.head.weight.to_local())
    assert torch.equal(own.amax_history[head, 1, 0], shard_amax)
    state = fp8fn.update(state, fp8fn.all_reduce(own))
    model.zero_grad()
    assert_bit_identical(state, ref_states[0])
    for step in range(3):
        state = rank_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
        assert_state_same_on_all_ranks(state)
        assert_bit_identical(state, ref_states[1 + step])
    worst = _params_worst_rel_diff(model, ref_params, "uneven")
    assert worst < 1e-5, worst


def fp8_all_gather_current_scaling(rank):
    """CurrentScaling with float8_all_gather: every weight's scale from one all_reduce(MAX) of
    all shard amaxes a step (torchao's precompute, inside apply), the only collective fp8fn
    adds; params match one process."""
    recipe = fp8fn.CurrentScaling()
    ref_params, _ = _reference(3, recipe=recipe)
    model = _gathered_model()
    fn = fp8fn.transform(model, recipe)
    state = fn.init(_shard(_batch(0), rank))
    assert len(state) == 0  # stateless: nothing to observe or reduce
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(4):  # as the reference: a first pass without optimizer step, then 3 steps
        with CommCounter() as comm:
            out = fn.apply(dict(model.named_parameters()), state, _shard(_batch(step), rank))
            _loss(out).backward()
        if step:
            opt.step()
        model.zero_grad()
        reduces = [b for n, b in comm.log if n == "allreduce_"]
        assert reduces == [4 * len(fn.layers)], comm.log  # the 7 weights' amaxes, at once
        assert {n for n, _ in comm.log} == {
            "_allgather_base_",
            "_reduce_scatter_base_",
            "allreduce_",
        }
    worst = _params_worst_rel_diff(model, ref_params, "current_scaling")
    assert worst < 1e-5, worst


def fp8_all_gather_eval_between_steps(rank):
    """An evaluation between steps (a plain `model(x)`, which runs on the gathered float8
    weights dequantized, and `fn.apply` under no_grad) leaves training bit-identical to one
    process: FSDP2 keeps the root gathered, with the last apply's scale, after a forward without
    backward, and the next `apply` gathers it again with its own scale."""
    from torch.distributed.tensor import DTensor

    _, ref_states = _reference(3)
    model = _gathered_model()
    fn = fp8fn.transform(model, RECIPE)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = fn.init(_shard(_batch(0), rank))
    state = rank_step(model, fn, state, _shard(_batch(0), rank))
    for step in range(3):
        state = rank_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
        assert_bit_identical(state, ref_states[1 + step])
        x = _shard(_batch(1 + step), rank)  # amaxes within the histories: no saturation
        with torch.no_grad():  # the plain forward gathers with the last apply's scales
            plain = model(x)
            assert type(model.head.weight) is not DTensor  # FSDP2 keeps the root gathered
            evaluated = fn.apply(dict(model.named_parameters()), state, x)
        error = (plain - evaluated).norm() / evaluated.norm()
        assert error < 0.1, error  # float8 weights (and inputs, in apply)


def _trained_pair(rank):
    """A float8-gathered model, its transform and two states with other weight scales: `late`
    after a warm step, `early` with 3x the warm step's amaxes pushed on top (1/3 the scales)."""
    model = _gathered_model()
    fn = fp8fn.transform(model, RECIPE)
    state = fn.init(_shard(_batch(0), rank))
    observed = fp8fn.observe(state)
    _loss(fn.apply(dict(model.named_parameters()), observed, _shard(_batch(0), rank))).backward()
    model.zero_grad()
    obs = fp8fn.all_reduce(fp8fn.observations(observed))
    late = fp8fn.update(state, obs)
    early = fp8fn.update(late, obs._replace(amax_history=obs.amax_history * 3))
    return model, fn, late, early


def _local_grads(model) -> dict:
    grads = {k: p.grad.to_local().clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return grads


def fp8_all_gather_backward_after_another_forward(rank):
    """Another forward of the same FSDP2 model between a training forward and its backward
    (an evaluation under no_grad with another state; a second transform of the model,
    evaluated, or trained with its own backward after) leaves that backward bit-identical to
    one without: its float8 weights are cast with its own forward's scales (FSDP2's re-gather
    casts with the last forward's, so the op gathers them again)."""
    x, other = _shard(_batch(1), rank), _shard(_batch(2), rank)
    margin = fp8fn.DelayedScaling(history_len=4, margin=1)  # another transform: other scales

    def train(between=None, second=False):
        """`({param: local grad}, [observations])` of one training forward and backward on a
        fresh model (`early`'s scales), `between(model, fn, late)` run before the backward;
        `second`: a second transform's step follows, forward before the first backward."""
        model, fn, late, early = _trained_pair(rank)
        observed = fp8fn.observe(early)
        out = fn.apply(dict(model.named_parameters()), observed, x)
        seen = []
        if second:
            fn2 = fp8fn.transform(model, margin)
            observed2 = fp8fn.observe(fn2.init(other))
            out2 = fn2.apply(dict(model.named_parameters()), observed2, other)
        if between is not None:
            between(model, fn, late)
        _loss(out).backward()
        seen.append(fp8fn.observations(observed))
        if second:
            _loss(out2).backward()
            seen.append(fp8fn.observations(observed2))
        return _local_grads(model), seen

    def evaluate(model, fn, late):
        with torch.no_grad():
            fn.apply(dict(model.named_parameters()), late, other)

    def evaluate_second(model, fn, late):
        fn2 = fp8fn.transform(model, margin)
        with torch.no_grad():
            fn2.apply(dict(model.named_parameters()), fn2.init(other), other)

    want, want_obs = train()
    for between in (evaluate, evaluate_second):
        grads, obs = train(between)
        for k, g in grads.items():
            assert torch.equal(g, want[k]), (between.__name__, k)
        assert_bit_identical(obs, want_obs)

    # two transforms, both trained, forwards before backwards == one after the other
    grads, obs = train(second=True)
    model, fn, _, early = _trained_pair(rank)
    observed = fp8fn.observe(early)
    _loss(fn.apply(dict(model.named_parameters()), observed, x)).backward()
    fn2 = fp8fn.transform(model, margin)
    observed2 = fp8fn.observe(fn2.init(other))
    _loss(fn2.apply(dict(model.named_parameters()), observed2, other)).backward()
    want = _local_grads(model)
    for k, g in grads.items():
        assert torch.equal(g, want[k]), ("two transforms", k)
    assert_bit_identical(obs, [fp8fn.observations(observed), fp8fn.observations(observed2)])


def fp8_all_gather_tied_weights(rank):
    """Two Linears sharing one weight stay one parameter under float8_all_gather: after 3 AdamW
    steps under FSDP2 they are still tied, and params and states are bitwise those of the same
    FSDP2 model gathered in float32, under DelayedScaling and the finer recipes (rowwise, MX,
    blockwise: each layer's backward gathers its grad_input plane of the shared weight). A
    weight tied to an embedding is refused before fully_shard, naming the fix."""
    import pytest
    from _models import Tied
    from torch.distributed.fsdp import fully_shard

    from fp8fn._parallel.fsdp_gather import Float8ShardWeight

    with pytest.raises(ValueError, match=r"^fp8fn\.float8_all_gather: expected the weight of la"):
        fp8fn.float8_all_gather(Tied(16, 32))
    idx = torch.randint(0, 16, (BATCH, 3), generator=torch.Generator().manual_seed(5))
    for recipe in (RECIPE, FINER[0], FINER[2], FINER[4]):
        runs = []
        for gathered in (True, False):
            model = Tied(16, 32, seed=4)
            if gathered:
                fp8fn.float8_all_gather(model, filter_fn=lambda name, module: name != "head")
                assert type(model.a.weight) is Float8ShardWeight  # (an nn.Parameter)
                assert isinstance(model.a.weight, nn.Parameter)
                assert model.b.weight is model.a.weight
            fully_shard(model)
            fn = fp8fn.transform(model, recipe)
            state = fn.init(_shard(idx, rank))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for _ in range(3):
                state = rank_step(model, fn, state, _shard(idx, rank), opt)
            assert model.b.weight is model.a.weight
            assert len(list(model.parameters())) == 4  # emb = head, a = b weights; 2 biases
            runs.append(({k: _full(p) for k, p in model.named_parameters()}, state))
        (params, state), (want, want_state) = runs
        assert_bit_identical(state, want_state)
        for k, p in params.items():
            assert torch.equal(p, want[k]), (recipe, k)


def fp8_all_gather_sharded_classes(rank):
    """float8_all_gather against FSDP2's float32 gather of the same model, 3 SGD steps from a
    cold state, params and states bitwise: DelayedScaling with margin=1 (a weight whose float8
    bits depend on the margin), a frozen weight (stays as it was), layers of CurrentScaling
    (then of MXScaling, then of RowwiseScaling: one step with both the per-tensor amaxes'
    all-reduce and the finer statistics' all-gather) between the delayed ones (a recipe
    function), a head of 1 row (more ranks than rows; under the finer recipe, an empty shard),
    and the state's sites in reverse order (scales are found by site name, not position)."""
    delayed = fp8fn.DelayedScaling(history_len=4, margin=1)
    for middle in (fp8fn.CurrentScaling(), fp8fn.MXScaling(), fp8fn.RowwiseScaling()):
        _sharded_classes(rank, delayed, middle)


def _sharded_classes(rank, delayed, middle):
    def recipe(name, module):
        if name == "head" and not isinstance(middle, fp8fn.CurrentScaling):
            return middle
        return middle if name.startswith("blocks.1.") else delayed

    x0 = _shard(_batch(0), rank)
    runs = []
    for gathered in (True, False):
        model = Net(out=1)
        for block in model.blocks:
            probe_subnormal(block.fc1.weight)
        model.blocks[0].fc1.weight.requires_grad_(False)
        if gathered:
            fp8fn.float8_all_gather(model)
        frozen = model.blocks[0].fc1.weight.detach().clone()
        _fully_shard(model)
        fn = fp8fn.transform(model, recipe)
        state = fn.init(x0)
        flat = fp8fn.flatten_state(state)
        state = fp8fn.unflatten_state(dict(reversed(list(flat.items()))), delayed)
        assert list(state)[0] == list(flat)[-1].rsplit(".", 2)[0]  # reversed
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        for step in range(3):
            state = rank_step(model, fn, state, _shard(_batch(step), rank), opt)
        assert torch.equal(_full(model.blocks[0].fc1.weight), frozen)
        runs.append(({k: _full(p) for k, p in model.named_parameters()}, state))
    (params, state), (want, want_state) = runs
    assert_bit_identical(fp8fn.flatten_state(state), fp8fn.flatten_state(want_state))
    for k, p in params.items():
        assert torch.equal(p, want[k]), (middle, k)


class SplitAttention(nn.Module):
    """Cross-attention with separate q/k/v projections (kdim, vdim other than embed_dim) and a
    head; sites `k_in`, `v_in`, `attn.q_proj`, `attn.k_proj`, `attn.v_proj`, `attn.out_proj`,
    `head`. Input `(2 * n, 16)`: n sequences of 2 tokens."""

    def __init__(self, seed=1):
        super().__init__()
        with _seeded(seed):
            self.k_in, self.v_in = nn.Linear(16, 12), nn.Linear(16, 10)
            self.attn = nn.MultiheadAttention(16, 2, kdim=12, vdim=10, batch_first=True)
            self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = x.view(-1, 2, 16)
        out, _ = self.attn(x, self.k_in(x), self.v_in(x), need_weights=False)
        return self.head(out).flatten(0, 1)


def fsdp2_split_attention(rank):
    """nn.MultiheadAttention's separate q/k/v projections under FSDP2 (the unsharded weights
    swapped in): each projection is its own site, and 2 steps keep the states bitwise those of
    one process, the params within 1e-5."""
    from torch.distributed.fsdp import fully_shard

    ref = SplitAttention()
    ref_fn = fp8fn.transform(ref, RECIPE)
    ref_state = ref_fn.init(_batch(0))
    model = SplitAttention()
    fully_shard(model.attn)
    fully_shard(model)
    fn = fp8fn.transform(model, RECIPE)
    state = fn.init(_shard(_batch(0), rank))
    assert list(state) == list(ref_state) and "attn.k_proj" in list(state)
    _two_steps_like_one_process(rank, (model, fn, state), (ref, ref_fn, ref_state))


def _two_steps_like_one_process(rank, sharded, one, observed=()):
    """2 SGD steps of `sharded` `(model, fn, state)` on this rank's rows and of `one` (the same
    on one process, all rows): the states bitwise equal after each step (and each site of
    `observed` with a filled input history), the params within 1e-5 at the end."""
    (model, fn, state), (ref, ref_fn, ref_state) = sharded, one
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        ref_state = reference_step(ref, ref_fn, ref_state, _batch(step), ref_opt)
        state = rank_step(model, fn, state, _shard(_batch(step), rank), opt)
        assert_bit_identical(state, ref_state)
        assert all(bool(state[s].input.amax_history[0] > 0) for s in observed)
    for name, p in model.named_parameters():
        want = dict(ref.named_parameters())[name]
        assert ((_full(p) - want).norm() / want.norm()).item() < 1e-5, name


class PackedCrossAttention(nn.Module):
    """Cross-attention with nn.MultiheadAttention's packed `in_proj_weight` (kdim = vdim =
    embed_dim): `kv` with key and value one tensor (torch splits the weight into q and kv
    slices), `qkv` with key and value apart (three slices); then self-attention (one GEMM).
    Input `(2 * n, 16)`."""

    def __init__(self, seed=1):
        super().__init__()
        with _seeded(seed):
            self.mem, self.v_in = nn.Linear(16, 16), nn.Linear(16, 16)
            self.kv = nn.MultiheadAttention(16, 2, batch_first=True)
            self.qkv = nn.MultiheadAttention(16, 2, batch_first=True)
            self.self_attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = x.view(-1, 2, 16)
        mem = self.mem(x)
        h, _ = self.kv(x, mem, mem, need_weights=False)
        h, _ = self.qkv(h, mem, self.v_in(x), need_weights=False)
        h, _ = self.self_attn(h, h, h, need_weights=False)
        return self.head(h).flatten(0, 1)


def fsdp2_packed_cross_attention(rank):
    """The slices of a packed `in_proj_weight` under FSDP2 (the unsharded weight swapped in,
    then split by torch): each slice is a site of its own in float8 (`kv.in_proj`,
    `kv.in_proj#1`; `qkv.in_proj`, `#1`, `#2`), and 2 steps keep the states bitwise those of
    one process, the params within 1e-5. Each attention is wrapped by FSDP2, which hands its
    inputs over as tensors of their own when gradients are recorded (`key is value` false):
    fp8fn 0.4 then ran three GEMMs where `fn.init` saw two and refused the first step."""
    from torch.distributed.fsdp import fully_shard

    ref = PackedCrossAttention()
    ref_fn = fp8fn.transform(ref, RECIPE)
    ref_state = ref_fn.init(_batch(0))
    model = PackedCrossAttention()
    for attention in (model.kv, model.qkv, model.self_attn):
        fully_shard(attention)
    fully_shard(model)
    fn = fp8fn.transform(model, RECIPE)
    state = fn.init(_shard(_batch(0), rank))
    slices = ["kv.in_proj", "kv.in_proj#1", "qkv.in_proj", "qkv.in_proj#1", "qkv.in_proj#2"]
    assert "self_attn.in_proj" in state and "self_attn.in_proj#1" not in state
    assert list(state) == list(ref_state) and set(slices) <= set(state)
    assert "float8 DelayedScaling" in fn.summary().split("qkv.in_proj_weight")[1].split("\n")[0]
    _two_steps_like_one_process(rank, (model, fn, state), (ref, ref_fn, ref_state), slices)


def fp8_all_gather_errors(rank):
    """Misuse raises a clear fp8fn error, the same on every rank (no rank left waiting in a
    collective)."""
    import pytest
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    with pytest.raises(
        ValueError,
        match=r"^fp8fn\.float8_all_gather: expected layer 'blocks.0.fc1' to hold a plain weight "
        r"Parameter, got DTensor\. Call float8_all_gather before fully_shard",
    ):
        fp8fn.float8_all_gather(_fully_shard(Net()))
    with pytest.raises(ValueError, match=r"^fp8fn\.float8_all_gather: expected at least one nn.L"):
        fp8fn.float8_all_gather(Net(), filter_fn=lambda name, module: False)
    with pytest.raises(TypeError, match=r"^fp8fn\.float8_all_gather: expected `model` to be an "):
        fp8fn.float8_all_gather([nn.Linear(2, 2)])

    model = _gathered_model()
    with pytest.raises(ValueError, match=r"^fp8fn\.transform: parameter 'head.weight' is all-ga"):
        fp8fn.transform(model, RECIPE, filter_fn=lambda name, module: name != "head")
    with pytest.raises(ValueError, match=r"^fp8fn\.transform: expected layer 'blocks.0.fc1', wh"):
        fp8fn.transform(model, fp8fn.NVFP4Scaling())
    unsharded = fp8fn.float8_all_gather(Net())
    with pytest.raises(ValueError, match=r"to be sharded by FSDP2, got an unsharded weight\. Ca"):
        fp8fn.transform(unsharded, RECIPE)

    # a plain forward before any apply: no scale yet
    with pytest.raises(RuntimeError, match=r"'head' was all-gathered outside fp8fn's apply befo"):
        model(_shard(_batch(0), rank))

    # FSDP2-managed parameters must be the model's own
    model = _gathered_model()
    fn = fp8fn.transform(model, RECIPE)
    state = fn.init(_shard(_batch(0), rank))
    params = dict(model.named_parameters())
    params["blocks.1.fc2.bias"] = params["blocks.1.fc2.bias"].detach().clone()
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected `params\['blocks.1.fc2.bias'"):
        fn.apply(params, state, _shard(_batch(0), rank))

    # weights sharded along another dim
    model = fp8fn.float8_all_gather(Net())
    for block in model.blocks:
        fully_shard(block, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    fully_shard(model)
    fn = fp8fn.transform(model, RECIPE)
    with pytest.raises(RuntimeError, match=r"expected 'blocks.0.fc1' sharded along dim 0, got a "):
        fn.init(_shard(_batch(0), rank))


# --- 6b. the finer recipes: one plane per phase ------------------------------------------------

FINER = [
    fp8fn.RowwiseScaling(),
    fp8fn.RowwiseScaling(hp_grad_weight=True),
    fp8fn.MXScaling(),
    fp8fn.MXScaling(scale_rounding="floor"),
    fp8fn.BlockwiseScaling(),
]


def _stateless_step(model, fn, state, x, opt=None, microbatches=1):
    """One step of a stateless recipe on this rank's rows `x` (as `microbatches` microbatches
    whose gradients accumulate): apply, backward, the optimizer step."""
    for part in x.chunk(microbatches):
        _loss(fn.apply(dict(model.named_parameters()), state, part)).backward()
    if opt is not None:
        opt.step()
    model.zero_grad()


def _record_planes(model, layers):
    """`(forward, backward)`: `{path: (plane kind, gathered e4m3 bytes)}` that each layer's
    weight holds when its forward runs and when its backward starts."""
    from fp8fn._parallel.fsdp_finer import FinerGatheredWeight

    forward, backward = {}, {}

    def record(into, path):
        def hook(module, *args):
            w = module.weight
            assert type(w) is FinerGatheredWeight, (path, type(w), into is backward)
            into[path] = (w._plane.kind, w._data.view(torch.uint8).clone())

        return hook

    for path, layer in layers.items():
        layer.register_forward_pre_hook(record(forward, path))
        layer.register_full_backward_pre_hook(record(backward, path))
    return forward, backward


def fp8_all_gather_finer_recipes(rank):
    """float8_all_gather under each finer recipe (rowwise, rowwise_with_gw_hp, MXFP8 RCEIL and
    FLOOR, blockwise), an uneven head (7 rows: padded) and cuts inside groups (rows 16 of 32:
    every MX 32 x 1 and blockwise 128 x 128 group of fc1 split): each forward gathers the
    output GEMM's plane, the e4m3 bytes of the whole weight's plane bit for bit; each block's
    backward re-gather the grad_input GEMM's (blockwise: the same plane); after a warm step
    and 3 SGD steps the parameters are bit-identical to one process (float32 gathers) on
    every rank; a steady step reads no value on the host."""
    from _helpers import CountHostReads

    from fp8fn._parallel import planes

    for recipe in FINER:
        ref_params, _ = _reference(3, recipe=recipe, out=7)
        model = _gathered_model(out=7)
        fn = fp8fn.transform(model, recipe)
        state = fn.init(_shard(_batch(0), rank))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        layers = {p: model.get_submodule(p) for p in fn.layers}
        forward, backward = _record_planes(model, layers)
        _stateless_step(model, fn, state, _shard(_batch(0), rank))  # warm
        for step in range(3):
            full = {path: _full(layer.weight) for path, layer in layers.items()}
            with CountHostReads() as reads:
                _stateless_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
            assert reads.reads == [], (recipe, reads.reads)
            for path in layers:
                for gemm, seen in ((0, forward), (1, backward)):
                    if gemm and path == "head":  # the root stays gathered for its backward
                        continue
                    plane = planes.plane_of(recipe, gemm)
                    kind, data = seen.pop(path)
                    want, _ = planes.quantize(plane, full[path])
                    assert kind == plane.kind, (recipe, path, kind)
                    assert torch.equal(data, want.view(torch.uint8)), (recipe, path, gemm)
        name = type(recipe).__name__ + ("_gw_hp" if getattr(recipe, "hp_grad_weight", 0) else "")
        name += "_" + getattr(recipe, "scale_rounding", "")
        worst = _params_worst_rel_diff(model, ref_params, f"finer_{name}")
        assert MEASURED[f"finer_{name}_params_bit_identical_3_steps"], (recipe, worst)


def fp8_all_gather_finer_bytes(rank):
    """Per rank and steady step on 3 blocks of `Linear(64, 256)`, `Linear(256, 64)` and a head,
    each finer recipe: FSDP2's all-gathers (as many as in float32) carry one plane's e4m3 bytes
    per weight half, every other parameter's float32 half, nothing else; one more all-gather
    carries the statistics of both planes of all 7 weights; the root's head, which FSDP2 keeps
    gathered, all-gathers its grad_input plane in the backward (rowwise, MX); the
    reduce-scatters are float32's. All-gathered bytes, scales included, <= 0.30x float32's;
    recorded beside a both-planes gather (each FSDP2 all-gather carrying both planes' bytes,
    the head's own all-gather not needed)."""
    net = dict(d=64, hidden=256, out=64, seed=2)

    def x(step):
        return _shard(_batch(step, 64), rank)

    fp32 = _float32_step_collectives(net, x, steps=2).summary()
    for recipe in FINER:
        model = _gathered_model(**net)
        fn = fp8fn.transform(model, recipe)
        state = fn.init(x(0))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        _stateless_step(model, fn, state, x(0), opt)
        with CommCounter() as comm:
            _stateless_step(model, fn, state, x(1), opt)
        got = comm.summary()
        assert set(got) == {"_allgather_base_", "_reduce_scatter_base_"}, got
        assert got["_reduce_scatter_base_"] == fp32["_reduce_scatter_base_"]
        own = 0 if isinstance(recipe, fp8fn.BlockwiseScaling) else 1  # the head's
        assert got["_allgather_base_"][0] == fp32["_allgather_base_"][0] + 1 + own, got

        def fsdp_bytes(module):  # FSDP2's all-gather of `module`'s own parameters, one plane
            params = [p for n, p in module.named_parameters() if not n.startswith("blocks.")]
            weights = [p for p in params if p.dim() == 2]
            rest = sum(p.numel() for p in params) - sum(w.numel() for w in weights)
            return sum(w.numel() // WORLD for w in weights) + rest * 4 // WORLD

        fp8 = sum(2 * fsdp_bytes(b) for b in model.blocks) + fsdp_bytes(model)
        head = model.head.weight.numel() // WORLD
        sizes = [b for n, b in comm.log if n == "_allgather_base_"]
        side = sizes[0]  # the statistics' all-gather comes first (in apply, before the forward)
        assert sum(sizes) == fp8 + side + own * head, (recipe, sizes, fp8, side)
        one_plane = sum(sizes)
        weight_bytes = sum(
            2 * p.numel() // WORLD for b in model.blocks for p in b.parameters() if p.dim() == 2
        )
        both_planes = one_plane + weight_bytes + head - own * head
        ratio = one_plane / fp32["_allgather_base_"][1]
        assert ratio <= 0.30, (recipe, ratio)
        MEASURED.setdefault("finer_bytes_per_step", {})[repr(recipe)] = {
            "fp32_all_gather": fp32["_allgather_base_"][1],
            "one_plane": one_plane,
            "statistics": side,
            "both_planes": both_planes,
            "ratio_one_plane": ratio,
            "ratio_both_planes": both_planes / fp32["_allgather_base_"][1],
            "all_gathers": got["_allgather_base_"][0],
            "all_gathers_fp32": fp32["_allgather_base_"][0],
        }


def fp8_all_gather_finer_variants(rank):
    """Each finer recipe, against one process, bit for bit: FSDP2 with
    `reshard_after_forward=False` (no backward re-gather: every layer's op all-gathers its
    grad_input plane itself), gradient accumulation over 2 microbatches, and an evaluation
    (`fn.apply` under no_grad, which gathers the forward plane again) between a training
    forward and its backward."""
    x = _shard(_batch(1), rank)
    for recipe in FINER:
        ref_params, _ = _reference(2, recipe=recipe)
        model = _fully_shard(fp8fn.float8_all_gather(Net()), reshard_after_forward=False)
        fn = fp8fn.transform(model, recipe)
        state = fn.init(_shard(_batch(0), rank))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        _stateless_step(model, fn, state, _shard(_batch(0), rank))
        for step in range(2):
            _stateless_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
        for name, p in model.named_parameters():
            assert torch.equal(_full(p), ref_params[name]), (recipe, "no reshard", name)

        # gradient accumulation: 2 microbatches per rank = 4 microbatches of one process
        model = _gathered_model()
        fn = fp8fn.transform(model, recipe)
        state = fn.init(_shard(_batch(0), rank))
        _stateless_step(model, fn, state, _shard(_batch(0), rank))
        for part in _shard(_batch(1), rank).chunk(2):
            _loss(fn.apply(dict(model.named_parameters()), state, part)).backward()
        grads = _local_grads(model)
        ref = Net()
        ref_fn = fp8fn.transform(ref, recipe)
        ref_state = ref_fn.init(_batch(0))
        parts = [x.chunk(2) for x in _batch(1).chunk(WORLD)]  # [rank][microbatch]
        per = [[None] * 2 for _ in range(WORLD)]
        for r in range(WORLD):
            for j in range(2):
                _loss(ref_fn.apply(dict(ref.named_parameters()), ref_state, parts[r][j])).backward()
                per[r][j] = {k: p.grad.clone() for k, p in ref.named_parameters()}
                ref.zero_grad()
        for name in grads:  # FSDP2: each microbatch's gradient averaged over ranks, accumulated
            want = sum(per[r][0][name] for r in range(WORLD)) / WORLD
            want = want + sum(per[r][1][name] for r in range(WORLD)) / WORLD
            assert torch.equal(grads[name], want.chunk(WORLD)[rank]), (recipe, "accum", name)

        # an evaluation between the forward and its backward
        runs = []
        for between in (False, True):
            model = _gathered_model()
            fn = fp8fn.transform(model, recipe)
            state = fn.init(_shard(_batch(0), rank))
            out = fn.apply(dict(model.named_parameters()), state, x)
            if between:
                with torch.no_grad():
                    fn.apply(dict(model.named_parameters()), state, _shard(_batch(2), rank))
            _loss(out).backward()
            runs.append(_local_grads(model))
        for k, g in runs[1].items():
            assert torch.equal(g, runs[0][k]), (recipe, "eval between", k)

        _finer_bf16_meta_checkpoint(rank, recipe)


def _bf16_grid(model):
    """Round `model`'s float32 parameters in place to bfloat16 values (FSDP2's sharded ones
    too: their local shards)."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(local.to(torch.bfloat16))


def _finer_bf16_meta_checkpoint(rank, recipe):
    """Under `recipe`, against one process, bit for bit after 2 SGD steps: (1) FSDP2's
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` (the weights gathered as e4m3 and, to
    autograd, bfloat16; one process runs bfloat16 copies of the params, gradients summed in
    bfloat16; both keep the params on the bfloat16 grid, where the float32 master's cast and its
    bfloat16 copy's agree); (2) a model made on the meta device, float8_all_gather and
    fully_shard there, then `to_empty` and filled from one process's initial weights; (3)
    `checkpoint_fn` recomputing the blocks in the backward (the recompute's output GEMM
    all-gathers its plane again)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    ref = Net()
    _bf16_grid(ref)
    ref_fn = fp8fn.transform(ref, recipe)
    ref_state = ref_fn.init(_batch(0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    model = _fully_shard(fp8fn.float8_all_gather(Net()), mp_policy=policy)
    _bf16_grid(model)
    fn = fp8fn.transform(model, recipe)
    state = fn.init(_shard(_batch(0), rank))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        params = {
            n: p.detach().to(torch.bfloat16).requires_grad_() for n, p in ref.named_parameters()
        }
        for part in _batch(step).chunk(WORLD):
            part = part.to(torch.bfloat16)  # (FSDP2 casts the root's inputs to param_dtype)
            _loss(ref_fn.apply(params, ref_state, part)).backward()
        for n, p in ref.named_parameters():
            p.grad = params[n].grad.float() / WORLD
        ref_opt.step()
        ref.zero_grad()
        _bf16_grid(ref)
        _stateless_step(model, fn, state, _shard(_batch(step), rank), opt)
        _bf16_grid(model)
    for name, p in model.named_parameters():
        assert torch.equal(_full(p), dict(ref.named_parameters())[name]), (recipe, "bf16", name)

    ref_params, _ = _reference(2, recipe=recipe)
    with torch.device("meta"):
        model = Net()
    _fully_shard(fp8fn.float8_all_gather(model))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in Net().named_parameters():  # the initial weights, this rank's rows
            model.get_parameter(name).to_local().copy_(p.chunk(WORLD)[rank])
    runs = [model, _gathered_model()]
    checkpointed = fp8fn.transform(
        runs[1], recipe, checkpoint_fn=lambda name, m: name.startswith("blocks.")
    )
    for model, fn in ((runs[0], fp8fn.transform(runs[0], recipe)), (runs[1], checkpointed)):
        state = fn.init(_shard(_batch(0), rank))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        _stateless_step(model, fn, state, _shard(_batch(0), rank))
        for step in range(2):
            _stateless_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
        what = "meta" if model is runs[0] else "checkpoint_fn"
        for name, p in model.named_parameters():
            assert torch.equal(_full(p), ref_params[name]), (recipe, what, name)


# --- 7. checkpoints ----------------------------------------------------------------------------

WORKDIR = None  # set by `main`: where the checkpoint and the uninterrupted run's results go


def _dcp_setup(rank, seed):
    model = _gathered_model(seed=seed)
    fn = fp8fn.transform(model, RECIPE)
    state = fn.init(_shard(_batch(0), rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, fn, state, opt


def _dcp_dict(model, opt, state):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "fp8fn": fp8fn.flatten_state(state)}


def dcp_save(rank):
    """Warm, 2 steps, `torch.distributed.checkpoint.save` of the sharded model, AdamW and the
    fp8fn state; then the uninterrupted 3rd step, kept for `dcp_resume`."""
    import torch.distributed.checkpoint as dcp

    model, fn, state, opt = _dcp_setup(rank, seed=1)
    state = rank_step(model, fn, state, _shard(_batch(0), rank))
    for step in range(2):
        state = rank_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
    dcp.save(_dcp_dict(model, opt, state), checkpoint_id=os.path.join(WORKDIR, "ckpt"))
    state = rank_step(model, fn, state, _shard(_batch(3), rank), opt)
    params = {k: _full(p) for k, p in model.named_parameters()}
    torch.save({"params": params, "state": state}, os.path.join(WORKDIR, f"truth{rank}.pt"))
    for recipe in DCP_FINER:  # the finer recipes: resumed on 1 rank (`dcp_resume_one_rank`)
        model = _gathered_model(seed=1)
        fn = fp8fn.transform(model, recipe)
        state = fn.init(_shard(_batch(0), rank))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _stateless_step(model, fn, state, _shard(_batch(0), rank))
        for step in range(2):
            _stateless_step(model, fn, state, _shard(_batch(1 + step), rank), opt)
        path = os.path.join(WORKDIR, f"ckpt_{type(recipe).__name__}")
        dcp.save(_dcp_dict(model, opt, state), checkpoint_id=path)
        _stateless_step(model, fn, state, _shard(_batch(3), rank), opt)
        params = {k: _full(p) for k, p in model.named_parameters()}
        torch.save(params, path + ".truth.pt")


def dcp_resume_one_rank(rank):
    """On ONE rank (another world size), for each finer recipe: a model built from other
    weights loads the 2-rank checkpoint (float8_all_gather, FSDP2 over 1 rank, AdamW) and takes
    the 3rd step on the global batch as the 2 ranks' rows (2 microbatches, gradients averaged
    as FSDP2 averaged them over 2 ranks): parameters bit-identical to the uninterrupted 2-rank
    run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    assert torch.distributed.get_world_size() == 1
    for recipe in DCP_FINER:
        path = os.path.join(WORKDIR, f"ckpt_{type(recipe).__name__}")
        model = _gathered_model(seed=7)
        fn = fp8fn.transform(model, recipe)
        state = fn.init(_batch(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loaded = _dcp_dict(model, opt, state)
        dcp.load(loaded, checkpoint_id=path)
        set_state_dict(
            model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        for part in _batch(3).chunk(WORLD):
            _loss(fn.apply(dict(model.named_parameters()), state, part)).backward()
        for p in model.parameters():
            p.grad /= WORLD  # (exact: a power of two)
        opt.step()
        truth = torch.load(path + ".truth.pt", weights_only=True)
        for name, p in model.named_parameters():
            assert torch.equal(_full(p), truth[name]), (recipe, name)


def dcp_resume(rank):
    """In fresh processes: a model built from other weights loads the checkpoint and takes the
    3rd step: params and state bit-identical to the uninterrupted run. The checkpoint holds plain
    tensors (torch.load(weights_only=True) reads it without fp8fn's classes registered), so a
    model without float8_all_gather loads the same weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from fp8fn._parallel.fsdp_gather import Float8ShardWeight

    path = os.path.join(WORKDIR, "ckpt")
    model, fn, state, opt = _dcp_setup(rank, seed=7)  # everything must come from the checkpoint
    loaded = _dcp_dict(model, opt, state)
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert type(model.blocks[0].fc1.weight.to_local()) is Float8ShardWeight  # still opted in
    at_load = {k: _full(p) for k, p in model.named_parameters()}
    state = fp8fn.unflatten_state(loaded["fp8fn"], RECIPE)
    state = rank_step(model, fn, state, _shard(_batch(3), rank), opt)
    truth = torch.load(os.path.join(WORKDIR, f"truth{rank}.pt"), weights_only=False)
    assert_bit_identical(state, truth["state"])
    for name, p in model.named_parameters():
        assert torch.equal(_full(p), truth["params"][name]), name

    # DCP's reader unpickles with torch.load(weights_only=True); fp8fn's weight class is not an
    # allowed global here, so the load above shows the checkpoint holds plain tensors
    assert Float8ShardWeight not in torch.serialization.get_safe_globals()
    plain = _fully_shard(Net(seed=7))  # no float8_all_gather: the same weights load
    weights = {"model": plain.state_dict()}
    dcp.load(weights, checkpoint_id=path)
    plain.load_state_dict(weights["model"])
    for name, p in plain.named_parameters():
        assert type(p.to_local()) is torch.Tensor, name
        assert torch.equal(_full(p), at_load[name]), name


SCENARIOS = [
    fsdp2_the_usual_way,
    fsdp2_transform_before_fully_shard,
    fp8_all_gather_delayed,
    fp8_all_gather_bytes_and_collectives,
    fp8_all_gather_residual_model_bytes,
    fp8_all_gather_uneven,
    fp8_all_gather_current_scaling,
    fp8_all_gather_eval_between_steps,
    fp8_all_gather_backward_after_another_forward,
    fp8_all_gather_tied_weights,
    fp8_all_gather_sharded_classes,
    fsdp2_split_attention,
    fsdp2_packed_cross_attention,
    fp8_all_gather_errors,
    fp8_all_gather_finer_recipes,
    fp8_all_gather_finer_bytes,
    fp8_all_gather_finer_variants,
]


DCP_FINER = [fp8fn.RowwiseScaling(), fp8fn.MXScaling(), fp8fn.BlockwiseScaling()]
# run by name: dcp_save after SCENARIOS, then new spawns (dcp_resume_one_rank: on 1 rank)
CHECKPOINT = [dcp_save, dcp_resume, dcp_resume_one_rank]


def main(rank: int, world_size: int, port: int, out_dir: str, names: list) -> None:
    global WORKDIR
    WORKDIR = out_dir
    chosen = [s for s in SCENARIOS + CHECKPOINT if s.__name__ in names]
    run_scenarios(rank, world_size, port, out_dir, chosen, MEASURED, group_timeout_s=60)
