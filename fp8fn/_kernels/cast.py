"""Fused Triton float8 casts: the cast and the amax of the next step in one pass over the data.

Delayed scaling knows the scale before it reads the tensor, so one kernel can write the float8
copy *and* reduce the amax. One registered custom op, `torch.ops.fp8fn.scaled_cast` (made with
`torch.library.triton_op`, so torch.compile sees the kernels), does every cast of the per-tensor
linear; each call is one dispatched op of one or two kernel launches, and writes, besides the
float8 copy and the amax, the scale used and its reciprocal (the GEMM's dequantization scale):

* `cast_and_amax(hp, scale, dtype)`: cast with a given scale, amax in the same pass (1 kernel).
* `delayed_cast(hp, newest, stored, margin, dtype)`: the stored scale, or current scaling while
  the history is empty, decided on the device (2 kernels; the second exits at once when the
  stored scale was right); with `filled=True` (the history is known non-empty, static) the
  stored scale in 1 kernel.
* `current_cast(hp, margin, dtype)`: amax pass, then the cast with the scale computed in the
  kernel (2 kernels).

Each takes `transpose=True` for a 2D `hp` of shape `(m, n)` to also write a contiguous `(n, m)`
float8 copy in the same pass, for a float8 GEMM whose operand must be row-major in the other
layout (no transposing copy). `delayed_cast` and `current_cast` take `observe=(input_amax,
weight_amax)` to return, instead of the amax, the per-tensor linear's whole observation
`[input_amax, weight_amax, amax]` (the output gradient's cast: no separate stack).
`forward_cast` and `backward_cast` are the per-tensor linear's casts on these kernels.

Numerics are bit for bit those of torch: `_numerics.fp8.saturate(hp.float() * scale, dtype)`,
`hp.abs().amax().float()` (NaN anywhere gives NaN, empty gives 0), `compute_scale` and
`scale.reciprocal()`. The float32 -> float8 rounding is done in integer ops (Triton's own
conversion does not round like torch under `TRITON_INTERPRET=1`).

Tested under `TRITON_INTERPRET=1` on CPU only: no GPU was at hand, so the kernels' GPU
compilation, their speed and the `triton_op` route under torch.compile are untested.

Triton is imported, the kernels (`triton_jit.py`) defined and the op registered on first use, so
this module imports without Triton (and without torch._dynamo: `import fp8fn` stays light), and
`TRITON_INTERPRET=1` (how the tests run the kernels on CPU) may be set any time before that
first use. Without Triton, that first use raises an ImportError naming
`pip install "fp8fn[triton]"`.

Example (skipped: it needs a GPU tensor, or CPU under the interpreter):
  >>> import torch, fp8fn._kernels.cast as fp8_triton
  >>> hp = torch.tensor([1.0, -3.0, 1000.0])
  >>> fp8, scale, inverse, amax = fp8_triton.delayed_cast(  # doctest: +SKIP
  ...     hp, torch.tensor(0.0), torch.tensor(1.0), 0, torch.float8_e4m3fn)
  >>> fp8.dtype, scale, amax  # doctest: +SKIP
  (torch.float8_e4m3fn, tensor(0.4480), tensor(1000.))
"""

from __future__ import annotations

import torch

from .._core.checks import HP_DTYPES
from .._numerics.fp8 import E4M3, E5M2, FP8_DTYPES, check_margin
from .._torch_private import Function


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


def _check(api: str, hp, dtype, transpose, required=(), **scalars) -> None:
    """Register the op if needed; raise a clear error unless the arguments are what the kernels
    take (metadata only, no torch op). `scalars` may be None, except those named in `required`."""
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
        if t is None and name not in required:
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
    out = torch.ops.fp8fn.scaled_cast(hp, None, scale, 0.0, dtype, transpose, True, None, None)
    return (*out[:-3], out[-1])


