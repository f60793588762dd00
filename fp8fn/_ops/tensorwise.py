"""The per-tensor fp8 linear (delayed and current scaling): an autograd.Function whose gradient
with respect to the site's state rows is the observed amaxes (Flax's overwrite-with-gradient).

Helpers first (scales, casts), then the op, then its vmap rule.
"""

from __future__ import annotations

import torch

from .._core.checks import no_autocast
from .._kernels.cast import TritonCast
from .._numerics.fp8 import E4M3, E5M2, amax, cast_to_fp8, scale_from_amax
from .._parallel.fsdp_gather import Float8GatheredWeight
from .._torch_private import tracked_below, tracked_by_outer_differentiation
from .gemm import fp8_mm, scaled_mm_supported

_HIGHER_ORDER = (
    "fp8fn.linear: higher-order derivatives through float8 casts are not defined (the backward's "
    "casts have no scales of their own). Differentiate fp8fn once; for a Hessian or "
    "gradient penalty, run that part in high precision (filter_fn, or a recipe of None)."
)


def _scales(amaxes, newest, stored, margin: int, fp8_max: float, filled: bool = False):
    """The scales the casts use, float32 of `amaxes`'s shape: `stored` where the history is
    non-empty (`newest > 0`), else current scaling from `amaxes`; current scaling when
    stateless (`newest` None). `filled` (static: every history used is known non-empty):
    `stored` alone, so that the cast does not wait for `amaxes` (one pass over the tensor)."""
    if filled:
        return stored
    current = scale_from_amax(amaxes, fp8_max, margin)
    return current if newest is None else torch.where(newest > 0, stored, current)


def _cast_operands(x, weight, newest, stored, margin: int, backend: str, filled):
    """The forward's casts: `(x_fp8, w_fp8, x_scale, w_scale, x_amax, w_amax)`, e4m3 copies of
    `x` and `weight`, the float32 `()` scales used and the observed amaxes. A weight that FSDP2
    gathered in float8 (`float8_all_gather`) comes cast: its bytes, scale and amax are used."""
    if isinstance(weight, Float8GatheredWeight):
        x_fp8, x_scale, x_amax = _cast_input(x, newest, stored, margin, backend, filled)
        return x_fp8, weight._data, x_scale, weight._scale, x_amax, weight._amax
    if backend == "triton":  # one pass over each tensor at step >= 2
        (xn, wn, _), (xs, ws, _) = (None,) * 3, (None,) * 3
        if newest is not None:
            (xn, wn, _), (xs, ws, _) = newest.unbind(), stored.unbind()
        x_fp8, x_scale, x_amax = TritonCast.apply(x, xn, xs, margin, E4M3)
        w_fp8, w_scale, w_amax = TritonCast.apply(weight, wn, ws, margin, E4M3)
        return x_fp8, w_fp8, x_scale, w_scale, x_amax, w_amax
    # Three roles at once (the last entry stands in for grad_output): no slicing of rows. The
    # formats' max are literals (448.0, 57344.0): torch.compile(dynamic=True) turns float
    # globals into symbols, which broke two chained layers.
    x_amax, w_amax = amax(x), amax(weight)
    known = filled is not None and filled[0] and filled[1]
    scales = _scales(torch.stack([x_amax, w_amax, w_amax]), newest, stored, margin, 448.0, known)
    x_scale, w_scale, _ = scales.unbind()
    x_fp8, w_fp8 = cast_to_fp8(x, x_scale, E4M3), cast_to_fp8(weight, w_scale, E4M3)
    return x_fp8, w_fp8, x_scale, w_scale, x_amax, w_amax


def _cast_input(x, newest, stored, margin: int, backend: str, filled=None):
    """The forward's cast of `x` alone: `(x_fp8, x_scale, x_amax)`."""
    xn = xs = None
    if newest is not None:
        xn, xs = newest[0], stored[0]
    if backend == "triton":
        return TritonCast.apply(x, xn, xs, margin, E4M3)
    x_amax = amax(x)
    x_scale = _scales(x_amax, xn, xs, margin, 448.0, filled is not None and filled[0])
    return cast_to_fp8(x, x_scale, E4M3), x_scale, x_amax


