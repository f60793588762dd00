"""Sharded parameters: the per-tensor float8 linear on DTensor operands.

`fn.apply` reaches this module in two ways.

* **Functional FSDP** (the torch.func way): `params` holds `distribute_tensor(p, mesh,
  [Shard(0)])` DTensors for a plain module. `gather_params` replaces each one that is not a
  float8 weight by its whole value, all-gathered in high precision (`_GatherParam`). A float8
  weight reaches `F.linear` as the DTensor, next to a plain input (this rank's rows): the
  per-tensor op, placed by `_FsdpShard`, casts its local shard with the state's weight scale
  and all-gathers the float8 bytes, just in time (1 byte per element on the wire), and gathers
  them again in the backward instead of keeping the whole weight (FSDP2's
  `reshard_after_forward`). Gradients come back as DTensors placed like the params, holding the
  mean over the ranks of their gradients (FSDP2's average).
* **Tensor parallel**: `parallelize_module` made the module's own parameters DTensors, and its
  styles' hooks hand `F.linear` a DTensor input. The per-tensor op, placed by a `_TPPlan`,
  casts the local shards with the state's (global) scales and returns a DTensor placed as
  DTensor's own `F.linear` places it: `Shard(-1)` for `ColwiseParallel`, `Partial()` for
  `RowwiseParallel` (whose output hook reduces it). Under FSDP2 on a 2-D mesh the same op runs
  on the unsharded TP weights.

Rules that torch 2.13 imposes (see tests/test_sharded.py): every collective runs inside the
`forward` of an autograd.Function with `setup_context`, the backward's too (torch.func refuses
the others, and in-place c10d at the gradient's level); static metadata (mesh, placements,
process group) is read from the tensor under torch.func's wrappers and passed to the Function as
a non-tensor argument; no DTensor meets a plain tensor in a torch op.

Scales: a role whose amax history is empty (step 1), and every role under `CurrentScaling`, is
cast with the amax of the whole logical tensor, i.e. the max over the ranks that hold its
shards (an all-reduce of one scalar, in the op); which roles are empty is read to the host once
per forward pass. A rank's own rows of data are its own tensor (data parallel, as in DDP).
Observations are each rank's local amaxes: `fp8fn.all_reduce` over data parallel x tensor
parallel makes them the global ones.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from .._core.owners import held
from .._core.recipes import CurrentScaling, DelayedScaling
from .._numerics.fp8 import FP8_DTYPES, ceil_div
from .._ops.first_order import BackwardOnly
from .._ops.gemm import matmul_backend, resolve_backend
from .._ops.tensorwise import Local, tensorwise_linear
from .._torch_errors import FSDP_HOWTO, TP_UNDER_FUNC
from .._torch_private import (
    as_dtensor,
    dtensor_local,
    dtensor_spec,
    functorch_level,
    make_dtensor,
    new_dtensor_spec,
    unwrapped,
)

_TENSORWISE = (DelayedScaling, CurrentScaling)
_VMAP_STATE = (
    "fp8fn.apply: expected an unbatched state for DTensor operands, got a stacked or vmapped one "
    "(vmap over sharded models is not supported)."
)
_VMAP_OPERANDS = (
    "fp8fn.apply: expected no vmap over a model with sharded (DTensor) parameters, got a vmapped "
    "call (vmap over sharded models is not supported). Loop over the members instead."
)

# -- DTensors under torch.func's wrappers -------------------------------------------------------


def sharded_operands(*tensors) -> bool:
    """Whether any of `tensors` is a DTensor (the sharded route of `fn.apply`). A dict lookup
    while `torch.distributed.tensor` has not been imported."""
    if sys.modules.get("torch.distributed.tensor") is None:
        return False
    if torch.compiler.is_compiling():
        return any(type(t).__name__ == "DTensor" for t in tensors)
    return any(as_dtensor(t) is not None for t in tensors)


# -- collectives along dim 0 (DTensor's Shard(0) split: torch.chunk, last shards may be short) --


def _shard_rows(rows: int, world: int, rank: int) -> int:
    chunk = ceil_div(rows, world)
    return max(0, min(chunk, rows - rank * chunk))


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (collectives want equal shards)."""
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def all_gather_rows(local: torch.Tensor, group, rows: int) -> torch.Tensor:
    """The whole `(rows, ...)` tensor from each rank's dim-0 shard. Float8 goes over the wire
    as its bytes (gloo has no float8)."""
    world = dist.get_world_size(group)
    chunk = ceil_div(rows, world)
    wire = local.view(torch.uint8) if local.dtype in FP8_DTYPES else local
    send = _padded(wire, chunk)
    out = send.new_empty((chunk * world, *send.shape[1:]))
    dist.all_gather_single(out, send, group=group)
    out = out[:rows]
    return out.view(local.dtype) if local.dtype in FP8_DTYPES else out


