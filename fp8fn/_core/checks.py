"""Argument checks and guards shared by the fp8 ops."""

from __future__ import annotations

import inspect
import pathlib
import sys
import sysconfig
import traceback

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


_PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # fp8fn/
_TORCH = pathlib.Path(torch.__file__).resolve().parent
_STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()
_SITE = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}


def forwards_the_model(module_globals: dict) -> bool:
    """Whether the module of `module_globals`, or its package, says `FORWARDS_THE_MODEL = True`."""
    package = sys.modules.get(module_globals.get("__package__") or "")
    return bool(
        module_globals.get("FORWARDS_THE_MODEL") or getattr(package, "FORWARDS_THE_MODEL", False)
    )


def raised_by_fp8fn(error: BaseException) -> traceback.FrameSummary | None:
    """The frame of fp8fn's own code that raised `error`, or None if the error is the model's.

    The error's origin is its innermost frame outside torch and the standard library (code that
    only forwards a call). It is fp8fn's when that frame is in the fp8fn package, outside the
    modules that run the user's module and forward its torch calls (an op that fails there
    failed on the model's data): those that say so with `FORWARDS_THE_MODEL = True`, in
    themselves or in their package (`_transform/__init__.py`, the demo's model).
    """
    walked = list(traceback.walk_tb(error.__traceback__))  # (frame, line)
    summaries = traceback.StackSummary.extract(walked)
    for (frame, _), summary in reversed(list(zip(walked, summaries, strict=True))):
        path = pathlib.Path(summary.filename).resolve()
        if path.is_relative_to(_PACKAGE):
            return None if forwards_the_model(frame.f_globals) else summary
        in_site = any(path.is_relative_to(p) for p in _SITE)
        if path.is_relative_to(_TORCH) or (path.is_relative_to(_STDLIB) and not in_site):
            continue
        return None
    return None


# The built-in errors a model raises on wrong inputs, which `fn.init` re-raises as they are.
_KEPT = (TypeError, ValueError, IndexError, AttributeError, NotImplementedError, RuntimeError)


def init_error(error: Exception) -> Exception:
    """The error `fn.init` raises when the model's forward on the example inputs raised `error`:
    it blames the inputs only when the error is not fp8fn's own (`raised_by_fp8fn`). The
    model's own error keeps its type when it is one of `_KEPT` (a `TypeError` stays a
    `TypeError`), else is a `RuntimeError`; fp8fn's is a `RuntimeError`."""
    what = f"{type(error).__name__}: {error}"
    frame = raised_by_fp8fn(error)
    if frame is None:
        return (type(error) if type(error) in _KEPT else RuntimeError)(
            f"fp8fn.init: the model raised on the example inputs ({what}). Call fn.init with "
            "inputs the model accepts."
        )
    where = f"{pathlib.Path(frame.filename).relative_to(_PACKAGE.parent)}:{frame.lineno}"
    return RuntimeError(
        f"fp8fn.init: fp8fn raised inside the model's forward ({what}, in {frame.name} at "
        f"{where}). This is an error in fp8fn, not in the example inputs: please report it "
        "with the traceback above."
    )
