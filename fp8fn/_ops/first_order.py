"""Refusing a second derivative, the one way every fp8fn op does it.

A float8 op's backward casts with no scales of its own, and a sharded op's backward runs
collectives that are differentiated once: a gradient of such a gradient would be silently
wrong, so it raises. Two pieces:

* `BackwardOnly`: an autograd.Function whose own backward raises. The functions that run only
  inside backward passes (the sharded ops' collectives) subclass it and define `forward`.
* `first_order_only(grads, anchor)`: a backward's results, passed through a `BackwardOnly`
  identity where an outer differentiation records that backward.
"""

from __future__ import annotations

import torch

from .._torch_private import tracked_by_outer_differentiation

HIGHER_ORDER = (
    "fp8fn.linear: higher-order derivatives through float8 casts are not defined (the backward's "
    "casts have no scales of their own). Differentiate fp8fn once; for a Hessian or "
    "gradient penalty, run that part in high precision (filter_fn, or a recipe of None)."
)
HIGHER_ORDER_EXPERTS = (
    "fp8fn.apply: higher-order derivatives through an experts weight's float8 GEMMs are not "
    "defined (the backward's casts have no scales of their own). Differentiate fp8fn once; "
    "for a Hessian or gradient penalty, run the experts in high precision (filter_fn, or a "
    "recipe of None for the experts weight)."
)
HIGHER_ORDER_SHARDED = (
    "fp8fn.apply: higher-order derivatives over sharded (DTensor) parameters are not "
    "supported: the gradient's collectives are differentiated once. Differentiate once, or "
    "take the higher-order part with whole parameters."
)


def refuse(message: str):
    """A Function's `backward` that raises `RuntimeError(message)`."""

    def backward(ctx, *grads):
        raise RuntimeError(message)

    return staticmethod(backward)


class BackwardOnly(torch.autograd.Function):
    """A Function run inside backward passes: differentiating it raises `HIGHER_ORDER_SHARDED`
    (subclasses define `forward`; `backward = refuse(...)` names another refusal)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = refuse(HIGHER_ORDER_SHARDED)


class _FirstOrderOnly(BackwardOnly):
    """Identity on a backward's results; differentiating through them raises `HIGHER_ORDER`.

    `anchor` (a differentiable output of the op's forward) ties the results to every outer
    differentiation that tracks the op's inputs, so grad-of-grad reaches this node.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(anchor, *grads):
        return grads

    backward = refuse(HIGHER_ORDER)


class _FirstOrderOnlyExperts(_FirstOrderOnly):
    """`_FirstOrderOnly` of the grouped ops (experts weights): raises `HIGHER_ORDER_EXPERTS`."""

    backward = refuse(HIGHER_ORDER_EXPERTS)


def first_order_only(grads, *anchors: torch.Tensor, experts: bool = False) -> tuple:
    """`grads` (a backward's results; None where not needed), made to raise when differentiated
    again where an outer differentiation records this backward (it tracks one of `anchors`: a
    float32 `()` output of the op's forward, or the saved inputs the backward differentiates);
    else `grads` as they are. `experts`: the grouped ops' message (`HIGHER_ORDER_EXPERTS`)."""
    if torch.is_grad_enabled():
        for anchor in anchors:
            if anchor is not None and tracked_by_outer_differentiation(anchor):
                function = _FirstOrderOnlyExperts if experts else _FirstOrderOnly
                return function.apply(anchor, *grads)
    return tuple(grads)
