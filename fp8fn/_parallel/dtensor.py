"""Sharded parameters: the per-tensor float8 linear on DTensor operands.

`fn.apply` reaches this module in two ways.

* **Functional FSDP** (the torch.func way): `params` holds `distribute_tensor(p, mesh,
  [Shard(0)])` DTensors for a plain module. `gather_params` replaces each one that is not a
  float8 weight by its whole value, all-gathered in high precision (`_GatherParam`). A float8
  weight reaches `F.linear` as the DTensor, next to a plain input (this rank's rows):
  `_FsdpLinear` casts its local shard with the state's weight scale and all-gathers the float8
  bytes, just in time (1 byte per element on the wire), and gathers them again in the backward
  instead of keeping the whole weight (FSDP2's `reshard_after_forward`). Gradients come back as
  DTensors placed like the params, holding the mean over the ranks of their gradients (FSDP2's
  average).
* **Tensor parallel**: `parallelize_module` made the module's own parameters DTensors, and its
  styles' hooks hand `F.linear` a DTensor input. `_TPLinear` casts the local shards with the
  state's (global) scales and returns a DTensor placed as DTensor's own `F.linear` places it:
  `Shard(-1)` for `ColwiseParallel`, `Partial()` for `RowwiseParallel` (whose output hook
  reduces it). Under FSDP2 on a 2-D mesh the same op runs on the unsharded TP weights.

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

from .._core.checks import no_autocast
from .._core.recipes import CurrentScaling, DelayedScaling
from .._numerics.fp8 import E4M3, E5M2, FP8_DTYPES, FP8_MAX, amax, cast_to_fp8, ceil_div
from .._ops.gemm import fp8_mm, resolve_backend, scaled_mm_supported
from .._ops.tensorwise import _first_order_only, _fp8_gemm, _scales
from .._torch_private import (
    dtensor_local,
    dtensor_spec,
    functorch_level,
    make_dtensor,
    new_dtensor_spec,
    unwrapped,
)

_TENSORWISE = (DelayedScaling, CurrentScaling)
_FSDP_HOWTO = (
    "Functional FSDP takes `params` as `distribute_tensor(p, mesh, [Shard(0)])` on a 1-D mesh, "
    "for a module whose own parameters are plain; tensor parallel takes the module made by "
    "parallelize_module (ColwiseParallel / RowwiseParallel), with "
    "`params = dict(model.named_parameters())`."
)

# -- DTensors under torch.func's wrappers -------------------------------------------------------


def as_dtensor(t):
    """The DTensor that `t` is (under torch.func's wrappers), or None for any other value.

    A dict lookup while `torch.distributed.tensor` has not been imported: no DTensor exists then.
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, torch.Tensor):
        return None
    t = unwrapped(t)
    return t if isinstance(t, module.DTensor) else None


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


def _all_gather_rows(local: torch.Tensor, group, rows: int) -> torch.Tensor:
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


_HIGHER_ORDER = (
    "fp8fn.apply: higher-order derivatives over sharded (DTensor) parameters are not "
    "supported: the gradient's collectives are differentiated once. Differentiate once, or "
    "take the higher-order part with whole parameters."
)


class _InBackward(torch.autograd.Function):
    """A Function that runs only inside backward passes (gathering the float8 weight again,
    reducing gradients, making them DTensors): its own backward, a second derivative, raises.
    Subclasses define `forward`."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_HIGHER_ORDER)


class _AllGather(_InBackward):
    """A dim-0 shard -> the whole tensor of `rows` rows (inside a backward)."""

    @staticmethod
    def forward(local, group, rows):
        return _all_gather_rows(local, group, rows)


class _ReduceScatter(_InBackward):
    """The whole tensor -> this rank's dim-0 shard of the sum over the ranks (in a backward)."""

    @staticmethod
    def forward(full, group):
        return _reduce_scatter_rows(full, group)


class _FromLocal(_InBackward):
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
        return _all_gather_rows(dtensor_local(p), group, spec.shape[0])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec, ctx.group = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        local = _ReduceScatter.apply(grad, ctx.group) / dist.get_world_size(ctx.group)
        return _FromLocal.apply(local, ctx.spec), None, None


# -- the ops ------------------------------------------------------------------------------------


def _grad_output_scale(g_amax, newest, stored, margin: int):
    """The e5m2 scale of the output gradient, as the per-tensor op computes it."""
    scale = _scales(g_amax, newest, stored, margin, FP8_MAX[E5M2])
    return scale if newest is None else scale[..., 2]


