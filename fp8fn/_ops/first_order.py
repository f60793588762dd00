"""Refusing a second derivative, the one way every fp8fn op does it.

A float8 op's backward casts with no scales of its own, and a sharded op's backward runs
collectives that are differentiated once: a gradient of such a gradient would be silently
wrong, so it raises. Two pieces:

* `BackwardOnly`: an autograd.Function whose own backward raises. The functions that run only
  inside backward passes (the sharded ops' collectives) subclass it and define `forward`.
* `first_order_only(grads, anchor, api=...)`: a backward's results, passed through an identity
  whose backward raises (naming `api`, what the user called) where an outer differentiation
  records that backward.
"""

from __future__ import annotations

import torch

from .._torch_private import tracked_by_outer_differentiation


def higher_order(api: str) -> str:
    """The refusal of a second derivative through a float8 linear that the user reached by
    `fp8fn.{api}` (`"linear"`, or `"apply: layer 'fc1'"` through `fn.apply`)."""
    return (
        f"fp8fn.{api}: higher-order derivatives through float8 casts are not defined (the "
        "backward's casts have no scales of their own). Differentiate fp8fn once; for a Hessian "
        "or gradient penalty, run that part in high precision (filter_fn, or a recipe of None)."
    )


def kept_api(api: str) -> str:
    """The `api` a float8 op keeps for its backward's refusal (`first_order_only`): `api`,
    or "linear" while dynamo traces. A compiled backward is never differentiated again (torch
    refuses first: "torch.compile with aot_autograd does not currently support double
    backward"), and a layer's name kept there is a constant of the graph that dynamo guards
    on: a frame the model calls once per layer would compile once per layer."""
    return "linear" if torch.compiler.is_compiling() else api


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


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on a backward's results; differentiating through them raises
    `RuntimeError(message)`.

    `anchor` (a differentiable output of the op's forward) ties the results to every outer
    differentiation that tracks the op's inputs, so grad-of-grad reaches this node.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(message, anchor, *grads):
        return grads

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def first_order_only(
    grads, *anchors: torch.Tensor, api: str = "linear", experts: bool = False
) -> tuple:
    """`grads` (a backward's results; None where not needed), made to raise when differentiated
    again where an outer differentiation records this backward (it tracks one of `anchors`: a
    float32 `()` output of the op's forward, or the saved inputs the backward differentiates);
    else `grads` as they are. `api`: what the user called (`higher_order(api)`); `experts`: the
    grouped ops' message (`HIGHER_ORDER_EXPERTS`)."""
    if torch.is_grad_enabled():
        for anchor in anchors:
            if anchor is not None and tracked_by_outer_differentiation(anchor):
                message = HIGHER_ORDER_EXPERTS if experts else higher_order(api)
                return _FirstOrderOnly.apply(message, anchor, *grads)
    return tuple(grads)
