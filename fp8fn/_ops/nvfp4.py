"""The NVFP4 linear (`NVFP4Scaling`): three emulated FP4 GEMMs, randomness drawn from a key.

`x` is `(m, k)`, `weight` `(n, k)`, the output gradient `g` `(m, n)`. Each GEMM quantizes both
operands to NVFP4 (`_numerics.nvfp4.quantize_nvfp4`) along its contraction dim, dequantizes them and
multiplies in float32 (no FP4 GEMM here):

* `output = x @ weight.T` over k: `x` in 1 x 16 blocks, `weight` in 16 x 16 tiles
  (`weight_2d`) or 1 x 16 blocks, both rounded to nearest even.
* `grad_input = g @ weight` over n: `g` in 1 x 16 blocks, stochastically rounded
  (`stochastic_rounding`); `weight` the forward's tiles (`weight_2d`: the same quantized
  weight) or `weight.T` in 1 x 16 blocks along n.
* `grad_weight = g.T @ x` over m (the tokens): `g.T` and `x.T`, each first multiplied by the
  16 x 16 random Hadamard transform along m (`hadamard`; the product is unchanged in exact
  arithmetic), then quantized in 1 x 16 blocks along m, `g.T` stochastically rounded.

Randomness is data. Every draw is `random_bits(key, site, role, shape, stream)`, a pure
function: `key` the integer in the state's float64 `key` leaf (`_core.keys`), `site` a stable
32-bit hash of the call's site name (`keys.site_id`), `role` which draw (`DRAW_GRAD_INPUT` or
`DRAW_GRAD_WEIGHT`). The Hadamard signs of a layer (one `(16,)` vector
for both `grad_weight` operands) are shared by all ranks; the stochastic-rounding bits fold in
the process's rank (`stream = 2 * rank`), so data-parallel ranks round their own gradients
independently and their rounding errors average out; rank 0 (and a single process) draws
stream 0.

Saved for the backward is what an FP4 kernel needs, not the high-precision operands: the
quantized weight for `grad_input` and the (transformed) `x.T` quantized along m for
`grad_weight`, as packed E2M1 codes (two per byte) with their E4M3 and float32 scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._core import keys
from .._core.checks import no_autocast
from .._core.recipes import NVFP4Scaling
from .._numerics.nvfp4 import (
    NVFP4,
    dequantize_nvfp4,
    hadamard_signs,
    pack_e2m1,
    quantize_dequantize_nvfp4,
    quantize_nvfp4,
    random_bits,
    random_hadamard,
    unpack_e2m1,
)
from .._torch_private import never_compiled_alone
from .first_order import first_order_only, kept_api

# The draws' indices (`random_bits`' `role` argument; not the state's roles, `input`, `weight`
# and `grad_output`, which index its rows): the output gradient of the grad_input GEMM, and of
# the grad_weight GEMM (whose Hadamard signs are stream 1 of the same index).
DRAW_GRAD_INPUT = 2
DRAW_GRAD_WEIGHT = 3


# -- randomness as data ---------------------------------------------------------------------------


def _sr_bits(key, site, role, shape, rank, recipe):
    """Stochastic-rounding bits of one operand (stream `2 * rank`; the signs use stream 1),
    or None (round to nearest even) when the recipe does not round stochastically."""
    if not recipe.stochastic_rounding:
        return None
    return random_bits(key, site, role, shape, stream=2 * rank)


# -- quantized operands ---------------------------------------------------------------------------


def _pack(q: NVFP4) -> tuple:
    """`q` as saved for the backward: codes two per byte (last dim padded to even)."""
    codes = q.codes
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    return pack_e2m1(codes), q.block_scale, q.tensor_scale


def _unpack(saved: tuple, k: int) -> torch.Tensor:
    """The float32 values of an operand saved by `_pack`, with last dim `k`."""
    packed, block_scale, tensor_scale = saved
    return dequantize_nvfp4(unpack_e2m1(packed)[..., :k], block_scale, tensor_scale)


def _hadamard(t, key, site, recipe):
    """`t` `(r, m)` times the random Hadamard transform along m, or `t` itself."""
    if not recipe.hadamard:
        return t
    return random_hadamard(t, hadamard_signs(key, site, DRAW_GRAD_WEIGHT))


def weight_for_grad_input(weight, recipe) -> NVFP4:
    """`weight` quantized along n: its 16 x 16 tiles (`(n, k)`, as the forward's), or
    `weight.T` `(k, n)` in blocks along n."""
    if recipe.weight_2d:
        return quantize_nvfp4(weight, tile_2d=True)
    return quantize_nvfp4(weight.t())


def x_for_grad_weight(x, key, site, recipe) -> NVFP4:
    """`x.T` `(k, m)` (Hadamard-transformed: `(k, 16 * ceil(m / 16))`) quantized along m."""
    return quantize_nvfp4(_hadamard(x.t(), key, site, recipe))


# -- the three GEMMs (float32 results) -------------------------------------------------------------


def output_gemm(x, weight, recipe) -> torch.Tensor:
    """`x` `(m, k)` times `weight` `(n, k)` transposed, both quantized along k: `(m, n)`."""
    w_values = quantize_dequantize_nvfp4(weight, tile_2d=recipe.weight_2d)
    return torch.mm(quantize_dequantize_nvfp4(x), w_values.t())


def grad_input_gemm(g, w_values, key, site, rank, recipe) -> torch.Tensor:
    """`g` float32 `(m, n)` quantized along n (stochastic rounding: draw `DRAW_GRAD_INPUT`)
    times the weight's `weight_for_grad_input` values `w_values` (float32 `(n, k)` tiles, or
    `(k, n)` blocks along n): `(m, k)`."""
    bits = _sr_bits(key, site, DRAW_GRAD_INPUT, g.shape, rank, recipe)
    g_values = quantize_dequantize_nvfp4(g, sr_bits=bits)
    return torch.mm(g_values, w_values if recipe.weight_2d else w_values.t())


def grad_weight_gemm(g, x_values, key, site, rank, recipe) -> torch.Tensor:
    """`g.T` (`g` float32 `(m, n)`; Hadamard-transformed, quantized along m, draw
    `DRAW_GRAD_WEIGHT`) times `x_values` (float32 `(k, m')`, `x_for_grad_weight`'s values)
    transposed: `(n, k)`."""
    g_t = _hadamard(g.t(), key, site, recipe)  # (n, m) or (n, 16 * ceil(m / 16))
    bits = _sr_bits(key, site, DRAW_GRAD_WEIGHT, g_t.shape, rank, recipe)
    return torch.mm(quantize_dequantize_nvfp4(g_t, sr_bits=bits), x_values.t())


# -- the op ---------------------------------------------------------------------------------------


class _NVFP4Linear(torch.autograd.Function):
    """y = x @ weight.T + bias under NVFP4. x (m, k), weight (n, k), bias (n,) or None; `key`
    `()` int64 or None (a recipe without randomness), `site` int, `rank` int, `api` what the
    user called (static).

    Returns `(y, anchor)`: `anchor` a `()` zero whose only use is to tell the backward whether
    an outer differentiation records it (then using its results raises: higher-order
    derivatives through the casts are not defined).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, key, recipe, site, rank, api):
        out = output_gemm(x, weight, recipe)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype), x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, key, recipe, site, rank, api = inputs
        ctx.set_materialize_grads(False)  # the anchor gets no gradient: no zeros made
        needs = ctx.needs_input_grad
        ctx.recipe, ctx.site, ctx.rank, ctx.api = recipe, site, rank, api
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        # What an FP4 kernel keeps: the quantized operands of the backward's GEMMs (a weight
        # in 16 x 16 tiles is the forward's, quantized again here: the same bits).
        w_saved = _pack(weight_for_grad_input(weight, recipe)) if needs[0] else ()
        x_q = x_for_grad_weight(x, key, site, recipe) if needs[1] else None
        x_saved = _pack(x_q) if needs[1] else ()
        # (n, k, and m' the columns of the quantized x.T: m, or 16 * ceil(m / 16) transformed)
        ctx.shapes = (weight.shape[0], weight.shape[1], x_q.codes.shape[1] if needs[1] else 0)
        ctx.counts = (len(w_saved), len(x_saved))
        ctx.save_for_backward(*w_saved, *x_saved, key, output[1])

    @staticmethod
    @never_compiled_alone  # (run by autograd from eager code: see the fence)
    def backward(ctx, grad_out, _):
        *saved, key, anchor = ctx.saved_tensors
        with no_autocast(grad_out):
            grads = _NVFP4Linear._grads(ctx, grad_out, saved, key)
        return (*first_order_only(grads, anchor, api=ctx.api), None, None, None, None, None)

    @staticmethod
    def _grads(ctx, grad_out, saved, key):
        """`(grad_x, grad_w, grad_b)`, None where not needed."""
        n_w, _ = ctx.counts
        w_saved, x_saved = tuple(saved[:n_w]), tuple(saved[n_w:])
        recipe, site, rank = ctx.recipe, ctx.site, ctx.rank
        n, k, m_cols = ctx.shapes
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        g = grad_out.float()
        if needs[0]:
            w_values = _unpack(w_saved, k if recipe.weight_2d else n)
            grad_x = grad_input_gemm(g, w_values, key, site, rank, recipe).to(x_dtype)
        if needs[1]:
            x_values = _unpack(x_saved, m_cols)
            grad_w = grad_weight_gemm(g, x_values, key, site, rank, recipe).to(w_dtype)
        if needs[2]:
            grad_b = g.sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b


