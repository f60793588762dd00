"""GPU smoke test of fp8fn's CUDA path: one command, at most ~8 minutes on one H100.

NOT YET RUN ON A GPU: only `--dry-run` has run (on CPU, tests/test_gpu_smoke.py). Run it first
on the first GPU lent, as one command with a time limit that leaves room for one rerun:

    timeout 540 python tools/gpu_smoke.py --out gpu_smoke.json

Steps, in this order, each with its own time budget and exception handler, one JSON verdict
line per step (`{"step", "name", "verdict": "pass" | "fail" | "timeout" | "skipped",
"seconds", "figures", "error"}`), all of them written to `--out` at the end:

0. versions and the device's compute capability;
1. the raw op contracts with fp8fn's exact arguments (its `scaled_mm` and one-call grouped
   forward): dense tensorwise e4m3 x e4m3 and e5m2 x e4m3 at M 4095 / K 4112 / N 11008,
   row-wise, and grouped with an empty group and tail rows (weights stored `(E, N, K)` and
   `(E, K, N)`), each against the dequantized float32 matmul (SQNR);
2. the Triton casts bit for bit against torch's (NaN, +-inf, subnormals, saturation, a
   2**31 + 16-element tensor for int64 indexing) and their GB/s against `clone()`;
3. `fp8fn.linear` forward and backward for every CUDA-capable recipe and backend against
   `backend="emulated"` on the device (SQNR of the output and both gradients);
4. the grouped op (one call on sm_90) against its per-group emulated path;
5. a compiled 2-layer MLP (`fullgraph=True`), `backend="scaled_mm"` and `"triton"`, against eager;
6. `benchmarks/gpu.py --quick`, its compile seconds recorded.

If step 1 fails, steps 3 to 6 are skipped (they stand on it). The exit status is 0 when no
step failed. `--dry-run` runs every step on CPU with tiny shapes under
`fp8fn.testing.cuda_path_on_cpu((9, 0))` (torch's CUDA rules checked on each float8 GEMM call,
Triton under its interpreter, compiled with "aot_eager"): it proves the script, not the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
# (step, name, budget in seconds): 485 s in all, under 8 minutes with the start-up
STEPS = [
    (0, "versions", 10),
    (1, "raw op contracts", 60),
    (2, "triton casts", 60),
    (3, "fp8fn.linear", 60),
    (4, "grouped op", 45),
    (5, "compiled mlp", 100),
    (6, "benchmarks/gpu.py --quick", 150),
]
STAND_ON_STEP_1 = (3, 4, 5, 6)


class Budget(Exception):
    """A step ran past its time budget."""


@contextlib.contextmanager
def budget(seconds: int):
    """Raise `Budget` in the main thread after `seconds` (a CUDA call in flight finishes
    first)."""

    def expired(signum, frame):
        raise Budget(f"ran past its budget of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def sqnr(ref, x) -> float:
    """Signal to quantization noise ratio of `x` against `ref`, dB (float64)."""
    import torch

    ref, x = ref.double(), x.double()
    noise = (ref - x).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(ref.norm() / noise))


def db(value: float):
    """An SQNR for the JSON: dB to 0.1, or "exact" (no noise: JSON has no infinity)."""
    return "exact" if value == float("inf") else round(value, 1)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Context:
    """What the steps share: the device, the shapes, and the figures' sink."""

    def __init__(self, dry: bool):
        import torch

        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.torch = torch
        # dense GEMM (m, k, n); the linear's; grouped (tokens, k, n, experts); the big tensor
        self.gemm = (37, 48, 80) if dry else (4095, 4112, 11008)
        self.linear = (37, 48, 80) if dry else (4095, 4112, 2048)
        self.grouped = (64, 48, 80, 4) if dry else (8192, 2048, 1408, 8)
        self.big = 2**12 + 16 if dry else 2**31 + 16
        self.bandwidth = 2**12 if dry else 2**26

    def cpu_as_cuda(self, step: int):
        """A dry run's context for `step`: the CPU as sm_90, every float8 GEMM call checked
        against torch's CUDA rules (`fp8fn.testing.cuda_path_on_cpu`), but for the compiled
        step: torch.compile refuses a dispatch mode, so there only the CPU's path is switched
        (its GEMM calls are the eager ones step 3 checked). A GPU run: nothing."""
        if not self.dry:
            return contextlib.nullcontext()
        from fp8fn._core.device import cpu_as_cuda
        from fp8fn.testing import cuda_path_on_cpu

        return cuda_path_on_cpu((9, 0)) if step != 5 else cpu_as_cuda((9, 0))

    def randn(self, *shape, dtype=None, seed=0):
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(seed)
        t = torch.randn(*shape, generator=gen, device=self.device)
        return t if dtype is None else t.to(dtype)

    def synchronize(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def seconds(self, fn, repeats: int = 10) -> float:
        """The median seconds of `fn()` over `repeats` calls (after one warmup)."""
        fn()
        self.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            self.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]