def delayed_cast(
    hp: torch.Tensor,
    newest: torch.Tensor | None,
    stored: torch.Tensor,
    margin,
    dtype: torch.dtype,
    *,
    transpose: bool = False,
    filled: bool = False,
    observe: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Delayed scaling's cast: the stored scale, or current scaling while the history is empty.

    The choice is made on the device, no host sync: pass 1 casts with `stored` and takes the
    amax; pass 2 returns at once if `newest > 0`, else recasts with `compute_scale(amax)`. With
    `filled` (static: the history is known non-empty) there is no pass 2.

    Args:
      hp: float32, bfloat16 or float16, any shape (2D `(m, n)` when `transpose`).
      newest: float32 `()`, the newest amax history entry (0: never observed); may be None when
        `filled`.
      stored: float32 `()`, the state's scale.
      margin: an int from 0 to 64 (the recipe's).
      dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
      transpose: also return a contiguous `(n, m)` float8 copy, written in the same pass.
      filled: the history is known non-empty: cast with `stored` in one pass.
      observe: `(input_amax, weight_amax)`, float32 `()` each, or None.

    Returns:
      `(fp8, scale, inverse, amax)`, or `(fp8, fp8_t, scale, inverse, amax)` when `transpose`:
      `scale` is the float32 `()` scale used, `inverse` its reciprocal (`scale.reciprocal()`,
      bit for bit), `amax` the float32 `()` amax of `hp` (the observation), or with `observe`
      the float32 `(3,)` `[input_amax, weight_amax, amax of hp]`.
    """
    api = "_kernels.cast.delayed_cast"
    margin = _margin(api, margin)
    required = ("stored",) if filled else ("newest", "stored")
    _check(api, hp, dtype, transpose, required, newest=newest, stored=stored, **_observed(observe))
    return tuple(torch.ops.fp8fn.scaled_cast(
        hp, None if filled else newest, stored, margin, dtype, transpose, filled,
        *(observe or (None, None)),
    ))  # fmt: skip


def current_cast(
    hp: torch.Tensor,
    margin,
    dtype: torch.dtype,
    *,
    transpose: bool = False,
    observe: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Current scaling's cast: an amax pass, then the cast with `compute_scale(amax)`.

    Args and returns as `delayed_cast`, without `newest`, `stored` and `filled`.
    """
    margin = _margin("_kernels.cast.current_cast", margin)
    _check("_kernels.cast.current_cast", hp, dtype, transpose, **_observed(observe))
    return tuple(torch.ops.fp8fn.scaled_cast(
        hp, None, None, margin, dtype, transpose, False, *(observe or (None, None))
    ))  # fmt: skip


def _observed(observe) -> dict:
    """`observe`'s two amaxes by name, for `_check`."""
    if observe is None:
        return {}
    input_amax, weight_amax = observe
    return {"input_amax": input_amax, "weight_amax": weight_amax}


class TritonCast(Function):
    """A Triton cast as a constant to autograd: `delayed_cast` when `stored` is given, else
    `current_cast`; returns their outputs. (An autograd.Function, so that torch.func transforms
    run the custom op below their levels, e.g. in fp8fn's backward.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(hp, newest, stored, margin, dtype, transpose, filled, input_amax, weight_amax):
        observe = None if input_amax is None else (input_amax, weight_amax)
        if stored is None:
            return current_cast(hp, margin, dtype, transpose=transpose, observe=observe)
        return delayed_cast(
            hp, newest, stored, margin, dtype, transpose=transpose, filled=filled, observe=observe
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output)

    @staticmethod
    def backward(ctx, *_):
        return (None,) * 9


def forward_cast(hp, newest, stored, margin: int, filled: bool, transposed: bool):
    """The per-tensor linear's e4m3 cast of a forward operand (`x` or the weight), one op.

    Args:
      hp: `(m, k)` float32, bfloat16 or float16.
      newest, stored: the role's newest amax history entry and stored scale, float32 `()`, or
        None (current scaling).
      margin: the recipe's margin. filled: the role's history is known non-empty (static).
      transposed: the backward's GEMM is a float8 GEMM that wants the other layout row-major.

    Returns:
      `(fp8, inverse, amax, keep)`: `fp8` e4m3 `(m, k)` row-major, for the forward GEMM;
      `inverse`, `amax` float32 `()`; `keep` the e4m3 `(m, k)` copy the backward keeps: `fp8`
      itself, or when `transposed` the transpose of the `(k, m)` row-major copy written in the
      same pass (so the backward's `keep.t()` is contiguous and no GEMM copies it).
    """
    out = TritonCast.apply(hp, newest, stored, margin, E4M3, transposed, filled, None, None)
    fp8, inverse, amax = out[0], out[-2], out[-1]
    return fp8, inverse, amax, out[1].t() if transposed else fp8


def backward_cast(grad, newest, stored, margin: int, filled: bool, transposed: bool, observe):
    """The per-tensor linear's e5m2 cast of the output gradient, one op.

    Args:
      grad: `(m, n)` float32, bfloat16 or float16.
      newest, stored, margin, filled: as `forward_cast`'s, for the grad_output role.
      transposed: `grad_weight`'s GEMM is a float8 GEMM that wants `(n, m)` row-major.
      observe: `(input_amax, weight_amax)` float32 `()` of the forward's casts, or None.

    Returns:
      `(fp8, fp8_t, inverse, observed)`: `fp8` e5m2 `(m, n)`; `fp8_t` its `(n, m)` transpose (a
      row-major copy written in the same pass when `transposed`, else a view); `inverse`
      float32 `()`; `observed` the float32 `(3,)` `[input_amax, weight_amax, grad amax]`, or
      None without `observe`.
    """
    before = (None, None) if observe is None else observe
    out = TritonCast.apply(grad, newest, stored, margin, E5M2, transposed, filled, *before)
    fp8, inverse, observed = out[0], out[-2], out[-1]
    return fp8, out[1] if transposed else fp8.t(), inverse, None if observe is None else observed
