"""The per-group float8 GEMMs of the tensorwise grouped op, as two custom ops, and the helper
that makes a per-group function a custom op under torch.compile (`custom_op_when_compiling`,
also used by `grouped_block_scaled` for the stateless recipes' GEMMs).

Each group's rows are found by reading the group offsets on the host; inside a custom op
(`torch.library.custom_op`) that read is the op's own, so torch.compile traces the grouped op
with no graph break (the op is opaque to it, its fake gives the shape) and runs the same
eager code: compiled and eager give the same bits.

* `rows_mm(a, b, a_inv, b_inv, offs, out_dtype, backend, b_t)`: `(T, N)`, rows
  `offs[e-1]:offs[e]` of `a @ M(e).T` with `M(e)` = `b[e]` (`(N, K)`), or `b[e].T` when `b_t`
  (the backward's `g @ w[e]`); rows past `offs[-1]` are 0.
* `weight_mm(g, x, g_inv, x_inv, offs, out_dtype, backend)`: `(E, N, K)`, expert `e`'s
  `g[rows].T @ x[rows]`; 0 for an expert with no row.

Every product is `fp8_mm` (`a @ b`) of views of the operands: a group's rows, `M(e).T`, their
transposes, so the emulated matmul sees each operand in the layout it has.

On CUDA sm_90 and sm_100 the backward takes instead the two GEMMs of one call each, with no
host read (`grouped_on_device`):

* `rows_mm_on_device(a, b, a_inv, b_inv, offs, ids, out_dtype)`: `rows_mm`'s `b_t` product;
* `weight_mm_on_device(g, x, g_inv, x_inv, offs, out_dtype)`: `weight_mm`'s.

torch's float8 grouped GEMM (`torch._scaled_grouped_mm`) takes e4m3 operands only, and the
output gradient is e5m2. So the float8 operands are widened to bfloat16, which holds every
e4m3 and e5m2 value exactly (NaN and infinities included), and multiplied by torch's bfloat16
grouped GEMM (`F.grouped_mm`: float32 accumulation, the offsets read on the device), then by
the per-group dequantization scales in float32. The one difference from `fp8_mm`'s
`torch._scaled_mm` is a rounding of each unscaled product to bfloat16 (relative 2**-8) before
the scale. Rows past the last group and experts with no row, which the GEMM leaves unwritten,
are set to 0 on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._core.device import cuda_capability
from .gemm import fp8_mm
from .roles import per_row


def bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """The `(start, end)` rows of each group (a host read of `offs`)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def _rows_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inv: torch.Tensor,
    b_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str,
    b_t: bool,
) -> torch.Tensor:
    """See the module docstring. a: float8 `(T, K)`; b: float8 `(E, N, K)`, or `(E, K, N)`
    when `b_t`; a_inv, b_inv: float32 `(E,)`; offs: int32 `(E,)`."""
    n = b.shape[2] if b_t else b.shape[1]
    out = torch.zeros(a.shape[0], n, dtype=out_dtype, device=a.device)
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            m = b[e] if b_t else b[e].t()
            out[s:t] = fp8_mm(a[s:t], m, a_inv[e], b_inv[e], out_dtype, backend)
    return out


def _rows_mm_fake(a, b, a_inv, b_inv, offs, out_dtype, backend, b_t):
    return a.new_empty(a.shape[0], b.shape[2] if b_t else b.shape[1], dtype=out_dtype)


