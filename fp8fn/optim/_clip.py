"""`fp8fn.optim.clip_by_global_norm`: gradients scaled to a global L2 norm, a pure function."""

from __future__ import annotations

import torch

from .._torch_private import dtensor_local_or_none, tree_flatten, tree_unflatten
from ._layout import local_of, shard_like


def _norm(g: torch.Tensor) -> torch.Tensor:
    """The L2 norm of `g`'s global tensor: a DTensor's over all its shards (DTensor's norm
    reduces the shards' partial norms), a plain float32 `()` tensor."""
    norm = g.norm()
    return norm if dtensor_local_or_none(norm) is None else norm.full_tensor()


def clip_by_global_norm(grads, max_norm: float):
    """`grads` scaled by `min(1, max_norm / (norm + 1e-6))`, where `norm` is the L2 norm of all
    the leaves together (the norm of the leaves' norms); a new tree, nothing changed.

    DTensor leaves count with their whole global tensors, so every rank scales alike. A
    non-finite gradient makes the norm non-finite and the factor NaN: `adamw`'s update then
    skips the step (its rule for non-finite gradients).

    Args:
      grads: a pytree of float tensors (plain or DTensors).
      max_norm: the largest global norm let through, a float > 0.

    Returns:
      `(clipped, norm)`: the tree of `grads`' structure, and the global norm before clipping,
      float32 `()`.

    Example:
      >>> import torch, fp8fn
      >>> clipped, norm = fp8fn.optim.clip_by_global_norm({"w": torch.full((4,), 2.0)}, 1.0)
      >>> round(norm.item(), 4), round(clipped["w"][0].item(), 4)
      (4.0, 0.5)
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(
            f"fp8fn.optim.clip_by_global_norm: expected `max_norm` a float > 0, got {max_norm!r}."
        )
    leaves, spec = tree_flatten(grads)
    if not leaves or not all(isinstance(g, torch.Tensor) for g in leaves):
        raise TypeError(
            "fp8fn.optim.clip_by_global_norm: expected `grads` a pytree of tensors, got "
            f"{[type(g).__name__ for g in leaves]}."
        )
    norm = torch.linalg.vector_norm(torch.stack([_norm(g) for g in leaves]))
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return tree_unflatten([shard_like(local_of(g) * factor, g) for g in leaves], spec), norm
