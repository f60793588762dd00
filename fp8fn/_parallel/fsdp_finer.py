"""Float8 all-gather under FSDP2 for the finer recipes (`RowwiseScaling`, `BlockwiseScaling`,
`MXScaling`): one weight plane per phase, cast shard by shard with the whole weight's scales.

A linear weight `(n, k)` under a finer recipe is read by two GEMMs, each quantizing it along its
own contraction dim (`_numerics/planes.py`): the output GEMM along k (rowwise: a scale per row;
MX: per 1 x 32 block), the grad_input GEMM along n (rowwise: per column; MX: per 32 x 1 block);
blockwise's 128 x 128 blocks serve both. FSDP2 shards dim 0 (n). The pieces:

* `FinerScales`: the statistics of every group of both planes of one weight, the same on every
  rank. `finer_scales` makes them for all of a step's finer weights with ONE all-gather per
  device mesh, of the statistics of each rank's pieces of the groups its rows touch (a uint8
  code per group, float32 amaxes for blockwise); each group's is the max over its pieces.
  Statistics travel there rather than in FSDP2's all-gather for three reasons: FSDP2 requires
  every all-gather input of an unevenly sharded weight to have the padded shard's shape (no
  room for scales); rowwise's grad_input plane has a group per column spanning every rank; and
  a shard cut may split an MX or blockwise group (a cut is at `r * ceil(n / ranks)` rows).
* FSDP2's all-gather (`Float8ShardWeight.fsdp_pre_all_gather`) carries the e4m3 bytes alone,
  one input of the padded shard's shape: in the forward the output GEMM's plane, in the
  backward re-gather (after `reshard_after_forward`, outside `fn.apply`) the grad_input GEMM's
  (blockwise: the one plane again).
* `FinerGatheredWeight`: FSDP2's unsharded parameter, a tensor of the weight's dtype and shape
  holding the gathered bytes of one plane. The op (`_ops/block_scaled.py`) takes the operand of
  the plane its GEMM reads from it (`fp8fn_finer_operand`); where it holds the other plane (a
  module FSDP2 does not reshard after forward, such as the root; an evaluation forward between
  a forward and its backward; a recompute in the backward) the op casts this rank's shard to the
  plane it needs and all-gathers it itself (one all-gather per GEMM that needs it).
"""

from __future__ import annotations

import dataclasses

import torch

from .._numerics import planes
from .._numerics.fp8 import (
    E4M3,
    ceil_div,
    dequantize_blocks,
    dequantize_mx,
    dequantize_scaled,
)
from .._torch_private import (
    disabled_torch_function,
    make_wrapper_subclass,
    op_mutates,
    tree_map_only,
)
from .dtensor import _all_gather_rows, _AllGather

_aten = torch.ops.aten
_VIEWS = {_aten.alias.default, _aten.as_strided.default, _aten.detach.default, _aten.view.default}


@dataclasses.dataclass(frozen=True, eq=False)
class FinerScales:
    """The scales of one finer-recipe weight `(n, k)` for one step: `recipe`, `shape` `(n, k)`
    and `grids`, `{Plane: statistics (gn, gk)}` for the planes of its two GEMMs (one for
    blockwise), the same on every rank (`finer_scales`)."""

    recipe: object
    shape: tuple
    grids: dict

    def plane(self, gemm: int) -> planes.Plane:
        """The plane of the output (`gemm` 0) or grad_input (`gemm` 1) GEMM."""
        return planes.plane_of(self.recipe, gemm)


def _layout(plane, n: int, k: int, world: int):
    """`[(first row, rows, group rows touched)]` per rank of FSDP2's dim-0 shards of `(n, k)`."""
    chunk = ceil_div(n, world)
    out = []
    for r in range(world):
        first = min(r * chunk, n)
        rows = max(0, min(n, first + chunk) - first)
        g0, g1 = planes.touched(plane, first, rows, n, k)
        out.append((first, rows, g1 - g0))
    return out


def _to_bytes(stats: torch.Tensor, count: int) -> torch.Tensor:
    """`stats` `(c, gk)` padded to `count` rows, as flat uint8 padded to a multiple of 4 bytes
    (so each part of the wire can be viewed as float32 again)."""
    stats = torch.cat([stats, stats.new_zeros(count - len(stats), stats.shape[1])])
    flat = stats.contiguous().view(torch.uint8).reshape(-1)
    return torch.cat([flat, flat.new_zeros(-len(flat) % 4)])


