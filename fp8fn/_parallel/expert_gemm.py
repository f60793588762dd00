"""Expert parallel's two float8 grouped GEMMs, each fused with the all-to-all on its operand's
side (built from the grouped op's parts, `fp8fn/_ops/grouped.py`):

* `dispatch_grouped_mm`: dispatch, then `out = x_e @ W[e].T` on the experts' ranks. The
  rows of each expert on the wire (`wire[e]`: DelayedScaling, its input history filled) are
  cast by the sender to e4m3 with that expert's input scale (the state's, known on every rank)
  in the pass that packs them, and only those bytes are sent; the receiver's GEMM takes them as
  they are. Its backward sends `grad_x` back in high precision.
* `grouped_mm_combine`: `y = h_e @ W[e].T` on the experts' ranks, then combine (the rows sent
  back in high precision). Its backward: the sender casts the output gradient's rows of each
  expert on the wire (its grad_output history filled) to e5m2 with that expert's grad_output
  scale and sends the bytes; the receiver's GEMMs take them as they are.

With `scaled` (`float8_wire="all"`) the GEMM outputs travel in float8 too: combine forward
(`y`) and dispatch backward (`grad_x`) send each row as e4m3 with a power-of-two scale of its
own, computed by the sender from the row and sent as one byte beside it
(`exchange_scaled_rows`); the receiver dequantizes to the activation dtype. These values have
no delayed state (no role of the state holds a GEMM output's amax), hence the per-row scale.
Their gradient passes through the rounding unchanged (the rounding is not differentiated, as
every float8 cast of fp8fn's).

The rows of the other experts (the first step, an expert whose history is still empty,
CurrentScaling, `float8_wire=False`) travel in high precision, in a second all-to-all made only
when some expert is off the wire, and the receiver casts them as the grouped op does (current
scaling from the amax of all the rows the expert received, from every rank).

Observations (the gradient with respect to `newest`, float32 `(E, 3)` for all E experts):
what a rank sent in float8 is observed by the sender (the amax of its rows per destination
expert); the rest by the experts' rank (its experts' rows, 0 elsewhere). `fp8fn.all_reduce`
(max over the ranks) makes them the amaxes of one process running every rank's tokens. An
expert that received no row observes 0 for its input and grad_output (history kept).
"""

from __future__ import annotations

import torch

from .._core.checks import no_autocast
from .._numerics.fp8 import E4M3, E5M2, cast_to_fp8
from .._ops.first_order import first_order_only
from .._ops.grouped import expert_amax, group_amax
from .._ops.grouped_gemm import rows_mm, weight_mm
from .._ops.tensorwise import scales_for
from .expert_exchange import Exchange, Exchanged, exchange_rows, exchange_scaled_rows

_MAX = {E4M3: 448.0, E5M2: 57344.0}


def pack_rows(rows: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, dtype) -> tuple:
    """`(fp8, amax)`: each row of `rows` `(S, K)` cast to `dtype` with the scale of its expert
    (`scale` float32 `(E,)`, row r's expert `ids[r]`, int64 `(S,)`), and the per-expert amax
    of the rows (float32 `(E,)`, 0 for an expert without a row): the sender's observation."""
    experts = scale.shape[0]
    amax = group_amax(rows, ids, experts)
    return cast_to_fp8(rows, scale[ids][:, None], dtype), amax


def _local(t, ex: Exchange):
    return None if t is None else t[ex.first : ex.first + ex.local]


def _receive(rows, ex: Exchange, newest, stored, margin, role: int, wire, back: bool):
    """`(fp8, scale, observed)` of `rows` sent to the experts' ranks, cast to role `role`'s
    format (0 input e4m3, 2 grad_output e5m2) with its experts' scales: the rows of the experts
    `wire` (E bools: their `role` history holds an amax) on the sender, in the pass that packs
    them, and sent as float8 bytes; the others' in high precision, cast on the receiver with the
    amax of all the rows each expert received (one all-to-all of each kind that has rows on
    some rank: `wire` is the same on every rank). `fp8` `(M, K)` expert-major, `scale` float32
    `(El,)` (this rank's experts), `observed` float32 `(E,)` (the sender's amax of its rows for
    an expert on the wire, the experts' rank's for the others, 0 where not observed here).
    `back`: the rows go from the sender to the experts in a backward. A fourth value: the
    high-precision rows received (source-major: `[ex.to_experts]` makes them expert-major)
    when no expert is on the wire, else None."""
    dtype = E4M3 if role == 0 else E5M2
    send = Exchanged.apply if back else exchange_rows
    on_wire = torch.tensor(wire, device=rows.device)
    local_wire = on_wire[ex.first : ex.first + ex.local]
    parts, part_ids = [], []
    if any(wire):
        fp8, sent_amax = pack_rows(rows, ex.send_ids, stored[:, role], dtype)
        if not all(wire):
            fp8 = fp8[on_wire[ex.send_ids]]
        parts.append(send(fp8, *ex.splits(wire), ex.group))
        part_ids.append(ex.source_ids[local_wire[ex.source_ids]])
    hp_scale = observed = None
    if not all(wire):
        off = [not w for w in wire]
        hp = send(rows[~on_wire[ex.send_ids]] if any(wire) else rows, *ex.splits(off), ex.group)
        ids = ex.source_ids[~local_wire[ex.source_ids]]
        amax = group_amax(hp, ids, ex.local)
        local_newest, local_stored = _role(newest, ex, role), _role(stored, ex, role)
        hp_scale = scales_for(amax, local_newest, local_stored, margin, _MAX[dtype])
        parts.append(cast_to_fp8(hp, hp_scale[ids][:, None], dtype))
        part_ids.append(ids)
        observed = _spread(amax, ex)
    if hp_scale is None:
        return parts[0][ex.to_experts], _local(stored[:, role], ex), sent_amax, None
    if len(parts) == 1:
        return parts[0][ex.to_experts], hp_scale, observed, hp
    order = torch.argsort(torch.cat(part_ids), stable=True)  # an expert's rows: one part
    scale = torch.where(local_wire, _local(stored[:, role], ex), hp_scale)
    return torch.cat(parts)[order], scale, torch.where(on_wire, sent_amax, observed), None


