"""Float8 weight all-gather under FSDP2: `float8_all_gather`, the opt-in that makes FSDP2 gather
the chosen weights as e4m3 bytes cast with fp8fn's scales. (This module: the per-tensor recipes
and the hooks; the finer recipes' planes: `fsdp_finer.py`.)

FSDP2 (`fully_shard`) lets a parameter's local tensor choose what is all-gathered
(`fsdp_pre_all_gather`) and what the gathered bytes become (`fsdp_post_all_gather`). fp8fn's
per-tensor recipes know every weight scale before the step (delayed scaling: the state's; current
scaling: one batched max of the shards' amaxes), so each rank casts its shard to e4m3 *before*
the all-gather, 1 byte per element on the wire, and the op multiplies the gathered bytes as they
are. The pieces:

* `Float8ShardWeight`: the high-precision weight (and each FSDP2 shard of it). A wrapper tensor
  subclass that behaves as its float32 (or bfloat16) data everywhere (optimizers, state dicts,
  checkpoints, which see a plain tensor when pickled) and implements the two FSDP2 hooks.
* `Float8GatheredWeight`: FSDP2's unsharded parameter, a tensor of the weight's dtype and shape
  for autograd and FSDP2 that holds the gathered e4m3 bytes, their scale and the whole weight's
  amax. The per-tensor op (`fp8fn/_ops/tensorwise.py`) and, for an experts weight, the grouped
  op (`fp8fn/_ops/grouped.py`) take them without casting again, placed by `_Float8Gathered` (the
  weight gives it through `fp8fn_placement()`); any other use sees the dequantized weight.
* `ScalesForCall`: what `fp8fn.apply` hands the hooks for one forward pass (a context variable):
  each layer's weight scale (an experts weight's: one per expert). FSDP2's backward re-gather
  runs after `apply` has returned (and on CUDA in autograd's thread), so each shard keeps the
  scale of its last forward all-gather and the backward gathers the same bytes. Where another
  forward has gathered the weight with another scale since (an evaluation with another state
  between a training forward and its backward, two transforms of one model), the op's backward
  finds FSDP2's bytes cast with that scale and all-gathers the shards again, cast with its own
  forward's scale.

Wire format, per weight and rank: the e4m3 shard viewed as uint8 (gloo cannot all-gather float8)
and the 4 bytes of the shard's float32 amax, in FSDP2's one all-gather of the block. The max of
the gathered amaxes is the whole weight's amax, the weight's observation, with no collective of
its own. A weight whose rows do not split evenly over the ranks is gathered as one padded e4m3
input (FSDP2 requires every input of such a weight to have the padded shard's shape); its
observation is then the shard's own amax, which `fp8fn.all_reduce` turns into the whole weight's.

Experts weights `(E, A, B)` (transformers' `gate_up_proj`, `down_proj`): FSDP2 shards dim 0, so
each rank holds whole experts, rows `r * ceil(E / ranks)` on. Each expert is cast with its own
scale (`(E,)`, known on every rank before the all-gather: the stored ones, or the experts'
amaxes in the same batched `all_reduce(MAX)`), and its 4-byte amax travels instead of the
shard's: the gathered `(E,)` amaxes are the per-expert observation. The gathered weight keeps
its experts on dim 0 through a transpose of its last two dims and the selection of expert `e`
(`W[e]`: its bytes, scale and amax), the forms in which the experts' forward passes reach it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .._core.experts import find_experts, find_gates
from .._core.registries import GATHER_SCALES
from .._core.state import known_filled
from .._numerics.fp8 import E4M3, FP8_MAX, amax, cast_to_fp8, ceil_div, scale_from_amax
from .._ops.grouped import expert_amax
from .._ops.tensorwise import Local
from .._torch_private import (
    aten_copy_ops,
    disabled_torch_function,
    dtensor_local_or_none,
    make_wrapper_subclass,
    op_mutates,
    tree_leaves,
    tree_map_only,
)
from .dtensor import AllGather
from .fsdp_finer import FinerGatheredWeight, FinerScales, post_all_gather, pre_all_gather

_aten = torch.ops.aten
# Ops whose results are again (pieces of) the weight: FSDP2's sharding and padding, moves and
# copies. Their results stay `Float8ShardWeight`s; every other op returns plain tensors.
_KEEP = {
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.clone.default,
    _aten.detach.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.view.default,
    *aten_copy_ops(),
}
_GATHERED_VIEWS = {
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.detach.default,
    _aten.view.default,
}


def _api_error(message: str) -> RuntimeError:
    return RuntimeError(f"fp8fn.float8_all_gather: {message}")


class Float8ShardWeight(torch.Tensor):
    """A weight (or an FSDP2 shard of it) that FSDP2 all-gathers as e4m3 bytes.

    Behaves as its data (`_tensor`, float32 or bfloat16) under every op; pickles as that plain
    tensor. `_path` names the layer (an experts weight: the weight) for messages, `_attr` is the
    weight's name on its module; `_scale` is the scale of the last forward all-gather (float32
    `()`; an experts weight `(E, A, B)`: `(E,)`, one per expert), reused by the backward
    re-gather. `_flipped`, an experts weight's under a finer recipe: whether its GEMMs read each
    expert matrix transposed (None until `fn.init` sees a GEMM read it: `FinerGatheredWeight.
    note_orientation`), which decides the planes its all-gathers cast.
    """

    __torch_function__ = disabled_torch_function

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, path: str, attr: str = "weight"):
        return make_wrapper_subclass(
            cls,
            tensor,
            storage_offset=tensor.storage_offset(),
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, path: str, attr: str = "weight"):
        self._tensor, self._path, self._attr, self._scale = tensor, path, attr, None
        self._flipped = None

    def __repr__(self):
        return f"Float8ShardWeight({self._tensor!r}, path={self._path!r})"

    def __reduce_ex__(self, protocol):  # checkpoints hold plain tensors
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_tensor"], {"path": self._path, "attr": self._attr, "flipped": self._flipped}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        out = Float8ShardWeight(inner["_tensor"], meta["path"], meta["attr"])
        out._flipped = meta["flipped"]
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrapped = [t for t in tree_leaves((args, kwargs)) if isinstance(t, cls)]
        outer = {id(t._tensor): t for t in wrapped}
        args, kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if op_mutates(func):  # in place (an optimizer step, a checkpoint load)
            return tree_map_only(torch.Tensor, lambda t: outer.get(id(t), t), out)
        if func not in _KEEP:
            return out
        return tree_map_only(torch.Tensor, lambda t: wrapped[0]._like(t), out)

    def _like(self, tensor: torch.Tensor) -> Float8ShardWeight:
        """`tensor` as a piece of this weight: its names and orientation kept (FSDP2 makes new
        shards of it, e.g. when it loads a state dict)."""
        out = Float8ShardWeight(tensor, self._path, self._attr)
        out._flipped = self._flipped
        return out

    # -- FSDP2's all-gather extension --------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The e4m3 shard and its amax (an experts weight: its experts' amaxes), as uint8
        all-gather inputs; metadata for post."""
        if mesh.ndim != 1:
            raise _api_error(
                f"expected FSDP2 sharding over a 1-D mesh for {self._path!r}, got a {mesh.ndim}-D "
                "mesh (HSDP). Leave this model's weights out of float8_all_gather."
            )
        world = mesh.size()
        if tuple(self.shape[1:]) != tuple(outer_size[1:]):
            raise _api_error(
                f"expected {self._path!r} sharded along dim 0, got a shard {tuple(self.shape)} of "
                f"{tuple(outer_size)}. Shard weights along dim 0 (fully_shard's default "
                "shard_placement_fn)."
            )
        scales = GATHER_SCALES.get()
        if scales is not None:
            scale = scales.scale_for((module, self._attr), self._path, outer_size, self.device)
            if not scales.discovering:
                self._scale = scale
        elif self._scale is not None:  # FSDP2's backward re-gather: the forward's bytes again
            scale = self._scale
        else:
            raise _api_error(
                f"{self._path!r} was all-gathered outside fp8fn's apply before any apply: its "
                "scale is not known. Run the model through `fn.apply(params, state, ...)`."
            )
        if isinstance(scale, FinerScales):  # a finer recipe: one plane per phase
            return pre_all_gather(self, scale, mesh, backward=scales is None)
        shard = self._tensor
        rows = ceil_div(outer_size[0], world)  # the padded shard's rows
        source = (self, mesh, outer_size[0])  # to gather again with another scale
        fp8 = cast_to_fp8(shard, _shard_scale(scale, mesh, outer_size[0], shard), E4M3)
        fp8 = fp8.view(torch.uint8)
        # An experts weight: its experts' amaxes, float32 `(experts of this rank,)`
        shard_amax = amax(shard) if scale.dim() == 0 else expert_amax(shard)
        # Uneven: one input of the padded shard's shape. One rank: FSDP2 copies only the first
        # input (no all-gather), and the shard's amax is the whole weight's.
        if outer_size[0] % world or world == 1:
            if fp8.shape[0] < rows:
                fp8 = torch.cat([fp8, fp8.new_zeros(rows - fp8.shape[0], *fp8.shape[1:])])
            if scale.dim():  # every expert's amax, 0 (not observed) for the other ranks'
                first = _first_row(mesh, outer_size[0])
                own = shard_amax.new_zeros(outer_size[0])
                own[first : first + shard.shape[0]] = shard_amax
                shard_amax = own
            return (fp8,), (scale, shard_amax, source)
        return (fp8, shard_amax.reshape(-1).view(torch.uint8)), (scale, None, source)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered weight: a new `Float8GatheredWeight`, or `out` refreshed in place."""
        if isinstance(metadata[0], FinerScales):
            return post_all_gather(outputs, metadata, param_dtype, out)
        if isinstance(out, FinerGatheredWeight):
            raise _api_error(
                f"{self._path!r} was all-gathered for a finer recipe first and now for a "
                "per-tensor one: a float8-gathered weight keeps the kind of recipe of its first "
                "fn.apply or fn.init."
            )
        scale, own_amax, source = metadata
        data = outputs[0].view(E4M3)
        whole_amax = own_amax
        if own_amax is None:  # the ranks' amaxes: the whole weight's is their max; an experts
            # weight's are its experts' (kept apart from FSDP2's buffer, freed at reshard)
            gathered = outputs[1].view(torch.float32)
            whole_amax = gathered.max() if scale.dim() == 0 else gathered.clone()
        if out is not None:  # later all-gathers refill the same buffers
            out._scale, out._amax, out._source = scale, whole_amax, source
            out._again = None
            return None
        gathered = Float8GatheredWeight(data, scale, whole_amax, param_dtype, source)
        return gathered, tuple(outputs)


class Float8GatheredWeight(torch.Tensor):
    """FSDP2's unsharded parameter for a `Float8ShardWeight`.

    To autograd and FSDP2 a tensor of the weight's shape `(out_features, in_features)` (an
    experts weight: `(E, A, B)`) and high-precision dtype (so the weight gradient stays high
    precision); it holds `_data`, the gathered e4m3 weight, `_scale`, the float32 scale it was
    cast with (`_data = saturate(weight * _scale)`; `()`, or `(E,)` for an experts weight, one
    per expert along dim 0), `_amax`, the float32 amax of the whole weight (of its shard for an
    unevenly sharded weight; per expert for an experts weight), and `_source`, what gathers it
    again (this rank's `Float8ShardWeight`, the device mesh, the whole weight's rows). Views
    apply to `_data`; so do, on an experts weight, a transpose of its last two dims and the
    selection of one expert (dim 0; its scale and amax become that expert's), as the experts'
    forward passes make them. Such a derived weight keeps `_view`, `(the gathered weight FSDP2
    refills, its `_scale` when derived, the expert or None, whether transposed)`. Any other op
    sees the dequantized weight `_data / _scale`.
    """

    __torch_function__ = disabled_torch_function

    @staticmethod
    def __new__(cls, data, scale, whole_amax, dtype, source=None, view=None):
        return make_wrapper_subclass(cls, data, dtype)

    def __init__(self, data, scale, whole_amax, dtype, source=None, view=None):
        self._data, self._scale, self._amax, self._source = data, scale, whole_amax, source
        self._view = view
        self._again = None  # (scale, the weight all-gathered again with it): `gathered_again`

    def __repr__(self):
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def dequantize(self) -> torch.Tensor:
        scale = (
            self._scale.reshape(-1, *[1] * (self._data.dim() - 1))
            if self._scale.dim()
            else (self._scale)
        )
        return (self._data.float() / scale).to(self.dtype)

    def fp8fn_placement(self) -> _Float8Gathered:
        """The float8 ops' placement for a call with this weight (duck-typed there)."""
        return _Float8Gathered(self)

    def gathered_again(self, scale: torch.Tensor) -> torch.Tensor:
        """The whole weight cast to e4m3 with `scale` (of the weight FSDP2 refills: for a
        derived weight, `_view[0]`'s), all-gathered again from the shards, and derived as this
        weight was. Once per weight and scale (kept until FSDP2 refills the weight): the
        experts of transformers' eager loop each ask for it in the backward, but only those
        that received tokens, which differ between ranks; every rank asks once (each of its
        tokens reached some expert), so the ranks' collectives pair up."""
        if self._view is not None:
            root, _, expert, flipped = self._view
            whole = root.gathered_again(scale)
            whole = whole if expert is None else whole[expert]
            return whole.transpose(-2, -1) if flipped else whole
        if self._again is None or self._again[0] is not scale:
            shard, mesh, rows = self._source
            local = cast_to_fp8(shard._tensor, _shard_scale(scale, mesh, rows, shard._tensor), E4M3)
            self._again = (scale, AllGather.apply(local, mesh.get_group(), rows))
        return self._again[1]

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_amax"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatheredWeight(inner["_data"], inner["_scale"], inner["_amax"], meta["dtype"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS:
            src = args[0]
            data = func(src._data, *args[1:], **kwargs)
            # (an experts weight's view keeps its experts along dim 0, or is dequantized)
            if src._scale.dim() == 0 or data.dim() == src.dim() and len(data) == len(src._scale):
                return cls(data, src._scale, src._amax, src.dtype, src._source, src._view)
        derived = _expert_view(cls, func, args, kwargs)
        if derived is not None:
            return derived
        if op_mutates(func):
            raise _api_error(
                f"the gathered float8 weight cannot be changed in place ({func}). Change the "
                "sharded parameters (the optimizer does), not the unsharded ones."
            )
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def _expert_view(cls, func, args, kwargs):
    """An experts weight's transpose of its last two dims, or its expert `e` (`select` on dim
    0), and a transpose of such an expert, as a `Float8GatheredWeight`; else None."""
    src = args[0] if args else None
    if not isinstance(src, cls):
        return None
    per_expert = src._scale.dim() == 1
    if not (per_expert or src._view is not None and src._view[2] is not None):
        return None  # (a linear weight's: dequantized, as before)
    root, stamp, expert, flipped = src._view or (src, src._scale, None, False)
    nd = src.dim()
    if func is _aten.select.int and per_expert and not kwargs:
        dim, e = args[1:3]
        if dim % nd != 0:
            return None
        e = e % src.shape[0]
        return cls(
            src._data[e],
            src._scale[e],
            src._amax[e],
            src.dtype,
            src._source,
            (root, stamp, e, flipped),
        )
    if func is _aten.transpose.int and not kwargs:
        dims = sorted(d % nd for d in args[1:3])
        if dims != [nd - 2, nd - 1] or nd < 2:
            return None
    elif not (func is _aten.t.default and nd == 2):
        return None
    data = src._data.transpose(-2, -1)
    return cls(
        data, src._scale, src._amax, src.dtype, src._source, (root, stamp, expert, not flipped)
    )


def _shard_scale(scale: torch.Tensor, mesh, rows: int, shard: torch.Tensor) -> torch.Tensor:
    """The scale that casts this rank's `shard` of a weight of `rows` rows: `scale` itself
    (float32 `()`), or for an experts weight, its experts' rows of `scale` (`(E,)`), shaped
    `(experts here, 1, ...)` (FSDP2 gives rank r the padded shard's rows from `r * ceil(E /
    ranks)`: whole experts)."""
    if scale.dim() == 0:
        return scale
    first = _first_row(mesh, rows)
    return scale[first : first + shard.shape[0]].reshape(-1, *[1] * (shard.dim() - 1))


def _first_row(mesh, rows: int) -> int:
    """The first of the `rows` rows (dim 0) that FSDP2 gives this rank's shard."""
    return mesh.get_local_rank() * ceil_div(rows, mesh.size())


class _Float8Gathered(Local):
    """The float8 ops' placement for a weight FSDP2 gathered in float8 (the per-tensor op's,
    and the grouped op's for an experts weight): the op multiplies the gathered bytes with the
    scale they were cast with, and its backward takes the bytes of its own forward.

    Args:
      weight: the `Float8GatheredWeight`: FSDP2's unsharded parameter, refilled in place by each
        all-gather, or derived from it (`_view`: an expert, a transpose). Its `_scale` (or the
        refilled weight's, when derived) at the forward is kept, the object.
    """

    def __init__(self, weight: Float8GatheredWeight):
        self.weight = weight
        self.root, self.scale = (
            (weight, weight._scale) if weight._view is None else (weight._view[:2])
        )

    def float8_weight(self, weight):
        return weight._data, weight._scale, weight._amax

    def weight_again(self, w_fp8):
        """FSDP2's bytes when they were gathered with this forward's scale (the same object:
        no device read), else the shards cast with it and all-gathered again."""
        if self.root._scale is self.scale:
            return w_fp8
        return self.weight.gathered_again(self.scale)


class ScalesForCall:
    """The weight scales of one forward pass, by `(module, weight's name on it)`, for FSDP2's
    pre-all-gather hook.

    Args:
      scales: `{(module, attr): float32 scale}` (`()`, or `(E,)` for an experts weight; a
        `FinerScales` under a finer recipe); None while `fn.init` discovers the sites (any
        scale does then: the results are not used, and nothing is cached for a backward).
      discovering: the finer weights' `FinerScales` while `fn.init` discovers the sites (so
        that FSDP2's first all-gather makes the unsharded weight of their kind).
    """

    def __init__(self, scales: dict | None, discovering: dict | None = None):
        self.scales, self.discovering = scales, scales is None
        self.finer = discovering or {}

    def scale_for(self, key, path: str, shape, device) -> torch.Tensor:
        if self.discovering:
            if key in self.finer:
                return self.finer[key]
            return torch.ones(shape[:1] if len(shape) >= 3 else (), device=device)
        scale = self.scales.get(key)
        if scale is None:
            raise _api_error(
                f"{path!r} is all-gathered in float8, but the running fp8fn.apply does not "
                "run it in float8 (a layer or experts weight left out by the transform's "
                "filter_fn or recipe, or a transform made before float8_all_gather). Give "
                "float8_all_gather the same filter_fn as fp8fn.transform, and call it before "
                "fully_shard and transform."
            )
        return scale


def is_float8_gathered(weight) -> bool:
    """Whether `weight` is a `float8_all_gather` weight: sharded, or gathered by FSDP2."""
    gathered = (Float8GatheredWeight, FinerGatheredWeight)
    return shard_of(weight) is not None or isinstance(weight, gathered)


def shard_of(weight) -> Float8ShardWeight | None:
    """The `Float8ShardWeight` under a parameter: itself, or a DTensor's local tensor; else
    None."""
    if isinstance(weight, Float8ShardWeight):
        return weight
    local = dtensor_local_or_none(weight)  # a DTensor (FSDP2's sharded parameter)
    return local if isinstance(local, Float8ShardWeight) else None


def weight_scales(entries, state) -> dict:
    """`{(module, attr): weight scale}` for one forward pass: float32 `()`, or `(E,)` for an
    experts weight `(E, A, B)` (one per expert).

    Args:
      entries: `(module, attr, site row or None, margin)` per weight all-gathered in float8: the
        row in `state` of a DelayedScaling layer's first call (an experts weight: of expert 0's
        first call, its E experts' rows following), None for current scaling.
      state: the `fp8fn.State` of the call.

    A delayed weight uses its stored weight scale once its weight history holds an amax; while it
    is empty, and for current scaling, the scale comes from the whole weight's amax: the max of
    the shards' amaxes, for all such weights in one `all_reduce(MAX)` per device mesh (the step's
    only extra collective; none once every history holds an amax). An experts weight takes
    this per expert, as the grouped op does (`where(newest > 0, stored, current)`), each
    expert's amax from the rank that holds it. Which histories hold one is read from
    `known_filled(state)` (no host read), from the values where it is not known (an experts
    weight then takes the amaxes, without a host read). The sharded parameters are read from
    the modules (FSDP2 holds them there between forward passes).
    """
    # Views, by Python index: an index tensor would be a copy to the device (a device sync).
    weights = [getattr(module, attr) for module, attr, _, _ in entries]
    spans = [
        (r, r + (len(w) if w.dim() >= 3 else 1))
        for w, (_, _, r, _) in zip(weights, entries)
        if r is not None
    ]
    filled = known_filled(state)  # whether each weight history holds an amax, if known
    if filled is not None:  # static: no host read
        empty = [not all(filled[3 * r + 1] for r in range(*span)) for span in spans]
    else:  # not known (a state made by hand): read the values (a device sync; not for experts)
        newest = (state.amax_history[..., 1, 0] == 0).tolist() if spans else []
        empty = [b - a > 1 or newest[a] for a, b in spans]
    need = []
    it = iter(empty)
    for _, _, row, _ in entries:
        need.append(True if row is None else next(it))
    wanted = [(w, m) for w, (_, _, _, m), want in zip(weights, entries, need) if want]
    current = iter(_current_scales(wanted) if wanted else ())
    scales = {}
    for weight, (module, attr, row, _), want in zip(weights, entries, need):
        scale = next(current) if want else None
        if row is not None:
            span = slice(row, row + len(weight)) if weight.dim() >= 3 else row
            stored = state.scale[span, 1]
            if scale is None:
                scale = stored
            elif weight.dim() >= 3:  # per expert: the stored scale where its history is filled
                scale = torch.where(state.amax_history[span, 1, 0] > 0, stored, scale)
        scales[(module, attr)] = scale
    return scales


def _current_scales(entries) -> list:
    """Current-scaling weight scales `448 / (amax * 2**margin)` (float32 `()`, or `(E,)` per
    expert) from the whole weights' amaxes, one `all_reduce(MAX)` per device mesh over the
    shards' amaxes (an experts weight's: its experts', 0 for the other ranks' experts)."""
    groups: dict = {}
    for i, (weight, _) in enumerate(entries):
        mesh = getattr(weight, "device_mesh", None)
        groups.setdefault(None if mesh is None else mesh.get_group(), []).append(i)
    amaxes = [None] * len(entries)
    with torch.no_grad():
        for group, members in groups.items():
            parts = [_local_amaxes(entries[i][0]) for i in members]
            local = torch.cat(parts)
            if group is not None:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            for i, a in zip(members, local.split([len(p) for p in parts])):
                amaxes[i] = a if entries[i][0].dim() >= 3 else a[0]
    margins = [m for _, m in entries]
    if len(set(margins)) == 1:  # one batched computation
        flat = torch.cat([a.reshape(-1) for a in amaxes])
        scales = scale_from_amax(flat, FP8_MAX[E4M3], margins[0])
        sizes = [a.numel() for a in amaxes]
        return [s.reshape(a.shape) for s, a in zip(scales.split(sizes), amaxes)]
    return [scale_from_amax(a, FP8_MAX[E4M3], m) for a, m in zip(amaxes, margins)]


def _local_amaxes(weight) -> torch.Tensor:
    """float32 `(1,)`: the amax of this rank's shard of `weight`; for an experts weight
    `(E, A, B)`, `(E,)`: its experts' amaxes where this rank holds them, else 0."""
    shard = shard_of(weight)
    if shard is None:
        raise _api_error(
            f"expected the weight to be an FSDP2 shard of a float8_all_gather weight, "
            f"got {type(weight).__name__}."
        )
    data = shard._tensor
    if weight.dim() < 3:
        return amax(data).reshape(1)
    experts = weight.shape[0]
    first = _first_row(weight.device_mesh, experts)
    out = torch.zeros(experts, dtype=torch.float32, device=data.device)
    out[first : first + data.shape[0]] = expert_amax(data)
    return out


def float8_all_gather(model: nn.Module, filter_fn=None) -> nn.Module:
    """Make FSDP2 all-gather `model`'s linear and experts weights in float8, cast with fp8fn's
    scales.

    An explicit opt-in that changes `model` for good: each chosen `nn.Linear` weight, and each
    chosen experts weight (a 3-D floating parameter `(E, A, B)`, E >= 2 experts along dim 0,
    found by structure as `fp8fn.transform` finds experts: transformers' `gate_up_proj`
    `(E, 2I, D)` and `down_proj` `(E, D, I)`, a user module's weight used with `grouped_mm` or
    `bmm`), becomes a `Float8ShardWeight`, a float32 (or bfloat16) tensor to the optimizer,
    `state_dict` and checkpoints (saved as plain tensors) that tells FSDP2 to gather its shard
    as e4m3 bytes. Call it before `fully_shard`, then transform the sharded model; `fn.apply`
    then casts each shard with the weight scale of the step (DelayedScaling: the state's;
    CurrentScaling: the whole weight's, from one batched `all_reduce(MAX)` of the shards'
    amaxes per step), FSDP2 gathers 1 byte per element plus 4 bytes of amax per rank, and the
    float8 op uses the gathered bytes without casting them again. The whole weight's amax
    travels in the same all-gather, so the weight's observation needs no collective. Every call
    of a layer in one forward pass uses the weight scale of its first site.

    An experts weight is cast per expert, with the scales of its experts' sites (`path[e]`;
    DelayedScaling: the stored one where that expert's weight history holds an amax, else, as
    for current scaling, the expert's own amax, max-reduced in the same batched collective),
    and 4 bytes of amax per expert travel with it: each rank holds whole experts (dim 0 is
    sharded), so the grouped op (and an expert's `F.linear` in transformers' eager loop) takes
    the same bytes and scales as without FSDP2, and the states and weights after a step are bit
    for bit those of one process. A 3-D parameter with one row along dim 0 (a ViT's
    `pos_embed`, broadcast over the batch) is not chosen; one that is chosen must be used as an
    experts weight in a GEMM, which `fn.init` checks.

    The routers and gates next to experts (an `nn.Linear` beside the experts module with at most
    E outputs, which `fp8fn.transform` keeps in high precision with a plain recipe) are not
    chosen: they are gathered in high precision.

    Linear layers that share one weight keep sharing it (one parameter, gathered once with the
    scale of the first of them that FSDP2 names); a weight tied to any other module (an
    embedding) or to a layer `filter_fn` leaves out is refused: leave its layers out.

    Under a finer recipe (`RowwiseScaling`, `BlockwiseScaling`, `MXScaling`) a linear weight is
    gathered one float8 plane per phase: in the forward the plane the output GEMM reads, in
    FSDP2's backward re-gather the plane the grad_input GEMM reads (blockwise: the same one),
    each rank casting its shard with the whole weight's scales, which one all-gather per step
    of the ranks' group statistics makes (`fp8fn/_parallel/fsdp_finer.py`); the gathered bytes
    and scales are those of casting the whole weight, bit for bit. An experts weight likewise,
    each expert's planes its own, in the coordinates of the weight as stored (where its GEMMs
    read each expert transposed, GPT-OSS's and Llama 4's `(E, K, N)`, the transposed planes:
    which way is seen at `fn.init`).

    Weights are sharded along dim 0. One whose rows do not split evenly over the ranks is gathered
    padded, and its observation is the shard's amax (an experts weight's: 0 for the experts of
    other ranks) until `fp8fn.all_reduce` (the usual loop) takes the max over the ranks.

    Outside `fn.apply` (a plain `model(x)`), an FSDP2-gathered weight is the float8 weight cast
    with its last scale, dequantized; before the first `apply` such a call raises.

    Args:
      model: the module, before `fully_shard`.
      filter_fn: `(name, module) -> bool` choosing among the `nn.Linear` layers (asked with the
        layer's name) and the experts weights (asked with the weight's name,
        `model.layers.0.mlp.experts.gate_up_proj`, and the module holding it), as
        `fp8fn.transform` asks it (default: all). Every chosen one must run in float8 with
        `DelayedScaling`, `CurrentScaling`, `RowwiseScaling`, `BlockwiseScaling` or
        `MXScaling` under the transform (`fp8fn.transform` checks; NVFP4 is refused).

    Returns:
      `model` itself, changed in place.

    Raises:
      ValueError: when a chosen weight is already sharded (call this before `fully_shard`), is
        tied to a module other than chosen linear layers (or its experts module), or when no
        weight was chosen.

    Example (on every rank)::

      model = fp8fn.float8_all_gather(Transformer())
      for block in model.blocks:
          fully_shard(block)
      fully_shard(model)
      fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fp8fn.float8_all_gather: expected `model` to be an nn.Module, got "
            f"{type(model).__name__}."
        )
    attention = {  # nn.MultiheadAttention uses its projections' weights itself
        id(m) for a in model.modules() if isinstance(a, nn.MultiheadAttention) for m in a.modules()
    }

    def choose(name, owner):
        return True if filter_fn is None or filter_fn(name, owner) else None

    experts = [e for e in find_experts(model, choose) if e.experts >= 2]
    gates = find_gates(model, experts)  # routers and gates: high precision under transform
    chosen = {}  # (id(module), attr) -> (name for messages, module, attr, kind)
    for name, sub in model.named_modules():
        if not isinstance(sub, nn.Linear) or id(sub) in attention or name in gates:
            continue
        if filter_fn is not None and not filter_fn(name, sub):
            continue
        chosen[(id(sub), "weight")] = (name, sub, "weight", "layer")
    for e in experts:
        chosen[(id(e.module), e.attr)] = (e.path, e.module, e.attr, "experts weight")
    holders: dict = {}  # id(parameter) -> [(path, module, attr)]: every module holding it
    for path, sub in model.named_modules(remove_duplicate=False):
        for attr, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), []).append((path, sub, attr))
    converted = []
    for name, sub, attr, kind in chosen.values():
        weight = getattr(sub, attr)
        if shard_of(weight) is not None:
            continue  # opted in already (or tied to a layer converted before)
        if type(weight) is not nn.Parameter:
            raise ValueError(
                f"fp8fn.float8_all_gather: expected {kind} {name!r} to hold a plain weight "
                f"Parameter, got {type(weight).__name__}. Call float8_all_gather before "
                "fully_shard (and before other wrappers)."
            )
        tied = holders[id(weight)]
        others = [(p, m, a) for p, m, a in tied if (id(m), a) not in chosen]
        if others:
            path, module, attr_ = others[0]
            raise ValueError(
                f"fp8fn.float8_all_gather: expected the weight of {kind} {name!r} to be held by "
                f"chosen nn.Linear layers or experts modules only, got it tied to "
                f"{path + '.' + attr_!r} ({type(module).__name__}): a tied parameter is "
                f"all-gathered once, in float8 for every module that holds it. Leave {name!r} "
                "out with `filter_fn` (it is then gathered in high precision, and still runs in "
                "float8), or untie it."
            )
        shared = nn.Parameter(
            Float8ShardWeight(weight.detach(), name, attr), requires_grad=weight.requires_grad
        )
        for _, module, attr_ in tied:  # tied layers stay tied: one parameter
            setattr(module, attr_, shared)
        converted.append(name)
    if not converted and not any(shard_of(p) is not None for p in model.parameters()):
        raise ValueError(
            "fp8fn.float8_all_gather: expected at least one nn.Linear layer or experts weight "
            "chosen by `filter_fn`, got none."
        )
    return model