def _reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's dim-0 shard of the sum of `full` over the ranks."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = full.shape[0]
    chunk = ceil_div(rows, world)
    send = _padded(full, chunk * world)
    out = send.new_empty((chunk, *send.shape[1:]))
    dist.reduce_scatter_single(out, send, group=group)
    return out[: _shard_rows(rows, world, rank)]


def _max_over(t: torch.Tensor, group) -> torch.Tensor:
    """The max of `t` over the ranks of `group` (a new tensor)."""
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


class AllGather(BackwardOnly):
    """A dim-0 shard -> the whole tensor of `rows` rows (inside a backward)."""

    @staticmethod
    def forward(local, group, rows):
        return all_gather_rows(local, group, rows)


class _ReduceScatter(BackwardOnly):
    """The whole tensor -> this rank's dim-0 shard of the sum over the ranks (in a backward)."""

    @staticmethod
    def forward(full, group):
        return _reduce_scatter_rows(full, group)


class _FromLocal(BackwardOnly):
    """A local shard -> the DTensor of `spec` holding it (`DTensor.from_local` without a check,
    usable under torch.func; in a backward)."""

    @staticmethod
    def forward(local, spec):
        return make_dtensor(local.view_as(local), spec)


class _GatherParam(torch.autograd.Function):
    """A `Shard(0)` DTensor parameter -> its whole value, a plain tensor of its dtype.

    Backward: the whole gradient reduce-scattered and divided by the number of ranks (the
    gradient of the mean of the ranks' losses, as FSDP2 averages), as a DTensor of `spec`.
    """

    @staticmethod
    def forward(p, spec, group):
        return all_gather_rows(dtensor_local(p), group, spec.shape[0])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec, ctx.group = inputs[1], inputs[2]

    @staticmethod
    def vmap(info, in_dims, p, spec, group):
        raise ValueError(_VMAP_OPERANDS)

    @staticmethod
    def backward(ctx, grad):
        local = _ReduceScatter.apply(grad, ctx.group) / dist.get_world_size(ctx.group)
        return _FromLocal.apply(local, ctx.spec), None, None


# -- the placements of the per-tensor op (`fp8fn/_ops/tensorwise.py`) ---------------------------


class _Sharded(Local):
    """A placement over the ranks of `self.group`: a role split over them (`whole`) is cast
    with the max of the ranks' amaxes. The op is not vmapped."""

    vmap_refusal = _VMAP_OPERANDS

    def max_over_ranks(self, amaxes, mask: list):
        """`amaxes` where `mask` is False, their max over the ranks where it is True (one
        collective)."""
        whole = _max_over(amaxes, self.group)
        if all(mask):
            return whole
        return torch.where(torch.tensor(mask, device=amaxes.device), whole, amaxes)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class _FsdpShard(_Sharded):
    """Functional FSDP: the weight a `Shard(0)` DTensor of `spec` over the ranks of `group`,
    the input and output plain (this rank's rows), the bias plain (gathered).

    The weight's local shard is cast (with the whole weight's amax while `whole[1]`) and
    all-gathered as e4m3 bytes for each GEMM, in the backward again instead of being kept
    (FSDP2's `reshard_after_forward`); the weight's gradient is this rank's rows' sum,
    reduce-scattered and divided by the number of ranks (the mean, as FSDP2), a DTensor of
    `spec`.
    """

    spec: object
    group: object
    whole: tuple

    def operands(self, x, weight):
        return x, dtensor_local(weight)

    def gemm_weight(self, w_fp8):
        return all_gather_rows(w_fp8, self.group, self.spec.shape[0])  # 1 byte per element

    def weight_again(self, w_fp8):
        return AllGather.apply(w_fp8, self.group, self.spec.shape[0])

    def place_grads(self, grads: list) -> list:
        grad_input, grad_weight, grad_bias = grads
        if grad_weight is not None:
            local = _ReduceScatter.apply(grad_weight, self.group)
            local = local / dist.get_world_size(self.group)
            grad_weight = _FromLocal.apply(local, self.spec)
        return [grad_input, grad_weight, grad_bias]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class _TPPlan(_Sharded):
    """How one tensor-parallel call is placed (static; read outside the op).

    Colwise: x Replicate `(..., k)`, weight Shard(0) `(n, k)`, bias Shard(0) -> output
    Shard(-1) `(..., n)`. Rowwise: x Shard(-1), weight Shard(1), bias Replicate -> output
    Partial (the sum of the ranks' partial products). The op runs on the local shards; its
    gradients are DTensors placed like the inputs (the input's Partial for Colwise).
    """

    mesh: object
    group: object
    whole: tuple  # (input, weight, grad_output): cast with the whole tensor's amax
    add_bias: bool  # Rowwise: only the mesh's first rank adds the bias to its partial sum
    x_shape: tuple  # the input's local shape
    out_spec: object
    grad_placements: tuple  # what the output's gradient must be placed as
    grad_input_spec: object
    weight_spec: object
    bias_spec: object
    takes_rows = False

    def operands(self, x, weight):
        x_local = dtensor_local(x)
        return x_local.reshape(-1, x_local.shape[-1]), dtensor_local(weight)

    def gemm_bias(self, bias):
        return dtensor_local(bias) if bias is not None and self.add_bias else None

    def output(self, out):
        return make_dtensor(out.reshape(*self.x_shape[:-1], out.shape[-1]), self.out_spec)

    def grad_rows(self, grad_out):
        if tuple(grad_out.placements) != self.grad_placements:
            grad_out = grad_out.redistribute(self.mesh, self.grad_placements)
        g_local = dtensor_local(grad_out)
        return g_local.reshape(-1, g_local.shape[-1])

    def place_grads(self, grads: list) -> list:
        shapes = (self.x_shape, None, None)
        specs = (self.grad_input_spec, self.weight_spec, self.bias_spec)
        return [
            None if g is None else make_dtensor(g if s is None else g.reshape(s), spec)
            for g, s, spec in zip(grads, shapes, specs)
        ]


