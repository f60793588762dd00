"""The forms of a linear call that fp8fn converts: `F.linear(x, weight, bias)` and HF Conv1D's
`torch.addmm(bias, x, weight)`, each argument given by position or by keyword."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A layer's weight split into pieces (nn.MultiheadAttention's packed in_proj, into q, k, v).
SPLITS = (torch.Tensor.split, torch.Tensor.chunk)
LINEARS = (F.linear, torch.addmm, torch.Tensor.addmm)

_LINEAR_ARGS = ("input", "weight", "bias")  # F.linear(input, weight, bias=None)
_ADDMM_ARGS = ("input", "mat1", "mat2")  # torch.addmm(input, mat1, mat2, *, beta, alpha, out)


def _bind(args, kwargs, names, required, keywords=()) -> dict | None:
    """`{name: value}` of a call's arguments, each by position or by keyword, or None when the
    call does not fit (torch then raises its own error, or it is another overload)."""
    if len(args) > len(names) or kwargs.keys() - {*names, *keywords}:
        return None
    bound = dict(zip(names, args))
    if bound.keys() & kwargs.keys():
        return None
    bound.update(kwargs)
    return bound if all(n in bound for n in required) else None


def linear_operands(func, args, kwargs):
    """`(x, weight, bias, transposed, options)` of an `F.linear` call (`bias` None when not
    given), or of `torch.addmm(bias, x, weight)` (HF Conv1D; also as `bias.addmm(x, weight)`),
    each argument given by position or by keyword; `options` (`{name: shown value}`) the
    addmm keywords other than their defaults (`beta`, `alpha`, `out`), which fp8fn does not
    convert. None for a call of another form."""
    if func is F.linear:
        bound = _bind(args, kwargs, _LINEAR_ARGS, _LINEAR_ARGS[:2])
        if bound is None:
            return None
        return bound["input"], bound["weight"], bound.get("bias"), False, {}
    bound = _bind(args, kwargs, _ADDMM_ARGS, _ADDMM_ARGS, ("beta", "alpha", "out"))
    if bound is None:
        return None
    options = {k: repr(bound[k]) for k in ("beta", "alpha") if bound.get(k, 1) != 1}
    if bound.get("out") is not None:
        options["out"] = "a tensor"
    return bound["mat1"], bound["mat2"], bound["input"], True, options


def op_name(func) -> str:
    """How an error names the op `func` (`F.linear`, `torch.addmm`, ...)."""
    return f"torch.{func.__name__}" if func is not F.linear else "F.linear"