# -- the steps ------------------------------------------------------------------------------


def step_versions(ctx: Context) -> dict:
    import torch

    import fp8fn
    from fp8fn._core.device import cuda_capability

    figures = {"torch": torch.__version__, "fp8fn": fp8fn.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        figures["triton"] = triton.__version__
    except ImportError:
        figures["triton"] = None
    if ctx.device == "cuda":
        figures["device"] = torch.cuda.get_device_name()
    figures["capability"] = cuda_capability(torch.device(ctx.device))
    require(figures["capability"] is not None, "no CUDA path on this device")
    return figures


def _tensorwise(ctx, a_dtype, out_dtype):
    """fp8fn's `scaled_mm` of an `(m, k)` `a_dtype` and an `(n, k)` e4m3 operand, against the
    dequantized float32 matmul: its SQNR."""
    from fp8fn._ops.gemm import scaled_mm

    torch = ctx.torch
    m, k, n = ctx.gemm
    a = (ctx.randn(m, k, seed=1) * 4).to(a_dtype)
    b = (ctx.randn(n, k, seed=2) * 4).to(torch.float8_e4m3fn)
    sa, sb = (torch.tensor(s, device=ctx.device) for s in (0.5, 0.25))
    out = scaled_mm(a, b.t(), sa, sb, out_dtype)
    ref = (a.float() @ b.float().t()) * (sa * sb)
    return out, ref


def step_raw_contracts(ctx: Context) -> dict:
    """See the module docstring, step 1."""
    from fp8fn._ops.gemm import scaled_mm
    from fp8fn._ops.grouped import _group_ids, _scaled_grouped_forward

    torch = ctx.torch
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references exact to fp32
    figures = {}
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for name, a_dtype, out_dtype, floor in (
        ("e4m3 x e4m3 -> bf16", e4m3, torch.bfloat16, 40),
        ("e4m3 x e4m3 -> fp32", e4m3, torch.float32, 60),
        ("e5m2 x e4m3 -> bf16", e5m2, torch.bfloat16, 40),
    ):
        out, ref = _tensorwise(ctx, a_dtype, out_dtype)
        score = sqnr(ref, out)
        figures[name] = db(score)
        require(out.shape == ref.shape and score >= floor, f"{name}: {figures}")
    # row-wise: (m, 1) and (1, n) scales
    m, k, n = ctx.gemm
    a = ctx.randn(m, k, seed=3).to(e4m3)
    b = ctx.randn(n, k, seed=4).to(e4m3)
    sa = torch.rand(m, 1, device=ctx.device) + 0.5
    sb = torch.rand(1, n, device=ctx.device) + 0.5
    out = scaled_mm(a, b.t(), sa, sb, torch.bfloat16)
    score = sqnr((a.float() * sa) @ (b.float().t() * sb), out)
    figures["rowwise -> bf16"] = db(score)
    require(score >= 40, f"rowwise: {figures}")
    # grouped, an empty group and tail rows, both weight layouts
    tokens, k, n, experts = ctx.grouped
    ends = torch.linspace(0, tokens - 7, experts + 1)[1:].long()
    ends[1] = ends[0]  # expert 1: no token
    offs = ends.to(torch.int32).to(ctx.device)
    x = ctx.randn(tokens, k, seed=5).to(e4m3)
    x_inv = torch.rand(experts, device=ctx.device) + 0.5
    w_inv = torch.rand(experts, device=ctx.device) + 0.5
    ids = _group_ids(offs, tokens)
    for layout in ("ENK", "EKN"):
        w = ctx.randn(experts, n, k, seed=6).to(e4m3)
        if layout == "EKN":
            w = w.transpose(-2, -1).contiguous().transpose(-2, -1)  # stored (E, K, N)
        out = _scaled_grouped_forward(x, w, x_inv, w_inv, ids, offs)
        ref = torch.zeros(tokens, n, device=ctx.device)
        start = 0
        for e, end in enumerate(offs.tolist()):
            ref[start:end] = (x[start:end].float() @ w[e].float().t()) * (x_inv[e] * w_inv[e])
            start = end
        score = sqnr(ref, out.float())
        figures[f"grouped {layout}"] = db(score)
        require(score >= 40, f"grouped {layout}: {figures}")
        require(bool((out[start:] == 0).all()), "grouped: tail rows not zero")
    return figures


def step_triton_casts(ctx: Context) -> dict:
    """See the module docstring, step 2."""
    from fp8fn._kernels import cast as triton_cast
    from fp8fn._numerics.fp8 import cast_to_fp8

    torch = ctx.torch
    figures = {}
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30, 2**-9, 2**-17,
         447.9, 448.0, 449.0, 464.0, 1e6, -1e6, 57344.0, 61440.0, 1e-45],
        device=ctx.device,
    )  # fmt: skip
    hp = torch.cat([specials, ctx.randn(4096, seed=7) * 100])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for source in (torch.float32, torch.bfloat16, torch.float16):
            t = hp.to(source)
            scale = torch.tensor(0.75, device=ctx.device)
            fp8, amax = triton_cast.cast_and_amax(t, scale, dtype)
            ref = cast_to_fp8(t, scale, dtype)
            same = torch.equal(fp8.view(torch.uint8), ref.view(torch.uint8))
            require(same, f"cast_and_amax {source}->{dtype}: bits differ")
            require(bool(amax.isnan()), "the amax of a tensor with NaN is NaN")
    figures["special values, 3 dtypes x 2 formats"] = "bit for bit"
    # int64 indexing: a tensor beyond 2**31 elements, the tail's bits checked
    big = torch.full((ctx.big,), 3.0, dtype=torch.bfloat16, device=ctx.device)
    big[-16:] = torch.arange(16, dtype=torch.bfloat16, device=ctx.device) * 10
    fp8, amax = triton_cast.cast_and_amax(
        big, torch.tensor(1.0, device=ctx.device), torch.float8_e4m3fn
    )
    tail = cast_to_fp8(big[-16:], torch.tensor(1.0, device=ctx.device), torch.float8_e4m3fn)
    require(torch.equal(fp8[-16:].view(torch.uint8), tail.view(torch.uint8)), "big tail bits")
    require(float(amax) == 150.0, f"big amax {float(amax)}")
    figures["elements of the big tensor"] = ctx.big
    del big, fp8
    # GB/s: the bf16 read once and the float8 written once, against clone (read + write bf16)
    t = ctx.randn(ctx.bandwidth, dtype=torch.bfloat16, seed=8)
    stored = torch.tensor(1.0, device=ctx.device)
    repeats = 1 if ctx.dry else 20
    cast_s = ctx.seconds(
        lambda: triton_cast.delayed_cast(t, None, stored, 0, torch.float8_e4m3fn, filled=True),
        repeats,
    )
    clone_s = ctx.seconds(t.clone, repeats)
    figures["delayed_cast GB/s"] = round(t.numel() * 3 / cast_s / 1e9, 1)
    figures["clone GB/s"] = round(t.numel() * 4 / clone_s / 1e9, 1)
    return figures


