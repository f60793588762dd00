"""The parts the per-tensor-scaled float8 ops are built from, shared by the dense op
(`tensorwise._Fp8LinearOp`) and the grouped one (`grouped._Fp8GroupedMM`): the scales of the
three roles (input, weight, grad_output) from a site's state rows, the backward's grad_output
cast, the observation `[x_amax, w_amax, g_amax]` that is the op's gradient with respect to
those rows, and what `setup_context` keeps for the backward.

Each works per tensor (float32 `()` amaxes, state rows `(3,)`: the dense op) and per expert
(float32 `(E,)` amaxes, state rows `(E, 3)`: the grouped op, whose rows `ids` say which
expert each row of a `(T, ...)` operand belongs to, E for rows past the last group).
"""

from __future__ import annotations

import torch

from .._numerics.fp8 import E5M2, cast_to_fp8, scale_from_amax


def scales_for(amaxes, newest, stored, margin: int, fp8_max: float):
    """The scales the casts use, float32 of `amaxes`'s shape: `stored` where the history is
    non-empty (`newest > 0`), else current scaling from `amaxes`; current scaling when
    stateless (`newest` None). (A role whose history is known filled, `State.filled`, casts
    with `stored` alone and never comes here: its amax is taken by `_after_gemm`.)"""
    current = scale_from_amax(amaxes, fp8_max, margin)
    return current if newest is None else torch.where(newest > 0, stored, current)


def per_row(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A per-expert float32 `(E,)` (a scale, its reciprocal) spread over the rows: `(T,)`,
    row `r` gets `values[ids[r]]`, a row past the last group (id E) 1."""
    return torch.cat([values, values.new_ones(1)])[ids]


def cast_grad_output(grad_out, g_amax, newest, stored, margin: int, ids=None):
    """The backward's e5m2 cast of `grad_out` `(m, n)` with the grad_output role's scale.

    Args:
      grad_out: `(m, n)` high precision. g_amax: float32 `()`, or `(E,)` per expert (with
        `ids`): the amax a current scale is taken from. newest, stored: the state rows,
        float32 `(3,)` or `(E, 3)`, or None (current scaling). margin: the recipe's.
      ids: None (one scale), or int64 `(m,)` the expert of each row (`per_row`).

    Returns:
      `(g_fp8, g_inv)`: e5m2 `(m, n)`, and float32 of `g_amax`'s shape, the reciprocals of
      the scales used.
    """
    g_newest = None if newest is None else newest[..., 2]
    g_stored = None if stored is None else stored[..., 2]
    g_scale = scales_for(g_amax, g_newest, g_stored, margin, 57344.0)
    rows = g_scale if ids is None else per_row(g_scale, ids)[:, None]
    return cast_to_fp8(grad_out, rows, E5M2), g_scale.reciprocal()


def observation(x_amax, w_amax, g_amax):
    """`[x_amax, w_amax, g_amax]` along a last dim: float32 `(3,)` from `()` amaxes, `(E, 3)`
    from `(E,)` ones. Compiled, one pointwise kernel selects the entries (a stack is a copy
    kernel per entry); eager, a stack (one kernel)."""
    if torch.compiler.is_compiling():
        role = torch.arange(3, device=g_amax.device)
        x_amax, w_amax, g_amax = (a[..., None] for a in (x_amax, w_amax, g_amax))
        return torch.where(role == 0, x_amax, torch.where(role == 1, w_amax, g_amax))
    return torch.stack([x_amax, w_amax, g_amax], -1)


def keep_for_backward(ctx, output: tuple, *inputs) -> None:
    """What both ops' `setup_context` keeps. `output` is `(result, *residuals, x_amax)`: the
    residuals are non-differentiable, `x_amax` stays differentiable (the anchor of
    `first_order_only`, which reaches the backward's results through it), no zeros are made
    for the residuals' absent gradients, and `(*residuals, x_amax, *inputs)` are saved."""
    ctx.mark_non_differentiable(*output[1:-1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[1:], *inputs)
