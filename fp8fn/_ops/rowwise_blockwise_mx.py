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
from .._core.device import cuda_capability
from .._core.recipes import BlockwiseScaling, MXScaling, RowwiseScaling
from .._numerics import fp8 as q
from .._torch_private import never_compiled_alone
from .first_order import first_order_only, kept_api
from .gemm import scaled_mm

FINER = (RowwiseScaling, BlockwiseScaling, MXScaling)

# -- rowwise ------------------------------------------------------------------------------------


def _rowwise_mm(a_fp8, a_scale, b_fp8, b_scale, out_dtype, backend, fast_accum: bool):
    """`(a_fp8 / a_scale) @ (b_fp8 / b_scale)` in float32, then cast to `out_dtype`.

    a_fp8 `(m, k)` e4m3 with a_scale float32 `(m, 1)`; b_fp8 `(k, n)` e4m3 (any layout) with
    b_scale float32 `(1, n)` or `()`. The scales are powers of two. `fast_accum`: the recipe's
    for this GEMM (torch's row-wise GEMM's `use_fast_accum`).

    `"scaled_mm"` on the CUDA path is torch's row-wise scaled GEMM (the scales applied in its
    epilogue: one pass over the output); elsewhere (the CPU's own path, its reference) a GEMM
    with unit scales and a float32 result, then the power-of-two scales: exact, and the same
    values up to the GEMM's accumulation order (tests/test_cuda_paths.py).
    """
    if backend == "scaled_mm" and cuda_capability(a_fp8.device) is not None:
        inv_b = b_scale.reciprocal().expand(1, b_fp8.shape[1])
        return scaled_mm(a_fp8, b_fp8, a_scale.reciprocal(), inv_b, out_dtype, fast_accum)
    if backend == "scaled_mm":
        one = torch.ones((), dtype=torch.float32, device=a_fp8.device)
        out = scaled_mm(a_fp8, b_fp8, one, one, torch.float32)
        return (out * (a_scale.reciprocal() * b_scale.reciprocal())).to(out_dtype)
    a_hp, b_hp = q.dequantize_scaled(a_fp8, a_scale), q.dequantize_scaled(b_fp8, b_scale)
    return torch.mm(a_hp, b_hp).to(out_dtype)


def _rowwise_weight(weight, recipe, gemm):
    """The weight operand `(e4m3 (n, k), float32 scale)`: per row `(n, 1)` for the output GEMM,
    per column `(1, k)` for grad_input (`hp_grad_weight`: per tensor, `()`)."""
    if gemm == 0:
        return q.quantize_rowwise(weight)
    if recipe.hp_grad_weight:  # torchao "rowwise_with_gw_hp": the weight per tensor
        w_scale = q.tensorwise_scale(weight)
        return q.cast_to_fp8(weight, w_scale, keep_nonfinite=False), w_scale
    w_fp8_t, w_scale_t = q.quantize_rowwise(weight.t())  # (k, n): rows along n
    return w_fp8_t.t(), w_scale_t.t()


def _rowwise_output(x, w, recipe, backend):
    x_fp8, x_scale = q.quantize_rowwise(x)
    w_fp8, w_scale = w
    accum = recipe.fast_accum[0]
    return _rowwise_mm(x_fp8, x_scale, w_fp8.t(), w_scale.t(), x.dtype, backend, accum)


def _rowwise_grad_input(g, w, recipe, backend):
    g_fp8, g_scale = q.quantize_rowwise(g)
    return _rowwise_mm(g_fp8, g_scale, *w, g.dtype, backend, recipe.fast_accum[1])


def _rowwise_grad_weight(g, x, recipe, backend):
    if recipe.hp_grad_weight:
        return torch.mm(g.t(), x)
    # Quantize g and x along m; the dequantized g.T keeps g's layout, as in torchao.
    g_fp8_t, g_scale_t = q.quantize_rowwise(g.t())
    x_fp8_t, x_scale_t = q.quantize_rowwise(x.t())
    accum = recipe.fast_accum[2]
    return _rowwise_mm(g_fp8_t, g_scale_t, x_fp8_t.t(), x_scale_t.t(), g.dtype, backend, accum)


# -- MXFP8 --------------------------------------------------------------------------------------


def _mx(hp, recipe, dtype):
    """`hp` `(r, c)` quantized in blocks along c, then dequantized in `dtype`: `(r, c)`."""
    fp8, exponent = q.quantize_mx(hp.contiguous(), recipe.block_size, recipe.scale_rounding)
    return q.dequantize_mx(fp8, exponent, dtype, recipe.block_size)


def _mx_weight(weight, recipe, gemm):
    """The weight operand `(e4m3, uint8 exponents)` in blocks along the GEMM's contraction dim:
    `(n, k)`, `(n, k / 32)` for the output GEMM, `weight.T`'s `(k, n)`, `(k, n / 32)` for
    grad_input."""
    hp = weight if gemm == 0 else weight.t()
    return q.quantize_mx(hp.contiguous(), recipe.block_size, recipe.scale_rounding)


def _mx_values(w, recipe, dtype):
    """The MX weight operand `w` dequantized in `dtype`."""
    return q.dequantize_mx(*w, dtype, recipe.block_size)


def _mx_output(x, w, recipe, backend):
    return torch.mm(_mx(x, recipe, x.dtype), _mx_values(w, recipe, x.dtype).t())


def _mx_grad_input(g, w, recipe, backend):
    return torch.mm(_mx(g, recipe, g.dtype), _mx_values(w, recipe, g.dtype).t())


def _mx_grad_weight(g, x, recipe, backend):
    return torch.mm(_mx(g.t(), recipe, g.dtype), _mx(x.t(), recipe, g.dtype).t())


