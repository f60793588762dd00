"""fp8fn.optim against torch's and torchao's AdamW: state bytes, peak memory, kernel bytes,
time.

Standalone: `python benchmarks/optim.py [--part bytes|memory|kernels|time|demo|all]
[--quick]` (`--quick`: the bytes table only). The package never imports it. One thread
(`torch.set_num_threads(1)`).

* `bytes`: the optimizer state per parameter, exact (the sum of the state tensors' bytes over
  the parameter count): the demo's GPT (`fp8fn.demo.GPT`, default size; its LayerNorms and
  biases keep float32 moments) and one 4096 x 4096 weight. "weight + moments" adds the
  parameter itself (bfloat16 with `master="bf16-sr"`).
* `memory`: 16 float32 `(1024, 1024)` weights (16.8M parameters), each optimizer in a fresh
  process through its torch.optim class (fp8fn: `fp8fn.optim.AdamW`): the state's bytes
  (exact, the tensors of `opt.state`, a tensor subclass by its inner tensors), and the peak
  resident memory of steps 2 and 3 above the resident memory after step 1 (`VmHWM` reset
  through /proc/self/clear_refs; what step 1 compiled and allocated is in the base): the
  step's transients. glibc returns large blocks to the system at once
  (`MALLOC_MMAP_THRESHOLD_` 64 KiB), so RSS follows the live tensors.
* `kernels`: `torch.compile(opt.update)` of a (4096, 1024) weight: inductor's generated kernels
  and the bytes they read and write (`torch._inductor.metrics`), against the floor: one read of
  the gradient, the moments (with their scales) and the weight, one write of the moments and
  the weight.
* `time`: one update of the 16 weights, the median of interleaved rounds, as a ratio to
  `torch.optim.AdamW(foreach=True)` timed in the same rounds.
* `demo`: the demo's final validation loss (`python -m fp8fn.demo`'s float32 model, its data
  and schedule; 400 steps, seeds 0, 1, 2) trained with each `--optim`, each run in its own
  process, all at once: per seed, mean ± standard deviation, and the gap to `adamw` (float32
  moments) paired by seed. Only the float32 model runs (the demo's fp8 run would double the
  cost and add its own gap): the optimizer is the only difference. About 12 CPU-minutes per
  run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # count what is compiled

import torch  # noqa: E402
from _common import median_times, print_table, ratio  # noqa: E402

import fp8fn  # noqa: E402

SETTINGS = {  # name -> fp8fn.optim.adamw keywords
    "fp8fn fp32": dict(moments="fp32"),
    "fp8fn bf16": dict(moments="bf16"),
    "fp8fn fp8": dict(moments="fp8"),
    "fp8fn fp8 + bf16-sr": dict(moments="fp8", master="bf16-sr"),
}


def _state_bytes(state) -> int:
    return sum(
        t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves((state.mu, state.nu))
    )


def _gpt_params() -> dict:
    from fp8fn.demo import GPT, Corpus

    model = GPT(len(Corpus.load().chars), 64, 128, 2, 4)
    return {k: p.detach() for k, p in model.named_parameters()}


def bytes_table() -> None:
    cases = {"demo GPT": _gpt_params(), "4096 x 4096": {"w": torch.zeros(4096, 4096)}}
    rows = []
    for case, params in cases.items():
        n = sum(p.numel() for p in params.values())
        rows.append((case, "torch.optim.AdamW", "8.0000", "12.0000"))
        for name, kwargs in SETTINGS.items():
            ps = params
            if kwargs.get("master"):
                ps = {k: p.bfloat16() for k, p in params.items()}
            state = fp8fn.optim.adamw(**kwargs).init(ps)
            moments = _state_bytes(state) / n
            weight = sum(p.numel() * p.element_size() for p in ps.values()) / n
            rows.append((case, name, f"{moments:.4f}", f"{moments + weight:.4f}"))
    print("state bytes per parameter (exact; the step count and key not counted: 16-24 bytes)")
    print_table(("params", "optimizer", "moments", "weight + moments"), rows)


# ----------------------------------------------------------------------------- memory

N_WEIGHTS, SIDE = 16, 1024


def _inner_bytes(t: torch.Tensor) -> int:
    """The bytes of `t`'s storage, or of a tensor subclass's inner tensors (torchao's states)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_inner_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _memory_child(name: str) -> None:
    """Runs in a fresh process: prints the state's bytes and the peak RSS of 2 steps above the
    resident memory after a first step (params, grads, state, compiled code)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if "bf16-sr" in name else torch.float32
    params = [
        torch.nn.Parameter(torch.randn(SIDE, SIDE, generator=gen).to(dtype))
        for _ in range(N_WEIGHTS)
    ]
    for p in params:
        p.grad = torch.randn(SIDE, SIDE, generator=gen).to(dtype) * 1e-3
    if name.startswith("torch "):
        opt = torch.optim.AdamW(params, 1e-3, foreach="foreach" in name)
    elif name.startswith("torchao"):
        import torchao.optim

        opt = getattr(torchao.optim, name.split()[1])(params, 1e-3)
    else:
        opt = fp8fn.optim.AdamW(params, 1e-3, **SETTINGS[name])
    opt.step()
    state = sum(
        _inner_bytes(v)
        for s in opt.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and k not in ("step", "skipped", "key")
    )
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS
    for _ in range(2):
        opt.step()
    print(state, _status("VmHWM") - base)


def _status(field: str) -> int:
    """A memory field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory_table() -> None:
    names = ["torch AdamW foreach", "torch AdamW for-loop", "torchao AdamW8bit"]
    names += ["torchao AdamWFp8", *SETTINGS]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    n = N_WEIGHTS * SIDE * SIDE
    rows = []
    for name in names:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", name],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        if out.returncode:
            rows.append((name, "fails: " + out.stderr.strip().splitlines()[-1][:60], "", ""))
            continue
        state, peak = map(int, out.stdout.strip().splitlines()[-1].split())
        rows.append((name, f"{state / n:.3f}", f"{peak / n:.2f}", f"{(state + peak) / n:.2f}"))
    print(f"bytes per parameter, {N_WEIGHTS} x ({SIDE}, {SIDE}) weights, steps 2 and 3")
    print_table(("optimizer", "state", "step peak above resident", "state + peak"), rows)


# ----------------------------------------------------------------------------- kernels


def kernels_table() -> None:
    from torch._inductor import metrics

    torch._logging.set_logs(inductor_metrics=True)
    rows = []
    shape = (4096, 1024)
    n = shape[0] * shape[1]
    for name, kwargs, floor in (
        ("fp8fn fp32", dict(moments="fp32"), 28.0),
        ("fp8fn bf16", dict(moments="bf16"), 20.0),
        ("fp8fn fp8", dict(moments="fp8"), 16 + 4 * 4 / 128),
    ):
        params = {"w": torch.randn(shape)}
        opt = fp8fn.optim.adamw(1e-3, **kwargs)
        state = opt.init(params)
        torch._dynamo.reset()
        metrics.reset()
        torch.compile(opt.update, fullgraph=True)({"w": torch.randn(shape)}, state, params)
        nbytes = sum(
            node.get_read_write_buffers_sizes()
            for node, _ in metrics.nodes_num_elem
            if not node.is_extern()
        )
        rows.append(
            (name, str(metrics.generated_kernel_count), f"{nbytes / n:.2f}", f"{floor:.2f}",
             ratio(nbytes / n, floor))
        )  # fmt: skip
    print(f"compiled update of one {shape} float32 weight: inductor's kernels")
    print_table(("optimizer", "kernels", "bytes / param", "floor", "vs floor"), rows)


# ----------------------------------------------------------------------------- time


def time_table() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(SIDE, SIDE, generator=gen) for _ in range(N_WEIGHTS)]
    grads = [torch.randn(SIDE, SIDE, generator=gen) * 1e-3 for _ in range(N_WEIGHTS)]
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(torch_params, grads):
        p.grad = g
    torch_opt = torch.optim.AdamW(torch_params, 1e-3, foreach=True)
    fns = {"torch AdamW foreach": torch_opt.step}
    for name in ("fp8fn fp32", "fp8fn fp8"):
        opt = fp8fn.optim.adamw(1e-3, **SETTINGS[name])
        held = [opt.init(params)]
        compiled = torch.compile(opt.update, fullgraph=True)

        def eager(opt=opt, held=held):
            opt.update(grads, held[0], params)

        def fused(compiled=compiled, held=held):
            compiled(grads, held[0], params)

        fns[f"{name} eager"] = eager
        fns[f"{name} compiled"] = fused
    times = median_times(fns, 15, warmup=2)
    base = times["torch AdamW foreach"]
    rows = [(k, f"{1000 * t:.1f}", ratio(t, base)) for k, t in times.items()]
    print(f"one update of {N_WEIGHTS} x ({SIDE}, {SIDE}) float32 weights, 1 thread")
    print_table(("optimizer", "ms", "vs torch foreach"), rows)


