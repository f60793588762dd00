"""Where a module holds a tensor, by the tensor's dotted name (`"layers.0.mlp.weight"`)."""

from __future__ import annotations

from torch import nn

from .._torch_private import module_buffers, module_parameters


def owner_of(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """`(module holding the tensor `name`, its attribute name)`."""
    path, _, attr = name.rpartition(".")
    return module.get_submodule(path), attr


def held(module: nn.Module, name: str):
    """The tensor (parameter, else buffer) that `module` holds under `name` now, or None: FSDP2
    swaps a weight's shard and its unsharded weight, `functional_call` the tensors it is given."""
    owner, attr = owner_of(module, name)
    tensor = module_parameters(owner).get(attr)
    return module_buffers(owner).get(attr) if tensor is None else tensor