def _cast_grad_output(grad_out, newest, stored, ctx):
    """The backward's e5m2 cast: `(g_fp8, g_fp8_t, g_scale, g_amax)`, `g_fp8_t` its `(n, m)`
    transpose: a view, or with the Triton casts before a float8 GEMM, a row-major copy the
    kernel writes in the same pass (the GEMM wants row-major operands)."""
    if ctx.backend == "triton":
        gn, gs = (None, None) if newest is None else (newest[2], stored[2])
        if not scaled_mm_supported(grad_out.device):  # emulated matmuls take any layout
            g_fp8, g_scale, g_amax = TritonCast.apply(grad_out, gn, gs, ctx.margin, E5M2)
            return g_fp8, g_fp8.t(), g_scale, g_amax
        return TritonCast.apply(grad_out, gn, gs, ctx.margin, E5M2, True)
    g_amax = amax(grad_out)
    known = ctx.filled is not None and ctx.filled[2]
    g_scale = _scales(g_amax, newest, stored, ctx.margin, 57344.0, known)
    g_scale = g_scale if newest is None else g_scale[..., 2]
    g_fp8 = cast_to_fp8(grad_out, g_scale, E5M2)
    return g_fp8, g_fp8.t(), g_scale, g_amax


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on the backward's results; differentiating through them raises.

    `anchor` (the forward's x amax, a differentiable output) ties the results to every outer
    differentiation that tracks the op's inputs, so grad-of-grad reaches this node.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(anchor, *grads):
        return grads

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_HIGHER_ORDER)


def _first_order_only(grads: list, x_amax) -> list:
    """`grads` (a backward's results), the first four made to raise when differentiated again
    where an outer differentiation records this backward (`x_amax`, the forward's float32 `()`
    input amax, is tracked by it); else `grads` as they are."""
    if torch.is_grad_enabled() and tracked_by_outer_differentiation(x_amax):
        grads[:4] = _FirstOrderOnly.apply(x_amax, *grads[:4])
    return grads


def _fp8_gemm(x_fp8, w_fp8, x_scale, w_scale, bias, out_dtype, backend: str):
    """The forward's float8 GEMM with its dequantization and bias: `(out, x_inv, w_inv)`.

    Args:
      x_fp8: e4m3 `(m, k)`. w_fp8: e4m3 `(n, k)`. x_scale, w_scale: the float32 `()` scales
        they were cast with. bias: `(n,)`, added in `out_dtype`, or None. out_dtype: the
        output's dtype (the input's). backend: `fp8_mm`'s backend.

    Returns:
      `out = (x_fp8 @ w_fp8.T) * x_inv * w_inv (+ bias)`, `(m, n)` of `out_dtype`, and the
      float32 `()` reciprocal scales `x_inv`, `w_inv` (saved for the backward's GEMMs).
    """
    x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
    out = fp8_mm(x_fp8, w_fp8, x_inv, w_inv, out_dtype, backend)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out, x_inv, w_inv


