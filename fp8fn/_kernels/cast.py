"""Fused Triton float8 casts: the cast and the amax of the next step in one pass over the data.

Delayed scaling knows the scale before it reads the tensor, so one kernel can write the float8
copy *and* reduce the amax. Three casts on two registered custom ops (`torch.ops.fp8fn.
cast_and_amax` and `scaled_cast`, made with `torch.library.triton_op`, so torch.compile sees the
kernels):

* `cast_and_amax(hp, scale, dtype)`: cast with a given scale, amax in the same pass (1 kernel).
* `delayed_cast(hp, newest, stored, margin, dtype)`: the stored scale, or current scaling while
  the history is empty, decided on the device (2 kernels; the second exits at once when the
  stored scale was right).
* `current_cast(hp, margin, dtype)`: amax pass, then the cast with the scale computed in the
  kernel (2 kernels).

Each takes `transpose=True` for a 2D `hp` of shape `(m, n)` to also write a contiguous `(n, m)`
float8 copy in the same pass: the output gradient's e5m2 cast uses it for the `grad_weight` GEMM,
whose float8 operand must be row-major (no transposing copy).

Numerics are bit for bit those of torch: `_quantize.saturate(hp.float() * scale, dtype)`,
`hp.abs().amax().float()` (NaN anywhere gives NaN, empty gives 0), and `compute_scale`. The
float32 -> float8 rounding is done in integer ops (Triton's own conversion does not round like
torch under `TRITON_INTERPRET=1`).

Triton is imported, the kernels (`_triton_kernels.py`) defined and the ops registered on first
use, so this module imports without Triton (and without torch._dynamo: `import fp8fn` stays
light), and `TRITON_INTERPRET=1` (how the tests run the kernels on CPU) may be set any time
before that first use. Without Triton, that first use raises an ImportError naming
`pip install "fp8fn[triton]"`.

Example (skipped: it needs a GPU tensor, or CPU under the interpreter):
  >>> import torch, fp8fn._kernels.cast as fp8_triton
  >>> hp = torch.tensor([1.0, -3.0, 1000.0])
  >>> fp8, scale, amax = fp8_triton.delayed_cast(  # doctest: +SKIP
  ...     hp, torch.tensor(0.0), torch.tensor(1.0), 0, torch.float8_e4m3fn)
  >>> fp8.dtype, scale, amax  # doctest: +SKIP
  (torch.float8_e4m3fn, tensor(0.4480), tensor(1000.))
"""

from __future__ import annotations

import torch

from .._core.checks import HP_DTYPES
from .._core.recipes import check_margin
from .._numerics.fp8 import FP8_DTYPES


def _kernels():
    """`triton_jit`, imported on first use: it imports Triton (and through
    `torch.compiler.assume_constant_result`, torch._dynamo), which `import fp8fn` must not."""
    try:
        from . import triton_jit
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "triton":
            raise
        raise ImportError(
            "fp8fn.linear: backend=\"triton\" needs Triton, got no module named 'triton'. "
            'Install it with pip install "fp8fn[triton]" (Linux), or use backend="auto".'
        ) from e
    return triton_jit


def _check(api: str, hp, dtype, transpose, **scalars) -> None:
    """Register the ops if needed; raise a clear error unless the arguments are what the kernels
    take (metadata only, no torch op)."""
    interpreted = _kernels().register_ops()
    if not isinstance(hp, torch.Tensor) or hp.dtype not in HP_DTYPES:
        got = hp.dtype if isinstance(hp, torch.Tensor) else type(hp).__name__
        raise TypeError(f"fp8fn.{api}: expected `hp` float32, bfloat16 or float16, got {got}.")
    if hp.device.type == "cpu" and not interpreted:
        raise ValueError(
            f"fp8fn.{api}: the Triton kernels need `hp` on a GPU, got a CPU tensor. To run them "
            "on CPU, set TRITON_INTERPRET=1 before their first use."
        )
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"fp8fn.{api}: expected `dtype` torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}."
        )
    if transpose and hp.dim() != 2:
        raise ValueError(
            f"fp8fn.{api}: `transpose=True` needs a 2D `hp`, got shape {tuple(hp.shape)}."
        )
    for name, t in scalars.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else t
            raise TypeError(f"fp8fn.{api}: expected `{name}` a float32 `()` tensor, got {got}.")
        if t.device != hp.device:
            raise ValueError(
                f"fp8fn.{api}: expected `{name}` on `hp`'s device {hp.device}, got {t.device}."
            )


