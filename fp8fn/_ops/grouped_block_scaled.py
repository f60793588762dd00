"""The grouped GEMM under the stateless recipes: rowwise, blockwise and MXFP8 per group, NVFP4
per expert.

`x` is `(T, K)`, the experts' weight `(E, N, K)`, `offs` int32 `(E,)` the cumulative group
ends: rows `offs[e-1]:offs[e]` of `x` go to expert `e`; rows past `offs[-1]` come out 0 and get
no gradient. Each group runs the dense op's numerics on its rows (`rowwise_blockwise_mx`'s GEMMs,
`nvfp4`'s op), so expert `e`'s output and gradients are bit for bit those of the dense
`fp8fn.linear` on `(x[rows of e], weight[e])`:

* rowwise, blockwise, MXFP8: every GEMM quantizes both operands along its contraction dim, the
  weight gradient's along the group's own tokens (a block never mixes two experts' tokens; a
  group whose size is not a multiple of the block ends in a partial block). With groups of a
  multiple of 32 tokens, MXFP8 is torchao 0.18's `_to_mxfp8_then_scaled_grouped_mm` with
  `KernelPreference.EMULATED`, bit for bit (its 2-D x 2-D weight-gradient emulation quantizes
  the tokens in blocks across group ends, which the GPU kernels do not: they pad each group).
* NVFP4: expert `e` draws its random bits (stochastic rounding, Hadamard signs) from the key
  folded with `e` (`keys.fold_key(key, e)`, as `fp8fn.fold_in`), so no two experts share bits.
  The grouped op saves `x` and the weight in high precision and quantizes them again in the
  backward, to the same bits. The dense op saves packed FP4 copies, but a group's `x.T` is
  quantized along its own tokens, a count only `offs` gives.

An expert with no token (an empty group) costs nothing and gets an exact zero weight gradient.

Backends: emulated, one dequantized matmul per group (as the dense op, reading `offs` on the
host). Per-group `torch.mm` and one `torch._grouped_mm` give the same bits on CPU (torch 2.13,
float32 and bfloat16); the per-group matmul was the faster in `benchmarks/moe.py`'s full runs,
and `torch._grouped_mm` on CPU needs 16-byte-aligned strides. The finer recipes have no
GPU GEMM here (as the dense op: `resolve_backend` emulates them).

torch.compile: the per-group loops run as custom ops (`grouped_gemm.custom_op_when_compiling`):
`fp8fn::finer_grouped_rows` and `fp8fn::finer_grouped_weights` for the finer recipes,
`fp8fn::nvfp4_grouped_rows` and `fp8fn::nvfp4_grouped_weights` for NVFP4. Each computes the
output or grad_input GEMM over every group's rows, or the grad_weight GEMM of every group.
`offs` is read inside them, so the graph does not break and compiled and eager run the same
code, to the same bits. Eagerly the same functions run directly. An in-graph grouped GEMM is
not an option on CPU: `torch._grouped_mm`'s fake (torch 2.13) takes bfloat16 only, and the
emulated GEMMs are float32.
"""

from __future__ import annotations

import torch

from .._core import keys
from .._core.checks import no_autocast
from .._core.recipes import BlockwiseScaling, MXScaling, NVFP4Scaling, RowwiseScaling
from .._numerics.nvfp4 import dequantize_nvfp4
from .._torch_private import never_compiled_alone
from .first_order import first_order_only
from .grouped_gemm import bounds, custom_op_when_compiling
from .member_loop import each_member, vmap_per_member
from .nvfp4 import (
    grad_input_gemm,
    grad_weight_gemm,
    output_gemm,
    weight_for_grad_input,
    x_for_grad_weight,
)
from .rowwise_blockwise_mx import FINER_GEMMS, gemm_or_zeros, weight_gemm

# -- the per-group GEMMs (custom ops under torch.compile) ---------------------------------------
# A custom op takes no recipe object: the finer recipe travels as its class name and the fields
# its GEMMs read (`_recipe_args`), and is rebuilt inside (`_recipe`).


