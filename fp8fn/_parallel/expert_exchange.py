"""Expert parallel's exchange of token rows: the plan of one all-to-all of rows between the
ranks of an expert-parallel group (`plan_exchange`), the rows sent (`exchange_rows`, one
`torch.distributed.all_to_all_single` of their bytes) and its autograd form (`send_rows`).

Each rank holds `E / world` consecutive experts (rank r: experts `r * El ... (r+1) * El - 1`,
DTensor `Shard(0)`). A sender sorts its (token, k) rows by their global expert; the rows for
rank r's experts go to rank r. A receiver gets, from each source rank in turn, its rows for
each local expert in turn, and regroups them expert-major (stable: source 0's rows of an
expert first), as one process running all the ranks' tokens would order them.

Every exchange sends the tensor's bytes (a `uint8` view): gloo has no float8 collectives, and
the bytes are the same whatever the dtype. `exchange_scaled_rows` sends high-precision rows
as e4m3 with a power-of-two scale of their own (`float8_wire="all"`: the GEMM outputs).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from .._numerics.fp8 import E4M3, dequantize_mx, quantize_mx
from .._ops.first_order import BackwardOnly


@dataclasses.dataclass(frozen=True, eq=False)
class Exchange:
    """One dispatch (and its combine, reversed) between the ranks of `group`.

    Fields (sender side: S rows sorted by global expert; receiver side: M rows):
      group: the expert-parallel process group.
      experts: E, the number of experts of the whole weight.
      first: the global index of this rank's first expert (`rank * El`).
      counts: rows sent to each global expert (a list of E ints).
      received: rows received from each source rank for each local expert (a list of `world`
        lists of El ints).
      send, recv: rows sent to, received from, each rank (lists of ints, the splits).
      send_ids: int64 `(S,)`, the global expert of each sent row.
      source_ids: int64 `(M,)`, the local expert of each received row, in received (source-
        major) order.
      to_experts: int64 `(M,)`, received order -> expert-major (`x[to_experts]`).
      from_experts: int64 `(M,)`, its inverse.
      ids: int64 `(M,)`, the local expert of each expert-major row.
      offs: int32 `(El,)`, cumulative ends of the local experts' expert-major rows.
      flags: the bools of `plan_exchange`'s `read`, read on the host with the counts (or None).
    """

    group: object
    experts: int
    first: int
    counts: list
    received: list
    send: list
    recv: list
    send_ids: torch.Tensor
    source_ids: torch.Tensor
    to_experts: torch.Tensor
    from_experts: torch.Tensor
    ids: torch.Tensor
    offs: torch.Tensor
    flags: list | None

    @property
    def local(self) -> int:
        """El, the number of experts on this rank."""
        return self.offs.shape[0]

    def splits(self, chosen) -> tuple[list, list]:
        """`(send, recv)`: the splits of the rows of the experts `chosen` (E bools) alone."""
        el = self.local
        send = [
            sum(self.counts[e] for e in range(r * el, (r + 1) * el) if chosen[e])
            for r in range(len(self.send))
        ]
        recv = [sum(row[j] for j in range(el) if chosen[self.first + j]) for row in self.received]
        return send, recv


def plan_exchange(send_ids: torch.Tensor, experts: int, group, read=None) -> Exchange:
    """The `Exchange` of rows whose global experts are `send_ids` (int64 `(S,)`, sorted).

    One collective: an all-to-all of the per-expert row counts (int64, `E` per rank), read on
    the host (the splits of the rows' all-to-all are host integers) in one transfer, with
    `read` (a bool tensor, or None) beside them: `Exchange.flags`.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = experts // world
    counts = torch.bincount(send_ids, minlength=experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    extra = [] if read is None else [read.to(counts.dtype)]
    host = torch.cat([counts, received, *extra]).tolist()  # the one host read
    sent, got = host[:experts], host[experts : 2 * experts]
    rows = [got[s * local : (s + 1) * local] for s in range(world)]  # [source][local expert]
    received = received.view(world, local)
    # received rows come source-major; each one's local expert, then a stable expert-major sort
    expert_of = torch.arange(local, device=counts.device).repeat(world)
    source_ids = expert_of.repeat_interleave(received.flatten())
    to_experts = torch.argsort(source_ids, stable=True)
    per_expert = received.sum(0)
    return Exchange(
        group=group,
        experts=experts,
        first=rank * local,
        counts=sent,
        received=rows,
        send=[sum(sent[r * local : (r + 1) * local]) for r in range(world)],
        recv=[sum(row) for row in rows],
        send_ids=send_ids,
        source_ids=source_ids,
        to_experts=to_experts,
        from_experts=torch.argsort(to_experts),
        ids=torch.arange(local, device=counts.device).repeat_interleave(per_expert),
        offs=per_expert.cumsum(0).int(),
        flags=None if read is None else [bool(v) for v in host[2 * experts :]],
    )


def exchange_rows(rows: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    """`rows` `(sum(send), ...)`, any dtype (float8 included), split by `send` over the ranks
    of `group`; returns the `(sum(recv), ...)` rows received, source-major, of its dtype."""
    flat = rows.contiguous().view(rows.shape[0], math.prod(rows.shape[1:])).view(torch.uint8)
    out = flat.new_empty(sum(recv), flat.shape[1])
    dist.all_to_all_single(out, flat, recv, send, group=group)
    return out.view(rows.dtype).view(sum(recv), *rows.shape[1:])


def exchange_scaled_rows(rows: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    """`exchange_rows` of high-precision `rows` `(sum(send), K)` as K + 1 bytes each: the row
    cast to e4m3 with a power-of-two scale of its own (one MXFP8 block of the whole row,
    `quantize_mx(rows, K)`, RCEIL: the row's amax lands in `(224, 448]`) and that scale's
    biased E8M0 exponent. Returns the `(sum(recv), K)` rows received, dequantized, of `rows`'
    dtype (an overflow stays visible: inf and NaN rows come back inf or NaN)."""
    k = rows.shape[1]
    fp8, exponent = quantize_mx(rows, block_size=k)
    got = exchange_rows(torch.cat([fp8.view(torch.uint8), exponent], 1), send, recv, group)
    values, exponent = got[:, :k].view(E4M3), got[:, k:]
    return dequantize_mx(values, exponent, torch.float32, block_size=k).to(rows.dtype)


class Exchanged(BackwardOnly):
    """`exchange_rows` inside a backward (differentiating it again raises); `scaled`:
    `exchange_scaled_rows`."""

    @staticmethod
    def forward(rows, send, recv, group, scaled=False):
        return (exchange_scaled_rows if scaled else exchange_rows)(rows, send, recv, group)


class _SendRows(torch.autograd.Function):
    """`exchange_rows` with autograd: the backward sends the gradient rows back (reversed
    splits), in the gradient's dtype."""

    @staticmethod
    def forward(rows, send, recv, group):
        return exchange_rows(rows, send, recv, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.send, ctx.recv, ctx.group = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad):
        return Exchanged.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def send_rows(rows: torch.Tensor, ex: Exchange, back: bool = False) -> torch.Tensor:
    """Dispatch (`back` False: sender-sorted rows -> the receiver's rows, expert-major) or
    combine (`back` True: expert-major rows -> the sender's sorted rows), in `rows`' dtype,
    differentiable (the gradient goes the other way, in its own dtype)."""
    if back:
        return _SendRows.apply(rows[ex.from_experts], ex.recv, ex.send, ex.group)
    return _SendRows.apply(rows, ex.send, ex.recv, ex.group)[ex.to_experts]
