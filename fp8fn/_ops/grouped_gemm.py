"""The per-group float8 GEMMs of the tensorwise grouped op, as two custom ops.

Each group's rows are found by reading the group offsets on the host; inside a custom op
(`torch.library.custom_op`) that read is the op's own, so torch.compile traces the grouped op
with no graph break (the op is opaque to it, its fake gives the shape) and runs the same
eager code: compiled and eager give the same bits.

* `rows_mm(a, b, a_inv, b_inv, offs, out_dtype, backend, b_t)`: `(T, N)`, rows
  `offs[e-1]:offs[e]` of `a @ M(e).T` with `M(e)` = `b[e]` (`(N, K)`), or `b[e].T` when `b_t`
  (the backward's `g @ w[e]`); rows past `offs[-1]` are 0.
* `weight_mm(g, x, g_inv, x_inv, offs, out_dtype, backend)`: `(E, N, K)`, expert `e`'s
  `g[rows].T @ x[rows]`; 0 for an expert with no row.

Every product is `fp8_mm` of the operands as the loop over groups gave them (the same views:
a transpose is taken inside, so the emulated matmul sees the layout it saw before).
"""

from __future__ import annotations

import torch

from .gemm import fp8_mm


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def _rows_mm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
            offs: torch.Tensor, out_dtype: torch.dtype, backend: str, b_t: bool) -> torch.Tensor:
    """See the module docstring. a: float8 `(T, K)`; b: float8 `(E, N, K)`, or `(E, K, N)`
    when `b_t`; a_inv, b_inv: float32 `(E,)`; offs: int32 `(E,)`."""
    n = b.shape[2] if b_t else b.shape[1]
    out = torch.zeros(a.shape[0], n, dtype=out_dtype, device=a.device)
    for e, (s, t) in enumerate(_bounds(offs)):
        if t > s:
            m = b[e].t() if b_t else b[e]
            out[s:t] = fp8_mm(a[s:t], m, a_inv[e], b_inv[e], out_dtype, backend)
    return out


def _rows_mm_fake(a, b, a_inv, b_inv, offs, out_dtype, backend, b_t):
    return a.new_empty(a.shape[0], b.shape[2] if b_t else b.shape[1], dtype=out_dtype)


def _weight_mm(g: torch.Tensor, x: torch.Tensor, g_inv: torch.Tensor, x_inv: torch.Tensor,
              offs: torch.Tensor, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """See the module docstring. g: float8 `(T, N)`; x: float8 `(T, K)`; g_inv, x_inv:
    float32 `(E,)`; offs: int32 `(E,)`."""
    out = torch.zeros(offs.shape[0], g.shape[1], x.shape[1], dtype=out_dtype, device=g.device)
    for e, (s, t) in enumerate(_bounds(offs)):
        if t > s:
            out[e] = fp8_mm(g[s:t].t(), x[s:t].t(), g_inv[e], x_inv[e], out_dtype, backend)
    return out


def _weight_mm_fake(g, x, g_inv, x_inv, offs, out_dtype, backend):
    return g.new_empty(offs.shape[0], g.shape[1], x.shape[1], dtype=out_dtype)



_ROWS_OP = torch.library.custom_op("fp8fn::grouped_rows_mm", _rows_mm, mutates_args=())
_ROWS_OP.register_fake(_rows_mm_fake)
_WEIGHT_OP = torch.library.custom_op("fp8fn::grouped_weight_mm", _weight_mm, mutates_args=())
_WEIGHT_OP.register_fake(_weight_mm_fake)


def rows_mm(*args):
    """`_rows_mm`: the custom op under torch.compile, else the function itself (a custom op
    without a derivative cannot run inside the grouped op's backward under torch.func)."""
    return (_ROWS_OP if torch.compiler.is_compiling() else _rows_mm)(*args)


def weight_mm(*args):
    """`_weight_mm`, as `rows_mm`."""
    return (_WEIGHT_OP if torch.compiler.is_compiling() else _weight_mm)(*args)
