"""GPU timings: fp8 linear layers, and fp8fn's fused Triton casts against torch's casts.

NOT YET RUN ON A GPU: written on a machine without CUDA (the kernels were checked there under
Triton's interpreter and compiled for sm_90 ahead of time, never launched on a device). Treat the
first run's numbers, and its "bits" column, as the first real test.

Standalone: `python benchmarks/gpu.py [--quick] [--repeats N]` on a CUDA machine (sm >= 8.9 for
float8 matmuls), optionally after `pip install -e ".[bench]"` for torchao; the package never
imports it. Without CUDA it says so and exits 0. Two tables, every variant of a table timed side
by side in one run (warmup, then rounds that call each variant in turn; the median per variant):

1. Forward + backward of one linear layer, x `(4096, 8192)` @ W `(16384, 8192)^T`, and of a
   LLaMA-7B MLP block (4096 -> 11008 -> 4096, SwiGLU) on 4096 tokens, in bfloat16: plain bf16,
   torchao tensorwise float8 (`convert_to_float8_training`, compiled) if installed, and fp8fn
   `DelayedScaling(backend="scaled_mm")` (history already observed). Ratios are against bf16.
2. The casts of those layers' tensors (inputs and weights to e4m3, output gradients to e5m2 with
   a transposed copy): the torch reference (`clamp(x.float() * scale).to(fp8)` plus
   `x.abs().amax()`, eager and compiled) against `fp8fn._kernels.cast`'s `cast_and_amax` (one pass),
   `delayed_cast` at step >= 2 (one pass) and at step 1 (two passes), and `current_cast`.
   Ratios are against the eager reference; "bits" says whether every kernel's float8 output and
   amax equal the reference's bit for bit on that tensor.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import cuda_clock, median_times, print_table, ratio
from torch import nn

DEVICE = "cuda"


def _time(fns: dict, repeats: int, inner: int) -> dict:
    """Median milliseconds per call of each function, timed with CUDA events in interleaved
    rounds (3 warmup rounds, then `repeats` rounds of `inner` calls each)."""
    seconds = median_times(fns, repeats, warmup=3, inner=inner, clock=cuda_clock)
    return {name: t * 1e3 for name, t in seconds.items()}


class SwiGLU(nn.Module):
    """LLaMA's MLP: `w2(silu(w1(x)) * w3(x))`, no biases."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _observed(state: dict) -> dict:
    """The fp8fn state with every history marked observed (casts use the stored scales)."""
    import fp8fn

    def mark(s):
        return s._replace(amax_history=torch.ones_like(s.amax_history))

    return {k: None if v is None else fp8fn.SiteState(*map(mark, v)) for k, v in state.items()}


