"""The finer recipes' fp8 linear (stateless): rowwise, blockwise and MXFP8.

`x` is `(m, k)`, `weight` `(n, k)`, the output gradient `g` `(m, n)`. Three GEMMs, each with
both operands quantized from high precision along that GEMM's contraction dim:
`output = x @ weight.T` (over k), `grad_input = g @ weight` (over n), `grad_weight = g.T @ x`
(over m, the tokens). The layouts of the emulated matmuls are torchao 0.18's, so that the
results are bit-identical to it on CPU (a bfloat16 matmul rounds differently by shape and
layout).
"""

from __future__ import annotations

import torch

from .._core.checks import no_autocast
from .._core.recipes import BlockwiseScaling, MXScaling, RowwiseScaling
from .._numerics import fp8 as q
from .first_order import first_order_only
from .gemm import scaled_mm

FINER = (RowwiseScaling, BlockwiseScaling, MXScaling)

# -- rowwise ------------------------------------------------------------------------------------


def _rowwise_mm(a_fp8, a_scale, b_fp8, b_scale, out_dtype, backend):
    """`(a_fp8 / a_scale) @ (b_fp8 / b_scale)` in float32, then cast to `out_dtype`.

    a_fp8 `(m, k)` e4m3 with a_scale float32 `(m, 1)`; b_fp8 `(k, n)` e4m3 (any layout) with
    b_scale float32 `(1, n)` or `()`. The scales are powers of two.
    """
    if backend == "scaled_mm":
        # Unit scales and a float32 result, then the power-of-two scales: exact, and the
        # tensorwise kernel takes a float32 output where the rowwise one gives bfloat16 only.
        one = torch.ones((), dtype=torch.float32, device=a_fp8.device)
        out = scaled_mm(a_fp8, b_fp8.t(), one, one, torch.float32)
        return (out * (a_scale.reciprocal() * b_scale.reciprocal())).to(out_dtype)
    a_hp, b_hp = q.dequantize_scaled(a_fp8, a_scale), q.dequantize_scaled(b_fp8, b_scale)
    return torch.mm(a_hp, b_hp).to(out_dtype)


def _rowwise_output(x, weight, recipe, backend):
    x_fp8, x_scale = q.quantize_rowwise(x)
    w_fp8, w_scale = q.quantize_rowwise(weight)
    return _rowwise_mm(x_fp8, x_scale, w_fp8.t(), w_scale.t(), x.dtype, backend)


def _rowwise_grad_input(g, weight, recipe, backend):
    g_fp8, g_scale = q.quantize_rowwise(g)
    if recipe.hp_grad_weight:  # torchao "rowwise_with_gw_hp": the weight per tensor
        w_scale = q.tensorwise_scale(weight)
        w_fp8 = q.cast_to_fp8(weight, w_scale, keep_nonfinite=False)
    else:
        w_fp8_t, w_scale_t = q.quantize_rowwise(weight.t())  # (k, n): rows along n
        w_fp8, w_scale = w_fp8_t.t(), w_scale_t.t()
    return _rowwise_mm(g_fp8, g_scale, w_fp8, w_scale, g.dtype, backend)


def _rowwise_grad_weight(g, x, recipe, backend):
    if recipe.hp_grad_weight:
        return torch.mm(g.t(), x)
    # Quantize g and x along m; the dequantized g.T keeps g's layout, as in torchao.
    g_fp8_t, g_scale_t = q.quantize_rowwise(g.t())
    x_fp8_t, x_scale_t = q.quantize_rowwise(x.t())
    return _rowwise_mm(g_fp8_t, g_scale_t, x_fp8_t.t(), x_scale_t.t(), g.dtype, backend)


# -- MXFP8 --------------------------------------------------------------------------------------


def _mx(hp, recipe, dtype):
    """`hp` `(r, c)` quantized in blocks along c, then dequantized in `dtype`: `(r, c)`."""
    fp8, exponent = q.quantize_mx(hp.contiguous(), recipe.block_size, recipe.scale_rounding)
    return q.dequantize_mx(fp8, exponent, dtype, recipe.block_size)


def _mx_output(x, weight, recipe, backend):
    return torch.mm(_mx(x, recipe, x.dtype), _mx(weight, recipe, x.dtype).t())


def _mx_grad_input(g, weight, recipe, backend):
    return torch.mm(_mx(g, recipe, g.dtype), _mx(weight.t(), recipe, g.dtype).t())


def _mx_grad_weight(g, x, recipe, backend):
    return torch.mm(_mx(g.t(), recipe, g.dtype), _mx(x.t(), recipe, g.dtype).t())


# -- blockwise ----------------------------------------------------------------------------------


def _tiles(hp, recipe):
    """`hp` `(r, c)` quantized in 1 x block tiles along c, dequantized: float32 `(r, c)`."""
    fp8, inverse = q.quantize_tiles(hp.contiguous(), recipe.block_size)
    return q.dequantize_tiles(fp8, inverse, recipe.block_size)