def _recipe_args(recipe) -> tuple[str, int, bool, str, list[bool]]:
    """`(class name, block_size, hp_grad_weight, scale_rounding, fast_accum)` of a finer recipe
    (0, False, "" and `[False] * 3` where the recipe has no such field)."""
    return (
        type(recipe).__name__,
        getattr(recipe, "block_size", 0),
        getattr(recipe, "hp_grad_weight", False),
        getattr(recipe, "scale_rounding", ""),
        list(getattr(recipe, "fast_accum", (False,) * 3)),
    )


def _recipe(
    kind: str, block_size: int, hp_grad_weight: bool, scale_rounding: str, fast_accum: list[bool]
):
    """The finer recipe `_recipe_args` described."""
    if kind == "RowwiseScaling":
        return RowwiseScaling(hp_grad_weight=hp_grad_weight, fast_accum=tuple(fast_accum))
    if kind == "BlockwiseScaling":
        return BlockwiseScaling(block_size=block_size)
    assert kind == "MXScaling", kind  # `_recipe_args` of a finer recipe: one of three
    return MXScaling(block_size=block_size, scale_rounding=scale_rounding)


def _rows(
    a: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    gemm: int,
    kind: str,
    block_size: int,
    hp_grad_weight: bool,
    scale_rounding: str,
    fast_accum: list[bool],
    backend: str,
) -> torch.Tensor:
    """The output (`gemm` 0, `a` = x `(T, K)`) or grad_input (`gemm` 1, `a` = the output
    gradient `(T, N)`) GEMM of each group's rows of `a` with `weight[e]` (`(E, N, K)`), as
    the dense op's: `(T, N)` or `(T, K)` in `a`'s dtype, rows past `offs[-1]` 0."""
    recipe = _recipe(kind, block_size, hp_grad_weight, scale_rounding, fast_accum)
    cols = weight.shape[2 if gemm else 1]
    out = a.new_zeros(a.shape[0], cols)
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            out[s:t] = weight_gemm(gemm, a[s:t], weight[e], recipe, backend, (t - s, cols), a.dtype)
    return out


def _rows_fake(a, weight, offs, gemm, *recipe_args_and_backend):
    return a.new_empty(a.shape[0], weight.shape[2 if gemm else 1])


def _weights(
    g: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    kind: str,
    block_size: int,
    hp_grad_weight: bool,
    scale_rounding: str,
    fast_accum: list[bool],
    backend: str,
) -> torch.Tensor:
    """The grad_weight GEMM of each group, as the dense op's on its rows of `g` `(T, N)` and
    `x` `(T, K)`: `(E, N, K)` in `g`'s dtype, 0 for an empty group."""
    recipe = _recipe(kind, block_size, hp_grad_weight, scale_rounding, fast_accum)
    fn, (n, k) = FINER_GEMMS[type(recipe)][2], (g.shape[1], x.shape[1])
    out = g.new_zeros(offs.shape[0], n, k)
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            out[e] = gemm_or_zeros(fn, g[s:t], x[s:t], recipe, backend, (n, k), g.dtype)
    return out


def _weights_fake(g, x, offs, *recipe_args_and_backend):
    return g.new_empty(offs.shape[0], g.shape[1], x.shape[1])


rows = custom_op_when_compiling("finer_grouped_rows", _rows, _rows_fake)
weights = custom_op_when_compiling("finer_grouped_weights", _weights, _weights_fake)


# -- the ops ------------------------------------------------------------------------------------