def _layer_variants(make_module, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """fwd + bwd step functions of one module in bf16, torchao and fp8fn (where available)."""
    variants = {}

    def plain_step(module):
        def step():
            x.grad = None
            for p in module.parameters():
                p.grad = None
            module(x).backward(grad)

        return step

    variants["bf16"] = plain_step(make_module())
    try:
        from torchao.float8 import convert_to_float8_training

        variants["torchao tensorwise (compiled)"] = plain_step(
            torch.compile(convert_to_float8_training(make_module()))
        )
    except ImportError:
        print("(torchao not installed: no torchao row)")
    try:
        import fp8fn

        module = make_module()
        fn = fp8fn.transform(module, fp8fn.DelayedScaling(history_len=16, backend="scaled_mm"))
        state = _observed(fn.init(x))
        params = dict(module.named_parameters())

        def fp8fn_step():
            x.grad = None
            for p in params.values():
                p.grad = None
            fn.apply(params, state, x).backward(grad)

        fp8fn_step()
        variants["fp8fn delayed, scaled_mm"] = fp8fn_step
    except Exception as e:  # a row that fails must not lose the others
        print(f"(fp8fn delayed scaled_mm failed: {type(e).__name__}: {e})")
    return variants


def bench_layers(sizes: dict, repeats: int) -> None:
    m, k, n, d, hidden = (sizes[key] for key in ("m", "k", "n", "d", "hidden"))
    cases = {
        f"linear {m}x{k}x{n}": (lambda: nn.Linear(k, n, bias=False), (m, k), (m, n)),
        f"SwiGLU MLP {d}->{hidden}, {m} tokens": (lambda: SwiGLU(d, hidden), (m, d), (m, d)),
    }
    rows = []
    for case, (make, x_shape, g_shape) in cases.items():
        x = torch.randn(x_shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(g_shape, device=DEVICE, dtype=torch.bfloat16)

        def make_module(make=make):
            return make().to(DEVICE, torch.bfloat16)

        ms = _time(_layer_variants(make_module, x, grad), repeats, inner=1)
        for name, t in ms.items():
            rows.append((case, name, f"{t:.3f}", ratio(t, ms["bf16"])))
    print()
    print_table(["case", "variant", "ms", "ratio"], rows, "fwd + bwd (ms, ratio to bf16)", left=2)


def _reference(hp, scale, dtype, transpose):
    fp8_max = torch.finfo(dtype).max
    fp8 = (hp.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    amax = hp.abs().amax().float()
    return (fp8, fp8.t().contiguous(), amax) if transpose else (fp8, amax)


def bench_casts(sizes: dict, repeats: int) -> None:
    import fp8fn
    import fp8fn._kernels.cast as fp8_triton

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    m, k, n, d, hidden = (sizes[key] for key in ("m", "k", "n", "d", "hidden"))
    tensors = [  # (name, shape, dtype, transpose)
        ("linear input", (m, k), e4m3, False),
        ("linear weight", (n, k), e4m3, False),
        ("linear grad_output", (m, n), e5m2, True),
        ("MLP w1 weight", (hidden, d), e4m3, False),
        ("MLP w2 input", (m, hidden), e4m3, False),
        ("MLP w1 grad_output", (m, hidden), e5m2, True),
    ]
    compiled_reference = torch.compile(_reference, fullgraph=True)
    zero, one = (torch.tensor(v, device=DEVICE) for v in (0.0, 1.0))
    rows = []
    for name, shape, dtype, transpose in tensors:
        hp = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
        amax = hp.abs().amax().float()
        scale = fp8fn.compute_scale(amax, torch.finfo(dtype).max)
        t = {"transpose": transpose}
        fns = {
            "torch eager": lambda: _reference(hp, scale, dtype, transpose),
            "torch compiled": lambda: compiled_reference(hp, scale, dtype, transpose),
            "cast_and_amax": lambda: fp8_triton.cast_and_amax(hp, scale, dtype, **t),
            "delayed step>=2": lambda: fp8_triton.delayed_cast(hp, one, scale, 0, dtype, **t),
            "delayed step 1": lambda: fp8_triton.delayed_cast(hp, zero, scale, 0, dtype, **t),
            "current": lambda: fp8_triton.current_cast(hp, 0, dtype, **t),
        }
        want = [x.view(torch.uint8) if x.dtype == dtype else x for x in fns["torch eager"]()]
        exact = True
        for variant in ("cast_and_amax", "delayed step>=2", "delayed step 1", "current"):
            got = fns[variant]()
            got = [got[0], got[1], got[-1]] if transpose else [got[0], got[-1]]
            got = [x.view(torch.uint8) if x.dtype == dtype else x for x in got]
            exact &= all(torch.equal(a, b) for a, b in zip(got, want))
        ms = _time(fns, repeats, inner=5)
        ref = ms["torch eager"]
        gb = hp.numel() * (2 + (2 if transpose else 1)) / 1e9  # bf16 read, float8 write(s)
        row = [f"{name} {tuple(shape)}"]
        row += [f"{ms[v] * 1e3:.0f} ({ratio(ref, ms[v])})" for v in fns]
        row += [f"{gb / (ms['delayed step>=2'] / 1e3):.0f}", "yes" if exact else "NO"]
        rows.append(row)
    columns = ["tensor", *fns, "GB/s step>=2", "bits"]
    print()
    print_table(columns, rows, "casts: us per call (speedup over torch eager)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per variant")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs CUDA (a GPU with sm >= 8.9 for float8 matmuls); exiting.")
        return 0
    if args.quick:
        sizes = {"m": 256, "k": 512, "n": 1024, "d": 256, "hidden": 688}
    else:
        sizes = {"m": 4096, "k": 8192, "n": 16384, "d": 4096, "hidden": 11008}
    repeats = args.repeats or (5 if args.quick else 20)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, sizes {sizes}")
    torch.manual_seed(0)
    bench_layers(sizes, repeats)
    bench_casts(sizes, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
