"""Benchmark fp8fn on torch.distributed: `all_reduce` of observations, and FSDP2's traffic and
memory with float8 weight all-gathers.

Standalone: `python benchmarks/distributed.py [--sizes 8 512] [--repeats N] [--quick]`. The
package never imports it. It spawns 2 gloo ranks on CPU and prints two tables.

1. `fp8fn.all_reduce` against a naive per-site loop: `fp8fn.all_reduce` reduces the packed
   observation of all sites in one `all_reduce(MAX)`; the naive loop reduces each site's
   observed amax of each role with its own `all_reduce` (3 per site), as a design with one state
   per tensor would. Collectives are counted with torch's `CommDebugMode`, bytes (per rank, sent
   into the collective) by wrapping `torch.distributed.all_reduce`; both results are checked to
   agree.
2. Two models (residual MLP blocks and a head, `fully_shard` per block and on the root): blocks
   `x + fc2(gelu(fc1(ln(x))))` of the `--fsdp-shape`, and issue 28's model, 3 blocks
   `x + fc2(gelu(fc1(x)))` of `Linear(32, 64)`, `Linear(64, 32)` without LayerNorm and a
   `Linear(32, 8)` head; one training step after warming, routes side by side: FSDP2 in
   float32; fp8fn DelayedScaling with float32 all-gathers and with `fp8fn.float8_all_gather`;
   fp8fn CurrentScaling with float8 all-gathers; torchao 0.18 tensorwise (`emulate=True`) with
   `enable_fsdp_float8_all_gather`, with and without `precompute_float8_dynamic_scale_for_fsdp`;
   fp8fn 0.2's route, `unshard()` of every FSDP module before the step; FSDP2 in bfloat16
   (`MixedPrecisionPolicy(param_dtype=torch.bfloat16)`); and the finer recipes (rowwise,
   rowwise_with_gw_hp, MXFP8, blockwise) with high-precision and with float8 all-gathers, one
   weight plane per phase, whose rows also give the bytes of a both-planes gather (each FSDP2
   all-gather carrying the bytes of both GEMMs' planes, so that the root needs no all-gather of
   its own in the backward: computed from the measured step). For each: the
   collectives of the step (c10d ops seen by a dispatch mode, FSDP2's and the route's own) and
   the bytes this rank sends into them, and the peak parameter memory per rank (the shards plus
   the unsharded parameters alive, sampled at every op of the step). torchao rows are left out
   when torchao is not installed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _common import median_times, print_table
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fp8fn

WORLD = 2


def observation(n_sites: int, history_len: int, rank: int) -> fp8fn.State:
    """An observation of `n_sites` sites: amaxes at position 0, zeros elsewhere, per rank."""
    state = fp8fn.init_state(fp8fn.DelayedScaling(history_len=history_len), range_names(n_sites))
    history = torch.zeros_like(state.amax_history)
    gen = torch.Generator().manual_seed(rank)
    history[..., 0] = torch.rand(history.shape[:-1], generator=gen) * 10
    return state._replace(amax_history=history, scale=torch.zeros_like(state.scale))


def range_names(n: int) -> list[str]:
    return [f"blocks.{i}.fc" for i in range(n)]


def naive_all_reduce(obs: fp8fn.State) -> fp8fn.State:
    """One all_reduce(MAX) per site and role, of that role's observed amax."""
    history = obs.amax_history.clone()
    for i in range(len(obs)):
        for r in range(3):
            amax = history[i, r, :1].clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            history[i, r, 0] = amax[0]
    return obs._replace(amax_history=history)