def _role(rows, ex, role):
    return None if rows is None else _local(rows, ex)[:, role]


def _cast_weight(weight, ex, newest, stored, margin):
    """`(w_fp8, w_scale, w_amax)` of this rank's experts `(El, N, K)`."""
    amax = expert_amax(weight)
    scale = scales_for(amax, _role(newest, ex, 1), _role(stored, ex, 1), margin, 448.0)
    return cast_to_fp8(weight, scale[:, None, None], E4M3), scale, amax


def _spread(local, ex):
    """This rank's experts' `(El,)` amaxes placed among all E, 0 elsewhere: `(E,)` (made
    without writes in place, at the level of `local`)."""
    zeros = local.new_zeros(ex.experts - ex.local)
    return torch.cat([zeros[: ex.first], local, zeros[ex.first :]])


def _observation(ex, x_amax, w_amax, g_amax):
    """`(E, 3)`: the input, weight and grad_output amaxes observed on this rank (`x_amax`,
    `g_amax` `(E,)`; `w_amax` `(El,)`, this rank's experts)."""
    return torch.stack([x_amax, _spread(w_amax, ex), g_amax], 1)


class _DispatchGroupedMM(torch.autograd.Function):
    """`x` `(S, K)` (sender rows sorted by global expert) -> `(M, N)` expert-major rows of
    `x_e @ weight[e].T` on the experts' rank (`weight` `(El, N, K)`, this rank's experts)."""

    @staticmethod
    def forward(x, weight, newest, stored, ex, margin, backend, wire, scaled):
        x_fp8, x_scale, x_amax, _ = _receive(x, ex, newest, stored, margin, 0, wire, False)
        w_fp8, w_scale, w_amax = _cast_weight(weight, ex, newest, stored, margin)
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        out = rows_mm(x_fp8, w_fp8, x_inv, w_inv, ex.offs, x.dtype, backend, False)
        return out, x_amax, x_fp8, w_fp8, x_inv, w_inv, w_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, newest, stored, ex, margin, backend, wire, scaled = inputs
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(*output[1:], newest, stored)
        ctx.ex, ctx.margin, ctx.backend, ctx.dtypes = ex, margin, backend, (x.dtype, weight.dtype)
        ctx.scaled = scaled

    @staticmethod
    def backward(ctx, grad_out, *_):
        x_amax, x_fp8, w_fp8, x_inv, w_inv, w_amax, newest, stored = ctx.saved_tensors
        ex, (x_dtype, w_dtype) = ctx.ex, ctx.dtypes
        with no_autocast(grad_out):
            g_amax = group_amax(grad_out, ex.ids, ex.local)
            g_scale = scales_for(
                g_amax, _role(newest, ex, 2), _role(stored, ex, 2), ctx.margin, 57344.0
            )
            g_fp8 = cast_to_fp8(grad_out, g_scale[ex.ids][:, None], E5M2)
            g_inv = g_scale.reciprocal()
            grad_x = rows_mm(g_fp8, w_fp8, g_inv, w_inv, ex.offs, x_dtype, ctx.backend, True)
            # every rank sends its gradient rows back (the collective pairs across ranks)
            back = grad_x[ex.from_experts]
            grads = [Exchanged.apply(back, ex.recv, ex.send, ex.group, ctx.scaled)]
            grads.append(weight_mm(g_fp8, x_fp8, g_inv, x_inv, ex.offs, w_dtype, ctx.backend))
            g_observed = _spread(g_amax, ex)
            obs = _observation(ex, x_amax, w_amax, g_observed) if ctx.needs_input_grad[2] else None
            grads += [obs, None, None, None, None, None, None]
        return tuple(first_order_only(grads, x_amax))