# -- routing (from `fn.apply`) ------------------------------------------------------------------


def _unobserved(call, site: str) -> list:
    """Which roles of `site` have an empty history: `[input, weight, grad_output]` bools.

    Read to the host once per forward pass, for all sites (the collectives a rank runs must not
    depend on device values another rank might not have: every rank holds the same state).
    """
    if call.unobserved is None:
        newest = unwrapped(call.state.amax_history)[..., 0]
        call.unobserved = (newest > 0).logical_not().tolist()
    return call.unobserved[call.state._positions()[site]]


def _layout(d) -> str:
    return "plain" if d is None else f"{tuple(d.placements)} on a {d.device_mesh.ndim}-D mesh"


def sharded_linear(call, layer, site, x, weight, bias, newest, stored):
    """`fp8fn.linear` of one call of `layer` whose input or weight is a DTensor.

    Args:
      call: the running `Call` (its state, for which roles are still unobserved).
      layer: the `_Layer`; site: this call's site name.
      x, weight, bias: what `F.linear` received (DTensors, possibly under torch.func's
        wrappers, or plain tensors), checked for shapes and dtypes.
      newest, stored: the site's state rows, float32 `(3,)`, or None (current scaling).

    Returns:
      The output, placed as `F.linear` on these operands places it (plain rows for functional
      FSDP; a DTensor for tensor parallel).
    """
    api = f"fp8fn.apply: layer {layer.path!r}"
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{api}: expected plain tensors under torch.compile, got DTensor operands, which "
            "fp8fn compiles not yet. Run the sharded model eagerly."
        )
    recipe = layer.recipe
    if not isinstance(recipe, _TENSORWISE):
        raise ValueError(
            f"{api}: expected a per-tensor recipe (DelayedScaling, CurrentScaling) for "
            f"DTensor operands, got {type(recipe).__name__}. Give this layer a per-tensor "
            "recipe, or None (high precision), through a recipe function."
        )
    _check_state("fp8fn.apply", call.state)
    xd, wd, bd = as_dtensor(x), as_dtensor(weight), as_dtensor(bias)
    device = (wd if wd is not None else xd).device
    backend = resolve_backend(recipe, device, "apply")
    if backend == "triton":  # fused casts are for plain tensors; the matmul as "auto"
        backend = matmul_backend(device)
    unobserved = [True] * 3 if newest is None else _unobserved(call, site)
    if torch.is_autocast_enabled(device.type):
        x = x.to(torch.get_autocast_dtype(device.type))
    margin = getattr(recipe, "margin", 0)
    scaling = dict(newest=newest, stored=stored, margin=margin, backend=backend)
    scaling["fast_accum"], scaling["api"] = recipe.fast_accum, f"apply: layer {layer.path!r}"
    if xd is None:
        return _fsdp_linear(api, x, weight, wd, bias, bd, scaling, unobserved)
    return _tp_linear(api, x, xd, weight, wd, bias, bd, scaling, unobserved)