def _weight_mm(
    g: torch.Tensor,
    x: torch.Tensor,
    g_inv: torch.Tensor,
    x_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """See the module docstring. g: float8 `(T, N)`; x: float8 `(T, K)`; g_inv, x_inv:
    float32 `(E,)`; offs: int32 `(E,)`."""
    out = torch.zeros(offs.shape[0], g.shape[1], x.shape[1], dtype=out_dtype, device=g.device)
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            out[e] = fp8_mm(g[s:t].t(), x[s:t], g_inv[e], x_inv[e], out_dtype, backend)
    return out


def _weight_mm_fake(g, x, g_inv, x_inv, offs, out_dtype, backend):
    return g.new_empty(offs.shape[0], g.shape[1], x.shape[1], dtype=out_dtype)


def grouped_on_device(backend: str, device: torch.device, n: int, k: int, experts: int) -> bool:
    """Whether the backward's GEMMs run on the device as one `F.grouped_mm` call each: torch's
    float8 GEMMs (`backend="scaled_mm"`) on sm_90 or sm_100, where torch's bfloat16 grouped
    GEMM reads the offsets on the device (elsewhere it reads them on the host), with the
    output gradient's N and the input's K multiples of 8 (16-byte rows of bfloat16) and
    fewer than 1024 experts (the kernel's limit)."""
    capability = cuda_capability(device)
    return (
        backend == "scaled_mm"
        and capability is not None
        and capability[0] in (9, 10)
        and n % 8 == 0
        and k % 8 == 0
        and experts < 1024
    )


def _widened(fp8: torch.Tensor) -> torch.Tensor:
    """`fp8` as bfloat16 (exact), row-major unless its layout is already one that
    `F.grouped_mm` takes (row- or column-major in its last two dims, 16-byte rows)."""
    hp = fp8.to(torch.bfloat16)
    rows, cols = hp.stride(-2), hp.stride(-1)
    if (cols == 1 and rows % 8 == 0 and rows >= hp.shape[-1]) or (
        rows == 1 and cols % 8 == 0 and cols >= hp.shape[-2]
    ):
        return hp
    return hp.contiguous()


def rows_mm_on_device(a, b, a_inv, b_inv, offs, ids, out_dtype: torch.dtype) -> torch.Tensor:
    """`rows_mm(a, b, a_inv, b_inv, offs, out_dtype, backend, b_t=True)` in one call (see
    the module docstring). a: float8 `(T, N)`; b: float8 `(E, N, K)`; a_inv, b_inv: float32
    `(E,)`; offs: int32 `(E,)`; ids: int64 `(T,)` the expert of each row (E past the last
    group). Returns `(T, K)` of `out_dtype`."""
    out = F.grouped_mm(_widened(a), _widened(b), offs=offs)
    inv = per_row(a_inv * b_inv, ids)[:, None]
    return torch.where((ids < b.shape[0])[:, None], out.float() * inv, 0.0).to(out_dtype)


def weight_mm_on_device(g, x, g_inv, x_inv, offs, out_dtype: torch.dtype) -> torch.Tensor:
    """`weight_mm(g, x, g_inv, x_inv, offs, out_dtype, backend)` in one call (see the module
    docstring). g: float8 `(T, N)`; x: float8 `(T, K)`; g_inv, x_inv: float32 `(E,)`; offs:
    int32 `(E,)`. Returns `(E, N, K)` of `out_dtype`, 0 for an expert with no row."""
    out = F.grouped_mm(_widened(g).t(), _widened(x), offs=offs)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    has_rows = (offs > starts)[:, None, None]
    inv = (g_inv * x_inv)[:, None, None]
    return torch.where(has_rows, out.float() * inv, 0.0).to(out_dtype)


def custom_op_when_compiling(name: str, fn, fake):
    """`fn`, run as the custom op `fp8fn::<name>` (`fake` its fake: the output's shape and
    dtype) under torch.compile, and as itself eagerly (a custom op without a derivative cannot
    run inside a grouped op's backward under torch.func). `fn` reads the group offsets on the
    host: inside the custom op that read is the op's own, so the graph does not break, and
    compiled and eager run the same code (the same bits)."""
    op = torch.library.custom_op(f"fp8fn::{name}", fn, mutates_args=())
    op.register_fake(fake)

    def call(*args):
        return (op if torch.compiler.is_compiling() else fn)(*args)

    return call


rows_mm = custom_op_when_compiling("grouped_rows_mm", _rows_mm, _rows_mm_fake)
weight_mm = custom_op_when_compiling("grouped_weight_mm", _weight_mm, _weight_mm_fake)
