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
"""

from __future__ import annotations

import torch

from .._core import keys
from .._core.checks import no_autocast
from .block_scaled import _GEMMS, _gemm
from .nvfp4 import _NVFP4Linear


def bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """The `(start, end)` rows of each group (a host read of `offs`)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


class _FinerGroupedMM(torch.autograd.Function):
    """out = concat_e(x[s_e:t_e] @ weight[e].T) under a stateless finer recipe.

    Inputs: x `(T, K)`, weight `(E, N, K)`, offs int32 `(E,)`, recipe (`RowwiseScaling`,
    `BlockwiseScaling` or `MXScaling`), backend. Saves `x` and `weight` in high precision (each
    GEMM quantizes its operands along its own contraction dim).
    """

    @staticmethod
    def forward(x, weight, offs, recipe, backend):
        output = _GEMMS[type(recipe)][0]
        out = x.new_zeros(x.shape[0], weight.shape[1])
        for e, (s, t) in enumerate(bounds(offs)):
            if t > s:
                shape = (t - s, weight.shape[1])
                out[s:t] = _gemm(output, x[s:t], weight[e], recipe, backend, shape, x.dtype)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, offs, recipe, backend = inputs
        ctx.save_for_backward(x, weight, offs)
        ctx.recipe, ctx.backend = recipe, backend

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        _, grad_input, grad_weight = _GEMMS[type(ctx.recipe)]
        recipe, backend, needs = ctx.recipe, ctx.backend, ctx.needs_input_grad
        grad_x = torch.zeros_like(x) if needs[0] else None
        grad_w = torch.zeros_like(weight) if needs[1] else None
        with no_autocast(grad_out):
            g = grad_out.contiguous()
            for e, (s, t) in enumerate(bounds(offs)):
                if t == s:
                    continue
                g_e, x_e = g[s:t], x[s:t]
                if needs[0]:
                    grad_x[s:t] = _gemm(grad_input, g_e, weight[e], recipe, backend, x_e.shape,
                                        g.dtype)
                if needs[1]:
                    grad_w[e] = _gemm(grad_weight, g_e, x_e, recipe, backend, weight[e].shape,
                                      g.dtype)
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