def _linear_run(ctx, recipe, x, w, b):
    import fp8fn

    torch = ctx.torch
    leaves = [v.detach().clone().requires_grad_() for v in (x, w, b)]
    state = None
    if isinstance(recipe, fp8fn.DelayedScaling):
        state = fp8fn.init_state(recipe, ["fc"]).to(ctx.device)["fc"]
    y = fp8fn.linear(*leaves, state, recipe)
    g = torch.ones_like(y)
    grads = torch.autograd.grad(y, leaves[:2], g)
    return y, grads


def step_linear(ctx: Context) -> dict:
    """See the module docstring, step 3."""
    import fp8fn

    torch = ctx.torch
    m, k, n = ctx.linear
    x = ctx.randn(m, k, dtype=torch.bfloat16, seed=9)
    w = ctx.randn(n, k, dtype=torch.bfloat16, seed=10) * 0.05
    b = ctx.randn(n, dtype=torch.bfloat16, seed=11)
    figures = {}
    cases = [
        (fp8fn.DelayedScaling, {}, ("scaled_mm", "triton")),
        (fp8fn.CurrentScaling, {}, ("scaled_mm", "triton")),
        (fp8fn.RowwiseScaling, {}, ("scaled_mm",)),
        (fp8fn.RowwiseScaling, {"hp_grad_weight": True}, ("scaled_mm",)),
    ]
    for cls, fields, backends in cases:
        ref = _linear_run(ctx, cls(backend="emulated", **fields), x, w, b)
        for backend in backends:
            name = f"{cls.__name__}{fields or ''} {backend}"
            y, grads = _linear_run(ctx, cls(backend=backend, **fields), x, w, b)
            scores = [sqnr(r, o) for r, o in zip((ref[0], *ref[1]), (y, *grads))]
            figures[name] = [db(s) for s in scores]
            require(min(scores) >= 30, f"{name}: SQNR {figures[name]} (output, dx, dw)")
    return figures


