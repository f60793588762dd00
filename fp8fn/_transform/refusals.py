"""The calls a forward makes that fp8fn cannot convert faithfully, refused with `fp8fn.`
errors by the router (`routing.Call`) and by `fn.apply`."""

from __future__ import annotations

import torch

from .._torch_private import refuse_fullgraph_trace


def refuse_unrouted_grouped_mm(plan, call, torch_grouped) -> None:
    """Raise when this forward used an experts weight that `init` saw in `torch._grouped_mm`
    (or `F.grouped_mm`; their paths: `torch_grouped`) but no GEMM of it reached fp8fn: under
    torch.compile, dynamo (torch 2.13) does not hand that call to a `TorchFunctionMode`, so it
    ran in high precision. (transformers' grouped_mm experts, compiled, call their own custom
    op, which dynamo hands over.) Under fullgraph the user sees this error at trace time;
    without it, when the frame runs."""
    watched = call.touched & torch_grouped & plan.confirmed
    names = sorted(
        e.path
        for e in plan.experts
        if e.path in watched and not any(call.counts.get(e.expert(i)) for i in range(e.experts))
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