class _FsdpLinear(torch.autograd.Function):
    """`x @ weight.T + bias`, float8 operands, `weight` a `Shard(0)` DTensor over the ranks.

    Args (of `forward`):
      x: plain `(m, k)`, this rank's rows. weight: DTensor `(n, k)`, `Shard(0)` on a 1-D mesh.
      bias: plain `(n,)` (gathered) or None. newest, stored: float32 `(3,)` or None (current
      scaling). margin: int. backend: `"emulated"` or `"scaled_mm"`. spec: the weight's
      DTensorSpec. group: its mesh's process group. whole_amax: whether the weight is cast
      with the whole weight's amax (empty history, current scaling) instead of `stored`.

    The gradient with respect to `newest` is `[x_amax, w_amax, g_amax]` of this rank (its rows,
    its weight shard); the weight's gradient a DTensor of `spec`, the mean over the ranks.
    """

    @staticmethod
    def forward(x, weight, bias, newest, stored, margin, backend, spec, group, whole_amax):
        w_local = dtensor_local(weight)
        x_amax, w_amax = amax(x), amax(w_local)
        w_whole = _max_over(w_amax, group) if whole_amax else w_amax
        scales = _scales(
            torch.stack([x_amax, w_whole, w_whole]), newest, stored, margin, FP8_MAX[E4M3]
        )
        x_scale, w_scale, _ = scales.unbind()
        x_fp8, w_fp8_local = cast_to_fp8(x, x_scale, E4M3), cast_to_fp8(w_local, w_scale, E4M3)
        w_fp8 = _all_gather_rows(w_fp8_local, group, spec.shape[0])  # 1 byte per element
        out, x_inv, w_inv = _fp8_gemm(x_fp8, w_fp8, x_scale, w_scale, bias, x.dtype, backend)
        return out, x_fp8, w_fp8_local, x_inv, w_inv, w_amax, x_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, newest, stored, margin, backend, spec, group, _ = inputs
        ctx.mark_non_differentiable(*output[1:6])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*output[1:], newest, stored)
        ctx.margin, ctx.backend, ctx.spec, ctx.group = margin, backend, spec, group
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out, *_):
        x_fp8, w_fp8_local, x_inv, w_inv, w_amax, x_amax, newest, stored = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        grads = [None] * 10
        with no_autocast(grad_out):
            g_amax = amax(grad_out)
            g_scale = _grad_output_scale(g_amax, newest, stored, ctx.margin)
            g_fp8, g_inv = cast_to_fp8(grad_out, g_scale, E5M2), g_scale.reciprocal()
            if needs[0]:  # the float8 weight again (FSDP2 reshards after the forward)
                w_fp8 = _AllGather.apply(w_fp8_local, ctx.group, ctx.spec.shape[0])
                grads[0] = fp8_mm(g_fp8, w_fp8.t(), g_inv, w_inv, x_dtype, ctx.backend)
            if needs[1]:  # this rank's rows' sum, reduce-scattered: the mean over the ranks
                partial = fp8_mm(g_fp8.t(), x_fp8.t(), g_inv, x_inv, w_dtype, ctx.backend)
                local = _ReduceScatter.apply(partial, ctx.group) / dist.get_world_size(ctx.group)
                grads[1] = _FromLocal.apply(local, ctx.spec)
            if needs[2]:
                grads[2] = grad_out.float().sum(0).to(b_dtype)
            if needs[3]:
                grads[3] = torch.stack([x_amax, w_amax, g_amax])
        return tuple(_first_order_only(grads, x_amax))


@dataclasses.dataclass(frozen=True, eq=False)
class _TPPlan:
    """How one tensor-parallel call is placed (static; read outside the Function)."""

    colwise: bool  # ColwiseParallel (x Replicate, weight Shard(0)); else RowwiseParallel
    mesh: object
    group: object
    whole: tuple  # (input, weight, grad_output): cast with the whole tensor's amax
    add_bias: bool  # Rowwise: only the mesh's first rank adds the bias to its partial sum
    out_spec: object
    grad_placements: tuple  # what the output's gradient must be placed as
    grad_input_spec: object
    weight_spec: object
    bias_spec: object


