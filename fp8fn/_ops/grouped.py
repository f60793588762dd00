"""The per-expert float8 grouped GEMM (delayed and current tensorwise scaling): one
autograd.Function for `out[rows of e] = x[rows of e] @ weight[e].T`, every expert with its own
scales, whose gradient with respect to the experts' state rows is the observed amaxes (Flax's
overwrite-with-gradient, as `fp8fn.linear`).

An expert that received no token observes 0 for its input and its grad_output (0 = not
observed: `update` keeps those histories); its weight is observed as usual.

Backends: on CPU the GEMMs are emulated, one float32 matmul of the widened float8 operands per
group (`fp8_mm`), which reads the group offsets on the host (under torch.compile inside the
custom ops of `grouped_gemm`, so the graph does not break). On CUDA (`backend="scaled_mm"`)
the forward is one `torch._scaled_grouped_mm` call on sm_90 (torch's float32-scaled grouped
kernel is built for sm_90 only), where the torch in use has it, the output is bfloat16 and K, N
are multiples of 16 (per-expert scales given as its row and column scales), and the forward
otherwise goes per group through `fp8_mm`'s `torch._scaled_mm`. The backward's GEMMs, on
sm_90 and sm_100, are one `F.grouped_mm` each of the float8 operands widened to bfloat16,
with no host read (`grouped_gemm.grouped_on_device`: `_scaled_grouped_mm` takes e4m3 operands
only, and the output gradient is e5m2); elsewhere per group, as the forward. **The CUDA path
has not run on a GPU**; its calls pass torch's CUDA rules for sm_90 and sm_100 on CPU
(`fp8fn.testing.cuda_path_on_cpu`, tests/test_cuda_paths.py).

The op is built from the dense op's parts (`roles`: the scales, the grad_output cast, the
observation, what `setup_context` keeps; `first_order.first_order_only`, the guard).

The stateless recipes (rowwise, blockwise, MXFP8 per group; NVFP4 per expert) live in
`grouped_block_scaled`; `grouped_mm` dispatches on the recipe.
"""

from __future__ import annotations

import torch

from .._core.checks import no_autocast, refuse_compile_under_func
from .._core.device import cuda_capability
from .._core.recipes import NVFP4Scaling
from .._numerics.fp8 import E4M3, cast_to_fp8
from .._torch_private import never_compiled_alone, scaled_grouped_mm, scaled_grouped_mm_available
from .first_order import first_order_only
from .gemm import resolve_backend
from .grouped_block_scaled import finer_grouped_mm, nvfp4_grouped_mm
from .grouped_gemm import (
    grouped_on_device,
    rows_mm,
    rows_mm_on_device,
    weight_mm,
    weight_mm_on_device,
)
from .member_loop import each_member, vmap_per_member
from .nvfp4 import check_random
from .roles import cast_grad_output, keep_for_backward, observation, per_row, scales_for
from .rowwise_blockwise_mx import FINER, check_finer
from .tensorwise import placement_of


def _group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each of `rows` rows, int64 `(rows,)`, from the cumulative group ends
    `offs` (int `(E,)`, non-decreasing, last <= rows; rows past the last end get id E)."""
    return torch.searchsorted(
        offs.to(torch.int64), torch.arange(rows, device=offs.device), right=True
    )


def group_amax(hp: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Per-expert largest magnitude of the rows of `hp` `(rows, n)`: float32 `(E,)`, 0 for an
    expert with no row. NaN in a group's rows gives NaN."""
    row_amax = hp.abs().amax(1).float() if hp.shape[1] else hp.new_zeros(hp.shape[0]).float()
    out = torch.zeros(experts + 1, dtype=torch.float32, device=hp.device)
    out = out.scatter_reduce(0, ids, row_amax, "amax", include_self=True)
    nan = torch.zeros_like(out).scatter_add(0, ids, row_amax.isnan().float()) > 0
    return torch.where(nan, float("nan"), out)[:experts]


def expert_amax(weight: torch.Tensor) -> torch.Tensor:
    """Per-expert largest magnitude of `weight` `(E, ...)`: float32 `(E,)` (0 for an empty
    expert; NaN in an expert gives NaN)."""
    if weight.numel() == 0:
        return weight.new_zeros(weight.shape[0], dtype=torch.float32)
    return weight.abs().flatten(1).amax(1).float()


