"""Argument checks and guards shared by the fp8 ops."""

from __future__ import annotations

import torch

from .._torch_private import functorch_level

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class no_autocast:
    """Disable autocast on the device of `t` while inside (a no-op when it is off)."""

    def __init__(self, t: torch.Tensor):
        self.device = t.device.type
        self.ctx = (
            torch.autocast(self.device, enabled=False)
            if torch.is_autocast_enabled(self.device)
            else None
        )

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def refuse_compile_under_func(api: str) -> None:
    """Refuse to let dynamo trace an fp8fn op inside a torch.func transform.

    There it would drop the custom backward (pytorch#193279). Outside transforms dynamo folds
    `maybe_current_level()` to None, so this check leaves nothing in the graph; inside one it
    returns the level (an int), on which dynamo breaks the graph: `fullgraph=True` then fails,
    and otherwise the frame runs eagerly, which is correct.
    """
    if torch.compiler.is_compiling() and functorch_level() is not None:
        raise RuntimeError(
            f"fp8fn.{api}: torch.compile cannot trace fp8fn.linear inside a torch.func "
            "transform (grad, vjp, vmap): it would drop fp8fn's backward and return wrong "
            "gradients and observations (pytorch#193279). Use fp8fn.value_and_grad, or compile "
            "with plain autograd (loss.backward() or torch.autograd.grad), or leave fullgraph "
            "off so that this part runs eagerly."
        )


def check_operands(api: str, x, weight, bias) -> None:
    """Raise a clear error unless x `(..., k)`, weight `(n, k)`, bias `(n,)` or None fit."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fp8fn.{api}: expected `{name}` to be a tensor, got {type(t).__name__}."
            )
        if t.dtype not in HP_DTYPES:
            raise TypeError(
                f"fp8fn.{api}: expected `{name}` in float32, bfloat16 or float16, got {t.dtype}."
            )
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8fn.{api}: expected `x` of shape (..., in_features) and `weight` of shape "
            f"(out_features, in_features), got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"fp8fn.{api}: expected `bias` of shape ({weight.shape[0]},), got {tuple(bias.shape)}."
        )