class _TPLinear(torch.autograd.Function):
    """`x @ weight.T + bias` of a tensor-parallel layer, on the local shards, float8 operands.

    Colwise: x Replicate `(..., k)`, weight Shard(0) `(n, k)`, bias Shard(0) -> output
    Shard(-1) `(..., n)`. Rowwise: x Shard(-1), weight Shard(1), bias Replicate -> output
    Partial (the sum of the ranks' partial products). newest, stored: float32 `(3,)` or None.
    The gradient with respect to `newest` is this rank's `[x_amax, w_amax, g_amax]` (of its
    shards); the others are DTensors placed like the inputs (the input's Partial for Colwise).
    """

    @staticmethod
    def forward(x, weight, bias, newest, stored, margin, backend, plan):
        x_local, w_local = dtensor_local(x), dtensor_local(weight)
        rows = x_local.reshape(-1, x_local.shape[-1])
        x_amax, w_amax = amax(rows), amax(w_local)
        x_whole = _max_over(x_amax, plan.group) if plan.whole[0] else x_amax
        w_whole = _max_over(w_amax, plan.group) if plan.whole[1] else w_amax
        scales = _scales(
            torch.stack([x_whole, w_whole, w_whole]), newest, stored, margin, FP8_MAX[E4M3]
        )
        x_scale, w_scale, _ = scales.unbind()
        x_fp8, w_fp8 = cast_to_fp8(rows, x_scale, E4M3), cast_to_fp8(w_local, w_scale, E4M3)
        b_local = dtensor_local(bias) if bias is not None and plan.add_bias else None
        out, x_inv, w_inv = _fp8_gemm(x_fp8, w_fp8, x_scale, w_scale, b_local, rows.dtype, backend)
        out = make_dtensor(out.reshape(*x_local.shape[:-1], out.shape[-1]), plan.out_spec)
        return out, x_fp8, w_fp8, x_inv, w_inv, w_amax, x_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, newest, stored, margin, backend, plan = inputs
        ctx.mark_non_differentiable(*output[1:6])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*output[1:], newest, stored)
        ctx.margin, ctx.backend, ctx.plan = margin, backend, plan
        ctx.x_shape = tuple(dtensor_local(unwrapped(x)).shape)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out, *_):
        x_fp8, w_fp8, x_inv, w_inv, w_amax, x_amax, newest, stored = ctx.saved_tensors
        plan, (x_dtype, w_dtype, b_dtype) = ctx.plan, ctx.dtypes
        if tuple(grad_out.placements) != plan.grad_placements:
            grad_out = grad_out.redistribute(plan.mesh, plan.grad_placements)
        g_local = dtensor_local(grad_out)
        needs = ctx.needs_input_grad
        grads = [None] * 8
        with no_autocast(g_local):
            rows = g_local.reshape(-1, g_local.shape[-1])
            g_amax = amax(rows)
            g_whole = _max_over(g_amax, plan.group) if plan.whole[2] else g_amax
            g_scale = _grad_output_scale(g_whole, newest, stored, ctx.margin)
            g_fp8, g_inv = cast_to_fp8(rows, g_scale, E5M2), g_scale.reciprocal()
            if needs[0]:
                gx = fp8_mm(g_fp8, w_fp8.t(), g_inv, w_inv, x_dtype, ctx.backend)
                grads[0] = make_dtensor(gx.reshape(ctx.x_shape), plan.grad_input_spec)
            if needs[1]:
                gw = fp8_mm(g_fp8.t(), x_fp8.t(), g_inv, x_inv, w_dtype, ctx.backend)
                grads[1] = make_dtensor(gw, plan.weight_spec)
            if needs[2]:
                grads[2] = make_dtensor(rows.float().sum(0).to(b_dtype), plan.bias_spec)
            if needs[3]:
                grads[3] = torch.stack([x_amax, w_amax, g_amax])
        return tuple(_first_order_only(grads, x_amax))


# -- routing (from `fn.apply`) ------------------------------------------------------------------


def _unobserved(call, site: str) -> list:
    """Which roles of `site` have an empty history: `[input, weight, grad_output]` bools.

    Read to the host once per forward pass, for all sites (the collectives a rank runs must not
    depend on device values another rank might not have: every rank holds the same state).
    """
    table = getattr(call, "_fp8fn_unobserved", None)
    if table is None:
        newest = unwrapped(call.state.amax_history)[..., 0]
        table = call._fp8fn_unobserved = (newest > 0).logical_not().tolist()
    return table[call.state._positions()[site]]


def _layout(d) -> str:
    return "plain" if d is None else f"{tuple(d.placements)} on a {d.device_mesh.ndim}-D mesh"