# -- blockwise ----------------------------------------------------------------------------------


def _tiles(hp, recipe):
    """`hp` `(r, c)` quantized in 1 x block tiles along c, dequantized: float32 `(r, c)`."""
    fp8, inverse = q.quantize_tiles(hp.contiguous(), recipe.block_size)
    return q.dequantize_tiles(fp8, inverse, recipe.block_size)


def _blockwise_weight(weight, recipe, gemm):
    """The weight operand of both GEMMs: `(e4m3 (n, k), float32 inverse scale (n / 128,
    k / 128))`, in block x block blocks."""
    return q.quantize_blocks(weight.contiguous(), recipe.block_size)


def _blocks(w, recipe):
    """The blockwise weight operand `w` dequantized: float32 `(n, k)`."""
    return q.dequantize_blocks(*w, recipe.block_size)


def _blockwise_output(x, w, recipe, backend):
    return torch.mm(_tiles(x, recipe), _blocks(w, recipe).t()).to(x.dtype)


def _blockwise_grad_input(g, w, recipe, backend):
    return torch.mm(_tiles(g, recipe), _blocks(w, recipe)).to(g.dtype)


def _blockwise_grad_weight(g, x, recipe, backend):
    return torch.mm(_tiles(g.t(), recipe), _tiles(x.t(), recipe).t()).to(g.dtype)


# Per recipe: the output and grad_input GEMMs `(a, weight operand, recipe, backend)`, the
# grad_weight GEMM `(g, x, recipe, backend)`, and the weight operand `(weight, recipe, gemm)`.
FINER_GEMMS = {
    RowwiseScaling: (_rowwise_output, _rowwise_grad_input, _rowwise_grad_weight),
    BlockwiseScaling: (_blockwise_output, _blockwise_grad_input, _blockwise_grad_weight),
    MXScaling: (_mx_output, _mx_grad_input, _mx_grad_weight),
}
_WEIGHTS = {
    RowwiseScaling: _rowwise_weight,
    BlockwiseScaling: _blockwise_weight,
    MXScaling: _mx_weight,
}


def weight_operand(weight, recipe, gemm: int):
    """The weight operand of the output (`gemm` 0) or grad_input (`gemm` 1) GEMM under a finer
    recipe: quantized from `weight` `(n, k)` along that GEMM's contraction dim, or, for a weight
    that comes quantized (FSDP2's float8 all-gather: a `fp8fn_finer_operand` method, duck-typed),
    the plane it holds."""
    own = getattr(type(weight), "fp8fn_finer_operand", None)
    if own is not None:
        return own(weight, recipe, gemm)
    return _WEIGHTS[type(recipe)](weight, recipe, gemm)


def weight_gemm(gemm: int, a, weight, recipe, backend, shape, dtype):
    """The output (`gemm` 0, `a` = x `(m, k)`) or grad_input (`gemm` 1, `a` = the output
    gradient `(m, n)`) GEMM with `weight` `(n, k)`: `(m, n)` or `(m, k)`; zeros of `shape` in
    `dtype` for an empty operand (see `gemm_or_zeros`)."""
    if a.numel() == 0 or weight.numel() == 0:
        return torch.zeros(shape, dtype=dtype, device=a.device)
    fn = FINER_GEMMS[type(recipe)][gemm]
    return fn(a, weight_operand(weight, recipe, gemm), recipe, backend)


# -- the op -------------------------------------------------------------------------------------


def gemm_or_zeros(fn, a, b, recipe, backend, shape, dtype):
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
    def forward(x, weight, bias, recipe, backend, api):
        # (called by fp8fn.linear with autocast off, as the per-tensor op)
        out = weight_gemm(0, x, weight, recipe, backend, (x.shape[0], weight.shape[0]), x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, recipe, backend, api = inputs
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.backend, ctx.api = recipe, backend, api
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    @never_compiled_alone  # (run by autograd from eager code: see the fence)
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_weight = FINER_GEMMS[type(ctx.recipe)][2]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        with no_autocast(grad_out):
            g = grad_out.contiguous()
            if needs[0]:
                grad_x = weight_gemm(1, g, weight, ctx.recipe, ctx.backend, x.shape, g.dtype)
                grad_x = grad_x.to(x_dtype)
            if needs[1]:
                grad_w = gemm_or_zeros(
                    grad_weight, g, x, ctx.recipe, ctx.backend, weight.shape, g.dtype
                )
                grad_w = grad_w.to(w_dtype)
            if needs[2]:
                grad_b = g.float().sum(0).to(b_dtype)
        grad_x, grad_w = first_order_only((grad_x, grad_w), grad_out, x, weight, api=ctx.api)
        return grad_x, grad_w, grad_b, None, None, None


def check_finer(x, weight, recipe, api: str = "linear") -> None:
    """The checks a finer recipe adds to `check_operands`' (`api` names the caller)."""
    if isinstance(recipe, MXScaling) and torch.float16 in (x.dtype, weight.dtype):
        raise TypeError(
            f"fp8fn.{api}: expected `x` and `weight` in float32 or bfloat16 under MXScaling, "
            "got float16 (E8M0 scales span 2**-127..2**127, beyond float16). Cast to bfloat16."
        )


def finer_linear(x, weight, bias, recipe, backend, api: str = "linear"):
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
      api: what the user called, for errors (`fp8fn.{api}:`, e.g. a second derivative).

    Returns:
      `(..., out_features)` in `x.dtype`.
    """
    rows = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # (not -1: x may have no elements)
    out = _FinerLinear.apply(rows, weight, bias, recipe, backend, kept_api(api))
    return out.reshape(*x.shape[:-1], weight.shape[0])
