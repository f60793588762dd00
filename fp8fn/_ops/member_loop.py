"""A vmap rule for the grouped ops: one call of the op per member of the vmapped dimension.

A grouped op reads its group offsets on the host (each group's rows), and each member of a
vmap (an ensemble member, an example) routes its own tokens: no batched kernel serves them all.
So the rule runs the op once per member, on that member's slices, and stacks the results: each
member's numbers are those of the unbatched call, bit for bit (torch.func's own vmap of the
model gives each member its own call too).
"""

from __future__ import annotations

import torch

from .._torch_private import functorch_level, tracked_below
from .first_order import HIGHER_ORDER_EXPERTS, BackwardOnly, refuse

SHARED_STATE = (
    "fp8fn.apply: vmap over an experts weight's GEMM with an unbatched scaling state that is "
    "differentiated: the members would share one state and autograd would sum their "
    "observations. Give each member its own state (`fp8fn.stack_states`) and vmap over it too."
)


def vmap_per_member(function, state: int | None = None):
    """The `vmap` staticmethod of the autograd.Function `function`: `function.apply` per member.
    `state`: the position of the op's state rows (`newest`), refused when unbatched while
    differentiated and another input is batched (`SHARED_STATE`)."""

    def vmap(info, in_dims, *args):
        if state is not None and args[state] is not None and in_dims[state] is None:
            if tracked_below(args[state]) and any(d is not None for d in in_dims):
                raise ValueError(SHARED_STATE)
        outs = []
        for i in range(info.batch_size):
            member = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]
            outs.append(function.apply(*member))
        if not isinstance(outs[0], tuple):
            return torch.stack(outs), 0
        stacked = tuple(None if o[0] is None else torch.stack(o) for o in zip(*outs))
        return stacked, tuple(None if o is None else 0 for o in stacked)

    return staticmethod(vmap)


class _EachMember(BackwardOnly):
    """`fn(*tensors)`: the per-group GEMMs of a grouped op's backward, which vmap of grad runs
    on batched tensors (the backward of a vmapped forward): under vmap, once per member."""

    @staticmethod
    def forward(fn, *tensors):
        return fn(*tensors)

    backward = refuse(HIGHER_ORDER_EXPERTS)


_EachMember.vmap = vmap_per_member(_EachMember)


def each_member(fn, *tensors):
    """`fn(*tensors)` (a tuple of tensors and Nones), run once per member under vmap (outside
    torch.func's transforms a plain call: what torch.compile traces)."""
    if functorch_level() is None:
        return fn(*tensors)
    return _EachMember.apply(fn, *tensors)
