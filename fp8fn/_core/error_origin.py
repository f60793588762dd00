"""Whose error it is: fp8fn's own, or the model's (what `fn.init` tells the user).

`fn.init` runs the model's forward on the example inputs; when that raises, the error is the
inputs' (the model's) unless fp8fn's own code raised it, which this module decides from the
traceback (`raised_by_fp8fn`), then words (`init_error`).
"""

from __future__ import annotations

import pathlib
import sys
import sysconfig
import traceback

import torch

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