def sharded_linear(call, layer, site, x, weight, bias, newest, stored):
    """`fp8fn.linear` of one call of `layer` whose input or weight is a DTensor.

    Args:
      call: the running `_Call` (its state, for which roles are still unobserved).
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
    if newest is not None and unwrapped(call.state.amax_history).dim() != 3:
        raise ValueError(
            f"{api}: expected an unbatched state for DTensor operands, got a stacked or "
            "vmapped one (vmap over sharded models is not supported)."
        )
    xd, wd, bd = as_dtensor(x), as_dtensor(weight), as_dtensor(bias)
    device = (wd if wd is not None else xd).device
    backend = resolve_backend(recipe, device)
    if backend == "triton":  # fused casts are for plain tensors; the matmul as "auto"
        backend = "scaled_mm" if scaled_mm_supported(device) else "emulated"
    unobserved = [True] * 3 if newest is None else _unobserved(call, site)
    if torch.is_autocast_enabled(device.type):
        x = x.to(torch.get_autocast_dtype(device.type))
    margin = getattr(recipe, "margin", 0)
    scaling = (newest, stored, margin, backend)
    if xd is None:
        return _fsdp_linear(api, x, weight, wd, bias, bd, scaling, unobserved)
    return _tp_linear(api, x, xd, weight, wd, bias, bd, scaling, unobserved)


def _fsdp_linear(api, x, weight, wd, bias, bd, scaling, unobserved):
    shard0 = wd.device_mesh.ndim == 1 and tuple(wd.placements) == (_placements().Shard(0),)
    if not shard0 or bd is not None:
        raise ValueError(
            f"{api}: expected a weight sharded as `Shard(0)` on a 1-D mesh and a plain bias "
            f"next to a plain input, got the weight {_layout(wd)} and the bias {_layout(bd)}. "
            f"{_FSDP_HOWTO}"
        )
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    group = wd.device_mesh.get_group()
    with no_autocast(x):
        spec = dtensor_spec(wd)
        out = _FsdpLinear.apply(rows, weight, bias, *scaling, spec, group, unobserved[1])[0]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


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
            f"{_FSDP_HOWTO}"
        )
    mesh = wd.device_mesh
    out_shape = (*xd.shape[:-1], wd.shape[0])
    out_place = p.Shard(last) if colwise else p.Partial()
    x_spec = dtensor_spec(xd)
    return _TPPlan(
        colwise=colwise,
        mesh=mesh,
        group=mesh.get_group(),
        whole=(rowwise and unobserved[0], unobserved[1], colwise and unobserved[2]),
        add_bias=colwise or mesh.get_local_rank() == 0,
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
        raise RuntimeError(_TP_UNDER_FUNC)
    plan = _tp_plan(api, xd, wd, bias, bd, unobserved)
    with no_autocast(x):
        return _TPLinear.apply(x, weight, bias, *scaling, plan)[0]


# -- `fn.apply`: params and errors --------------------------------------------------------------


def _own_tensor(module, name: str):
    path, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(path), attr, None)


def gather_params(transformed, params: dict) -> dict:
    """`params` with each DTensor the module does not hold as one (functional FSDP) replaced by
    its whole value, all-gathered in high precision, except the weights of the per-tensor
    float8 layers (gathered in float8 by the op). A DTensor the module holds as one (tensor
    parallel, FSDP2) stays as it is.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "fp8fn.apply: expected plain tensors in `params` under torch.compile, got "
            "DTensors, which fp8fn compiles not yet. Run the sharded model eagerly."
        )
    tied = transformed._slots.others
    in_op = {  # (HF Conv1D's transposed weight and tied weights are gathered)
        m.weight
        for m in transformed._layers
        if isinstance(m.recipe, _TENSORWISE) and not m.transposed and m.weight not in tied
    }
    module, out = transformed.module, dict(params)
    for name, t in params.items():
        d = as_dtensor(t)
        if d is None or name in in_op or as_dtensor(_own_tensor(module, name)) is not None:
            continue
        if d.device_mesh.ndim != 1 or tuple(d.placements) != (_placements().Shard(0),):
            raise ValueError(
                f"fp8fn.apply: expected `params[{name!r}]` sharded as `Shard(0)` on a 1-D mesh "
                f"(the module holds a plain tensor there), got {_layout(d)}. {_FSDP_HOWTO}"
            )
        out[name] = _GatherParam.apply(t, dtensor_spec(d), d.device_mesh.get_group())
    return out


_TP_UNDER_FUNC = (
    "fp8fn.apply: expected plain autograd for a tensor-parallel model, got a torch.func "
    "transform: torch's parallel styles convert with DTensor.from_local, an autograd.Function "
    "without setup_context, which torch.func refuses. Differentiate with fp8fn.value_and_grad, "
    "or fp8fn.observe and loss.backward()."
)
_MIXED = "got mixed torch.Tensor and DTensor"
_NO_SETUP_CONTEXT = "must override the setup_context"


def explain_error(error: Exception, module) -> Exception | None:
    """A clear fp8fn error for what torch raised on a sharded model in `apply`, else None."""
    message = str(error)
    if _MIXED in message:
        return RuntimeError(
            "fp8fn.apply: expected the model's DTensors to meet only DTensors, got a torch op "
            f"mixing them with plain tensors ({message.splitlines()[0]}). {_FSDP_HOWTO} "
            "fp8fn looks at the first entry of `params` to know whether they are DTensors: "
            "give them all as DTensors, or none."
        )
    if (
        _NO_SETUP_CONTEXT in message
        and functorch_level() is not None
        and any(as_dtensor(p) is not None for p in module.parameters())
    ):
        return RuntimeError(_TP_UNDER_FUNC)
    return None