class _Bytes:
    """Counts the bytes passed to `dist.all_reduce` while active."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        self._original = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def count(reduce, obs: fp8fn.State) -> tuple[int, int]:
    """(collectives, bytes) of one call of `reduce(obs)`."""
    with CommDebugMode() as comm, _Bytes() as sent:
        reduce(obs)
    return comm.get_total_counts(), sent.bytes


def worker(rank: int, port: int, sizes, history_len: int, repeats: int, shapes, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    rows = []
    for n in sizes:
        obs = observation(n, history_len, rank)
        packed, naive = fp8fn.all_reduce(obs), naive_all_reduce(obs)
        assert torch.equal(packed.amax_history[..., 0], naive.amax_history[..., 0])
        methods = {"fp8fn.all_reduce": fp8fn.all_reduce, "per-site": naive_all_reduce}
        calls = {name: (lambda reduce=reduce: reduce(obs)) for name, reduce in methods.items()}
        # every timed call starts with the ranks together
        seconds = median_times(calls, repeats, before=dist.barrier)
        for name, reduce in methods.items():
            rows.append((n, name, *count(reduce, obs), seconds[name] * 1e3))
    if rank == 0:
        with open(out, "w") as f:
            f.writelines(f"{n}\t{name}\t{c}\t{b}\t{ms}\n" for n, name, c, b, ms in rows)
    fsdp_rows = [fsdp_table(rank, shape) for shape in shapes]
    if rank == 0:
        with open(out + ".fsdp.json", "w") as f:
            json.dump(fsdp_rows, f)
    dist.destroy_process_group()


# --- FSDP2: bytes, collectives and parameter memory per step --------------------------------------


class Block(nn.Module):
    """`x + fc2(gelu(fc1(ln(x))))`, the LayerNorm left out with `norm=False`."""

    def __init__(self, d: int, hidden: int, norm: bool):
        super().__init__()
        self.ln = nn.LayerNorm(d) if norm else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """`n_blocks` residual MLP blocks and a `Linear(d, out)` head; linear weights dominate the
    parameters."""

    def __init__(self, d: int, hidden: int, n_blocks: int, out: int, norm: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(d, hidden, norm) for _ in range(n_blocks))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _storages(t) -> list:
    """The storages holding `t`'s data (a tensor subclass: its inner tensors')."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return [t.untyped_storage()]
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return _storages(local)
    names, _ = t.__tensor_flatten__()
    return [s for name in names for s in _storages(getattr(t, name))]


class StepMeter(TorchDispatchMode):
    """Inside: the c10d collectives (`[(op, bytes this rank sends)]`) and, sampled at every op,
    the peak bytes of parameter storage: the modules' parameters as they hold them then (FSDP2
    swaps unsharded ones in and out) and the shards of every FSDP2 parameter."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.collectives, self.peak = model, [], 0
        self.shards = {id(p): p for p in model.parameters()}  # the optimizer's (sharded) ones

    def _parameter_bytes(self) -> int:
        seen = {}
        held = [p for m in self.model.modules() for p in m._parameters.values() if p is not None]
        for p in [*self.shards.values(), *held]:
            for storage in _storages(p):
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            # A tensor subclass (DTensor, float8 weights) first: the collectives it runs inside
            # (DTensor's redistributions, torchao's amax all-reduces) then come here too.
            return NotImplemented
        namespace, name = func.namespace, func.__name__.split(".")[0]
        collective = any(word in name for word in ("gather", "reduce", "broadcast", "all_to_all"))
        if namespace in ("c10d", "_c10d_functional") and collective:
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if name in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input)
                sent = tensors[1].nbytes
            else:  # in place (allreduce_), or the functional collectives' input
                sent = sum(t.nbytes for t in tensors)
            self.collectives.append((name.lstrip("_").rstrip("_"), sent))
        out = func(*args, **kwargs)
        self.peak = max(self.peak, self._parameter_bytes())
        return out


def _fsdp_route(name: str, rank: int, shape: tuple):
    """(collectives, peak parameter bytes) of the 3rd training step of route `name` on the
    model of `shape`: `(d, hidden, n_blocks, batch, out, norm)`."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    d, hidden, n_blocks, batch, out, norm = shape
    model = Net(d, hidden, n_blocks, out, norm)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if name == "bfloat16" else None)
    torchao = name.startswith("torchao")
    if torchao:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        convert_to_float8_training(model, config=config)
    if "fp8 gather" in name and not torchao:
        fp8fn.float8_all_gather(model)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    fn = state = None
    if name.startswith("fp8fn"):
        recipe = RECIPES[name.split(",")[0].split()[1]]
        fn = fp8fn.transform(model, recipe)
        state = fn.init(torch.randn(batch, d, generator=gen))
    precompute = name.endswith("precompute")
    unshard = "unshard" in name

    def step():
        nonlocal state
        if unshard:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.unshard()
        x = torch.randn(batch, d, generator=gen)
        if fn is None:
            model(x).square().mean().backward()
        else:
            observed = fp8fn.observe(state) if len(state) else state
            fn.apply(dict(model.named_parameters()), observed, x).square().mean().backward()
            if len(state):
                state = fp8fn.update(state, fp8fn.all_reduce(fp8fn.observations(observed)))
        opt.step()
        opt.zero_grad()
        if precompute:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    for _ in range(2):
        step()
    with StepMeter(model) as meter:
        step()
    return meter.collectives, meter.peak, _both_planes(name, model, meter.collectives)