class _GroupedMMCombine(torch.autograd.Function):
    """`h` `(M, K)` expert-major rows on the experts' rank -> `(S, N)` rows of
    `h_e @ weight[e].T (+ bias[e])` back on their senders, in their sorted order."""

    @staticmethod
    def forward(h, weight, bias, newest, stored, ex, margin, backend, wire, scaled):
        h_amax = group_amax(h, ex.ids, ex.local)
        h_scale = scales_for(h_amax, _role(newest, ex, 0), _role(stored, ex, 0), margin, 448.0)
        h_fp8 = cast_to_fp8(h, h_scale[ex.ids][:, None], E4M3)
        w_fp8, w_scale, w_amax = _cast_weight(weight, ex, newest, stored, margin)
        h_inv, w_inv = h_scale.reciprocal(), w_scale.reciprocal()
        y = rows_mm(h_fp8, w_fp8, h_inv, w_inv, ex.offs, h.dtype, backend, False)
        if bias is not None:  # (as transformers' `out.add_(bias[ids])`: rounded once)
            y = (y + bias[ex.ids]).to(y.dtype)
        send = exchange_scaled_rows if scaled else exchange_rows
        out = send(y[ex.from_experts], ex.recv, ex.send, ex.group)
        return out, _spread(h_amax, ex), h_fp8, w_fp8, h_inv, w_inv, w_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, weight, bias, newest, stored, ex, margin, backend, wire, _ = inputs
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(*output[1:], newest, stored)
        ctx.ex, ctx.margin, ctx.backend, ctx.wire = ex, margin, backend, wire
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out, *_):
        h_observed, h_fp8, w_fp8, h_inv, w_inv, w_amax, newest, stored = ctx.saved_tensors
        ex, (h_dtype, w_dtype, b_dtype) = ctx.ex, ctx.dtypes
        with no_autocast(grad_out):
            g_fp8, g_scale, g_observed, g_hp = _receive(
                grad_out, ex, newest, stored, ctx.margin, 2, ctx.wire, True
            )
            g_inv = g_scale.reciprocal()
            grads = [rows_mm(g_fp8, w_fp8, g_inv, w_inv, ex.offs, h_dtype, ctx.backend, True)]
            grads.append(weight_mm(g_fp8, h_fp8, g_inv, h_inv, ex.offs, w_dtype, ctx.backend))
            grads.append(None if b_dtype is None else _bias_grad(g_hp, ex, b_dtype))
            obs = (
                _observation(ex, h_observed, w_amax, g_observed)
                if ctx.needs_input_grad[3]
                else None
            )
            grads += [obs, None, None, None, None, None, None]
        return tuple(first_order_only(grads, h_observed))


def _bias_grad(g_hp, ex, dtype):
    """`(El, N)`: each local expert's sum of its gradient rows `g_hp` (`(M, N)` as received,
    high precision: a bias's experts are never on the combine backward's float8 wire), summed
    in expert-major row order as autograd sums the gradient of `bias[ids]` (`index_put_`,
    accumulate)."""
    zeros = g_hp.new_zeros(ex.local, g_hp.shape[1], dtype=dtype)
    return zeros.index_put_((ex.ids,), g_hp[ex.to_experts].to(dtype), accumulate=True)


def dispatch_grouped_mm(x, weight, newest, stored, ex, margin, backend, wire, scaled=False):
    """See the module docstring. x: `(S, K)` sorted by global expert (`ex.send_ids`); weight:
    `(El, N, K)`; newest, stored: float32 `(E, 3)` rows of the weight's experts, or None
    (current scaling; then `wire` must be all False); wire: E bools, the experts whose rows
    travel in float8 (the same on every rank); scaled: `grad_x` goes back as e4m3 rows with
    their own scales; returns `(M, N)` of x's dtype."""
    args = (x, weight, newest, stored, ex, margin, backend, wire, scaled)
    return _DispatchGroupedMM.apply(*args)[0]


def grouped_mm_combine(
    h, weight, newest, stored, ex, margin, backend, wire, scaled=False, bias=None
):
    """See the module docstring. h: `(M, K)` expert-major; weight: `(El, N, K)`; scaled: the
    output goes back as e4m3 rows with their own scales; bias: `(El, N)` added to each
    expert's rows before they go back (then `wire` must be all False: its gradient sums the
    high-precision output gradients), or None; returns `(S, N)` of h's dtype, the sender's
    rows in `ex.send_ids` order."""
    args = (h, weight, bias, newest, stored, ex, margin, backend, wire, scaled)
    return _GroupedMMCombine.apply(*args)[0]