class _FinerGroupedMM(torch.autograd.Function):
    """out = concat_e(x[s_e:t_e] @ weight[e].T) under a stateless finer recipe.

    Inputs: x `(T, K)`, weight `(E, N, K)`, offs int32 `(E,)`, recipe (`RowwiseScaling`,
    `BlockwiseScaling` or `MXScaling`), backend. Saves `x` and `weight` in high precision (each
    GEMM quantizes its operands along its own contraction dim).
    """

    @staticmethod
    def forward(x, weight, offs, recipe, backend):
        return rows(x, weight, offs, 0, *_recipe_args(recipe), backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, offs, recipe, backend = inputs
        ctx.save_for_backward(x, weight, offs)
        ctx.recipe, ctx.backend = recipe, backend

    @staticmethod
    @never_compiled_alone  # (run by autograd from eager code: see the fence)
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        args, needs = (*_recipe_args(ctx.recipe), ctx.backend), ctx.needs_input_grad

        def gemms(g, x, weight, offs):
            return (
                rows(g, weight, offs, 1, *args).to(x.dtype) if needs[0] else None,
                weights(g, x, offs, *args).to(weight.dtype) if needs[1] else None,
            )

        with no_autocast(grad_out):
            grad_x, grad_w = each_member(gemms, grad_out.contiguous(), x, weight, offs)
        grad_x, grad_w = first_order_only((grad_x, grad_w), grad_out, x, weight, experts=True)
        return grad_x, grad_w, None, None, None


def finer_grouped_mm(x, weight, offs, recipe, backend):
    """The grouped GEMM under `RowwiseScaling`, `BlockwiseScaling` or `MXScaling`.

    Args:
      x: `(T, K)` float32 or bfloat16 (or float16, not under MX), autocast already applied.
      weight: `(E, N, K)`. offs: int32 `(E,)` cumulative group ends.
      recipe: the finer recipe. backend: `"emulated"` or (rowwise) `"scaled_mm"`.

    Returns:
      `(T, N)` in `x.dtype`.
    """
    return _FinerGroupedMM.apply(x, weight, offs, recipe, backend)


# -- NVFP4 per expert ---------------------------------------------------------------------------
# The per-group GEMMs take the recipe's three flags, the site id and the rank; `keys` is int64
# `(E,)`, expert e's key folded with e (None: a recipe without randomness).


def _nvfp4_rows(
    a: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    expert_keys: torch.Tensor | None,
    gemm: int,
    stochastic_rounding: bool,
    hadamard: bool,
    weight_2d: bool,
    site: int,
    rank: int,
) -> torch.Tensor:
    """The output (`gemm` 0, `a` = x `(T, K)`) or grad_input (`gemm` 1, `a` = the output
    gradient `(T, N)`) GEMM of each group's rows with `weight[e]` `(E, N, K)`, as the dense
    NVFP4 op's: float32 `(T, N)` or `(T, K)`, rows past `offs[-1]` 0."""
    recipe = NVFP4Scaling(
        stochastic_rounding=stochastic_rounding, hadamard=hadamard, weight_2d=weight_2d
    )
    out = a.new_zeros(a.shape[0], weight.shape[2 if gemm else 1], dtype=torch.float32)
    for e, (s, t) in enumerate(bounds(offs)):
        if t == s:
            continue
        if gemm == 0:
            out[s:t] = output_gemm(a[s:t], weight[e], recipe)
        else:
            key = None if expert_keys is None else expert_keys[e]
            w_values = dequantize_nvfp4(*weight_for_grad_input(weight[e], recipe))
            out[s:t] = grad_input_gemm(a[s:t].float(), w_values, key, site, rank, recipe)
    return out


def _nvfp4_rows_fake(a, weight, offs, expert_keys, gemm, *args):
    return a.new_empty(a.shape[0], weight.shape[2 if gemm else 1], dtype=torch.float32)


def _nvfp4_weights(
    g: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    expert_keys: torch.Tensor | None,
    stochastic_rounding: bool,
    hadamard: bool,
    weight_2d: bool,
    site: int,
    rank: int,
) -> torch.Tensor:
    """The grad_weight GEMM of each group, as the dense NVFP4 op's on its rows of `g` `(T, N)`
    and `x` `(T, K)`: float32 `(E, N, K)`, 0 for an empty group."""
    recipe = NVFP4Scaling(
        stochastic_rounding=stochastic_rounding, hadamard=hadamard, weight_2d=weight_2d
    )
    out = g.new_zeros(offs.shape[0], g.shape[1], x.shape[1], dtype=torch.float32)
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            key = None if expert_keys is None else expert_keys[e]
            x_values = dequantize_nvfp4(*x_for_grad_weight(x[s:t], key, site, recipe))
            out[e] = grad_weight_gemm(g[s:t].float(), x_values, key, site, rank, recipe)
    return out


def _nvfp4_weights_fake(g, x, offs, *args):
    return g.new_empty(offs.shape[0], g.shape[1], x.shape[1], dtype=torch.float32)


nvfp4_rows = custom_op_when_compiling("nvfp4_grouped_rows", _nvfp4_rows, _nvfp4_rows_fake)
nvfp4_weights = custom_op_when_compiling(
    "nvfp4_grouped_weights", _nvfp4_weights, _nvfp4_weights_fake
)


_FinerGroupedMM.vmap = vmap_per_member(_FinerGroupedMM)


class _NVFP4GroupedMM(torch.autograd.Function):
    """out = concat_e(x[s_e:t_e] @ weight[e].T) under NVFP4, expert e drawing with its key.

    Inputs: x `(T, K)`, weight `(E, N, K)`, offs int32 `(E,)`, expert_keys int64 `(E,)` or
    None, recipe, site (int), rank (int). Returns `(out, anchor)` as the dense op. Saves `x` and
    `weight` in high precision (the dense op saves their packed FP4 copies: a group's `x.T` is
    quantized along its own tokens, of a size only `offs` tells), quantized again in the
    backward to the same bits.
    """

    @staticmethod
    def forward(x, weight, offs, expert_keys, recipe, site, rank):
        flags = (recipe.stochastic_rounding, recipe.hadamard, recipe.weight_2d)
        out = nvfp4_rows(x, weight, offs, expert_keys, 0, *flags, site, rank)
        return out.to(x.dtype), x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, offs, expert_keys, recipe, site, rank = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, offs, expert_keys, output[1])
        ctx.args = (recipe.stochastic_rounding, recipe.hadamard, recipe.weight_2d, site, rank)

    @staticmethod
    @never_compiled_alone  # (run by autograd from eager code: see the fence)
    def backward(ctx, grad_out, _):
        x, weight, offs, expert_keys, anchor = ctx.saved_tensors
        needs, args = ctx.needs_input_grad, ctx.args

        def gemms(grad_out, x, weight, offs, expert_keys):
            return (
                nvfp4_rows(grad_out, weight, offs, expert_keys, 1, *args).to(x.dtype)
                if needs[0]
                else None,
                nvfp4_weights(grad_out, x, offs, expert_keys, *args).to(weight.dtype)
                if needs[1]
                else None,
            )

        with no_autocast(grad_out):
            grad_x, grad_w = each_member(gemms, grad_out, x, weight, offs, expert_keys)
        return (
            *first_order_only((grad_x, grad_w), anchor, experts=True),
            None,
            None,
            None,
            None,
            None,
        )


_NVFP4GroupedMM.vmap = vmap_per_member(_NVFP4GroupedMM)


def nvfp4_grouped_mm(x, weight, offs, recipe, random):
    """The grouped GEMM under `NVFP4Scaling`: per expert, the dense NVFP4 op's numerics.

    Args:
      x: `(T, K)` floating. weight: `(E, N, K)`. offs: int32 `(E,)` cumulative group ends.
      recipe: the `NVFP4Scaling`.
      random: `(key, site)` (`key` float64 `()` holding an integer in `[0, 2**52)`, `site` the
        experts weight's site name), or None for a recipe without randomness. Expert `e`
        draws with `keys.fold_key(key, e)`.

    Returns:
      `(T, N)` in `x.dtype`; rows past `offs[-1]` are exact zeros with zero gradients.
    """
    key, site = (None, 0) if random is None else random
    expert_keys = None
    if key is not None:
        keys.check_key("apply", key)
        site = keys.site_id(site)
        expert_keys = torch.stack(
            [keys.fold_key(key.detach(), e) for e in range(weight.shape[0])]
        ).to(torch.int64)
    out, _ = _NVFP4GroupedMM.apply(x, weight, offs, expert_keys, recipe, site, keys.process_rank())
    return out