def _one_scaled_grouped_mm(x, weight, backend: str) -> bool:
    """Whether the forward runs as one `torch._scaled_grouped_mm` (see the module docstring)."""
    capability = cuda_capability(x.device)
    return (
        backend == "scaled_mm"
        and capability is not None
        and capability[0] == 9  # torch's float32-scaled grouped kernel is built for sm_90 only
        and scaled_grouped_mm_available()
        and x.dtype == torch.bfloat16
        and x.shape[1] % 16 == 0
        and weight.shape[1] % 16 == 0
    )


def _scaled_grouped_forward(x_fp8, w_fp8, x_inv, w_inv, ids, offs):
    """`torch._scaled_grouped_mm` of x_fp8 `(T, K)` and w_fp8 `(E, N, K)` (e4m3), with the
    per-expert inverse scales as row scales of x (float32 `(T,)`) and column scales of each
    expert's `(K, N)` operand (float32 `(E, N)`); bfloat16 `(T, N)`, rows past the last group
    0 (the kernel leaves them unwritten). Untested: no GPU here."""
    experts, n = w_fp8.shape[0], w_fp8.shape[1]
    row_inv = per_row(x_inv, ids)
    col_inv = w_inv[:, None].expand(experts, n).contiguous()
    # mat_b must be column-major in its last two dims: an (E, K, N) weight reached by a
    # transpose (Llama 4's bmm, batched_mm) is copied to (E, N, K) first (1 byte per element)
    w_t = w_fp8.contiguous().transpose(-2, -1)
    out = scaled_grouped_mm(x_fp8, w_t, row_inv, col_inv, offs, torch.bfloat16)
    return torch.where((ids < experts)[:, None], out, 0.0)


class _Fp8GroupedMM(torch.autograd.Function):
    """out = concat_e(x[s_e:t_e] @ weight[e].T) with float8 operands and per-expert scales.

    Inputs: x `(T, K)` floating; weight `(E, N, K)` (FSDP2's float8-gathered weight: cast
    already, taken through `place`, a `Local`, as the dense op takes it); offs int32 `(E,)`
    cumulative group ends (rows past `offs[-1]` get zeros and no gradient); `newest`, `stored`
    float32 `(E, 3)` (roles input, weight, grad_output per expert) or None for current scaling;
    `margin` an int; `backend` `fp8_mm`'s; `place` a `Local` (`placement_of(weight)`).
    The gradient with respect to `newest` is `(E, 3)`
    `[x_amax_e, w_amax_e, g_amax_e]`.
    """

    @staticmethod
    def forward(x, weight, offs, newest, stored, margin, backend, place):
        experts = weight.shape[0]
        ids = _group_ids(offs, x.shape[0])
        x_amax = group_amax(x, ids, experts)
        cast = place.float8_weight(weight)  # FSDP2's float8 all-gather: bytes, scales, amaxes
        w_amax = expert_amax(weight) if cast is None else cast[2]
        amaxes = torch.stack([x_amax, w_amax], 1)
        scales = scales_for(
            amaxes,
            None if newest is None else newest[:, :2],
            None if stored is None else stored[:, :2],
            margin,
            (448.0, 448.0),
        )
        x_scale, w_scale = scales.unbind(1)
        x_fp8 = cast_to_fp8(x, per_row(x_scale, ids)[:, None], E4M3)
        if cast is None:
            w_fp8 = cast_to_fp8(weight, w_scale[:, None, None], E4M3)
        else:  # cast with the scales of the step's all-gather (the same as `w_scale` would be)
            w_fp8, w_scale = cast[0], cast[1]
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        if _one_scaled_grouped_mm(x, weight, backend):
            out = _scaled_grouped_forward(x_fp8, w_fp8, x_inv, w_inv, ids, offs)
        else:
            out = rows_mm(x_fp8, w_fp8, x_inv, w_inv, offs, x.dtype, backend, False)
        return out, x_fp8, w_fp8, x_inv, w_inv, w_amax, x_amax

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, offs, newest, stored, margin, backend, place = inputs
        keep_for_backward(ctx, output, offs, newest, stored)
        ctx.margin, ctx.backend, ctx.dtypes = margin, backend, (x.dtype, weight.dtype)
        ctx.place = place

    @staticmethod
    @never_compiled_alone  # (run by autograd from eager code: see the fence)
    def backward(ctx, grad_out, *_):
        x_fp8, w_fp8, x_inv, w_inv, w_amax, x_amax, offs, newest, stored = ctx.saved_tensors
        experts = w_fp8.shape[0]
        x_dtype, w_dtype = ctx.dtypes
        with no_autocast(grad_out):
            ids = _group_ids(offs, grad_out.shape[0])
            g_amax = group_amax(grad_out, ids, experts)
            g_fp8, g_inv = cast_grad_output(grad_out, g_amax, newest, stored, ctx.margin, ids)
            needs, backend = ctx.needs_input_grad, ctx.backend
            grads = [None] * 8
            if needs[0]:
                w_fp8 = ctx.place.weight_again(w_fp8)
            n, k = g_fp8.shape[-1], x_fp8.shape[-1]
            on_device = grouped_on_device(backend, grad_out.device, n, k, experts)

            def gemms(g_fp8, w_fp8, x_fp8, g_inv, w_inv, x_inv, offs, ids):
                if on_device:  # one call each, the offsets read on the device
                    return (
                        rows_mm_on_device(g_fp8, w_fp8, g_inv, w_inv, offs, ids, x_dtype)
                        if needs[0]
                        else None,
                        weight_mm_on_device(g_fp8, x_fp8, g_inv, x_inv, offs, w_dtype)
                        if needs[1]
                        else None,
                    )
                return (
                    rows_mm(g_fp8, w_fp8, g_inv, w_inv, offs, x_dtype, backend, True)
                    if needs[0]
                    else None,
                    weight_mm(g_fp8, x_fp8, g_inv, x_inv, offs, w_dtype, backend)
                    if needs[1]
                    else None,
                )

            operands = (g_fp8, w_fp8, x_fp8, g_inv, w_inv, x_inv, offs, ids)
            grads[:2] = each_member(gemms, *operands)
            if needs[3]:
                grads[3] = observation(x_amax, w_amax, g_amax)
        return tuple(first_order_only(grads, x_amax, experts=True))