def _blocks(weight, recipe):
    """`weight` `(n, k)` quantized in block x block blocks, dequantized: float32 `(n, k)`."""
    fp8, inverse = q.quantize_blocks(weight.contiguous(), recipe.block_size)
    return q.dequantize_blocks(fp8, inverse, recipe.block_size)


def _blockwise_output(x, weight, recipe, backend):
    return torch.mm(_tiles(x, recipe), _blocks(weight, recipe).t()).to(x.dtype)


def _blockwise_grad_input(g, weight, recipe, backend):
    return torch.mm(_tiles(g, recipe), _blocks(weight, recipe)).to(g.dtype)


def _blockwise_grad_weight(g, x, recipe, backend):
    return torch.mm(_tiles(g.t(), recipe), _tiles(x.t(), recipe).t()).to(g.dtype)


_GEMMS = {
    RowwiseScaling: (_rowwise_output, _rowwise_grad_input, _rowwise_grad_weight),
    BlockwiseScaling: (_blockwise_output, _blockwise_grad_input, _blockwise_grad_weight),
    MXScaling: (_mx_output, _mx_grad_input, _mx_grad_weight),
}


# -- the op -------------------------------------------------------------------------------------


def _gemm(fn, a, b, recipe, backend, shape, dtype):
    """`fn(a, b, recipe, backend)`, or float zeros of `shape` in `dtype` when `a` or `b` is empty.

    An empty operand means an empty result or a sum over nothing (no tokens: the weight
    gradient; no features: the output before the bias): zeros, as the per-tensor op gives,
    without a quantizer reducing over an empty dim.
    """
    if a.numel() == 0 or b.numel() == 0:
        return torch.zeros(shape, dtype=dtype, device=a.device)
    return fn(a, b, recipe, backend)


class _FinerLinear(torch.autograd.Function):
    """y = x @ weight.T + bias. x (m, k), weight (n, k), bias (n,) or None; stateless recipes.

    Saves `x` and `weight` in high precision: each GEMM quantizes its operands along its own
    contraction dim, so no float8 copy serves two GEMMs.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, recipe, backend):
        # (called by fp8fn.linear with autocast off, as the per-tensor op)
        output = _GEMMS[type(recipe)][0]
        out = _gemm(output, x, weight, recipe, backend, (x.shape[0], weight.shape[0]), x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, recipe, backend = inputs
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.backend = recipe, backend
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        _, grad_input, grad_weight = _GEMMS[type(ctx.recipe)]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        with no_autocast(grad_out):
            g = grad_out.contiguous()
            if needs[0]:
                grad_x = _gemm(grad_input, g, weight, ctx.recipe, ctx.backend, x.shape, g.dtype)
                grad_x = grad_x.to(x_dtype)
            if needs[1]:
                grad_w = _gemm(grad_weight, g, x, ctx.recipe, ctx.backend, weight.shape, g.dtype)
                grad_w = grad_w.to(w_dtype)
            if needs[2]:
                grad_b = g.float().sum(0).to(b_dtype)
        grad_x, grad_w = first_order_only((grad_x, grad_w), grad_out, x, weight)
        return grad_x, grad_w, grad_b, None, None


def check_finer(x, weight, recipe, api: str = "linear") -> None:
    """The checks a finer recipe adds to `check_operands`' (`api` names the caller)."""
    if isinstance(recipe, MXScaling) and torch.float16 in (x.dtype, weight.dtype):
        raise TypeError(
            f"fp8fn.{api}: expected `x` and `weight` in float32 or bfloat16 under MXScaling, "
            "got float16 (E8M0 scales span 2**-127..2**127, beyond float16). Cast to bfloat16."
        )


def finer_linear(x, weight, bias, recipe, backend):
    """`x @ weight.T + bias` under a stateless fine-grained float8 recipe.

    Each of the three GEMMs (output, grad_input, grad_weight) quantizes both of its operands
    to `float8_e4m3fn` from high precision, along its contraction dim, at the recipe's
    granularity: per row (`RowwiseScaling`), per 1 x 128 tile and 128 x 128 weight block
    (`BlockwiseScaling`) or per 32-element MX block (`MXScaling`). The bias gradient is
    `grad.float().sum(0)` in the bias dtype. Bit-identical on CPU to torchao 0.18's
    emulated `Float8Linear` ("rowwise", "rowwise_with_gw_hp") and `MXFP8Linear`. An empty
    operand (no tokens, e.g. an uneven data-parallel shard) gives an empty output and exact
    zeros for the weight gradient, as under the per-tensor recipes; no features, the bias.

    Args:
      x: `(..., in_features)` in float32, bfloat16 or float16 (not float16 under MX).
      weight: `(out_features, in_features)`, same dtypes.
      bias: `(out_features,)` or None.
      recipe: `RowwiseScaling`, `BlockwiseScaling` or `MXScaling`.
      backend: `"emulated"` or (rowwise) `"scaled_mm"`, from `resolve_backend`.

    Returns:
      `(..., out_features)` in `x.dtype`.
    """
    rows = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # (not -1: x may have no elements)
    out = _FinerLinear.apply(rows, weight, bias, recipe, backend)
    return out.reshape(*x.shape[:-1], weight.shape[0])
