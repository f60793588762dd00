"""The per-tensor fp8 linear (delayed and current scaling): one autograd.Function whose gradient
with respect to the site's state rows is the observed amaxes (Flax's overwrite-with-gradient),
for every placement of its operands.

The op is written once. What differs between plain tensors, a functional-FSDP weight shard, a
tensor-parallel plan and FSDP2's float8-gathered weight is a small *placement* object passed to
it (`Local` here; the others in `fp8fn/_parallel/`): where the float8 weight comes from, which
amaxes are max-reduced over ranks before the scales are taken, and how the results and the
gradients are placed.

Helpers first (placement, scales, casts), then the op, then its vmap rule.
"""

from __future__ import annotations

import dataclasses

import torch

from .._core.checks import no_autocast
from .._core.device import scaled_mm_supported
from .._core.recipes import FAST_ACCUM
from .._kernels.cast import backward_cast, forward_cast
from .._numerics.fp8 import E4M3, E5M2, amax, cast_to_fp8
from .._torch_private import Function, never_compiled_alone, tracked_below
from .first_order import first_order_only, kept_api
from .gemm import fp8_mm, widen_operand
from .roles import cast_grad_output, keep_for_backward, observation, scales_for


class Local:
    """Where the op's operands live: plain tensors of this process. Every hook is the identity.

    The sharded placements (`fp8fn/_parallel/`) subclass it and override what differs:

    * `whole`: per role (input, weight, grad_output), whether that role is cast with the amax of
      the whole logical tensor, the max over the ranks (`max_over_ranks`), instead of the local
      one (a history that is still empty, or current scaling, on a tensor split over ranks).
    * `operands`, `float8_weight`, `gemm_weight`, `gemm_bias`, `output`: the forward's side.
    * `grad_rows`, `weight_again`, `place_grads`: the backward's side.

    A weight may give its own placement (`placement_of`): FSDP2's float8-gathered weight does.
    """

    whole = (False, False, False)
    vmap_refusal = None  # the error a placement whose op cannot be vmapped raises under vmap
    takes_rows = True  # the op's `x` is rows `(m, k)` (callers flatten); else as `x` is placed

    def operands(self, x, weight):
        """The high-precision local operands the forward casts: `(rows (m, k), weight (n, k))`."""
        return x, weight

    def float8_weight(self, weight):
        """`(e4m3 weight, float32 () scale, float32 () amax)` of a weight that comes cast, else
        None (the op casts it)."""
        return None

    def gemm_weight(self, w_fp8):
        """The forward GEMM's e4m3 weight, from the cast (and saved) one."""
        return w_fp8

    def gemm_bias(self, bias):
        """The bias the forward GEMM adds (a plain tensor), or None."""
        return bias

    def output(self, out):
        """The op's output, from the GEMM's `(m, n)` result."""
        return out

    def grad_rows(self, grad_out):
        """The output gradient's local rows, `(m, n)`, from the gradient the backward received."""
        return grad_out

    def weight_again(self, w_fp8):
        """The e4m3 weight of the backward's `grad_input` GEMM, from the saved one."""
        return w_fp8

    def place_grads(self, grads: list) -> list:
        """`[grad_input, grad_weight, grad_bias]` (None where not needed), placed as the inputs."""
        return grads


LOCAL = Local()


@dataclasses.dataclass(frozen=True, slots=True)
class Statics:
    """The op's arguments that are not tensors, as one object (see `_Fp8LinearOp`).

    Under torch.func each call of the op flattens its arguments as a tree three times and binds
    them to `forward`'s signature once, at a cost per entry (a tuple of three bools is four
    entries): as one object, not a tree node, they are one entry.
    """

    margin: int
    backend: str
    place: Local
    filled: tuple[bool, bool, bool] | None
    fast_accum: tuple[bool, bool, bool]
    api: str


def _whole(place: Local, amaxes, roles: tuple):
    """`amaxes` (float32, one per entry of `roles`), max-reduced over the ranks where `place`
    casts that role with the whole tensor's amax."""
    mask = [place.whole[r] for r in roles]
    return place.max_over_ranks(amaxes, mask) if any(mask) else amaxes


