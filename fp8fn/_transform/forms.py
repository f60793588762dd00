"""The forms of a linear call that fp8fn converts: `F.linear(x, weight, bias)` and HF Conv1D's
`torch.addmm(bias, x, weight)`, each argument given by position or by keyword; and the inputs of
`F.multi_head_attention_forward` as one forward pass gives them (`one_tensor_each`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._torch_private import is_fake, unwrapped

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


def _aliases(a, b) -> bool:
    """Whether the plain tensors `a` and `b` are the same elements of the same memory (so the
    same values) though not the same tensor object. False while torch.compile traces, and for
    tensors without memory (meta, fake)."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a is not b
        and not torch.compiler.is_compiling()
        and unwrapped(a) is a
        and unwrapped(b) is b
        and a.device.type != "meta"
        and not (is_fake(a) or is_fake(b))
        and (a.device, a.dtype, a.shape, a.stride()) == (b.device, b.dtype, b.shape, b.stride())
        and a.data_ptr() == b.data_ptr()
    )


def one_tensor_each(args: tuple) -> tuple:
    """`F.multi_head_attention_forward`'s positional `(query, key, value, ...)` with `key` made
    `query` and `value` made `key` where they alias it: torch projects `query is key` and `key
    is value` with fewer GEMMs of the packed `in_proj_weight` (one, or q and kv: sites
    `in_proj`, `#1`), and FSDP2 with gradients recorded hands each input of a wrapped module's
    forward over as a tensor of its own (a tensor given as key and value, not as query), so the
    attention would take another path (three GEMMs) than in `fn.init` (no gradients) and than
    one process."""
    if len(args) < 3:
        return args
    query, key, value = args[:3]
    if _aliases(query, key):
        key = query
    if _aliases(key, value):
        value = key
    return (query, key, value, *args[3:])
