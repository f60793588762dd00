"""The parts the per-tensor-scaled float8 ops are built from, shared by the dense op
(`tensorwise._Fp8LinearOp`) and the grouped one (`grouped._Fp8GroupedMM`): the scales of the
three roles (input, weight, grad_output) from a site's state rows, and the observation
`[x_amax, w_amax, g_amax]` that is the op's gradient with respect to those rows.
"""

from __future__ import annotations

import torch

from .._numerics.fp8 import scale_from_amax


def scales_for(amaxes, newest, stored, margin: int, fp8_max: float):
    """The scales the casts use, float32 of `amaxes`'s shape: `stored` where the history is
    non-empty (`newest > 0`), else current scaling from `amaxes`; current scaling when
    stateless (`newest` None). (A role whose history is known filled, `State.filled`, casts
    with `stored` alone and never comes here: its amax is taken by `_after_gemm`.)"""
    current = scale_from_amax(amaxes, fp8_max, margin)
    return current if newest is None else torch.where(newest > 0, stored, current)


def observation(x_amax, w_amax, g_amax):
    """`[x_amax, w_amax, g_amax]`, float32 `(3,)`. Compiled, one pointwise kernel selects the
    entries (a stack is a copy kernel per entry); eager, a stack (one kernel)."""
    if torch.compiler.is_compiling():
        role = torch.arange(3, device=g_amax.device)
        return torch.where(role == 0, x_amax, torch.where(role == 1, w_amax, g_amax))
    return torch.stack([x_amax, w_amax, g_amax])
