"""Argument checks and guards shared by the fp8 ops and the transform (whose error an exception
is: `error_origin.py`)."""

from __future__ import annotations

import inspect

import torch

from .._torch_private import refuse_fullgraph_trace, traced_functorch_level

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_function(api: str, arg: str, f, parameters: tuple[str, ...], returns: str) -> None:
    """Refuse `f` unless it is callable with the positional arguments `parameters` (their
    names), before anything calls it; `returns` says what it must return, for the message."""
    wanted = f"a function ({', '.join(parameters)}) -> {returns}"
    if not callable(f) or isinstance(f, type):
        raise TypeError(
            f"fp8fn.{api}: expected `{arg}` to be {wanted}, got {type(f).__name__}"
            f"{' ' + f.__name__ if isinstance(f, type) else ''}. Pass e.g. "
            f"`{arg}=lambda {', '.join(parameters)}: ...`."
        )
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):  # no signature to read (some builtins): left to the call
        return
    try:
        signature.bind(*parameters)
    except TypeError as e:
        name = getattr(f, "__qualname__", type(f).__name__)
        raise TypeError(
            f"fp8fn.{api}: expected `{arg}` to be {wanted}, got {name}{signature}, which cannot "
            f"be called with {len(parameters)} positional arguments ({e}). Give it the "
            f"parameters ({', '.join(parameters)})."
        ) from None


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

    There it would drop the custom backward (pytorch#193279). Outside transforms the level is
    None and this check leaves nothing in the graph. Inside one, with `fullgraph=True`, the
    error is raised at trace time, past dynamo (`refuse_fullgraph_trace`: the user sees this
    `RuntimeError`, not dynamo's `Unsupported`); without it dynamo traces the `raise`, breaks
    the graph and runs the frame eagerly, which is correct.
    """
    if torch.compiler.is_compiling() and traced_functorch_level() is not None:
        message = (
            f"fp8fn.{api}: torch.compile cannot trace fp8fn's float8 ops inside a torch.func "
            "transform (grad, vjp, vmap): it would drop fp8fn's backward and return wrong "
            "gradients and observations (pytorch#193279). Use fp8fn.value_and_grad, or compile "
            "with plain autograd (loss.backward() or torch.autograd.grad), or leave fullgraph "
            "off so that this part runs eagerly."
        )
        refuse_fullgraph_trace(message)
        raise RuntimeError(message)


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


def check_dtypes(api: str, x, weight, bias) -> None:
    """Outside autocast, raise unless `x`, `weight` and `bias` share a dtype, as a module's
    `F.linear` does ("mat1 and mat2 must have the same dtype"): a model that runs under fp8fn
    must not fail once fp8fn is off. Under autocast the op casts them itself. (The primitive
    `fp8fn.linear` takes mixed dtypes: its output has the dtype of `x`.)"""
    if torch.is_autocast_enabled(x.device.type):
        return
    dtypes = {"x": x.dtype, "weight": weight.dtype}
    if bias is not None:
        dtypes["bias"] = bias.dtype
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise TypeError(
            f"fp8fn.{api}: expected `x`, `weight` and `bias` of one dtype outside autocast, as "
            f"the layer without fp8fn (which raises 'mat1 and mat2 must have the same dtype'), "
            f"got {got}. Cast the input to the model's dtype (`x.to(dtype)`), or run "
            "under torch.autocast."
        )
