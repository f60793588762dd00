"""`fn.init`'s one forward pass: the model run on the example inputs under a discovering `Call`,
on the meta device when it can, else for real without autograd."""

from __future__ import annotations

import torch

from .._core.error_origin import init_error
from .._parallel.dtensor import sharded_operands
from .._parallel.wrappers import reshard_fsdp
from .._torch_private import tree_map
from .plan import Plan
from .routing import Call
from .swap import exclusive, swapped_call


def discover(plan: Plan, args, kwargs, memo: dict) -> Call:
    """The `Call` of one forward pass of `plan.module` on the example inputs (its `sites`, in
    call order, and its `weights`); `memo` the `Transformed`'s (`plan.holder_of`)."""
    module = plan.module
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    memo_meta = {}

    def to_meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo_meta:  # tied tensors stay tied
            memo_meta[id(t)] = torch.empty_like(t, device="meta")
        return memo_meta[id(t)]

    with torch.random.fork_rng(devices=[]):  # discovery must not consume the RNG
        # Sharded (DTensor) parameters: FSDP2's lazy init would adopt meta tensors as its
        # shards, so such a model runs for real (FSDP2 all-gathers: every rank calls init).
        if not any(sharded_operands(t) for t in tensors.values()):
            try:
                meta = {k: to_meta(v) for k, v in tensors.items()}
                return _run(plan, meta, tree_map(to_meta, (args, kwargs)), memo)
            except Exception:  # data-dependent control flow, or an op without a meta kernel
                pass
        try:
            call = _run(plan, {}, (args, kwargs), memo)
        except Exception as e:
            if str(e).startswith("fp8fn."):  # fp8fn refuses a call of the model's
                raise
            raise init_error(e) from e
    if any(p is not tensors[n] for n, p in module.named_parameters()):
        reshard_fsdp(module)  # FSDP2 keeps the root unsharded after a forward
    return call


def _run(plan: Plan, tensors, args_kwargs, memo) -> Call:
    args, kwargs = args_kwargs
    tensors = plan.slots.expand(tensors, "init")
    call = Call(plan, tensors, None, memo)
    with torch.no_grad(), plan.fsdp.scales(None), exclusive(plan.module), call:
        with call.tracked.marking():  # (entered after `call`: its marks cleared before)
            swapped_call(plan.module, None, tensors, args, kwargs)
    return call
