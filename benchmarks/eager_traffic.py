"""Eager memory traffic of one fp8fn linear's forward + backward on the CUDA path, without a GPU.

Standalone: `python benchmarks/eager_traffic.py [--quick] [--shape M K N]` (default 4096 4096
11008, bf16; `--quick` is the same run: fake tensors cost nothing); the package never imports
it. Under `FakeTensorMode` (no data, any size) and
`fp8fn.testing.cuda_path_on_cpu((9, 0))` (the CUDA path, each float8 GEMM call checked against
torch's CUDA rules), a dispatch mode counts every aten op's bytes: each tensor argument read
once and each output written once (views and metadata ops move nothing and count 0; a GEMM
counts its operands and its output). That is the traffic of eager execution, op by op, with no
fusion: the figure compared here is how many bytes each recipe's float8 GEMMs and their
dequantization move around the same casts.

Rows: fp8fn `CurrentScaling(backend="scaled_mm")` (tensorwise); `RowwiseScaling(backend=
"scaled_mm")` as it runs on the CUDA path now (torch's row-wise scaled GEMM: the scales in its
epilogue); and as it ran before (and still runs on the CPU's own path): a tensorwise GEMM with
unit scales to a float32 output, then an `(m, n)` scale matrix and a multiply.
"""

from __future__ import annotations

import argparse

import torch
from _common import print_table, ratio
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import fp8fn
from fp8fn._core.device import cpu_as_cuda
from fp8fn.testing import cuda_path_on_cpu


class CountBytes(TorchDispatchMode):
    """Sums the bytes each aten op reads (its tensor arguments) and writes (its outputs)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.gemm_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func in (torch.ops.aten.detach.default,):
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out))]
        moved = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        self.bytes += moved
        if "scaled_mm" in str(func):
            self.gemm_bytes += moved
        return out


def step_bytes(recipe, shape, own_cpu_path: bool) -> tuple[int, int]:
    """`(all bytes, GEMM bytes)` of one forward + backward of `fp8fn.linear` at `shape`."""
    m, k, n = shape
    with FakeTensorMode():
        x = torch.empty(m, k, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(n, k, dtype=torch.bfloat16, requires_grad=True)
        path = cpu_as_cuda(None) if own_cpu_path else cuda_path_on_cpu((9, 0))
        with path, CountBytes() as count:
            y = fp8fn.linear(x, w, None, None, recipe)
            y.backward(torch.ones_like(y))
    return count.bytes, count.gemm_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(4096, 4096, 11008))
    parser.add_argument("--quick", action="store_true", help="the same (no data: no cost)")
    shape = tuple(parser.parse_args().shape)
    rows, figures = [], {}
    for name, recipe, own in (
        ("tensorwise (current)", fp8fn.CurrentScaling(backend="scaled_mm"), False),
        ("rowwise, native GEMM", fp8fn.RowwiseScaling(backend="scaled_mm"), False),
        ("rowwise, unit-scale GEMM", fp8fn.RowwiseScaling(backend="scaled_mm"), True),
    ):
        figures[name] = step_bytes(recipe, shape, own)
    base = figures["tensorwise (current)"][0]
    for name, (total, gemm) in figures.items():
        rows.append([name, f"{total / 1e9:.2f}", f"{gemm / 1e9:.2f}", ratio(total, base)])
    print(f"fp8fn.linear forward + backward, bf16 x {shape[:2]}, weight {shape[2], shape[1]}")
    print_table(["variant", "GB (eager)", "GB in GEMM calls", "vs tensorwise"], rows)


if __name__ == "__main__":
    main()