def step_grouped(ctx: Context) -> dict:
    """See the module docstring, step 4."""
    import fp8fn
    from fp8fn._ops.grouped import grouped_mm

    torch = ctx.torch
    tokens, k, n, experts = ctx.grouped
    ends = torch.linspace(0, tokens - 7, experts + 1)[1:].long()
    ends[1] = ends[0]
    offs = ends.to(torch.int32).to(ctx.device)
    x = ctx.randn(tokens, k, dtype=torch.bfloat16, seed=12)
    figures = {}
    for name, recipe in (("delayed", fp8fn.DelayedScaling()), ("current", fp8fn.CurrentScaling())):
        for layout in ("ENK", "EKN"):
            stored = ctx.randn(experts, n, k, seed=13) * 0.05
            if layout == "EKN":
                stored = stored.transpose(-2, -1).contiguous()
            runs = []
            for backend in ("scaled_mm", "emulated"):
                xl = x.detach().clone().requires_grad_()
                wl = stored.to(torch.bfloat16).requires_grad_()
                weight = wl if layout == "ENK" else wl.transpose(-2, -1)
                newest = scales = None
                if name == "delayed":
                    newest = torch.zeros(experts, 3, device=ctx.device)
                    scales = torch.ones(experts, 3, device=ctx.device)
                out = grouped_mm(xl, weight, offs, newest, scales, 0, backend, recipe)
                out.float().square().sum().backward()
                runs.append((out, xl.grad, wl.grad))
            scores = [
                sqnr(r[: int(ends[-1])].float(), o[: int(ends[-1])].float())
                for r, o in zip(runs[1][:2], runs[0][:2])
            ]
            scores.append(sqnr(runs[1][2], runs[0][2]))
            figures[f"{name} {layout}"] = [db(s) for s in scores]
            require(min(scores) >= 30, f"{name} {layout}: SQNR {figures[f'{name} {layout}']}")
            require(bool((runs[0][0][int(ends[-1]) :] == 0).all()), "tail rows not zero")
    return figures


