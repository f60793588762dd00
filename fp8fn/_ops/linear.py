"""`fp8fn.linear`, the primitive: its checks, and the routing to the recipe's op."""

from __future__ import annotations

import torch

from .._core.checks import check_operands, no_autocast, refuse_compile_under_func
from .._core.recipes import RECIPES, DelayedScaling, NVFP4Scaling
from .._core.state import check_scales, check_site_state, claim, filled_mark
from .gemm import resolve_backend
from .nvfp4 import check_nvfp4, check_random, nvfp4_linear
from .rowwise_blockwise_mx import FINER, check_finer, finer_linear
from .tensorwise import tensorwise_linear


def linear(x, weight, bias, site_state, recipe):
    """`x @ weight.T + bias` with both operands in float8, and float8 gradients.

    Every GEMM (the output, `grad_input`, `grad_weight`) runs on float8 operands; the bias
    gradient is taken in high precision. Casts saturate finite values and keep inf and NaN
    visible (as NaN). Under autocast, `x` is first cast to the autocast dtype (as torchao does)
    and the op itself is not re-autocast, so every route gives the same bits.

    * Per tensor (`DelayedScaling`, `CurrentScaling`): the forward casts `x` and `weight` to
      `float8_e4m3fn`, the backward casts the output gradient to `float8_e5m2`; only the float8
      copies of `x` and `weight` (1 byte per element) and scalars are saved for the backward.
      Under `DelayedScaling`, each cast uses the scale stored in `site_state` (or the tensor's
      own amax while that role's history is empty). The gradient with respect to `site_state`
      is the observation: `amax_history[:, 0]` holds the amaxes of input, weight and output
      gradient seen in this call. Higher-order derivatives are refused.
    * Finer (`RowwiseScaling`, `BlockwiseScaling`, `MXScaling`): each GEMM quantizes both of
      its operands from high precision along its contraction dim, so `x` and `weight` are
      saved in high precision.

    Under `NVFP4Scaling` the operands are NVFP4 instead (see the recipe), and `site_state` is
    the pair `(key, site)` from which the random bits are drawn: `key` a float64 `()` tensor
    holding an integer (a transform's `state.key`), `site` the call's name (a str; the same
    name as a transform's site draws the same bits). It may be None for a recipe without
    stochastic rounding or Hadamard transform. The key is not differentiated (its gradient
    is 0).

    Args:
      x: `(..., in_features)` in float32, bfloat16 or float16.
      weight: `(out_features, in_features)`, floating.
      bias: `(out_features,)` or None.
      site_state: `state[site]` of an `fp8fn.State` for `DelayedScaling` (made for this recipe:
        its config is checked); `(key, site)` for `NVFP4Scaling`; None otherwise.
      recipe: an fp8fn recipe (`DelayedScaling`, `CurrentScaling`, `RowwiseScaling`,
        `BlockwiseScaling`, `MXScaling`, `NVFP4Scaling`).

    Returns:
      `(..., out_features)` in `x.dtype` (the autocast dtype under autocast).

    Example:
      >>> import torch, fp8fn
      >>> recipe = fp8fn.DelayedScaling()
      >>> state = fp8fn.init_state(recipe, ["fc"])
      >>> x, w = torch.randn(8, 32), torch.randn(16, 32)
      >>> y = fp8fn.linear(x, w, None, state["fc"], recipe)
      >>> y.shape, y.dtype
      (torch.Size([8, 16]), torch.float32)
    """
    if not isinstance(recipe, RECIPES):
        raise TypeError(
            f"fp8fn.linear: expected `recipe` to be an fp8fn recipe (e.g. fp8fn.DelayedScaling), "
            f"got {type(recipe).__name__}."
        )
    check_operands("linear", x, weight, bias)
    if isinstance(recipe, DelayedScaling):
        check_site_state("linear", site_state)
        h = recipe.history_len
        if site_state.amax_history.shape[-1] != h:
            raise ValueError(
                f"fp8fn.linear: expected `site_state` of history length {h} like the recipe's, "
                f"got {site_state.amax_history.shape[-1]}."
            )
        if site_state.static != (recipe.amax_compute, recipe.margin):
            raise ValueError(
                "fp8fn.linear: expected `site_state` made for the recipe, got one with "
                f"amax_compute={site_state.amax_compute!r}, margin={site_state.margin} against "
                f"{recipe}. A site's static config lives in its state: make the state with "
                "fp8fn.init_state(recipe, sites) (or fn.init) for this recipe."
            )
        check_scales("linear", site_state.scale, "site_state")
        claim(site_state.amax_history, "linear", "site_state", site_state._row)
        newest, stored = site_state.amax_history[:, 0], site_state.scale
        filled = _site_filled(site_state)
        return fp8_linear(x, weight, bias, newest, stored, recipe, filled=filled)
    elif isinstance(recipe, NVFP4Scaling):
        check_random("linear", site_state, recipe, x.device)
        return fp8_linear(x, weight, bias, None, None, recipe, random=site_state)
    elif site_state is not None:
        raise TypeError(
            f"fp8fn.linear: {type(recipe).__name__} is stateless: expected `site_state` None, "
            f"got {type(site_state).__name__}."
        )
    return fp8_linear(x, weight, bias, None, None, recipe)


def _site_filled(site_state) -> tuple[bool, bool, bool] | None:
    """Which of the site's three roles (input, weight, grad_output) hold an observation, where
    `update` marked it of the values of the `State` the site's rows are views of (`State[site]`;
    identity and version, no host read): those cast with the stored scale alone, one pass per
    tensor. None (decided in the graph) for rows of no such state, and under torch.compile,
    where `fn.apply`'s in-graph check (`known_filled`) is not made."""
    if site_state._row is None or torch.compiler.is_compiling():
        return None
    history, i = site_state._row
    filled = filled_mark(history)[0]
    return None if not filled else filled[3 * i : 3 * i + 3]


def fp8_linear(
    x, weight, bias, newest, stored, recipe, random=None, filled=None, api: str = "linear"
):
    """`linear` on checked operands: `newest`, `stored` float32 `(3,)` or None; `random`
    `(key, site)` (NVFP4) or None; `filled` the roles whose histories are known non-empty
    (the site's three of `known_filled`) or None; `api` what the user called, for errors
    (`fp8fn.{api}:`)."""
    refuse_compile_under_func(api)
    if newest is not None and newest.device != x.device:
        raise ValueError(
            f"fp8fn.{api}: expected the scaling state on the device of `x`, {x.device}, got "
            f"{newest.device}. Move it: `state = state.to(device)`."
        )
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    backend = resolve_backend(recipe, x.device, api)
    if isinstance(recipe, NVFP4Scaling):
        check_nvfp4(x, weight, api)
        with no_autocast(x):
            return nvfp4_linear(x, weight, bias, recipe, random, api)
    if isinstance(recipe, FINER):
        check_finer(x, weight, recipe, api)
        with no_autocast(x):
            return finer_linear(x, weight, bias, recipe, backend, api)
    margin = getattr(recipe, "margin", 0)
    return tensorwise_linear(
        x,
        weight,
        bias,
        newest,
        stored,
        margin,
        backend,
        filled=filled,
        fast_accum=recipe.fast_accum,
        api=api,
    )
