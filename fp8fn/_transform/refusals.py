"""The calls a forward makes that fp8fn cannot convert faithfully, refused with `fp8fn.`
errors by the router (`routing.Call`) and by `fn.apply`."""

from __future__ import annotations

import torch

from .._torch_errors import USE_CHECKPOINT_FN
from .._torch_private import inside_torch_checkpoint, refuse_fullgraph_trace, under_compile
from .forms import op_name


def refuse_unrouted_grouped_mm(plan, call, torch_grouped) -> None:
    """Raise when this forward used an experts weight that `init` saw in `torch._grouped_mm`
    (or `F.grouped_mm`; their paths: `torch_grouped`) but no GEMM of it reached fp8fn: under
    torch.compile, dynamo (torch 2.13) does not hand that call to a `TorchFunctionMode`, so it
    ran in high precision. (transformers' grouped_mm experts, compiled, call their own custom
    op, which dynamo hands over.) Under fullgraph the user sees this error at trace time;
    without it, when the frame runs."""
    watched, counts = call.tracked.touched & torch_grouped & plan.confirmed, call.counts()
    names = sorted(
        e.path
        for e in plan.experts
        if e.path in watched and not any(counts.get(e.expert(i)) for i in range(e.experts))
    )
    if names:
        message = (
            f"fp8fn.apply: expected the GEMMs of experts weights {names} routed to fp8fn, "
            "as in fn.init, got none: under torch.compile, dynamo does not hand "
            "torch._grouped_mm (F.grouped_mm) to fp8fn, so they ran in high precision. "
            "Call the experts as torch.bmm or a loop of F.linear(x, weight[e]), or run "
            "apply uncompiled."
        )
        if torch.compiler.is_compiling():
            refuse_fullgraph_trace(message)
        raise RuntimeError(message)


def refuse_call(api: str, layer, what: str):
    """Raise: `layer` is called in a way fp8fn does not convert (`what`)."""
    raise ValueError(
        f"fp8fn.{api}: layer {layer.path!r} {what} (fp8fn runs `x @ weight.T + bias`). "
        "Call it as `F.linear(x, weight, bias)` (HF Conv1D: `torch.addmm(bias, x, "
        "weight)`), or leave the layer in high precision with `filter_fn=lambda name, "
        f"module: name != {layer.path!r}`."
    )


def refuse_other_form(api: str, func, args, kwargs, layer_given) -> None:
    """Raise if a layer's weight (`layer_given(t)`: its layer, or None) is among the tensors of
    a linear call of a form that `forms.linear_operands` does not know: it would silently run
    in high precision."""
    for t in (*args, *kwargs.values()):
        layer = layer_given(t) if torch.is_tensor(t) else None
        if layer is not None:
            what = f"passes its weight to {op_name(func)} in a form fp8fn does not convert"
            refuse_call(api, layer, what)


def refuse_compiled_torch_checkpoint(module) -> None:
    """Raise under torch.compile (`under_compile`) for a model that `fn.init` saw run a float8
    GEMM inside its own torch.utils.checkpoint: dynamo traces a checkpointed body without
    fp8fn's routing, so it would run in high precision, unobserved (its sites' observations
    zeros), and its gradients differ, silently. (Eagerly, `refuse_torch_checkpoint` raises.)"""
    if under_compile(module):
        message = (
            "fp8fn.apply: the model runs torch.utils.checkpoint (fn.init saw a float8 layer "
            "inside it), and torch.compile traces a checkpointed part without fp8fn: it would "
            f"run in high precision and go unobserved, silently. {USE_CHECKPOINT_FN}"
        )
        if torch.compiler.is_compiling():
            refuse_fullgraph_trace(message)
        raise RuntimeError(message)


def refuse_torch_checkpoint(stop_at) -> None:
    """Raise if the model runs its own torch.utils.checkpoint (seen as gradients turned off, or
    saved-tensor hooks, inside a forward that records gradients), below the frame of the code
    `stop_at` (`Transformed.apply`'s): its recompute would run after `apply` has returned,
    with the module's own parameters and without fp8fn. (Only walks the frames in such a
    stretch: a part run under no_grad on purpose costs a few microseconds per op.)"""
    if inside_torch_checkpoint(stop_at):
        raise RuntimeError(
            "fp8fn.apply: the model runs torch.utils.checkpoint, whose recompute in the "
            "backward would run outside fp8fn.apply: with the module's own parameters and "
            f"without fp8fn's casts, so silently wrong gradients. {USE_CHECKPOINT_FN}"
        )
