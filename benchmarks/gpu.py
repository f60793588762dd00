"""GPU throughput: a compiled Llama-style stack in bf16 and float8, and the float8 casts' bandwidth.

NOT YET RUN ON A GPU. No GPU was lent to the task that wrote this script (issue 28, item 8):
only `--dry-run` has run, on CPU. Treat the first CUDA run's numbers as the first real test.

Standalone: `python benchmarks/gpu.py [--quick] [--dry-run] [--repeats N] [--peak-gbps X]`, after
`pip install -e ".[bench]"` for torchao; the package never imports it. Without CUDA (and without
`--dry-run`) it says that it needs CUDA and exits 0. One run prints two tables, every variant of
a table timed side by side (warmup, then rounds that call each variant in turn; the median):

1. Training throughput, tokens/s of forward + backward (no optimizer step: the same for all) of
   a Llama-style stack: 4 blocks of RMSNorm, causal attention (32 heads, rotary embeddings) and
   a SwiGLU MLP (4096 -> 11008 -> 4096), d = 4096, one sequence of 4096 tokens, bfloat16. All
   compiled (`torch.compile`): plain bf16; torchao 0.18 tensorwise float8
   (`convert_to_float8_training`) if installed; fp8fn `CurrentScaling(backend="scaled_mm")`; fp8fn
   `DelayedScaling(backend="scaled_mm")` at steady state (histories filled; the step includes
   `observe`, `observations` and `update`). Ratios against bf16, and delayed / current.
2. The float8 casts of one block's tensors (the attention input, the MLP's first weight, its
   down projection's input, its output gradient with the transposed copy the weight gradient
   needs): fp8fn's cast (`_numerics.fp8`: cast with a given scale, and the amax) compiled as
   delayed scaling runs it (scale known: one pass) and as current scaling does (the amax first,
   then the cast: two passes), fp8fn's Triton kernels (`_kernels.cast`: `delayed_cast` with the
   history known filled, `current_cast`), and a device copy of the tensor (what the memory
   system gives).
   GB/s counts the bytes a cast must move (the bf16 tensor read once, each float8 copy written
   once), so a second pass shows as a lower figure; "% peak" is against the device's peak
   bandwidth (from its memory clock and bus width, or `--peak-gbps`).

The full run compiles four variants of the 4-block stack (most of its time) and should take
under 5 minutes on an H100/H200 class device; it prints the seconds of each phase.

`--dry-run`: the same code on CPU with tiny shapes (d = 32, 1 block, 32 tokens): every path that
can run on CPU (the variants under torch.compile with fullgraph where the GPU run has it, with
`torch._scaled_mm`'s CPU reference kernel, and the casts), host-clock times, and the same tables
(the figures mean nothing on CPU). It compiles with the "aot_eager" backend (dynamo and
AOTAutograd, not inductor's code generation, whose C++ compiles take minutes on a CPU); the
Triton casts run under `TRITON_INTERPRET=1` only; not run: inductor's GPU kernels, CUDA events.
`tests/test_benchmarks.py` runs it under the interpreter.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time

import torch
import torch.nn.functional as F
from _common import cuda_clock, median_times, print_table, ratio, wall_clock
from torch import nn

import fp8fn
from fp8fn._numerics.fp8 import amax, cast_to_fp8, scale_from_amax

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

FULL = dict(d=4096, heads=32, hidden=11008, blocks=4, seq=4096, batch=1)
QUICK = dict(d=1024, heads=8, hidden=2816, blocks=2, seq=1024, batch=1)
# One shape for all the cast's tensors: (tokens, d) = (hidden, d) = (tokens, hidden).
DRY = dict(d=32, heads=2, hidden=32, blocks=1, seq=32, batch=1)
BACKEND = "inductor"  # torch.compile's; `--dry-run` sets "aot_eager" (no C++ compiles on CPU)


# --- the model -----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `x` `(batch, heads, seq, head_dim)` (base 10000)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        out = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """`x + attention(norm(x))`, then `x + w2(silu(w1(norm(x))) * w3(norm(x)))`."""

    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(d), Attention(d, heads)
        self.mlp_norm = RMSNorm(d)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stack(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, hidden) for _ in range(blocks))
        self.norm = RMSNorm(d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


# --- 1. throughput ---------------------------------------------------------------------------


def _plain_step(model, x):
    run = torch.compile(model, backend=BACKEND)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        _loss(run(x)).backward()

    return step


def _torchao_step(model, x):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = convert_to_float8_training(
        copy.deepcopy(model), config=Float8LinearConfig(emulate=False)
    )
    return _plain_step(converted, x)


def _fp8fn_step(model, x, recipe):
    """A compiled step of `fn.apply` (plain autograd); delayed scaling observes and updates, at
    steady state: one eager step fills the histories first."""
    fn = fp8fn.transform(model, recipe)
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    holder = {"state": fn.init(x)}
    stateful = len(holder["state"]) > 0

    def run_with(apply):
        def step():
            for p in params.values():
                p.grad = None
            state = holder["state"]
            observed = fp8fn.observe(state) if stateful else state
            _loss(apply(params, observed, x)).backward()
            if stateful:
                holder["state"] = fp8fn.update(state, fp8fn.observations(observed))

        return step

    if stateful:
        run_with(fn.apply)()  # step 1 (empty histories), eager
    return run_with(torch.compile(fn.apply, fullgraph=True, backend=BACKEND))


def throughput(shape: dict, device: str, repeats: int, clock) -> dict:
    """`{variant: tokens/s}`, printed as a table; also prints each variant's first-call (compile)
    seconds."""
    torch.manual_seed(0)
    model = Stack(shape["d"], shape["heads"], shape["hidden"], shape["blocks"])
    model = model.to(device, torch.bfloat16)
    x = torch.randn(shape["batch"], shape["seq"], shape["d"], device=device, dtype=torch.bfloat16)
    steps = {"bf16": _plain_step(model, x)}
    if HAS_TORCHAO:
        steps["torchao tensorwise"] = _torchao_step(model, x)
    else:
        print("(torchao not installed: no torchao row)")
    steps["fp8fn current"] = _fp8fn_step(model, x, fp8fn.CurrentScaling(backend="scaled_mm"))
    steps["fp8fn delayed"] = _fp8fn_step(model, x, fp8fn.DelayedScaling(backend="scaled_mm"))
    compile_s = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        _synchronize(device)
        compile_s[name] = time.perf_counter() - start
    seconds = median_times(steps, repeats, warmup=1, clock=clock)
    tokens = shape["batch"] * shape["seq"]
    per_s = {name: tokens / s for name, s in seconds.items()}
    rows = [
        (name, f"{seconds[name] * 1e3:.2f}", f"{per_s[name]:.0f}",
         ratio(per_s[name], per_s["bf16"]), f"{compile_s[name]:.1f}")
        for name in steps
    ]  # fmt: skip
    title = (
        f"Llama-style stack, {shape['blocks']} blocks, d {shape['d']}, {shape['heads']} heads, "
        f"MLP {shape['hidden']}, {tokens} tokens, bf16, compiled; fwd + bwd, median of {repeats}"
    )
    print()
    print_table(["variant", "ms/step", "tokens/s", "vs bf16", "first call s"], rows, title)
    print(
        f"delayed / current (tokens/s): {ratio(per_s['fp8fn delayed'], per_s['fp8fn current'], 3)}"
    )
    return per_s


# --- 2. casts --------------------------------------------------------------------------------


def _delayed_cast(hp, scale, dtype, transpose):
    """Delayed scaling's cast: the scale is known, so the cast and the amax are one pass."""
    fp8 = cast_to_fp8(hp, scale, dtype)
    return (fp8, fp8.t().contiguous(), amax(hp)) if transpose else (fp8, amax(hp))