def _cast_operands(x, weight, newest, stored, margin: int, backend: str, place: Local, filled=None):
    """The forward's casts: `(x_fp8, w_fp8, x_inv, w_inv, x_amax, w_amax, x_keep, w_keep)`, e4m3
    copies of `x` and `weight` (the local operands) for the forward GEMM, the float32 `()`
    reciprocals of the scales used, the observed (local) amaxes, and the e4m3 `(m, k)`, `(n, k)`
    copies the backward keeps: `x_fp8`, `w_fp8`, or from the Triton casts before float8 GEMMs,
    transposes of the row-major transposed copies those casts wrote. A weight that comes cast
    (`place.float8_weight`: FSDP2's float8 all-gather) is used as it is: its bytes, scale and
    amax. Without Triton, an amax is None where the cast took a stored scale (`filled`): the
    caller takes it after the GEMM (`_after_gemm`)."""
    cast = place.float8_weight(weight)
    if cast is not None:
        x_fp8, x_inv, x_amax, x_keep = _cast_input(x, newest, stored, margin, backend, filled)
        w_fp8, w_scale, w_amax = cast
        return x_fp8, w_fp8, x_inv, w_scale.reciprocal(), x_amax, w_amax, x_keep, w_fp8
    if backend == "triton":  # one op per tensor; one pass over it at steady state
        x_fp8, x_inv, x_amax, x_keep = _cast_input(x, newest, stored, margin, backend, filled)
        wn, ws, known = _role(newest, stored, filled, 1)
        rowmajor = scaled_mm_supported(x.device)
        w_fp8, w_inv, w_amax, w_keep = forward_cast(weight, wn, ws, margin, known, rowmajor)
        return x_fp8, w_fp8, x_inv, w_inv, x_amax, w_amax, x_keep, w_keep
    if filled is not None and filled[0] and filled[1]:  # the stored scales: one pass each
        x_scale, w_scale, _ = stored.unbind()
        x_fp8, w_fp8 = cast_to_fp8(x, x_scale, E4M3), cast_to_fp8(weight, w_scale, E4M3)
        x_inv, w_inv, _ = stored.reciprocal().unbind()  # one kernel for both
        return x_fp8, w_fp8, x_inv, w_inv, None, None, x_fp8, w_fp8
    # Three roles at once (the last entry stands in for grad_output): no slicing of rows. The
    # formats' max are literals (448.0, 57344.0): torch.compile(dynamic=True) turns float
    # globals into symbols, which broke two chained layers.
    x_amax, w_amax = amax(x), amax(weight)
    amaxes = _whole(place, torch.stack([x_amax, w_amax, w_amax]), (0, 1, 1))
    scales = scales_for(amaxes, newest, stored, margin, 448.0)
    x_scale, w_scale, _ = scales.unbind()
    x_fp8, w_fp8 = cast_to_fp8(x, x_scale, E4M3), cast_to_fp8(weight, w_scale, E4M3)
    x_inv, w_inv, _ = scales.reciprocal().unbind()  # one kernel for both
    return x_fp8, w_fp8, x_inv, w_inv, x_amax, w_amax, x_fp8, w_fp8


def _after_gemm(amax_or_none, hp, transposed: bool = False):
    """The amax of `hp`, taken now where the cast did not need it (None: a stored scale).

    Where the cast took a stored scale, its amax is taken after the GEMM that consumes the
    cast: compiled, inductor realizes a cast only where a GEMM needs it, and fuses a reduction
    into a pointwise loop over the same elements only when the pointwise comes first, so in
    this order each tensor is read once, for its cast and its amax together. `transposed`:
    the cast writes `hp` `(m, n)` transposed (also), so its loop keeps `hp`'s two dims apart
    instead of running over the flat elements, and the amax is taken by rows, then over the
    rows (the same value: a max is exact), so that its loop matches the cast's."""
    if amax_or_none is not None:
        return amax_or_none
    if transposed and hp.dim() == 2 and hp.numel():
        return hp.abs().amax(1).float().amax()  # (float32 before the last max: one kernel)
    return amax(hp)


