"""Where a parameter's local elements sit in its global tensor: the layout that block-scaled
moments are cut on.

Blocks are runs of `block` elements of the parameter's *global* row-major flat index, whatever
the mesh. A plain tensor is its own global tensor. A DTensor's local shard is either one
contiguous range of that index (every placement `Shard(0)` or `Replicate()`: FSDP2) or, when a
placement shards a later dim (`Shard(1)`, tensor parallel), a set of runs whose indices are
listed elementwise. A shard cut may fall inside a block: the block's amax is then the max over
the ranks that hold a part of it (`reduce_max`), so every rank scales the block alike.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from .._torch_private import (
    dtensor_local_offset,
    dtensor_local_or_none,
    dtensor_spec,
    make_dtensor,
    new_dtensor_spec,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The global shape of a parameter and where its local elements sit.

    `start` is the global flat index of the first local element when the local elements are the
    contiguous range `[start, start + local numel)`, else None (`global_index` lists them).
    `groups` are the process groups of the mesh's dims (empty for a plain tensor).
    """

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    start: int | None
    groups: tuple = ()

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def sharded(self) -> bool:
        return bool(self.groups)


def layout_of(p: torch.Tensor) -> Layout:
    """The `Layout` of `p` (a plain tensor or a DTensor)."""
    if dtensor_local_or_none(p) is None:
        shape = tuple(p.shape)
        return Layout(shape, shape, (0,) * len(shape), 0)
    spec = dtensor_spec(p)
    local_shape, offset = dtensor_local_offset(p)
    shape = tuple(spec.shape)
    rows_only = all(o == 0 for o in offset[1:]) and tuple(local_shape[1:]) == shape[1:]
    start = offset[0] * math.prod(shape[1:]) if rows_only and shape else (0 if rows_only else None)
    mesh = spec.mesh
    groups = tuple(mesh.get_group(i) for i in range(mesh.ndim))
    return Layout(shape, tuple(local_shape), tuple(offset), start, groups)


def global_index(layout: Layout, device) -> torch.Tensor:
    """int64 of `layout.local_shape`: each local element's global row-major flat index."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(layout.global_shape))):
        n, o = layout.local_shape[dim], layout.offset[dim]
        shape = [1] * len(layout.global_shape)
        shape[dim] = n
        index = index + (torch.arange(o, o + n, device=device) * stride).view(shape)
        stride *= layout.global_shape[dim]
    return index.expand(layout.local_shape)


def reduce_max(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The elementwise max of `t` over every rank of the layout's mesh (one all-reduce per mesh
    dim; a plain layout returns `t`). In place on `t`, which the caller made."""
    for group in layout.groups:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the plain tensor `t` itself."""
    local = dtensor_local_or_none(t)
    return t if local is None else local


def shard_like(local: torch.Tensor, param: torch.Tensor, dtype=None) -> torch.Tensor:
    """`local` as `param` holds its shard: a DTensor of `param`'s placements, or itself."""
    if dtensor_local_or_none(param) is None:
        return local
    spec = dtensor_spec(param)
    new = new_dtensor_spec(spec.mesh, spec.placements, spec.shape, dtype or local.dtype)
    return make_dtensor(local, new)