def finer_scales(entries, discovering: bool = False) -> dict:
    """`{(module, attr): FinerScales}` for one step's finer-recipe weights.

    Args:
      entries: `(module, attr, recipe)` per weight all-gathered in float8 under a finer recipe;
        `getattr(module, attr)` is its FSDP2-sharded parameter (a DTensor over a 1-D mesh).
      discovering: `fn.init`'s pass: each rank's own pieces only, no collective (the results
        are not used; the shapes are those of a step's).

    One all-gather per device mesh, of every rank's pieces' statistics of both planes of every
    weight (padded to the most pieces any rank has); no host read. Where no group spans two
    ranks and each rank's groups start at a multiple of that count (rowwise and MX rows,
    aligned cuts), a weight's grid is the gathered statistics reshaped (one op); else each
    rank's pieces are placed in turn and max-combined.
    """
    from .fsdp_gather import shard_of  # (the module that imports this one)

    parts: dict = {}  # group -> [(key, plane, layout, (n, k), own bytes)]
    grids: dict = {}  # key -> {plane: statistics}
    with torch.no_grad():
        for module, attr, recipe in entries:
            weight = getattr(module, attr)
            mesh, (n, k) = weight.device_mesh, tuple(weight.shape)
            world, rank = mesh.size(), mesh.get_local_rank()
            shard = shard_of(weight)._tensor
            grids[(module, attr)] = {}
            for plane in dict.fromkeys(planes.plane_of(recipe, g) for g in (0, 1)):
                layout = _layout(plane, n, k, world)
                first = layout[rank][0]
                own = planes.piece_stats(plane, shard, first, n)
                if discovering or world == 1:
                    grids[(module, attr)][plane] = planes.assemble(plane, [(first, own)], n, k)
                    continue
                count = max(c for _, _, c in layout)
                item = ((module, attr), plane, layout, (n, k), _to_bytes(own, count))
                parts.setdefault(mesh.get_group(), []).append(item)
        for group, items in parts.items():
            local = torch.cat([b for *_, b in items])
            world = len(items[0][2])
            wire = _all_gather_rows(local.unsqueeze(0), group, world)  # (world, bytes)
            offset = 0
            for key, plane, layout, (n, k), own in items:
                (gn, gk), bn = plane.grid(n, k), plane.groups(n, k)[0]
                count = max(c for _, _, c in layout)
                raw = wire[:, offset : offset + count * gk * plane.stat_dtype.itemsize]
                offset += len(own)
                stats = raw.view(plane.stat_dtype).reshape(world, count, gk)
                if all(f // bn == r * count for r, (f, _, c) in enumerate(layout) if c):
                    if sum(c for _, _, c in layout) == gn:  # each rank's groups its own, in order
                        grids[key][plane] = stats.reshape(world * count, gk)[:gn]
                        continue
                pieces = [(f, stats[r, :c]) for r, (f, _, c) in enumerate(layout)]
                grids[key][plane] = planes.assemble(plane, pieces, n, k)
    return {
        (module, attr): FinerScales(
            recipe, tuple(getattr(module, attr).shape), grids[(module, attr)]
        )
        for module, attr, recipe in entries
    }


def _cast_shard(plan: FinerScales, plane, shard: torch.Tensor, first: int) -> torch.Tensor:
    """This rank's rows of `plane` (e4m3), cast with the whole weight's statistics."""
    return planes.cast_rows(plane, shard, first, plan.shape[0], plan.grids[plane])


def pre_all_gather(shard, plan: FinerScales, mesh, backward: bool):
    """FSDP2's all-gather input for a finer weight: this rank's e4m3 rows of the output GEMM's
    plane (the grad_input GEMM's in the `backward` re-gather) as uint8, padded to the padded
    shard's rows; and the metadata `(plan, plane, source)`."""
    n = plan.shape[0]
    first = min(mesh.get_local_rank() * ceil_div(n, mesh.size()), n)
    plane = plan.plane(1 if backward else 0)
    fp8 = _cast_shard(plan, plane, shard._tensor, first).view(torch.uint8)
    rows = ceil_div(n, mesh.size())
    if fp8.shape[0] < rows:
        fp8 = torch.cat([fp8, fp8.new_zeros(rows - fp8.shape[0], *fp8.shape[1:])])
    return (fp8,), (plan, plane, (shard, mesh, first))


def post_all_gather(outputs, metadata, param_dtype, out=None):
    """The gathered weight: a new `FinerGatheredWeight`, or `out` refreshed in place."""
    plan, plane, source = metadata
    if out is not None:
        if not isinstance(out, FinerGatheredWeight):
            raise RuntimeError(
                f"fp8fn.float8_all_gather: {source[0]._path!r} was all-gathered for a "
                "per-tensor recipe first and now for a finer one: a float8-gathered weight "
                "keeps the kind of recipe of its first fn.apply or fn.init."
            )
        out._plan, out._plane, out._source = plan, plane, source
        return None
    data = outputs[0].view(E4M3)
    return FinerGatheredWeight(data, plan, plane, param_dtype, source), tuple(outputs)


class FinerGatheredWeight(torch.Tensor):
    """FSDP2's unsharded parameter for a finer-recipe `Float8ShardWeight`.

    To autograd and FSDP2 a tensor of the weight's shape `(n, k)` and high-precision dtype (so
    the weight gradient stays high precision); holds `_data`, the gathered e4m3 bytes `(n, k)`
    of `_plane` (a `planes.Plane`), `_plan` (the step's `FinerScales`) and `_source` (this
    rank's `Float8ShardWeight`, the mesh, its first row), refreshed by each FSDP2 all-gather.
    Views keep it; the finer op takes its planes through `fp8fn_finer_operand`; any other op
    sees the dequantized weight.
    """

    __torch_function__ = disabled_torch_function

    @staticmethod
    def __new__(cls, data, plan, plane, dtype, source):
        return make_wrapper_subclass(cls, data, dtype)

    def __init__(self, data, plan, plane, dtype, source):
        self._data, self._plan, self._plane, self._source = data, plan, plane, source

    def __repr__(self):
        return f"FinerGatheredWeight(shape={tuple(self.shape)}, plane={self._plane.kind!r})"

    def __tensor_flatten__(self):
        return ["_data"], (self._plan, self._plane, self.dtype, self._source)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        plan, plane, dtype, source = meta
        return FinerGatheredWeight(inner["_data"], plan, plane, dtype, source)

    def fp8fn_finer_operand(self, recipe, gemm: int) -> tuple:
        """The weight operand of the output (`gemm` 0) or grad_input (`gemm` 1) GEMM under
        `recipe` (`block_scaled`'s form): from the bytes FSDP2 gathered when they are that
        GEMM's plane, else from the shards cast to it and all-gathered now."""
        plane = planes.plane_of(recipe, gemm)
        if plane not in self._plan.grids:
            raise RuntimeError(
                f"fp8fn.float8_all_gather: {self._source[0]._path!r} was all-gathered for "
                f"{self._plan.recipe}, but runs under {recipe}. Run each float8-gathered "
                "weight under one finer recipe."
            )
        fp8 = self._data if plane == self._plane else self._gather(plane)
        return planes.operand(plane, fp8, self._plan.grids[plane])

    def _gather(self, plane) -> torch.Tensor:
        """`plane`'s e4m3 bytes of the whole weight, from this rank's shard cast and
        all-gathered (a collective: every rank's op asks for it at the same point)."""
        shard, mesh, first = self._source
        local = _cast_shard(self._plan, plane, shard._tensor, first)
        return _AllGather.apply(local, mesh.get_group(), self._plan.shape[0])

    def dequantize(self) -> torch.Tensor:
        """The weight the held plane stands for, in the weight's dtype `(n, k)`."""
        fp8, scale = planes.operand(self._plane, self._data, self._plan.grids[self._plane])
        recipe, kind = self._plane.recipe, self._plane.kind
        if kind == "blocks":
            values = dequantize_blocks(fp8, scale, recipe.block_size)
        elif hasattr(recipe, "scale_rounding"):  # MX
            values = dequantize_mx(fp8, scale, torch.float32, recipe.block_size)
            values = values.t() if kind == "columns" else values
        else:
            values = dequantize_scaled(fp8, scale)
        return values.to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:  # the weight's rows, unpadded (FSDP2's as_strided), a detach: kept
            src = args[0]
            data = func(src._data, *args[1:], **kwargs)
            if _leading_rows(data, src._data):
                return cls(data, src._plan, src._plane, src.dtype, src._source)
        if op_mutates(func):
            raise RuntimeError(
                f"fp8fn.float8_all_gather: the gathered float8 weight cannot be changed in "
                f"place ({func}). Change the sharded parameters (the optimizer does), not the "
                "unsharded ones."
            )
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def _leading_rows(view: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether `view` is the first rows of the 2-D `data` (all its columns, its layout)."""
    return (
        view.dim() == data.dim() == 2
        and view.shape[1] == data.shape[1]
        and view.shape[0] <= data.shape[0]
        and view.stride() == data.stride()
        and view.storage_offset() == data.storage_offset()
    )