def step_compiled_mlp(ctx: Context) -> dict:
    """See the module docstring, step 5."""
    import torch.nn.functional as F

    import fp8fn

    torch = ctx.torch
    m, k, n = ctx.linear
    x = ctx.randn(m, k, dtype=torch.bfloat16, seed=14)
    w1 = ctx.randn(n, k, dtype=torch.bfloat16, seed=15) * 0.05
    w2 = ctx.randn(k, n, dtype=torch.bfloat16, seed=16) * 0.05
    figures = {}
    for backend in ("scaled_mm", "triton"):
        recipe = fp8fn.CurrentScaling(backend=backend)

        def mlp(x, w1, w2, recipe=recipe):
            h = F.relu(fp8fn.linear(x, w1, None, None, recipe))
            return fp8fn.linear(h, w2, None, None, recipe).float().square().mean()

        compiled = torch.compile(
            mlp, fullgraph=True, backend="aot_eager" if ctx.dry else "inductor"
        )
        results = []
        for fn in (mlp, compiled):
            leaves = [v.detach().clone().requires_grad_() for v in (w1, w2)]
            start = time.perf_counter()
            loss = fn(x, *leaves)
            loss.backward()
            ctx.synchronize()
            results.append((time.perf_counter() - start, loss, [v.grad for v in leaves]))
        (_, loss, grads), (first_s, c_loss, c_grads) = results
        scores = [sqnr(r, o) for r, o in zip(grads, c_grads)]
        figures[backend] = {
            "first call s": round(first_s, 1),
            "loss": [float(loss.detach()), float(c_loss.detach())],
            "grad SQNR": [db(s) for s in scores],
        }
        require(min(scores) >= 30, f"compiled {backend}: {figures[backend]}")
    return figures


def step_benchmark(ctx: Context) -> dict:
    """See the module docstring, step 6."""
    flag = "--dry-run" if ctx.dry else "--quick"
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), flag],
        cwd=ROOT, capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    figures = {"seconds": round(time.perf_counter() - start, 1), "stdout": run.stdout[-3000:]}
    require(run.returncode == 0, f"benchmarks/gpu.py {flag}: {run.stderr[-2000:]}")
    return figures


FUNCTIONS = {
    0: step_versions,
    1: step_raw_contracts,
    2: step_triton_casts,
    3: step_linear,
    4: step_grouped,
    5: step_compiled_mlp,
    6: step_benchmark,
}


def run_steps(ctx: Context, chosen: set[int]) -> list[dict]:
    """Every chosen step, in order, each under its budget; a verdict per step, printed as JSON."""
    verdicts = []
    step1_failed = False
    for step, name, seconds in STEPS:
        if step not in chosen:
            continue
        verdict = {"step": step, "name": name, "verdict": "pass", "seconds": 0.0}
        verdict.update(figures={}, error=None)
        if step in STAND_ON_STEP_1 and step1_failed:
            verdict.update(verdict="skipped", error="step 1 (the raw op contracts) failed")
        else:
            start = time.perf_counter()
            try:
                with budget(seconds), ctx.cpu_as_cuda(step):
                    verdict["figures"] = FUNCTIONS[step](ctx)
            except Budget as e:
                verdict.update(verdict="timeout", error=str(e))
            except Exception as e:  # noqa: BLE001 (every failure is a verdict, then the next step)
                verdict.update(verdict="fail", error=f"{type(e).__name__}: {e}")
                verdict["traceback"] = traceback.format_exc()[-4000:]
            verdict["seconds"] = round(time.perf_counter() - start, 1)
            if step == 1 and verdict["verdict"] != "pass":
                step1_failed = True
        print(json.dumps(verdict, default=str), flush=True)
        verdicts.append(verdict)
    return verdicts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on CPU, tiny shapes")
    parser.add_argument("--steps", default="0,1,2,3,4,5,6", help="comma-separated step numbers")
    parser.add_argument("--out", default="gpu_smoke.json", help="where the verdicts go")
    args = parser.parse_args(argv)
    chosen = {int(s) for s in args.steps.split(",")}
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("tools/gpu_smoke.py needs CUDA; `--dry-run` runs it on CPU.")
        return 1
    ctx = Context(args.dry_run)
    verdicts = run_steps(ctx, chosen)
    pathlib.Path(args.out).write_text(json.dumps(verdicts, indent=1, default=str))
    return 0 if all(v["verdict"] in ("pass", "skipped") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
