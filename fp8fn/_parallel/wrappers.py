"""The wrappers fp8fn must recognize around a user's module: FSDP2 (`fully_shard`) and DDP."""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist
from torch import nn

from .._torch_private import children_in_attributes


def is_fsdp_module(module) -> bool:
    """Whether `module` is an FSDP2 module (`fully_shard` was called on it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def reshard_fsdp(module) -> None:
    """Reshard every FSDP2 module in `module`: after a forward without backward (`fn.init`),
    FSDP2 leaves the root unsharded, and an optimizer made then would hold the unsharded
    tensors instead of the shards."""
    for m in module.modules():
        if is_fsdp_module(m):
            m.reshard()


def _is_ddp(module) -> bool:
    return isinstance(module, nn.parallel.DistributedDataParallel)


def ddp_parameter(module):
    """`(name, parameter)` of one parameter of a DDP `module` (to tell its own parameters from
    other tensors), or None when `module` is not DDP or has no parameter."""
    if not _is_ddp(module):
        return None
    return next(iter(module.named_parameters()), None)


def _ddp_owns(owner, modules: dict) -> bool:
    """Whether `owner` is a DDP whose `_modules` is `modules`, or the instance dict of one
    (Python 3.11 keeps an instance's attributes inline: the referrer is then its `__dict__`)."""
    if _is_ddp(owner):
        return children_in_attributes(owner.__dict__) is modules
    return (
        isinstance(owner, dict)
        and children_in_attributes(owner) is modules
        and any(_is_ddp(o) and o.__dict__ is owner for o in gc.get_referrers(owner))
    )


def refuse_ddp_inner_module(module) -> None:
    """Refuse the module inside a DistributedDataParallel: transforming it bypasses DDP's
    forward, and loss.backward() then leaves the gradients unaveraged (a documented trap)."""
    if not (dist.is_available() and dist.is_initialized()) or _is_ddp(module):
        return
    for holder in gc.get_referrers(module):  # DDP holds it in its `_modules` dict
        if isinstance(holder, dict) and any(_ddp_owns(o, holder) for o in gc.get_referrers(holder)):
            raise ValueError(
                "fp8fn.transform: `module` is the module inside a DistributedDataParallel, whose "
                "forward fp8fn would bypass, so loss.backward() would not average the gradients "
                "across ranks. Transform the DDP model itself: fp8fn.transform(ddp, recipe), "
                "with `params = dict(ddp.named_parameters())`."
            )