def _weight_once(hp, fp8, stored):
    """`(keep, x_inv, w_inv, amax)` of a weight cast with its stored scale, for a compiled step
    whose backward takes `grad_input` by `torch._scaled_mm`: `keep` the e4m3 `(n, k)` transpose
    of a row-major `(k, n)` copy of `fp8` (the layout that GEMM wants), `x_inv`, `w_inv` the
    float32 `()` reciprocals of the stored scales `stored` `(3,)` (one kernel), and `amax` the
    float32 `()` amax of `hp` `(n, k)`, all made in the forward, in the loop that casts the
    weight, so that the step reads the weight once.

    torch.compile's partitioner treats Parameters as free to save
    (`torch._functorch.config.treat_parameters_as_free_to_save`): it would recompute the
    transposed float8 copy and the amax in the backward from the high-precision Parameter, a
    second read of it. It never recomputes a forward value that a backward op outside its
    recompute allowlist (`aten.copy`) consumes, nor anything the forward's output depends on:
    so the copy is made by `copy_`, the amax is taken over the copy's loop (plus a zero made
    from the copy's bytes: the same value, bit for bit, NaN and inf included) and the GEMM's
    reciprocal scales pass through a select on it that always picks them (an amax is never
    < 0)."""
    copy = fp8.new_empty(fp8.shape[::-1]).copy_(fp8.t()).t()
    zero = (copy.view(torch.uint8) & 0).to(hp.dtype)
    amax = (hp.abs() + zero).amax(1).float().amax()  # by rows: the copy's two-dim loop
    x_inv, w_inv, _ = torch.where(amax < 0, amax, stored.reciprocal()).unbind()
    return copy, x_inv, w_inv, amax


def _stored(fp8):
    """`fp8` for a compiled GEMM on CPU whose operand also feeds a transposed copy (the layout a
    backward GEMM wants): a view of it with its own shape and strides (`as_strided`).

    Inductor lowers an extern GEMM's operand that is not stored yet to a copy of it (the cast
    recomputed from the high-precision tensor) and leaves the tensor itself unstored, so the
    transposed copy made later casts that tensor again, a loop of other ranges that inductor's
    CPU scheduler does not fuse with the first: a second read of it (2 or 4 bytes an element).
    `as_strided` makes inductor store `fp8` where it is made: the GEMM reads those bytes and
    the transposed copy loads them (1 byte an element). The same values. On other devices,
    and eager, `fp8` itself: inductor's Triton scheduler groups loops by their number of
    elements, so it may make both layouts in one kernel from one read, which a stored operand
    would prevent (not verified: no GPU has run it)."""
    if not torch.compiler.is_compiling() or fp8.device.type != "cpu":
        return fp8
    return fp8.as_strided(fp8.shape, fp8.stride())


def _both_layouts(fp8):
    """`(fp8, fp8_t)`: `fp8` `(m, n)` and its transpose `(n, m)`, for the backward's two GEMMs
    (grad_input wants `fp8` row-major, grad_weight its transpose row-major).

    Compiled on CPU, the transposed copy is stored (`_stored`) and `fp8` is its transpose: with
    the output gradient's amax taken by rows (`_after_gemm`), inductor then makes both layouts
    and the amax in one loop over the gradient's two dims, reading it once. As `(fp8, fp8.t())`
    the GEMM's copy of `fp8` is a loop over its flat elements, which inductor's CPU scheduler
    does not fuse with the transposed copy's (their sizes are `(m, n)` and `(n, m)`): the
    gradient was read twice. The same values. Eager, and on other devices, `(fp8, fp8.t())`
    (as `_stored`: not verified on a GPU)."""
    if not torch.compiler.is_compiling() or fp8.device.type != "cpu":
        return fp8, fp8.t()
    fp8_t = _stored(fp8.t().contiguous())
    return fp8_t.t(), fp8_t


def _role(newest, stored, filled, role: int):
    """`(newest, stored, filled)` of one role (0 input, 1 weight, 2 grad_output): float32 `()`
    views, or None for current scaling; whether its history is known non-empty."""
    known = filled is not None and filled[role]
    return (None, None, known) if newest is None else (newest[role], stored[role], known)