def _check_state(api: str, state) -> None:
    """Raise unless `state` is one plain, unbatched state (every rank holds all of it)."""
    history = unwrapped(state.amax_history)
    d = as_dtensor(history)
    if d is not None:
        raise ValueError(
            f"{api}: expected the state's tensors to be plain tensors, the same on every rank, "
            f"got DTensors ({_layout(d)}). Pass the state as fn.init and fp8fn.update make it; "
            "one loaded as DTensors: `state._replace(amax_history=state.amax_history."
            "full_tensor(), scale=state.scale.full_tensor())`."
        )
    if history.dim() != 3:
        raise ValueError(_VMAP_STATE)


def _fsdp_linear(api, x, weight, wd, bias, bd, scaling, unobserved):
    shard0 = wd.device_mesh.ndim == 1 and tuple(wd.placements) == (_placements().Shard(0),)
    if not shard0 or bd is not None:
        raise ValueError(
            f"{api}: expected a weight sharded as `Shard(0)` on a 1-D mesh and a plain bias "
            f"next to a plain input, got the weight {_layout(wd)} and the bias {_layout(bd)}. "
            f"{FSDP_HOWTO}"
        )
    whole = (False, unobserved[1], False)
    place = _FsdpShard(spec=dtensor_spec(wd), group=wd.device_mesh.get_group(), whole=whole)
    return tensorwise_linear(x, weight, bias, place=place, **scaling)


def _placements():
    import torch.distributed.tensor as placements

    return placements


def _tp_plan(api, xd, wd, bias, bd, unobserved) -> _TPPlan:
    """The `_TPPlan` of a tensor-parallel call, or a clear error for another layout.

    The roles split over the ranks (Colwise: weight, output gradient; Rowwise: input, weight)
    are cast with the whole tensor's amax while `unobserved`."""
    p = _placements()
    last = xd.dim() - 1
    x_place, w_place = (xd.placements[0], wd.placements[0]) if wd is not None else (None, None)
    colwise = x_place == p.Replicate() and w_place == p.Shard(0)
    rowwise = type(x_place) is p.Shard and x_place.dim % xd.dim() == last and w_place == p.Shard(1)
    bias_place = (p.Shard(0),) if colwise else (p.Replicate(),)
    bias_ok = bias is None or (bd is not None and tuple(bd.placements) == bias_place)
    one_mesh = wd is not None and wd.device_mesh.ndim == 1 and xd.device_mesh == wd.device_mesh
    if not (one_mesh and (colwise or rowwise) and bias_ok):
        raise ValueError(
            f"{api}: expected a tensor-parallel call as ColwiseParallel makes it (input "
            "Replicate, weight Shard(0), bias Shard(0)) or RowwiseParallel (input Shard(-1), "
            "weight Shard(1), bias Replicate), on one 1-D mesh; got the input "
            f"{_layout(xd)}, the weight {_layout(wd)} and the bias {_layout(bd)}. "
            f"{FSDP_HOWTO}"
        )
    mesh = wd.device_mesh
    out_shape = (*xd.shape[:-1], wd.shape[0])
    out_place = p.Shard(last) if colwise else p.Partial()
    x_spec = dtensor_spec(xd)
    return _TPPlan(
        mesh=mesh,
        group=mesh.get_group(),
        whole=(rowwise and unobserved[0], unobserved[1], colwise and unobserved[2]),
        add_bias=colwise or mesh.get_local_rank() == 0,
        x_shape=tuple(dtensor_local(xd).shape),
        out_spec=new_dtensor_spec(mesh, [out_place], out_shape, xd.dtype),
        grad_placements=(p.Shard(last),) if colwise else (p.Replicate(),),
        grad_input_spec=(
            new_dtensor_spec(mesh, [p.Partial()], xd.shape, xd.dtype) if colwise else x_spec
        ),
        weight_spec=dtensor_spec(wd),
        bias_spec=None if bd is None else dtensor_spec(bd),
    )


def _tp_linear(api, x, xd, weight, wd, bias, bd, scaling, unobserved):
    if functorch_level() is not None:
        raise RuntimeError(TP_UNDER_FUNC)
    plan = _tp_plan(api, xd, wd, bias, bd, unobserved)
    return tensorwise_linear(x, weight, bias, place=plan, **scaling)


# -- `fn.apply`: params and errors --------------------------------------------------------------