def _current_cast(hp, dtype, transpose):
    """Current scaling's cast: the amax first, then the cast with the scale from it."""
    seen = amax(hp)
    fp8 = cast_to_fp8(hp, scale_from_amax(seen, torch.finfo(dtype).max, 0), dtype)
    return (fp8, fp8.t().contiguous(), seen) if transpose else (fp8, seen)


def _copy(hp):
    return hp.clone()


def peak_bandwidth(device: str, override: float | None) -> float | None:
    """The device's peak memory bandwidth in GB/s: `override`, else its memory clock (kHz, double
    data rate) times its bus width (bits); None on CPU or where torch does not say."""
    if override is not None:
        return override
    if device != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def casts(shape: dict, device: str, repeats: int, clock, peak: float | None) -> None:
    tokens, d, hidden = shape["batch"] * shape["seq"], shape["d"], shape["hidden"]
    tensors = [  # (name, shape, dtype, transpose)
        ("attention input", (tokens, d), E4M3, False),
        ("w1 weight", (hidden, d), E4M3, False),
        ("w2 input", (tokens, hidden), E4M3, False),
        ("w1 grad_output", (tokens, hidden), E5M2, True),
    ]
    # static shapes: each tensor its own kernels, as in the model's graph
    options = dict(fullgraph=True, dynamic=False, backend=BACKEND)
    delayed = torch.compile(_delayed_cast, **options)
    current = torch.compile(_current_cast, **options)
    copy_ = torch.compile(_copy, **options)
    # Triton's kernels: on CUDA, or on CPU under its interpreter (TRITON_INTERPRET=1)
    triton = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if triton:
        import fp8fn._kernels.cast as kernels
    rows = []
    for name, size, dtype, transpose in tensors:
        hp = torch.randn(size, device=device, dtype=torch.bfloat16)
        scale = scale_from_amax(amax(hp), torch.finfo(dtype).max, 0)
        fns = {
            "copy": lambda: copy_(hp),
            "delayed, compiled": lambda: delayed(hp, scale, dtype, transpose),
            "current, compiled": lambda: current(hp, dtype, transpose),
        }
        if triton:
            t = {"transpose": transpose}
            fns["delayed, Triton"] = lambda: kernels.delayed_cast(
                hp, None, scale, 0, dtype, filled=True, **t
            )
            fns["current, Triton"] = lambda: kernels.current_cast(hp, 0, dtype, **t)
        seconds = median_times(fns, repeats, warmup=2, inner=5, clock=clock)
        n = hp.numel()
        for variant, s in seconds.items():
            moved = 4 * n if variant == "copy" else n * (2 + (2 if transpose else 1))
            gbps = moved / s / 1e9
            rows.append(
                (f"{name} {tuple(size)}", variant, f"{s * 1e6:.1f}", f"{gbps:.1f}",
                 f"{100 * gbps / peak:.0f}%" if peak else "-",
                 ratio(s, seconds[variant.replace("delayed", "current")], 2)
                 if variant.startswith("delayed") else "")
            )  # fmt: skip
    peak_text = f"{peak:.0f} GB/s" if peak else "not known"
    print()
    print_table(
        ["tensor", "variant", "us", "GB/s", "% peak", "time / current"],  # compiled or Triton alike
        rows,
        f"float8 casts, median of {repeats} (peak bandwidth: {peak_text}); GB/s: the bytes a "
        "cast must move (bf16 read once, each float8 copy written once) per second",
        left=2,
    )


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a smoke test)")
    parser.add_argument(
        "--dry-run", action="store_true", help="on CPU, tiny shapes: every path but CUDA's"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--peak-gbps", type=float, default=None, help="the device's peak GB/s")
    args = parser.parse_args()
    if args.dry_run:
        global BACKEND
        device, shape, clock, repeats = "cpu", DRY, wall_clock, args.repeats or 1
        BACKEND = "aot_eager"
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py needs CUDA (a GPU with sm >= 8.9 for float8 matmuls); exiting. "
              "`--dry-run` runs it on CPU with tiny shapes.")  # fmt: skip
        return 0
    else:
        device, clock = "cuda", cuda_clock
        shape = QUICK if args.quick else FULL
        repeats = args.repeats or (3 if args.quick else 10)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    print(f"{name}, torch {torch.__version__}, fp8fn {fp8fn.__version__}, shapes {shape}")
    start = time.perf_counter()
    throughput(shape, device, repeats, clock)
    middle = time.perf_counter()
    casts(shape, device, repeats, clock, peak_bandwidth(device, args.peak_gbps))
    end = time.perf_counter()
    print(f"\nseconds: throughput {middle - start:.0f}, casts {end - middle:.0f}, "
          f"total {end - start:.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