def check_nvfp4(x, weight, api: str = "linear") -> None:
    """The checks NVFP4 adds to `check_operands`' (`api` names the caller)."""
    if x.numel() == 0 or weight.numel() == 0:
        raise ValueError(
            f"fp8fn.{api}: expected non-empty `x` and `weight` under NVFP4Scaling, got x "
            f"{tuple(x.shape)} and weight {tuple(weight.shape)}."
        )


def check_random(api: str, random, recipe: NVFP4Scaling, device: torch.device) -> None:
    """Raise unless `random` is `(key, site)` (key float64 `()` on `device`, site a str), or
    None for a recipe that draws no random bits."""
    if random is None and not recipe.random:
        return
    fix = (
        "Pass `(key, site)`: `key` a float64 () tensor holding an integer in [0, 2**52) (e.g. "
        "`state.key` "
        "of fn.init(..., seed=...)), `site` the call's name (e.g. 'fc1')."
    )
    if not (isinstance(random, (tuple, list)) and len(random) == 2):
        raise TypeError(
            f"fp8fn.{api}: expected `site_state` to be a pair `(key, site)` under {recipe}, got "
            f"{type(random).__name__}. {fix}"
        )
    key, site = random
    if not (isinstance(key, torch.Tensor) and key.dtype == torch.float64 and key.dim() == 0):
        got = f"{key.dtype} {tuple(key.shape)}" if isinstance(key, torch.Tensor) else type(key)
        raise TypeError(
            f"fp8fn.{api}: expected the key of `site_state` to be a float64 () tensor, got "
            f"{got if isinstance(got, str) else got.__name__}. {fix}"
        )
    if not isinstance(site, str):
        raise TypeError(
            f"fp8fn.{api}: expected the site of `site_state` to be a str, got "
            f"{type(site).__name__}. {fix}"
        )
    if key.device != device:
        raise ValueError(
            f"fp8fn.{api}: expected the key on the device of `x`, {device}, got {key.device}. "
            "Move the state: `state = state.to(device)`."
        )
    keys.check_key(api, key, "the key of `site_state`")