def _both_planes(name: str, model, collectives) -> int | None:
    """The all-gathered bytes of route `name` (a finer recipe with float8 all-gathers) had
    FSDP2 gathered both planes of each weight: the measured bytes, plus each FSDP2 all-gather's
    e4m3 bytes of the other plane (the blocks gather twice, the root once), less the root's own
    all-gather of its grad_input plane (not needed then). None for other routes."""
    finer = ("rowwise", "rowwise_gw_hp", "mx", "blockwise")
    if "fp8 gather" not in name or name.split(",")[0].split()[1] not in finer:
        return None
    gathered = sum(b for op, b in collectives if op == "allgather_base")

    def half(w):  # this rank's padded rows of a weight, in e4m3
        return -(-w.shape[0] // WORLD) * w.shape[1]

    other = sum(2 * half(b.fc1.weight) + 2 * half(b.fc2.weight) for b in model.blocks)
    own = 0 if "blockwise" in name else half(model.head.weight)
    return gathered + other + half(model.head.weight) - own


# Issue 28's model: 3 blocks x + fc2(gelu(fc1(x))), Linear(32, 64) and Linear(64, 32), no
# LayerNorm, a Linear(32, 8) head; batch 8 per rank.
RESIDUAL = (32, 64, 3, 8, 8, False)

RECIPES = {
    "delayed": fp8fn.DelayedScaling(),
    "current": fp8fn.CurrentScaling(),
    "rowwise": fp8fn.RowwiseScaling(),
    "rowwise_gw_hp": fp8fn.RowwiseScaling(hp_grad_weight=True),
    "mx": fp8fn.MXScaling(),
    "blockwise": fp8fn.BlockwiseScaling(),
}

FSDP_ROUTES = (
    "float32",
    "bfloat16",
    "fp8fn delayed",
    "fp8fn delayed, fp8 gather",
    "fp8fn current, fp8 gather",
    "torchao tensorwise, fp8 gather",
    "torchao tensorwise, fp8 gather, precompute",
    "fp8fn delayed, unshard() (0.2)",
    "fp8fn rowwise",
    "fp8fn rowwise, fp8 gather",
    "fp8fn rowwise_gw_hp, fp8 gather",
    "fp8fn mx",
    "fp8fn mx, fp8 gather",
    "fp8fn blockwise",
    "fp8fn blockwise, fp8 gather",
)


def fsdp_table(rank: int, shape) -> list:
    """`[(route, {op: (count, bytes)}, peak parameter bytes, both-planes bytes or None)]` of
    every route."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        routes = [r for r in FSDP_ROUTES if not r.startswith("torchao")]
    else:
        routes = list(FSDP_ROUTES)
    rows = []
    for name in routes:
        collectives, peak, both = _fsdp_route(name, rank, shape)
        counts: dict = {}
        for op, sent in collectives:
            c, b = counts.get(op, (0, 0))
            counts[op] = (c + 1, b + sent)
        rows.append((name, counts, peak, both))
    return rows


def print_fsdp(rows, shape) -> None:
    d, hidden, n_blocks, batch, out, norm = shape
    blocks = f"Linear {d}->{hidden}->{d}" + (", LayerNorm" if norm else ", no LayerNorm")
    print(
        f"\nFSDP2, {WORLD} gloo ranks: {n_blocks} blocks ({blocks}) + head Linear {d}->{out}, "
        f"fully_shard per block and root, batch {batch} per rank; the 3rd step, per rank"
    )
    base = next(c for n, c, *_ in rows if n == "float32")["allgather_base"][1]
    bf16 = next(c for n, c, *_ in rows if n == "bfloat16")["allgather_base"][1]
    head = ("route", "all-gathers", "bytes", "vs fp32", "vs bf16", "both planes", "reduce-scatters",
            "bytes", "all-reduces", "bytes", "collectives", "peak param KiB")  # fmt: skip
    table = []
    for name, counts, peak, both in rows:
        ag = counts.get("allgather_base", (0, 0))
        rs = counts.get("reduce_scatter_base", (0, 0))
        ar = [v for k, v in counts.items() if "all_reduce" in k or k == "allreduce"]
        ar = (sum(c for c, _ in ar), sum(b for _, b in ar))
        total = sum(c for c, _ in counts.values())
        both = "-" if both is None else f"{both / base:.3f}x"
        table.append((name, ag[0], ag[1], f"{ag[1] / base:.3f}x", f"{ag[1] / bf16:.3f}x", both,
                      rs[0], rs[1], *ar, total, f"{peak / 1024:.1f}"))  # fmt: skip
    print_table(head, table)
    print(
        "(bytes: sent by this rank into the collectives; collectives: FSDP2's all-gathers and "
        "reduce-scatters, and the route's all-reduces: fp8fn.all_reduce of the observations, "
        "fp8fn's batched weight amaxes under CurrentScaling, torchao's amaxes; the finer "
        "recipes' fp8 gathers add one all-gather of both planes' scale statistics and, but for "
        "blockwise, the root's own all-gather of its grad_input plane; both planes: vs fp32, "
        "had each FSDP2 all-gather carried both GEMMs' planes; peak param: "
        "shards plus the unsharded parameters alive, sampled at every op)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 512])
    parser.add_argument("--history-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--fsdp-shape",
        type=int,
        nargs=4,
        default=[256, 1024, 4, 32],
        metavar=("D", "HIDDEN", "BLOCKS", "BATCH"),
        help="the FSDP2 model: width, hidden width, blocks, batch per rank",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    args = parser.parse_args()
    sizes, repeats = ([4, 16], 2) if args.quick else (args.sizes, args.repeats)
    d, hidden, n_blocks, batch = (64, 256, 2, 8) if args.quick else args.fsdp_shape
    # the --fsdp-shape model (LayerNorm, head d -> d), and issue 28's residual model
    shapes = [(d, hidden, n_blocks, batch, d, True), RESIDUAL]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.tsv")
        mp.spawn(
            worker,
            args=(free_port(), sizes, args.history_len, repeats, shapes, out),
            nprocs=WORLD,
            join=True,
        )
        with open(out) as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
        with open(out + ".fsdp.json") as f:
            fsdp_rows = json.load(f)
    print_table(
        ["sites", "method", "collectives", "bytes/rank", "ms"],
        [[n, name, c, nbytes, f"{float(ms):.3f}"] for n, name, c, nbytes, ms in rows],
        title=f"{WORLD} gloo ranks on CPU, history_len {args.history_len}, median of {repeats}",
        left=2,
    )
    for rows, shape in zip(fsdp_rows, shapes):
        print_fsdp(rows, shape)


if __name__ == "__main__":
    main()