def _cast_input(x, newest, stored, margin: int, backend: str, filled=None):
    """The forward's cast of `x` alone: `(x_fp8, x_inv, x_amax, x_keep)`, as `_cast_operands`."""
    xn, xs, known = _role(newest, stored, filled, 0)
    if backend == "triton":
        return forward_cast(x, xn, xs, margin, known, scaled_mm_supported(x.device))
    if known:
        x_fp8 = cast_to_fp8(x, xs, E4M3)
        return x_fp8, xs.reciprocal(), None, x_fp8
    x_amax = amax(x)
    x_scale = scales_for(x_amax, xn, xs, margin, 448.0)
    x_fp8 = cast_to_fp8(x, x_scale, E4M3)
    return x_fp8, x_scale.reciprocal(), x_amax, x_fp8


def _cast_grad_output(grad_out, newest, stored, ctx, observe):
    """The backward's e5m2 cast: `(g_fp8, g_fp8_t, g_inv, observed)`, `g_fp8_t` its `(n, m)`
    transpose where it is made with the cast (the Triton casts; a compiled `scaled_mm`
    backward: `_both_layouts`), else None (the caller takes the view where it needs it);
    `observed` the float32 `(3,)` `[*observe, g_amax]`, or None without `observe` (the
    forward's two amaxes) or, without Triton, where the cast took the stored scale (the caller
    makes it after the GEMMs: `_after_gemm`). The scale of a role split over ranks
    (`ctx.place.whole`) comes from the whole gradient's amax."""
    if ctx.backend == "triton":  # one op: the amax, the cast, its transpose, the observation
        gn, gs, known = _role(newest, stored, ctx.filled, 2)
        # (emulated matmuls take any layout; torch's float8 GEMM wants row-major operands)
        rowmajor = scaled_mm_supported(grad_out.device)
        return backward_cast(grad_out, gn, gs, ctx.margin, known, rowmajor, observe)
    if ctx.filled is not None and ctx.filled[2]:
        g_scale = stored[2]
        g_fp8 = cast_to_fp8(grad_out, g_scale, E5M2)
        g_fp8, g_fp8_t = _both_layouts(g_fp8) if ctx.backend == "scaled_mm" else (g_fp8, None)
        return g_fp8, g_fp8_t, g_scale.reciprocal(), None
    g_amax = amax(grad_out)
    whole = _whole(ctx.place, g_amax, (2,))
    g_fp8, g_inv = cast_grad_output(grad_out, whole, newest, stored, ctx.margin)
    observed = None if observe is None else observation(*observe, g_amax)
    return g_fp8, None, g_inv, observed


def _fp8_gemm(x_fp8, w_fp8, x_inv, w_inv, bias, out_dtype, backend: str, fast_accum: bool):
    """The forward's float8 GEMM with its dequantization and bias.

    Args:
      x_fp8: e4m3 `(m, k)`. w_fp8: e4m3 `(n, k)`. x_inv, w_inv: the float32 `()` reciprocals of
        the scales they were cast with. bias: `(n,)`, added in `out_dtype`, or None. out_dtype:
        the output's dtype (the input's). backend, fast_accum: `fp8_mm`'s.

    Returns:
      `out = (x_fp8 @ w_fp8.T) * x_inv * w_inv (+ bias)`, `(m, n)` of `out_dtype`.
    """
    out = fp8_mm(x_fp8, w_fp8.t(), x_inv, w_inv, out_dtype, backend, fast_accum)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


