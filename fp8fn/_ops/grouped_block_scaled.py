"""The grouped GEMM under the stateless recipes: rowwise, blockwise and MXFP8 per group, NVFP4
per expert.

`x` is `(T, K)`, the experts' weight `(E, N, K)`, `offs` int32 `(E,)` the cumulative group
ends: rows `offs[e-1]:offs[e]` of `x` go to expert `e`; rows past `offs[-1]` come out 0 and get
no gradient. Each group runs the dense op's numerics on its rows (`block_scaled`'s GEMMs,
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

An expert with no token (an empty group) costs nothing and gets an exact zero weight gradient.

Backends: emulated, one dequantized matmul per group (as the dense op, reading `offs` on the
host). Per-group `torch.mm` and one `torch._grouped_mm` give the same bits on CPU (torch 2.13,
float32 and bfloat16); the per-group matmul was the faster in `benchmarks/moe.py`'s full runs,
and `torch._grouped_mm` on CPU needs 16-byte-aligned strides. The finer recipes have no
GPU GEMM here (as the dense op: `resolve_backend` emulates them).

torch.compile: the finer recipes' per-group loops (the output and grad_input GEMMs over each
group's rows, the grad_weight GEMM per group) run as two custom ops, `fp8fn::finer_grouped_rows`
and `fp8fn::finer_grouped_weights` (`grouped_gemm.custom_op_when_compiling`), so `offs` is read
inside them, the graph does not break, and compiled and eager run the same code (the same
bits); eagerly the same functions run directly. One in-graph grouped GEMM is not an option on
CPU: `torch._grouped_mm`'s fake (torch 2.13) takes bfloat16 only, and the emulated GEMMs are
float32. NVFP4 per expert still loops on the host: `apply` refuses it under torch.compile.
"""

from __future__ import annotations

import torch

from .._core import keys
from .._core.checks import no_autocast
from .._core.recipes import BlockwiseScaling, MXScaling, RowwiseScaling
from .block_scaled import _GEMMS, _gemm
from .grouped_gemm import bounds, custom_op_when_compiling
from .nvfp4 import _NVFP4Linear

# -- the per-group GEMMs (custom ops under torch.compile) ---------------------------------------
# A custom op takes no recipe object: the finer recipe travels as its class name and the fields
# its GEMMs read (`_recipe_args`), and is rebuilt inside (`_recipe`).


def _recipe_args(recipe) -> tuple[str, int, bool, str]:
    """`(class name, block_size, hp_grad_weight, scale_rounding)` of a finer recipe (0, False
    and "" where the recipe has no such field)."""
    return (type(recipe).__name__, getattr(recipe, "block_size", 0),
            getattr(recipe, "hp_grad_weight", False), getattr(recipe, "scale_rounding", ""))


def _recipe(kind: str, block_size: int, hp_grad_weight: bool, scale_rounding: str):
    """The finer recipe `_recipe_args` described."""
    if kind == "RowwiseScaling":
        return RowwiseScaling(hp_grad_weight=hp_grad_weight)
    if kind == "BlockwiseScaling":
        return BlockwiseScaling(block_size=block_size)
    return MXScaling(block_size=block_size, scale_rounding=scale_rounding)


def _rows(a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, gemm: int, kind: str,
          block_size: int, hp_grad_weight: bool, scale_rounding: str,
          backend: str) -> torch.Tensor:
    """The output (`gemm` 0, `a` = x `(T, K)`) or grad_input (`gemm` 1, `a` = the output
    gradient `(T, N)`) GEMM of each group's rows of `a` with `weight[e]` (`(E, N, K)`), as
    the dense op's: `(T, N)` or `(T, K)` in `a`'s dtype, rows past `offs[-1]` 0."""
    recipe = _recipe(kind, block_size, hp_grad_weight, scale_rounding)
    fn, cols = _GEMMS[type(recipe)][gemm], weight.shape[2 if gemm else 1]
    out = a.new_zeros(a.shape[0], cols)
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            out[s:t] = _gemm(fn, a[s:t], weight[e], recipe, backend, (t - s, cols), a.dtype)
    return out


def _rows_fake(a, weight, offs, gemm, kind, block_size, hp_grad_weight, scale_rounding,
               backend):
    return a.new_empty(a.shape[0], weight.shape[2 if gemm else 1])


def _weights(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, kind: str, block_size: int,
             hp_grad_weight: bool, scale_rounding: str, backend: str) -> torch.Tensor:
    """The grad_weight GEMM of each group, as the dense op's on its rows of `g` `(T, N)` and
    `x` `(T, K)`: `(E, N, K)` in `g`'s dtype, 0 for an empty group."""
    recipe = _recipe(kind, block_size, hp_grad_weight, scale_rounding)
    fn, (n, k) = _GEMMS[type(recipe)][2], (g.shape[1], x.shape[1])
    out = g.new_zeros(offs.shape[0], n, k)
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            out[e] = _gemm(fn, g[s:t], x[s:t], recipe, backend, (n, k), g.dtype)
    return out


def _weights_fake(g, x, offs, kind, block_size, hp_grad_weight, scale_rounding, backend):
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
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        args, needs = (*_recipe_args(ctx.recipe), ctx.backend), ctx.needs_input_grad
        grad_x = grad_w = None
        with no_autocast(grad_out):
            g = grad_out.contiguous()
            if needs[0]:
                grad_x = rows(g, weight, offs, 1, *args).to(x.dtype)
            if needs[1]:
                grad_w = weights(g, x, offs, *args).to(weight.dtype)
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


def nvfp4_grouped_mm(x, weight, offs, recipe, random):
    """The grouped GEMM under `NVFP4Scaling`: per expert, the dense NVFP4 op.

    Args:
      x: `(T, K)` floating. weight: `(E, N, K)`. offs: int32 `(E,)` cumulative group ends.
      recipe: the `NVFP4Scaling`.
      random: `(key, site)` (`key` float64 `()` holding an integer in `[0, 2**52)`, `site` the
        experts weight's site name), or None for a recipe without randomness. Expert `e`
        draws with `keys.fold_key(key, e)`.

    Returns:
      `(T, N)` in `x.dtype`; rows past `offs[-1]` are exact zeros (still connected to `x` and
      `weight`, with zero gradients, through an empty contraction).
    """
    key, site = (None, 0) if random is None else random
    if key is not None:
        keys.check_key("apply", key)
        site = keys.site_id(site)
    rank = keys.process_rank()
    pieces, end = [], 0
    for e, (s, t) in enumerate(bounds(offs)):
        if t > s:
            key_e = None if key is None else keys.fold_key(key.detach(), e).to(torch.int64)
            out, _ = _NVFP4Linear.apply(x[s:t], weight[e], None, key_e, recipe, site, rank)
            pieces.append(out)
        end = t
    pieces.append(x[end:, :0] @ weight[0, :, :0].t().to(x.dtype))  # zeros, (T - end, N)
    return torch.cat(pieces)