# ----------------------------------------------------------------------------- demo


def _demo_child(optim: str, seed: int, steps: int) -> None:
    """Runs in a fresh process: the demo's float32 run (no fp8 layers: the optimizer alone
    differs) with `--optim optim --seed seed`; prints its final train and val losses."""
    import json
    import warnings

    from fp8fn import demo

    cfg = demo.parse_args(["--optim", optim, "--seed", str(seed), "--steps", str(steps), "--quiet"])
    corpus = demo.Corpus.load()
    torch.manual_seed(cfg.seed)
    model = demo.GPT(len(corpus.chars), cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "fp8fn.transform: no layer was converted")
        fn = fp8fn.transform(
            model,
            demo.RECIPES[cfg.recipe](),
            filter_fn=lambda name, m: False,
            checkpoint_fn=lambda name, m: isinstance(m, demo.Block),
        )
    x0, _ = next(demo.batches(corpus.train, 1, cfg.batch_size, cfg.seq_len, cfg.seed))
    run = demo.Run("float32", fn, dict(init), x0, cfg)
    out = demo.train([run], corpus, cfg, torch.device("cpu"))["float32"]
    print(json.dumps({"train": out["train_loss"], "val": out["val_loss"]}))


def demo_table(steps: int, seeds: int) -> None:
    import json
    import statistics

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {
        (optim, seed): subprocess.Popen(
            [sys.executable, __file__, "--demo-child", optim, str(seed), str(steps)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for optim in ("adamw", "adamw-bf16", "adamw-fp8")
        for seed in range(seeds)
    }  # all at once, one thread each
    val = {
        k: json.loads(p.communicate()[0].strip().splitlines()[-1])["val"] for k, p in runs.items()
    }
    rows = []
    for optim in ("adamw", "adamw-bf16", "adamw-fp8"):
        losses = [val[optim, s] for s in range(seeds)]
        gaps = [100 * (val[optim, s] - val["adamw", s]) / val["adamw", s] for s in range(seeds)]
        spread = statistics.stdev(losses) if seeds > 1 else 0.0
        gap_spread = statistics.stdev(gaps) if seeds > 1 else 0.0
        rows.append(
            (optim, " ".join(f"{v:.4f}" for v in losses),
             f"{statistics.fmean(losses):.4f} ± {spread:.4f}",
             f"{statistics.fmean(gaps):+.3f} ± {gap_spread:.3f}")
        )  # fmt: skip
    print(f"the demo's float32 model, {steps} steps, seeds 0..{seeds - 1}: val loss")
    print_table(("optimizer", "per seed", "mean ± std", "gap vs adamw (%)"), rows)


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/optim.py")
    p.add_argument(
        "--part", choices=("bytes", "memory", "kernels", "time", "demo", "all"), default="all"
    )
    p.add_argument("--steps", type=int, default=400, help="demo steps (default 400)")
    p.add_argument("--seeds", type=int, default=3, help="demo seeds (default 3)")
    p.add_argument("--demo-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="the bytes table only (seconds)")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.part = "bytes"
    if args.memory_child:
        return _memory_child(args.memory_child)
    if args.demo_child:
        optim, seed, steps = args.demo_child
        return _demo_child(optim, int(seed), int(steps))
    for part, fn in (
        ("bytes", bytes_table),
        ("memory", memory_table),
        ("kernels", kernels_table),
        ("time", time_table),
        ("demo", lambda: demo_table(args.steps, args.seeds)),
    ):
        if args.part in (part, "all"):
            fn()
            print()


if __name__ == "__main__":
    main()
