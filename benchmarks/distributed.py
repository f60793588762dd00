"""Benchmark `fp8fn.all_reduce` against a naive per-site loop: collectives, bytes and time a step.

Standalone: `python benchmarks/distributed.py [--sizes 8 512] [--repeats N] [--quick]`. The
package never imports it. It spawns 2 gloo ranks on CPU. `fp8fn.all_reduce` reduces the packed
observation of all sites in one `all_reduce(MAX)`; the naive loop reduces each site's observed
amax of each role with its own `all_reduce` (3 per site), as a design with one state per tensor
would. Collectives are counted with torch's `CommDebugMode`, bytes (per rank, sent into the
collective) by wrapping `torch.distributed.all_reduce`; both results are checked to agree.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import median_times, print_table
from torch.distributed.tensor.debug import CommDebugMode

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


def worker(rank: int, port: int, sizes, history_len: int, repeats: int, out: str) -> None:
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
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 512])
    parser.add_argument("--history-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    args = parser.parse_args()
    sizes, repeats = ([4, 16], 2) if args.quick else (args.sizes, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.tsv")
        mp.spawn(
            worker,
            args=(free_port(), sizes, args.history_len, repeats, out),
            nprocs=WORLD,
            join=True,
        )
        with open(out) as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
    print_table(
        ["sites", "method", "collectives", "bytes/rank", "ms"],
        [[n, name, c, nbytes, f"{float(ms):.3f}"] for n, name, c, nbytes, ms in rows],
        title=f"{WORLD} gloo ranks on CPU, history_len {args.history_len}, median of {repeats}",
        left=2,
    )


if __name__ == "__main__":
    main()
