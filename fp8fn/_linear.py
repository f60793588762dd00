"""The fp8 linear primitive: an autograd.Function whose state gradient is the observed amaxes."""

from __future__ import annotations

import torch

from ._cast import amax, cast_to_fp8, choose_scale
from ._matmul import fp8_mm, resolve_backend
from ._recipe import CurrentScaling, DelayedScaling
from ._scaling import E4M3, E5M2, FP8_MAX, compute_scale
from ._state import check_site_state

_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _scale(history, stored, margin, hp_amax, fp8_max):
    """Delayed scale (or current while `history` is empty); current scaling when stateless."""
    if history is None:
        return compute_scale(hp_amax, fp8_max)
    return choose_scale(history, stored, hp_amax, margin, fp8_max)


def _as_observation(hp_amax, history, like):
    """`(history_len,)` observation `[amax, 0, ...]`, made at the level of `like`.

    Built from a zero derived from `like` (the incoming gradient), so that an amax saved in the
    forward becomes a tensor of the backward's functorch level (needed once transforms nest).
    """
    zero = like.new_zeros(history.shape[0] - 1)
    return torch.cat([(hp_amax + like.new_zeros(())).reshape(1), zero])


class _Fp8Linear(torch.autograd.Function):
    """y = x @ weight.T + bias with float8 operands. x (m, k), weight (n, k), bias (n,) or None.

    `state` is `(history, scale, margin)` for input, weight and grad_output in turn (nine
    tensors), all None for current scaling. The gradient of each history is the observation
    `[amax, 0, ...]`; the other state tensors get none.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x,
        weight,
        bias,
        backend,
        x_history,
        x_stored,
        x_margin,
        w_history,
        w_stored,
        w_margin,
        g_history,
        g_stored,
        g_margin,
    ):
        # One named parameter per argument (not `*state`): when no input requires grad, dynamo
        # inlines `forward` and passes it a ctx unless the parameter count equals the argument
        # count (torch 2.13), so a `*state` signature would not compile for inference.
        x_amax, w_amax = amax(x), amax(weight)
        x_scale = _scale(x_history, x_stored, x_margin, x_amax, FP8_MAX[E4M3])
        w_scale = _scale(w_history, w_stored, w_margin, w_amax, FP8_MAX[E4M3])
        x_fp8, w_fp8 = cast_to_fp8(x, x_scale, E4M3), cast_to_fp8(weight, w_scale, E4M3)
        out = fp8_mm(x_fp8, w_fp8.t(), x_scale.reciprocal(), w_scale.reciprocal(), x.dtype, backend)
        if bias is not None:
            out = out + bias.to(out.dtype)
        # The scales (not their reciprocals) are residuals: as outputs of a compiled graph they
        # are computed once, not again inside every element's cast.
        return out, x_fp8, w_fp8, x_scale, w_scale, x_amax, w_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, backend, *state = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(*output[1:], state[0], state[3], *state[6:9])
        ctx.backend = backend
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out, *_):
        x_fp8, w_fp8, x_scale, w_scale, x_amax, w_amax, in_history, w_history, *go_state = (
            ctx.saved_tensors
        )
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        g_amax = amax(grad_out)
        g_scale = _scale(*go_state, g_amax, FP8_MAX[E5M2])
        g_fp8, g_inv = cast_to_fp8(grad_out, g_scale, E5M2), g_scale.reciprocal()
        grad_x = grad_w = grad_b = None
        if needs[0]:
            grad_x = fp8_mm(g_fp8, w_fp8, g_inv, w_inv, x_dtype, ctx.backend)
        if needs[1]:
            grad_w = fp8_mm(g_fp8.t(), x_fp8, g_inv, x_inv, w_dtype, ctx.backend)
        if needs[2]:
            grad_b = grad_out.float().sum(0).to(b_dtype)
        grad_state = [None] * 9
        for i, hp_amax, history in (
            (0, x_amax, in_history),
            (3, w_amax, w_history),
            (6, g_amax, go_state[0]),
        ):
            if needs[4 + i]:
                grad_state[i] = _as_observation(hp_amax, history, grad_out)
        return grad_x, grad_w, grad_b, None, *grad_state


def _refuse_compile_under_func():
    """Refuse to let dynamo trace `fp8fn.linear` inside a torch.func transform.

    There it would drop the custom backward (pytorch#193279). Outside transforms dynamo folds
    `maybe_current_level()` to None, so this check leaves nothing in the graph; inside one it
    returns the level (an int), on which dynamo breaks the graph: `fullgraph=True` then fails,
    and otherwise the frame runs eagerly, which is correct.
    """
    if torch.compiler.is_compiling() and torch._C._functorch.maybe_current_level() is not None:
        raise RuntimeError(
            "fp8fn.linear: torch.compile cannot trace fp8fn.linear inside a torch.func "
            "transform (grad, vjp, vmap): it would drop fp8fn's backward and return wrong "
            "gradients and observations (pytorch#193279). Compile with plain autograd "
            "(loss.backward() or torch.autograd.grad) instead, or leave fullgraph off so that "
            "this part runs eagerly."
        )


def linear(x, weight, bias, site_state, recipe):
    """`x @ weight.T + bias` with both operands in float8, and float8 gradients.

    The forward casts `x` and `weight` to `float8_e4m3fn`, the backward casts the output
    gradient to `float8_e5m2`, each with saturation; `grad_input` and `grad_weight` come from the
    float8 operands, the bias gradient is taken in high precision. Only the float8 copies of `x`
    and `weight` (1 byte per element) and scalars are saved for the backward.

    Under `DelayedScaling`, each cast uses the scale stored in `site_state` (or the tensor's own
    amax while that role's history is empty). The gradient with respect to `site_state` is the
    observation: `amax_history[0]` of each role holds the amax seen in this call. So
    `torch.func.grad` over the state, or `.grad` of state leaves that require grad, gives the
    tree `fp8fn.update` consumes.

    Args:
      x: `(..., in_features)` in float32, bfloat16 or float16.
      weight: `(out_features, in_features)`, floating.
      bias: `(out_features,)` or None.
      site_state: an `fp8fn.SiteState` for `DelayedScaling`, None for `CurrentScaling`.
      recipe: `fp8fn.DelayedScaling` or `fp8fn.CurrentScaling`.

    Returns:
      `(..., out_features)` in `x.dtype`.

    Example:
      >>> import torch, fp8fn
      >>> recipe = fp8fn.DelayedScaling()
      >>> state = fp8fn.init_site_state(recipe)
      >>> x, w = torch.randn(8, 32), torch.randn(16, 32)
      >>> y = fp8fn.linear(x, w, None, state, recipe)
      >>> y.shape, y.dtype
      (torch.Size([8, 16]), torch.float32)
    """
    return checked_linear(x, weight, bias, site_state, recipe, "linear", "`site_state`")


def checked_linear(x, weight, bias, site_state, recipe, api, where):
    """`linear` with its errors named for `api` (e.g. "apply") and the state at `where`."""
    if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise TypeError(
            f"fp8fn.{api}: expected `recipe` to be fp8fn.DelayedScaling or fp8fn.CurrentScaling, "
            f"got {type(recipe).__name__}."
        )
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fp8fn.{api}: expected `{name}` to be a tensor, got {type(t).__name__}."
            )
        if t.dtype not in _HP_DTYPES:
            raise TypeError(
                f"fp8fn.{api}: expected `{name}` in float32, bfloat16 or float16, got {t.dtype}."
            )
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8fn.{api}: expected `x` of shape (..., in_features) and `weight` of shape "
            f"(out_features, in_features), got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"fp8fn.{api}: expected `bias` of shape ({weight.shape[0]},), got {tuple(bias.shape)}."
        )
    check_site_state(api, site_state, recipe, where)
    _refuse_compile_under_func()
    leaves = [None] * 9
    if site_state is not None:
        leaves = [t for s in site_state for t in (s.amax_history, s.scale, s.margin)]
    backend = resolve_backend(recipe.backend, x.device)
    out = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, backend, *leaves)[0]
    return out.reshape(*x.shape[:-1], weight.shape[0])