def nvfp4_linear(x, weight, bias, recipe: NVFP4Scaling, random, api: str = "linear"):
    """`x @ weight.T + bias` under `NVFP4Scaling`, emulated (see the module docstring).

    Args:
      x: `(..., in_features)` in float32, bfloat16 or float16.
      weight: `(out_features, in_features)`.
      bias: `(out_features,)` or None.
      recipe: the `NVFP4Scaling`.
      random: `(key, site)`: `key` float64 `()` holding an integer in `[0, 2**52)`, `site`
        the site's name, or its `keys.site_id` as an int64 `()` tensor (`fn.apply`: the same
        graph for every layer under torch.compile); or None for a recipe without randomness.
      api: what the user called, for errors (`fp8fn.{api}:`, e.g. a second derivative).

    Returns:
      `(..., out_features)` in `x.dtype`.
    """
    key, site = (None, 0) if random is None else random
    if key is not None:
        keys.check_key("apply", key)  # once per key tensor (fp8fn.linear's is checked already)
        key = key.detach().to(torch.int64)
        site = keys.site_id(site) if isinstance(site, str) else site
    out, _ = _NVFP4Linear.apply(
        x.reshape(-1, x.shape[-1]),
        weight,
        bias,
        key,
        recipe,
        site,
        keys.process_rank(),
        kept_api(api),
    )
    return out.reshape(*x.shape[:-1], weight.shape[0])