_Fp8GroupedMM.vmap = vmap_per_member(_Fp8GroupedMM, state=3)


def grouped_mm(
    x,
    weight,
    offs,
    newest=None,
    stored=None,
    margin: int = 0,
    backend: str = "emulated",
    recipe=None,
    random=None,
    api: str = "grouped_mm",
):
    """Float8 grouped GEMM: `(T, N)` of x's dtype, rows `offs[e-1]:offs[e]` of `x @ weight[e].T`.

    Args:
      x: `(T, K)` floating. weight: `(E, N, K)` (the layout of `F.linear` on `weight[e]`).
      offs: int32 `(E,)` cumulative group ends.
      newest, stored: float32 `(E, 3)` state rows, or None for current scaling (per-tensor
        recipes only). margin: int. backend: `"emulated"` or `"scaled_mm"` (per-tensor
        recipes; the others resolve theirs from `recipe`).
      recipe: None, `DelayedScaling` or `CurrentScaling` (per expert, tensorwise: `newest`,
        `stored`, `margin` and `backend` decide), or `RowwiseScaling`, `BlockwiseScaling`,
        `MXScaling` (per group), `NVFP4Scaling` (per expert).
      random: NVFP4 only: `(key, site)` as `fp8fn.linear`'s `site_state` (expert `e` draws
        with the key folded with `e`), or None for a recipe without randomness.
      api: what the user called, for errors (`fp8fn.{api}:`).

    Returns:
      `(T, N)` tensor of `x`'s dtype (the autocast dtype under autocast: `x` is cast to it
      first and the op itself is not re-autocast, as `fp8fn.linear`). Rows past `offs[-1]` are
      0 and get no gradient.
    """
    refuse_compile_under_func(api)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    with no_autocast(x):
        if isinstance(recipe, FINER):
            check_finer(x, weight, recipe)
            return finer_grouped_mm(x, weight, offs, recipe, resolve_backend(recipe, x.device, api))
        if isinstance(recipe, NVFP4Scaling):
            check_random("apply", random, recipe, x.device)
            return nvfp4_grouped_mm(x, weight, offs, recipe, random)
        place = placement_of(weight)  # FSDP2's float8-gathered experts weight gives its own
        return _Fp8GroupedMM.apply(x, weight, offs, newest, stored, margin, backend, place)[0]