class _Fp8LinearOp(Function):
    """y = x @ weight.T + bias with float8 operands, placed by `place` (a `Local`).

    Locally, x `(m, k)`, weight `(n, k)`, bias `(n,)` or None; a sharded placement takes its
    DTensors (see `fp8fn/_parallel/dtensor.py`). `newest` and `stored` are the site's newest
    history entries and stored scales, float32 `(3,)` (roles input, weight, grad_output), or
    None for current scaling; `margin` an int; `backend` `fp8_mm`'s;
    `filled` the roles whose histories are known non-empty (three static bools), or None;
    `fast_accum` the recipe's (output, grad_input, grad_weight) `use_fast_accum`; `api` what the
    user called, for errors; these six as one `Statics`. The gradient with respect to `newest`
    is the observation `[x_amax, w_amax, g_amax]` of the local operands.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, newest, stored, statics):
        margin, backend, place = statics.margin, statics.backend, statics.place
        filled, fast_accum = statics.filled, statics.fast_accum
        x, w = place.operands(x, weight)
        x_fp8, w_fp8, x_inv, w_inv, x_amax, w_amax, x_keep, w_keep = _cast_operands(
            x, w, newest, stored, margin, backend, place, filled
        )
        # Compiled, a scaled_mm backward that needs `grad_input` (`x` differentiated) wants the
        # weight transposed too; inductor writes both layouts from one loop over `w`'s two dims.
        both = backend == "scaled_mm" and x.requires_grad and torch.compiler.is_compiling()
        if both and w_amax is None:  # the stored scales: the transposed copy kept, W read once
            w_keep, x_inv, w_inv, w_amax = _weight_once(w, w_keep, stored)
        w_gemm, b_gemm = place.gemm_weight(w_fp8), place.gemm_bias(bias)
        if backend == "scaled_mm":  # grad_weight's GEMM copies x_fp8 transposed: from its bytes
            x_fp8 = _stored(x_fp8)
        out = _fp8_gemm(x_fp8, w_gemm, x_inv, w_inv, b_gemm, x.dtype, backend, fast_accum[0])
        x_amax, w_amax = _after_gemm(x_amax, x), _after_gemm(w_amax, w, both)
        return place.output(out), x_keep, w_keep, x_inv, w_inv, w_amax, x_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, newest, stored, statics = inputs
        keep_for_backward(ctx, output, newest, stored)
        ctx.margin, ctx.backend, ctx.place = statics.margin, statics.backend, statics.place
        ctx.filled, ctx.fast_accum, ctx.api = statics.filled, statics.fast_accum, statics.api
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    @never_compiled_alone  # (run by autograd from eager code: see the fence)
    def backward(ctx, grad_out, *_):
        x_fp8, w_fp8, x_inv, w_inv, w_amax, x_amax, newest, stored = ctx.saved_tensors
        grad_out = ctx.place.grad_rows(grad_out)
        needs = ctx.needs_input_grad
        with no_autocast(grad_out):
            observe = (x_amax, w_amax) if needs[3] else None
            g_fp8, g_fp8_t, g_inv, observed = _cast_grad_output(
                grad_out, newest, stored, ctx, observe
            )
            x_dtype, w_dtype, b_dtype = ctx.dtypes
            grads = [None] * 4
            if ctx.backend == "emulated" and needs[0] and needs[1]:  # g widened once for both
                g_fp8 = widen_operand(g_fp8)
            if needs[0]:
                w_fp8 = ctx.place.weight_again(w_fp8)
                grads[0] = fp8_mm(
                    g_fp8, w_fp8, g_inv, w_inv, x_dtype, ctx.backend, ctx.fast_accum[1]
                )
            if needs[1]:
                g_fp8_t = g_fp8.t() if g_fp8_t is None else g_fp8_t
                grads[1] = fp8_mm(
                    g_fp8_t, x_fp8, g_inv, x_inv, w_dtype, ctx.backend, ctx.fast_accum[2]
                )
            if needs[2]:
                grads[2] = grad_out.float().sum(0).to(b_dtype)
            if needs[3] and observed is None:  # the stored scale: g's amax after the GEMMs
                # (compiled, a scaled_mm backward writes `g_fp8_t` from a loop over `g`'s two
                # dims, and on CPU `g_fp8` in it too: see `_after_gemm`, `_both_layouts`)
                by_rows = not needs[0] or grad_out.device.type == "cpu"
                by_rows = by_rows and ctx.backend == "scaled_mm" and torch.compiler.is_compiling()
                g_amax = _after_gemm(None, grad_out, by_rows)
                observed = observation(x_amax, w_amax, g_amax)
            grads[:3] = ctx.place.place_grads(grads[:3])
            if needs[3]:  # [x_amax, w_amax, g_amax], made here: at the backward's level
                grads[3] = observed
        return (*first_order_only(grads, x_amax, api=ctx.api), None, None)  # stored, statics


class _Fp8Linear(_Fp8LinearOp):
    """`_Fp8LinearOp` with fp8fn's vmap semantics.

    Where the vmapped computation is differentiated as a whole (grad of vmap, or plain
    autograd around vmap), a vmap over the batch only (`x` batched) is the unbatched call on the
    whole batch: one amax, as without vmap. Elsewhere (vmap of grad: per-example gradients;
    inference; model ensembles) every member is its own call, batched by the generated rule.
    A placement with a `vmap_refusal` (the sharded ones) raises it.
    """

    generate_vmap_rule = False

    @staticmethod
    def vmap(info, in_dims, *inputs):
        x, weight, bias, newest, stored, statics = inputs
        if statics.place.vmap_refusal is not None:
            raise ValueError(statics.place.vmap_refusal)
        args = (x, weight, bias, newest, stored)
        tracked = any(tracked_below(t) for t in args if t is not None)
        if tracked and all(d is None for d in in_dims[1:5]):
            xb = x.movedim(in_dims[0], 0)
            rows = xb.flatten(0, 1)
            outs = _Fp8Linear.apply(rows, weight, bias, newest, stored, statics)
            out, x_fp8, *rest = outs
            folded = (out.unflatten(0, xb.shape[:2]), x_fp8.unflatten(0, xb.shape[:2]))
            return (*folded, *rest), (0, 0) + (None,) * len(rest)
        if tracked and newest is not None and in_dims[3] is None:
            raise ValueError(
                f"fp8fn.{statics.api}: vmap over the weights with an unbatched scaling state: "
                "members would share one state and autograd would sum their observations. Give "
                "each member its own state (stack the states and vmap over them too)."
            )
        outs = torch.vmap(_Fp8LinearOp.apply, in_dims=(*in_dims[:5], None))(*args, statics)
        return outs, (0,) * len(outs)


def placement_of(weight) -> Local:
    """`LOCAL`, or the placement a weight gives itself through a `fp8fn_placement()` method
    (FSDP2's float8-gathered weight; duck-typed, so that the op does not import FSDP2's
    classes)."""
    own = getattr(type(weight), "fp8fn_placement", None)
    return LOCAL if own is None else own(weight)


def tensorwise_linear(
    x,
    weight,
    bias,
    newest,
    stored,
    margin: int,
    backend: str,
    place=None,
    filled=None,
    fast_accum=FAST_ACCUM,
    api: str = "linear",
):
    """`x @ weight.T + bias` under a per-tensor recipe, on checked operands.

    Args:
      x: `(..., k)`; weight `(n, k)`; bias `(n,)` or None; all high precision.
      newest, stored: the site's newest amax history entries and stored scales, float32 `(3,)`
        (roles input, weight, grad_output), or None for current scaling.
      margin: the recipe's margin.
      backend: `"emulated"`, `"scaled_mm"` or `"triton"`.
      place: where the operands live (a `Local`); None: `placement_of(weight)`.
      filled: which of the three roles' histories are known non-empty (static bools, from
        `State.filled`): those cast with the stored scale alone. None: decided in the graph.
      fast_accum: the recipe's `fast_accum`, (output, grad_input, grad_weight).
      api: what the user called, for errors (`fp8fn.{api}:`, e.g. a second derivative).

    Returns:
      `(..., n)` in `x.dtype` (placed by `place`); the gradient with respect to `newest` is the
      observation.
    """
    place = placement_of(weight) if place is None else place
    flat = x.dim() == 2 or not place.takes_rows
    rows = x if flat else x.reshape(-1, x.shape[-1])  # (a reshape is a kernel call)
    with no_autocast(x):
        statics = Statics(margin, backend, place, filled, fast_accum, kept_api(api))
        out = _Fp8Linear.apply(rows, weight, bias, newest, stored, statics)[0]
    return out if flat else out.reshape(*x.shape[:-1], weight.shape[0])
