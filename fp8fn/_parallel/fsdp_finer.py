"""Float8 all-gather under FSDP2 for the finer recipes (`RowwiseScaling`, `BlockwiseScaling`,
`MXScaling`): one weight plane per phase, cast shard by shard with the whole weight's scales.

A linear weight `(n, k)` under a finer recipe is read by two GEMMs, each quantizing it along its
own contraction dim (`_parallel/planes.py`): the output GEMM along k (rowwise: a scale per row;
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
* Experts weights `(E, a, b)`: each expert's planes its own (the grouped op quantizes each
  expert matrix alone), in the coordinates of the weight as stored: where the GEMMs read each
  expert transposed (`(E, K, N)`, `FinerScales.flipped`, seen at `fn.init`), the transposed
  planes (`planes.stored_plane`). FSDP2 shards the experts, so no group spans two ranks: each
  rank's experts' grids travel in the same one statistics all-gather, and the whole grid is
  the gathered rows reshaped.
* `FinerGatheredWeight`: FSDP2's unsharded parameter, a tensor of the weight's dtype and shape
  holding the gathered bytes of one plane. The op (`_ops/rowwise_blockwise_mx.py`) takes the
  operand of the plane its GEMM reads from it (`fp8fn_finer_operand`); where it holds the other
  plane (a module FSDP2 does not reshard after forward, such as the root; an evaluation forward
  between a forward and its backward; a recompute in the backward) the op casts this rank's shard
  to the plane it needs and all-gathers it itself (one all-gather per GEMM that needs it).
"""

from __future__ import annotations

import dataclasses

import torch

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
from . import planes
from .dtensor import AllGather, all_gather_rows

_aten = torch.ops.aten
_VIEWS = {_aten.alias.default, _aten.as_strided.default, _aten.detach.default, _aten.view.default}