def gather_params(plan, params: dict, state):
    """`(tensors, kept)`: `params` with each DTensor the module does not hold as one
    (functional FSDP) replaced by its whole value, all-gathered in high precision, except the
    weights of the per-tensor float8 layers (gathered in float8 by the op); a DTensor the module
    holds as one (tensor parallel, FSDP2) stays as it is. `kept` (`_BuffersKept`), a context
    manager around the call, raises when the model changed a buffer given as a DTensor (a batch
    norm's running statistics in train mode: each rank's own, which one sharded tensor cannot
    hold); nothing is written back. `state` (the call's) must be plain and unbatched; `plan`
    the transform's `Plan` (its module, layers and slots).
    """
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "fp8fn.apply: expected plain tensors in `params` under torch.compile, got "
            "DTensors, which fp8fn compiles not yet. Run the sharded model eagerly."
        )
    _check_state("fp8fn.apply", state)
    tied = plan.slots.others
    in_op = {  # (HF Conv1D's transposed weight and tied weights are gathered)
        m.weight
        for m in plan.layers
        if isinstance(m.recipe, _TENSORWISE) and not m.transposed and m.weight not in tied
    }
    module, out = plan.module, dict(params)
    buffers = {name for name, _ in module.named_buffers()}
    kept = _BuffersKept()
    for name, t in params.items():
        d = as_dtensor(t)
        if d is None or name in in_op:
            continue
        if as_dtensor(held(module, name)) is not None:  # tensor parallel
            # Refused here, before the model runs: under checkpoint_fn the forward would pass
            # and torch.func raise its own error in the backward's recompute.
            if functorch_level() is not None:
                raise RuntimeError(TP_UNDER_FUNC)
            continue
        if d.device_mesh.ndim != 1 or tuple(d.placements) != (_placements().Shard(0),):
            raise ValueError(
                f"fp8fn.apply: expected `params[{name!r}]` sharded as `Shard(0)` on a 1-D mesh "
                f"(the module holds a plain tensor there), got {_layout(d)}. {FSDP_HOWTO}"
            )
        out[name] = _GatherParam.apply(t, dtensor_spec(d), d.device_mesh.get_group())
        if name in buffers:
            kept.given.append((name, out[name], unwrapped(out[name]).detach().clone()))
    return out, kept


class _BuffersKept:
    """Around the call: raises when the model changed a buffer that `params` gave as a DTensor
    (it would change the gathered copy only). A batch norm's running statistics in train mode
    are each rank's own (as under FSDP2), which one sharded tensor cannot hold."""

    def __init__(self):
        self.given = []  # (name, its gathered value, a copy of that value)

    def __enter__(self):
        return self

    def __exit__(self, error_type, *_):
        if error_type is not None:
            return
        for name, whole, before in self.given:
            now = unwrapped(whole).detach()
            if not torch.equal(now.view(torch.uint8), before.view(torch.uint8)):  # bits: NaN too
                raise ValueError(
                    f"fp8fn.apply: expected the buffers given as DTensors in `params` to stay as "
                    f"they are, got {name!r} changed by the model (batch norm in train mode): "
                    "each rank's statistics are its own, which one sharded tensor cannot hold, "
                    "and fp8fn gathers a copy. Give buffers as plain tensors, or leave them out "
                    "of `params` (the module's own are used and updated), or run in eval mode."
                )


def gathered_for_split(weight, own):
    """`weight` all-gathered in high precision when it is a functional FSDP shard (a DTensor
    where the module holds `own`, a plain tensor) that the model splits (nn.MultiheadAttention's
    packed in_proj, in cross-attention): its pieces are whole q, k, v weights, as the plain
    model's. Else `weight` as it is."""
    d = as_dtensor(weight)
    if d is None or as_dtensor(own) is not None:
        return weight
    return _GatherParam.apply(weight, dtensor_spec(d), d.device_mesh.get_group())


class _LocalShard(torch.autograd.Function):
    """A DTensor -> its local shard (`DTensor.to_local` with `setup_context`, usable under
    torch.func); the gradient comes back as a DTensor of the input's spec."""

    @staticmethod
    def forward(d, spec):
        return dtensor_local(d).view_as(dtensor_local(d))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _FromLocal.apply(grad, ctx.spec), None


def local_shard(d: torch.Tensor) -> torch.Tensor:
    """The local shard of the DTensor `d` (or a torch.func wrapper of one), differentiable
    (plain autograd and torch.func)."""
    return _LocalShard.apply(d, dtensor_spec(as_dtensor(d)))
