"""Benchmark `fp8fn.expert_parallel`: the bytes each all-to-all direction sends per (token, k)
row with float8 on the wire against the activation dtype (bfloat16), the collectives of a
training step, and the step time of the two wires.

Standalone: `python benchmarks/expert_parallel.py [--hidden 256] [--steps 5] [--dry-run | --quick]`.
The package never imports it. It spawns 2 gloo ranks on CPU; each runs a tiny Mixtral
(transformers 5.x, from a config) in bfloat16 with its 4 experts sharded 2 per rank, under
`fp8fn.transform(..., DelayedScaling())`, warmed by one step (every expert's histories filled),
then times `--steps` training steps with `float8_wire=True`, with `float8_wire=False` (the
rows in bfloat16, cast by the receiver) and with `float8_wire="all"` (also the GEMM outputs,
e4m3 with one power-of-two scale byte per row), interleaved. The collectives are counted by
`WireMeter`, a dispatch mode (a wrapper of `torch.distributed` functions counts a call twice
under a TorchFunctionMode, DESIGN.md): the bytes a rank hands to each `all_to_all_single`
(its own rows included) and each `all_reduce`, summed over the ranks. The anchors' layout
(torchao's MXFP8 1x32 with E8M0 scales sent beside the data; Transformer Engine's NCCL-EP
MXFP8) costs `D + D/32` bytes a row, 0.516x bfloat16. CPU times are noisy (2 cores shared);
the bytes are the figure.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import print_table, ratio
from torch.utils._python_dispatch import TorchDispatchMode

import fp8fn

WORLD = 2
DIRECTIONS = ("dispatch forward", "combine forward", "combine backward", "dispatch backward")


class WireMeter(TorchDispatchMode):
    """The c10d collectives run inside, as `calls`: `[(name, bytes this rank hands in)]`.

    An `all_to_all_single` of int64 is the row counts (`"counts"`); the others are rows, named
    by their order: in a forward each MoE layer sends dispatch then combine, in a backward
    combine then dispatch (without `checkpoint_fn`: a recompute adds forward ones; with every
    expert's history filled or none: while only some are, dispatch forward and combine
    backward take two all-to-alls each, float8 and high precision, and the names shift).
    """

    def __init__(self):
        super().__init__()
        self.calls = []
        self._sent = {False: 0, True: 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func)
        if op.startswith("c10d.alltoall_base_"):
            sent = args[1]
            if sent.dtype == torch.int64:
                name = "counts"
            else:
                backward = torch._C._current_graph_task_id() != -1
                order = DIRECTIONS[2:] if backward else DIRECTIONS[:2]
                name = order[self._sent[backward] % 2]
                self._sent[backward] += 1
            self.calls.append((name, sent.numel() * sent.element_size()))
        elif op.startswith("c10d."):
            tensors = args[0] if isinstance(args[0], list) else [args[0]]
            name = op.split(".")[1]
            self.calls.append((name, sum(t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))

    def bytes_by(self) -> dict:
        """`{name: total bytes}`."""
        out = {}
        for name, nbytes in self.calls:
            out[name] = out.get(name, 0) + nbytes
        return out

    def counts(self) -> dict:
        """`{name: calls}`."""
        out = {}
        for name, _ in self.calls:
            out[name] = out.get(name, 0) + 1
        return out


def tiny_mixtral(hidden: int, seed: int = 0):
    """A 2-layer Mixtral of width `hidden`, 4 experts (top 2), bfloat16, from a config."""
    import transformers as tf

    config = tf.MixtralConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = tf.MixtralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return model.to(torch.bfloat16)


def _step(fn, model, state, ids):
    """One forward and backward (plain autograd; the optimizer and data parallel's gradient
    reduction left out: not the experts' traffic); returns the observation all-reduced (the
    step's one `all_reduce`), and the loss."""
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    observed = fp8fn.observe(state)
    loss = fn.apply(params, observed, ids, labels=ids).loss
    loss.backward()
    obs = fp8fn.all_reduce(fp8fn.observations(observed))
    return obs, loss


def worker(rank: int, port: int, hidden: int, steps: int, seq: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 128, (2, seq), generator=gen)
    runs = {}
    for wire in (True, False, "all"):
        model = fp8fn.expert_parallel(tiny_mixtral(hidden), mesh, float8_wire=wire)
        fn = fp8fn.transform(model, fp8fn.DelayedScaling(), filter_fn=_not_router)
        state = fn.init(ids)
        obs, _ = _step(fn, model, state, ids)  # warm: every expert's histories filled
        runs[wire] = [fn, model, fp8fn.update(state, obs), [], None]
    for i in range(steps):
        for wire, run in runs.items():
            fn, model, state = run[:3]
            meter = WireMeter()
            start = time.perf_counter()
            with meter:
                obs, _ = _step(fn, model, state, ids)
            run[3].append(time.perf_counter() - start)
            run[2], run[4] = fp8fn.update(state, obs), meter
    lines = []
    for wire, run in runs.items():
        times, meter = sorted(run[3]), run[4]
        nbytes = meter.bytes_by()
        summed = torch.tensor([nbytes[k] for k in sorted(nbytes)], dtype=torch.float64)
        dist.all_reduce(summed)  # over the ranks (a rank receives what another sends)
        nbytes = dict(zip(sorted(nbytes), summed.long().tolist()))
        lines.append(repr((wire, nbytes, meter.counts(), times[len(times) // 2])))
    if rank == 0:
        rows = WORLD * ids.numel() * 2  # (token, k) rows of all ranks, one layer
        with open(out, "w") as f:
            f.write("\n".join([*lines, repr(("rows", rows))]) + "\n")
    dist.destroy_process_group()


def _not_router(name, module):
    return not name.endswith("mlp.gate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dry-run", "--quick", action="store_true", help="tiny sizes, 1 step")
    args = parser.parse_args()
    hidden, seq, steps = (32, 16, 1) if args.dry_run else (args.hidden, args.seq, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.txt")
        mp.spawn(worker, args=(free_port(), hidden, steps, seq, out), nprocs=WORLD, join=True)
        with open(out) as f:
            lines = [eval(line) for line in f]  # noqa: S307 (our own repr)
    results = {wire: (nbytes, counts, t) for wire, nbytes, counts, t in lines[:3]}
    rows = lines[3][1]
    per_row = 2 * rows  # rows x 2 layers: bytes per (token, k) row of one layer
    f8, bf, al = results[True][0], results[False][0], results["all"][0]

    def share(names, wire=f8):
        return ratio(sum(wire.get(n, 0) for n in names), sum(bf.get(n, 0) for n in names), 3)

    anchor = ratio(hidden + hidden / 32, 2 * hidden, 3)
    table = [
        [name, f"{f8.get(name, 0) / per_row:.1f}", f"{bf.get(name, 0) / per_row:.1f}",
         f"{al.get(name, 0) / per_row:.1f}", share([name]), share([name], al),
         anchor if name in DIRECTIONS[::2] else "1.000x"]
        for name in DIRECTIONS
    ]  # fmt: skip
    pair, four = DIRECTIONS[::2], DIRECTIONS
    table.append(["dispatch fwd + combine bwd", "", "", "", share(pair), share(pair, al), anchor])
    table.append(["all four directions", "", "", "", share(four), share(four, al), ""])
    print_table(
        [
            "direction",
            "float8 B/row",
            "bf16 B/row",
            '"all" B/row',
            "float8 vs bf16",
            '"all" vs bf16',
            "anchors",
        ],
        table,
        title=f"{WORLD} gloo ranks on CPU, tiny Mixtral (hidden {hidden}, 4 experts, top 2, 2 "
        f"MoE layers) in bfloat16, {rows} (token, k) rows per layer (all ranks), "
        "DelayedScaling; bytes handed to all_to_all_single, summed over the ranks",
    )
    print()
    print_table(
        ["wire", "all_to_all (counts, rows)", "all_reduce", "step ms"],
        [
            [
                {True: "float8", False: "bf16", "all": '"all"'}[wire],
                f"{counts.get('counts', 0)}, {sum(counts.get(d, 0) for d in DIRECTIONS)}",
                counts.get("allreduce_", 0),
                f"{t * 1e3:.1f}",
            ]
            for wire, (_, counts, t) in results.items()
        ],
        title=f"collectives per training step, median of {steps} step(s)",
    )
    print(f"step time, float8 / bf16 wire: {ratio(results[True][2], results[False][2])}")
    print(f'step time, "all" / bf16 wire: {ratio(results["all"][2], results[False][2])}')


if __name__ == "__main__":
    sys.exit(main())