class _Fp8LinearOp(torch.autograd.Function):
    """y = x @ weight.T + bias with float8 operands. x (m, k), weight (n, k), bias (n,) or None.

    `newest` and `stored` are the site's newest history entries and stored scales, float32
    `(3,)` (roles input, weight, grad_output), or None for current scaling; `margin` an int;
    `filled` the roles whose histories are known non-empty (three bools), or None.
    The gradient with respect to `newest` is the observation `[x_amax, w_amax, g_amax]`.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, newest, stored, margin, backend, filled):
        x_fp8, w_fp8, x_scale, w_scale, x_amax, w_amax = _cast_operands(
            x, weight, newest, stored, margin, backend, filled
        )
        out, x_inv, w_inv = _fp8_gemm(x_fp8, w_fp8, x_scale, w_scale, bias, x.dtype, backend)
        return out, x_fp8, w_fp8, x_inv, w_inv, w_amax, x_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, newest, stored, margin, backend, filled = inputs
        ctx.mark_non_differentiable(*output[1:6])  # x_amax stays differentiable: see backward
        ctx.set_materialize_grads(False)  # the residual outputs get no gradient: no zeros made
        ctx.save_for_backward(*output[1:], newest, stored)
        ctx.margin, ctx.backend, ctx.filled = margin, backend, filled
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out, *_):
        x_fp8, w_fp8, x_inv, w_inv, w_amax, x_amax, newest, stored = ctx.saved_tensors
        with no_autocast(grad_out):
            g_fp8, g_fp8_t, g_scale, g_amax = _cast_grad_output(grad_out, newest, stored, ctx)
            g_inv = g_scale.reciprocal()
            x_dtype, w_dtype, b_dtype = ctx.dtypes
            needs = ctx.needs_input_grad
            grads = [None] * 8
            if needs[0]:
                grads[0] = fp8_mm(g_fp8, w_fp8.t(), g_inv, w_inv, x_dtype, ctx.backend)
            if needs[1]:
                grads[1] = fp8_mm(g_fp8_t, x_fp8.t(), g_inv, x_inv, w_dtype, ctx.backend)
            if needs[2]:
                grads[2] = grad_out.float().sum(0).to(b_dtype)
            if needs[3]:  # [x_amax, w_amax, g_amax], made here: at the backward's level
                grads[3] = torch.stack([x_amax, w_amax, g_amax])
        return tuple(_first_order_only(grads, x_amax))


class _Fp8Linear(_Fp8LinearOp):
    """`_Fp8LinearOp` with fp8fn's vmap semantics.

    Where the vmapped computation is differentiated as a whole (grad of vmap, or plain
    autograd around vmap), a vmap over the batch only (`x` batched) is the unbatched call on the
    whole batch: one amax, as without vmap. Elsewhere (vmap of grad: per-example gradients;
    inference; model ensembles) every member is its own call, batched by the generated rule.
    """

    generate_vmap_rule = False

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, newest, stored, margin, backend, filled):
        args = (x, weight, bias, newest, stored)
        tracked = any(tracked_below(t) for t in args if t is not None)
        if tracked and all(d is None for d in in_dims[1:5]):
            xb = x.movedim(in_dims[0], 0)
            outs = _Fp8Linear.apply(
                xb.flatten(0, 1), weight, bias, newest, stored, margin, backend, filled
            )
            out, x_fp8, *rest = outs
            folded = (out.unflatten(0, xb.shape[:2]), x_fp8.unflatten(0, xb.shape[:2]))
            return (*folded, *rest), (0, 0) + (None,) * len(rest)
        if tracked and newest is not None and in_dims[3] is None:
            raise ValueError(
                "fp8fn.linear: vmap over the weights with an unbatched scaling state: members "
                "would share one state and autograd would sum their observations. Give each "
                "member its own state (stack the states and vmap over them too)."
            )
        outs = torch.vmap(_Fp8LinearOp.apply, in_dims=(*in_dims[:5], None, None, None))(
            *args, margin, backend, filled
        )
        return outs, (0,) * len(outs)


def tensorwise_linear(x, weight, bias, newest, stored, margin: int, backend: str, filled=None):
    """`x @ weight.T + bias` under a per-tensor recipe, on checked operands.

    Args:
      x: `(..., k)`; weight `(n, k)`; bias `(n,)` or None; all high precision.
      newest, stored: the site's newest amax history entries and stored scales, float32 `(3,)`
        (roles input, weight, grad_output), or None for current scaling.
      margin: the recipe's margin.
      backend: `"emulated"`, `"scaled_mm"` or `"triton"`.
      filled: which of the three roles' histories are known non-empty (static bools, from
        `State.filled`): those cast with the stored scale alone. None: decided in the graph.

    Returns:
      `(..., n)` in `x.dtype`; the gradient with respect to `newest` is the observation.
    """
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (a reshape is a kernel call)
    with no_autocast(x):
        out = _Fp8Linear.apply(rows, weight, bias, newest, stored, margin, backend, filled)[0]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])