def _margin(api: str, margin) -> float:
    """The margin as the kernels take it; it must be an int from 0 to 64 (a recipe's)."""
    check_margin(api, margin)
    return float(margin)


def cast_and_amax(
    hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, transpose: bool = False
) -> tuple[torch.Tensor, ...]:
    """Cast with a known scale and take the amax in the same pass (one kernel).

    Args:
      hp: float32, bfloat16 or float16, any shape (2D `(m, n)` when `transpose`).
      scale: float32 `()`, finite and > 0, on `hp`'s device.
      dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
      transpose: also return a contiguous `(n, m)` float8 copy, written in the same pass.

    Returns:
      `(fp8, amax)`, or `(fp8, fp8_t, amax)` when `transpose`: `fp8` in `dtype` of `hp`'s shape,
      `clamp(hp.float() * scale, -max, max).to(dtype)`; `amax` float32 `()`, `hp.abs().amax()`.
    """
    _check("_kernels.cast.cast_and_amax", hp, dtype, transpose, scale=scale)
    return tuple(torch.ops.fp8fn.cast_and_amax(hp, scale, dtype, transpose))


def delayed_cast(
    hp: torch.Tensor,
    newest: torch.Tensor,
    stored: torch.Tensor,
    margin,
    dtype: torch.dtype,
    *,
    transpose: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Delayed scaling's cast: the stored scale, or current scaling while the history is empty.

    The choice is made on the device, no host sync: pass 1 casts with `stored` and takes the
    amax; pass 2 returns at once if `newest > 0`, else recasts with `compute_scale(amax)`.

    Args:
      hp: float32, bfloat16 or float16, any shape (2D `(m, n)` when `transpose`).
      newest: float32 `()`, the newest amax history entry (0: never observed).
      stored: float32 `()`, the state's scale.
      margin: an int from 0 to 64 (the recipe's).
      dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
      transpose: also return a contiguous `(n, m)` float8 copy, written in the same pass.

    Returns:
      `(fp8, scale, amax)`, or `(fp8, fp8_t, scale, amax)` when `transpose`: `scale` is the
      float32 `()` scale used, `amax` the float32 `()` amax of `hp` (the observation).
    """
    margin = _margin("_kernels.cast.delayed_cast", margin)
    _check("_kernels.cast.delayed_cast", hp, dtype, transpose, newest=newest, stored=stored)
    return tuple(torch.ops.fp8fn.scaled_cast(hp, newest, stored, margin, dtype, transpose))


def current_cast(
    hp: torch.Tensor, margin, dtype: torch.dtype, *, transpose: bool = False
) -> tuple[torch.Tensor, ...]:
    """Current scaling's cast: an amax pass, then the cast with `compute_scale(amax)`.

    Args and returns as `delayed_cast`, without `newest` and `stored`.
    """
    margin = _margin("_kernels.cast.current_cast", margin)
    _check("_kernels.cast.current_cast", hp, dtype, transpose)
    return tuple(torch.ops.fp8fn.scaled_cast(hp, None, None, margin, dtype, transpose))


class TritonCast(torch.autograd.Function):
    """A Triton cast as a constant to autograd: `delayed_cast` when `newest` and `stored` are
    given, else `current_cast`; returns `(fp8, scale, amax)`, or `(fp8, fp8_t, scale, amax)`
    with `transpose`. (An autograd.Function, so that torch.func transforms run the custom op
    below their levels, e.g. in fp8fn's backward.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(hp, newest, stored, margin, dtype, transpose=False):
        if newest is None:
            return current_cast(hp, margin, dtype, transpose=transpose)
        return delayed_cast(hp, newest, stored, margin, dtype, transpose=transpose)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output)

    @staticmethod
    def backward(ctx, *_):
        return None, None, None, None, None, None