@dataclasses.dataclass(frozen=True, eq=False)
class FinerScales:
    """The scales of one finer-recipe weight for one step: `recipe`, `shape` (`(n, k)`, or an
    experts weight's `(E, a, b)`), `grids`, `{Plane: statistics}` for the planes of its two
    GEMMs (one for blockwise), `(gn, gk)` (an experts weight: `(E, gn, gk)`, each expert's),
    the same on every rank (`finer_scales`), and `flipped`: whether the GEMMs read each expert
    matrix transposed (stored `(E, K, N)`; the planes are in the stored coordinates)."""

    recipe: object
    shape: tuple
    grids: dict
    flipped: bool = False

    def plane(self, gemm: int) -> planes.Plane:
        """The plane of the output (`gemm` 0) or grad_input (`gemm` 1) GEMM, stored
        coordinates."""
        return planes.stored_plane(self.recipe, gemm, self.flipped)


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
    rank's pieces are placed in turn and max-combined. An experts weight `(E, a, b)` (whole
    experts per rank) sends its experts' grids, in the planes of its stored coordinates
    (`Float8ShardWeight._flipped`); its `(E, gn, gk)` grid is the gathered rows reshaped.
    """
    from .fsdp_gather import shard_of  # (the module that imports this one)

    parts: dict = {}  # group -> [(key, plane, layout, shape, ranks, own bytes)]
    grids: dict = {}  # key -> {plane: statistics}
    flips: dict = {}  # key -> whether its GEMMs read it transposed (experts weights)
    with torch.no_grad():
        for module, attr, recipe in entries:
            weight = getattr(module, attr)
            mesh, shape = weight.device_mesh, tuple(weight.shape)
            world, rank = mesh.size(), mesh.get_local_rank()
            shard = shard_of(weight)
            flipped = bool(shard._flipped) if len(shape) == 3 else False
            shard, key = shard._tensor, (module, attr)
            grids[key], flips[key] = {}, flipped
            for plane in dict.fromkeys(planes.stored_plane(recipe, g, flipped) for g in (0, 1)):
                if len(shape) == 3:  # whole experts per rank: each expert's own grid
                    own = planes.expert_stats(plane, shard)
                    chunk = ceil_div(shape[0], world)
                    first = min(rank * chunk, shape[0])
                    if discovering or world == 1:
                        grid = own.new_zeros(shape[0], *own.shape[1:])
                        grid[first : first + len(own)] = own
                        grids[key][plane] = grid
                        continue
                    item = (key, plane, None, shape, world, _to_bytes(own.flatten(1), chunk))
                    parts.setdefault(mesh.get_group(), []).append(item)
                    continue
                n, k = shape
                layout = _layout(plane, n, k, world)
                first = layout[rank][0]
                own = planes.piece_stats(plane, shard, first, n)
                if discovering or world == 1:
                    grids[key][plane] = planes.assemble(plane, [(first, own)], n, k)
                    continue
                count = max(c for _, _, c in layout)
                item = (key, plane, layout, shape, world, _to_bytes(own, count))
                parts.setdefault(mesh.get_group(), []).append(item)
        for group, items in parts.items():
            local = torch.cat([b for *_, b in items])
            world = items[0][4]
            wire = all_gather_rows(local.unsqueeze(0), group, world)  # (world, bytes)
            offset = 0
            for key, plane, layout, shape, _, own in items:
                size = plane.stat_dtype.itemsize
                if layout is None:  # an experts weight: rank r's experts from r * chunk on
                    experts, (gn, gk) = shape[0], plane.grid(*shape[1:])
                    chunk = ceil_div(experts, world)
                    raw = wire[:, offset : offset + chunk * gn * gk * size]
                    offset += len(own)
                    stats = raw.contiguous().view(plane.stat_dtype)
                    grids[key][plane] = stats.reshape(world * chunk, gn, gk)[:experts]
                    continue
                (n, k), bn = shape, plane.groups(*shape)[0]
                (gn, gk) = plane.grid(n, k)
                count = max(c for _, _, c in layout)
                raw = wire[:, offset : offset + count * gk * size]
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
            recipe, tuple(getattr(module, attr).shape), grids[(module, attr)], flips[(module, attr)]
        )
        for module, attr, recipe in entries
    }


def _cast_shard(plan: FinerScales, plane, shard: torch.Tensor, first: int) -> torch.Tensor:
    """This rank's rows of `plane` (e4m3), cast with the whole weight's statistics (an experts
    weight: its experts `[first, first + len(shard))`, each with its own)."""
    grid = plan.grids[plane]
    if len(plan.shape) == 3:
        return planes.cast_experts(plane, shard, grid[first : first + len(shard)])
    return planes.cast_rows(plane, shard, first, plan.shape[0], grid)


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
        out._plan, out._plane, out._source, out._again = plan, plane, source, None
        return None
    data = outputs[0].view(E4M3)
    return FinerGatheredWeight(data, plan, plane, param_dtype, source), tuple(outputs)


class FinerGatheredWeight(torch.Tensor):
    """FSDP2's unsharded parameter for a finer-recipe `Float8ShardWeight`.

    To autograd and FSDP2 a tensor of the weight's shape (`(n, k)`, an experts weight's
    `(E, a, b)`) and high-precision dtype (so the weight gradient stays high precision); holds
    `_data`, the gathered e4m3 bytes of `_plane` (a `planes.Plane`; an experts weight: each
    expert's), `_plan` (the step's `FinerScales`) and `_source` (this rank's
    `Float8ShardWeight`, the mesh, its first row), refreshed by each FSDP2 all-gather. Views
    keep it; so do, on an experts weight, the selection of expert `e` (dim 0) and transposes of
    the last two dims, the forms in which the experts' forward passes reach it: such a derived
    weight keeps `_view`, `(the gathered weight FSDP2 refills, the expert or None, whether
    transposed)`, and reads the bytes and plan from that weight when used (so a derived weight
    saved for the backward sees FSDP2's re-gathered plane). The finer op takes its planes
    through `fp8fn_finer_operand`; any other op sees the dequantized weight.
    """

    __torch_function__ = disabled_torch_function

    @staticmethod
    def __new__(cls, data, plan, plane, dtype, source, view=None):
        return make_wrapper_subclass(cls, data, dtype)

    def __init__(self, data, plan, plane, dtype, source, view=None):
        self._data, self._plan, self._plane, self._source = data, plan, plane, source
        self._view = view
        self._again = None  # (plan, plane, bytes): `_gathered`'s, until FSDP2 refills

    def __repr__(self):
        return f"FinerGatheredWeight(shape={tuple(self.shape)}, plane={self._plane.kind!r})"

    def __tensor_flatten__(self):
        return ["_data"], (self._plan, self._plane, self.dtype, self._source, self._view)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FinerGatheredWeight(inner["_data"], *meta)

    def _root(self) -> tuple:
        """`(the gathered weight FSDP2 refills, expert or None, transposed)`."""
        return self._view or (self, None, False)

    def fp8fn_finer_operand(self, recipe, gemm: int) -> tuple:
        """The weight operand of the output (`gemm` 0) or grad_input (`gemm` 1) GEMM under
        `recipe` (`rowwise_blockwise_mx`'s form) of this weight as the GEMM reads it (`(n, k)`; an
        expert's, derived from an experts weight): from the bytes FSDP2 gathered when they are
        that GEMM's plane, else from the shards cast to it and all-gathered now."""
        root, expert, flipped = self._root()
        if root.dim() == 3 and expert is None:
            raise RuntimeError(  # (the grouped op reads each expert's matrix)
                "fp8fn.float8_all_gather: expected one expert of an experts weight, got all."
            )
        plane = planes.plane_of(recipe, gemm)
        stored = planes.swapped(plane) if flipped else plane
        if stored not in root._plan.grids or root.dim() == 3 and flipped != root._plan.flipped:
            raise RuntimeError(
                f"fp8fn.float8_all_gather: {root._source[0]._path!r} was all-gathered for "
                f"{root._plan.recipe} read {'transposed' if root._plan.flipped else 'as stored'}"
                f", but runs under {recipe} read {'transposed' if flipped else 'as stored'}. "
                "Run each float8-gathered weight under one finer recipe, in one orientation."
            )
        fp8 = root._data if stored == root._plane else root._gathered(stored)
        grid = root._plan.grids[stored]
        if expert is not None:
            fp8, grid = fp8[expert], grid[expert]
        if flipped:  # the plane of the transposed matrix: the same groups, transposed
            fp8, grid = fp8.t().contiguous(), grid.t().contiguous()
        return planes.operand(plane, fp8, grid)

    def _gathered(self, plane) -> torch.Tensor:
        """`plane`'s e4m3 bytes of the whole weight, from this rank's shard cast and
        all-gathered: a collective, once per weight and plane until FSDP2 refills the weight
        (transformers' eager experts loop asks once per expert with tokens, which differs
        between ranks; every rank asks once when each rank's tokens reach some expert, as the
        per-tensor `Float8GatheredWeight.gathered_again`)."""
        if self._again is None or self._again[:2] != (self._plan, plane):
            shard, mesh, first = self._source
            local = _cast_shard(self._plan, plane, shard._tensor, first)
            whole = AllGather.apply(local, mesh.get_group(), self._plan.shape[0])
            self._again = (self._plan, plane, whole)
        return self._again[2]

    def note_orientation(self) -> None:
        """`fn.init`: this weight (derived from an experts weight) is read by a GEMM as it is
        now, transposed or not: FSDP2's later all-gathers cast that GEMM's planes (kept on the
        shard, `Float8ShardWeight._flipped`). Raises when the same weight is read both ways."""
        root, _, flipped = self._root()
        shard = root._source[0]
        if root.dim() != 3:
            return
        if shard._flipped is not None and shard._flipped != flipped:
            raise RuntimeError(
                f"fp8fn.float8_all_gather: expected experts weight {shard._path!r} to be read "
                "by its GEMMs in one orientation under a finer recipe, got it read both as "
                "stored and transposed. Leave it out of float8_all_gather."
            )
        shard._flipped = flipped

    def dequantize(self) -> torch.Tensor:
        """The weight the held plane stands for, in the weight's dtype (a derived weight: its
        expert, transposed as it is)."""
        root, expert, flipped = self._root()
        plane, grid = root._plane, root._plan.grids[root._plane]
        if root.dim() == 3:
            values = torch.stack([_values(plane, f, g) for f, g in zip(root._data, grid)])
        else:
            values = _values(plane, root._data, grid)
        values = values if expert is None else values[expert]
        return (values.transpose(-2, -1) if flipped else values).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if func in _VIEWS:  # the weight's rows, unpadded (FSDP2's as_strided), a detach: kept
            data = func(src._data, *args[1:], **kwargs)
            if src._view is None and _leading_rows(data, src._data):
                return cls(data, src._plan, src._plane, src.dtype, src._source)
            if src._view is not None and data.shape == src.shape and data.stride() == src.stride():
                return cls(data, src._plan, src._plane, src.dtype, src._source, src._view)
        derived = _expert_view(cls, func, args, kwargs)
        if derived is not None:
            return derived
        if op_mutates(func):
            raise RuntimeError(
                f"fp8fn.float8_all_gather: the gathered float8 weight cannot be changed in "
                f"place ({func}). Change the sharded parameters (the optimizer does), not the "
                "unsharded ones."
            )
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def _values(plane, fp8: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """A matrix's plane `(n, k)` (bytes and statistics) dequantized: float32 `(n, k)`."""
    fp8, scale = planes.operand(plane, fp8, grid)
    recipe, kind = plane.recipe, plane.kind
    if kind == "blocks":
        return dequantize_blocks(fp8, scale, recipe.block_size)
    if hasattr(recipe, "scale_rounding"):  # MX
        values = dequantize_mx(fp8, scale, torch.float32, recipe.block_size)
        return values.t() if kind == "columns" else values
    return dequantize_scaled(fp8, scale)


def _expert_view(cls, func, args, kwargs):
    """On an experts weight (or a weight derived from it): expert `e` (`select` on dim 0) or a
    transpose of the last two dims, as a derived `FinerGatheredWeight`; else None."""
    src = args[0] if args else None
    if not isinstance(src, cls) or kwargs:
        return None
    root, expert, flipped = src._root()
    nd = src.dim()
    if root.dim() != 3:
        return None  # (a linear weight's: dequantized, as before)
    if func is _aten.select.int:
        dim, e = args[1:3]
        if expert is not None or dim % nd != 0:
            return None
        data = src._data[e]
        view = (root, e % src.shape[0], flipped)
    elif func is _aten.transpose.int and sorted(d % nd for d in args[1:3]) == [nd - 2, nd - 1]:
        data, view = src._data.transpose(-2, -1), (root, expert, not flipped)
    elif func is _aten.t.default and nd == 2:
        data, view = src._data.t(), (root, expert, not flipped)
    else:
        return None
    return cls(data, src._plan, src._plane, src.dtype, src._source, view)


def _leading_rows(view: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether `view` is the first rows (dim 0) of `data` (the rest whole, its layout)."""
    return (
        view.dim() == data.dim() >= 2
        and view.shape[1:] == data.shape[1:]
        and view.shape[0] <= data.shape[0]
        and view.stride() == data.stride()
        and view.storage_offset() == data.storage_offset()
    )
