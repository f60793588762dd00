"""The float8 grouped GEMM of mixture-of-experts layers against per-expert `F.linear`, on CPU.

Standalone: `python benchmarks/moe.py [--quick]`. The package never imports it. One training
step (forward and backward) of one experts projection: T routed token rows, E experts of
`(N, K)` weights, uneven groups with one idle expert. Variants, side by side in one run:

* `F.linear per expert (bf16)`: the loop HF's "eager" experts run, high precision;
* `fp8fn.linear per expert`: the same loop with each expert's GEMMs in float8 (one `fp8fn.linear`
  per expert, current scaling; `DelayedScaling` casts alike);
* `grouped delayed|current|rowwise|mxfp8|nvfp4`: fp8fn's grouped op (`fp8fn/_ops/grouped.py`),
  one autograd node for all experts;
* `emulated GEMMs: per-group mm | torch._grouped_mm`: the float32 GEMMs of the emulated
  backend alone (forward shape), per group or as one `torch._grouped_mm` call, which give the
  same bits: the measurement behind the CPU backend's choice.

Columns: `ops` the aten ops dispatched by the step, `MB` the bytes those ops read and write
(each op's tensor inputs plus outputs: eager traffic without fusion; the grouped op reads the
group offsets on the host, which under torch.compile happens inside fp8fn's custom ops, opaque
to inductor, so its per-kernel bytes, as in `traffic.py`, would miss the GEMMs), and the
median ms per step (interleaved rounds, this machine's CPU: state its load with the figures).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import median_times, print_table, ratio
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fp8fn
from fp8fn._ops.grouped import grouped_mm


class _Traffic(TorchDispatchMode):
    """Counts the aten ops dispatched inside, and the bytes of their tensor inputs and outputs
    (a view costs nothing: its output bytes are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops, self.nbytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not func.is_view:
            tensors += [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.nbytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _case(tokens: int, experts: int, k: int, n: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=gen).bfloat16()
    w = (torch.randn(experts, n, k, generator=gen) * k**-0.5).bfloat16()
    g = torch.randn(tokens, n, generator=gen).bfloat16()
    # Uneven groups, expert 1 idle: shares 3, 0, 1, 2, ... of the tokens.
    shares = torch.tensor([3.0, 0.0] + [float(1 + e % 3) for e in range(experts - 2)])
    ends = (shares.cumsum(0) / shares.sum() * tokens).round().to(torch.int32)
    return x, w, ends, g


def _step(fn, x, w, g):
    """One forward and backward of `fn(x, w)` with output gradient `g`."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()

    def step():
        x.grad = w.grad = None
        fn(x, w).backward(g)

    return step


def _per_expert(linear, ends):
    bounds = list(zip([0] + ends[:-1], ends))

    def fn(x, w):
        return torch.cat([linear(x[s:t], w[e]) for e, (s, t) in enumerate(bounds)])

    return fn


def variants(x, w, ends, g) -> dict:
    """`{name: step}`."""
    offs, ends_list = ends, ends.tolist()
    experts = w.shape[0]
    state = torch.ones(experts, 3)
    stored = torch.stack(
        [
            torch.full((experts,), 448.0 / x.float().abs().max()),
            448.0 / w.float().abs().flatten(1).amax(1),
            torch.full((experts,), 57344.0 / g.float().abs().max()),
        ],
        1,
    )
    current = fp8fn.CurrentScaling(backend="emulated")
    key = (torch.tensor(1.0, dtype=torch.float64), "experts")
    out = {
        "F.linear per expert (bf16)": _per_expert(F.linear, ends_list),
        "fp8fn.linear per expert": _per_expert(
            lambda x, w: fp8fn.linear(x, w, None, None, current), ends_list
        ),
        "grouped delayed": lambda x, w: grouped_mm(x, w, offs, state, stored),
        "grouped current": lambda x, w: grouped_mm(x, w, offs),
        "grouped rowwise": lambda x, w: grouped_mm(x, w, offs, recipe=fp8fn.RowwiseScaling()),
        "grouped mxfp8": lambda x, w: grouped_mm(x, w, offs, recipe=fp8fn.MXScaling()),
        "grouped nvfp4": lambda x, w: grouped_mm(
            x, w, offs, recipe=fp8fn.NVFP4Scaling(), random=key
        ),
    }
    steps = {name: _step(fn, x, w, g) for name, fn in out.items()}
    x32, w32 = x.float(), w.float()
    bounds = list(zip([0] + ends_list[:-1], ends_list))

    def per_group():
        out = x32.new_zeros(x32.shape[0], w32.shape[1])
        for e, (s, t) in enumerate(bounds):
            if t > s:
                out[s:t] = torch.mm(x32[s:t], w32[e].t())
        return out

    def grouped():
        return torch._grouped_mm(x32, w32.transpose(-2, -1), offs=offs)

    assert torch.equal(per_group(), grouped())  # the same bits: the choice is time only
    steps["emulated GEMMs: per-group mm"] = per_group
    steps["emulated GEMMs: torch._grouped_mm"] = grouped
    return steps


def table(quick: bool) -> dict:
    """`{variant: (ops, bytes, seconds)}`, printed with ratios to the bf16 per-expert loop."""
    shape = (256, 8, 64, 128) if quick else (2048, 8, 256, 512)
    x, w, ends, g = _case(*shape)
    steps = variants(x, w, ends, g)
    counts = {}
    for name, step in steps.items():
        step()  # warm
        with _Traffic() as traffic:
            step()
        counts[name] = (traffic.ops, traffic.nbytes)
    times = median_times(steps, repeats=3 if quick else 5, warmup=1)
    base = times["F.linear per expert (bf16)"]
    rows = [
        [
            name,
            str(ops),
            f"{nbytes / 1e6:.1f}",
            f"{times[name] * 1e3:.2f}",
            ratio(times[name], base),
        ]
        for name, (ops, nbytes) in counts.items()
    ]
    tokens, experts, k, n = shape
    print(
        f"T={tokens} token rows, E={experts} experts, K={k}, N={n}, bf16, groups "
        f"{ends.tolist()}; {torch.get_num_threads()} threads"
    )
    print_table(["variant", "ops", "MB", "ms", "/ bf16 loop"], rows)
    return {name: (*counts[name], times[name]) for name in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small shape, 3 rounds")
    table(parser.parse_args().quick)


if __name__ == "__main__":
    main()
