"""Recipes: frozen, validated, static configuration of how tensors are scaled to float8."""

from __future__ import annotations

import dataclasses
import importlib.util

from .._numerics.fp8 import check_margin
from .moved import register_moved

_BACKENDS = ("auto", "emulated", "scaled_mm")
_TENSORWISE_BACKENDS = (*_BACKENDS, "triton")  # fused Triton casts: per-tensor recipes only
_AMAX_COMPUTE = ("max", "most_recent")


FAST_ACCUM = (True, False, False)  # torchao's: the output GEMM fast, the gradients' not


def _check_fast_accum(api: str, fast_accum: object) -> None:
    if not (
        isinstance(fast_accum, tuple)
        and len(fast_accum) == 3
        and all(isinstance(f, bool) for f in fast_accum)
    ):
        raise TypeError(
            f"fp8fn.{api}: expected `fast_accum` a tuple of 3 bools (output, grad_input, "
            f"grad_weight), got {fast_accum!r}."
        )


def _check_backend(api: str, backend: object, allowed: tuple = _BACKENDS) -> None:
    if backend not in allowed:
        raise ValueError(f"fp8fn.{api}: expected `backend` in {allowed}, got {backend!r}.")
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise ImportError(
            f"fp8fn.{api}: backend=\"triton\" needs Triton, got no module named 'triton'. "
            'Install it with pip install "fp8fn[triton]" (Linux), or use backend="auto".'
        )


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed per-tensor scaling: each cast uses a scale derived from an amax history.

    The scale of a cast is `fp8_max / (amax * 2**margin)`, where `amax` is the maximum of the
    history (`amax_compute="max"`) or its newest entry (`"most_recent"`). A history that is still
    all zeros means "never observed": that cast scales from the tensor itself (current scaling).

    Args:
      history_len: number of past amaxes kept per tensor, >= 1.
      amax_compute: `"max"` or `"most_recent"`.
      margin: integer from 0 to 64; scales are divided by `2**margin` for headroom.
      backend: `"auto"` (`torch._scaled_mm` on CUDA devices of compute capability >= 8.9,
        emulation elsewhere), `"emulated"`, `"scaled_mm"`, or `"triton"` (fused Triton casts:
        cast and amax in one pass; matmuls as `"auto"`; not yet run on a GPU).
      fast_accum: `(output, grad_input, grad_weight)`: whether each float8 GEMM on CUDA
        accumulates in the tensor cores' fast mode (`use_fast_accum` of `torch._scaled_mm`:
        fewer promotions to float32, faster, less exact). torchao's defaults: the output GEMM
        fast, the gradients' not. Emulation (the CPU) ignores it.

    Example:
      >>> import fp8fn
      >>> fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent")  # doctest: +ELLIPSIS
      DelayedScaling(history_len=4, amax_compute='most_recent', margin=0, backend='auto', ...)
    """

    history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    backend: str = "auto"
    fast_accum: tuple[bool, bool, bool] = FAST_ACCUM

    def __post_init__(self):
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int):
            raise TypeError(
                f"fp8fn.DelayedScaling: expected `history_len` to be an int, "
                f"got {type(self.history_len).__name__} {self.history_len!r}."
            )
        if self.history_len < 1:
            raise ValueError(
                f"fp8fn.DelayedScaling: expected `history_len` >= 1, got {self.history_len}."
            )
        if self.amax_compute not in _AMAX_COMPUTE:
            raise ValueError(
                f"fp8fn.DelayedScaling: expected `amax_compute` in {_AMAX_COMPUTE}, "
                f"got {self.amax_compute!r}."
            )
        check_margin("DelayedScaling", self.margin)
        _check_backend("DelayedScaling", self.backend, _TENSORWISE_BACKENDS)
        _check_fast_accum("DelayedScaling", self.fast_accum)


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Current (dynamic) per-tensor scaling: every cast scales from the tensor's own amax.

    Stateless: sites have no scaling state (`None`), and there is nothing to `update`.

    Args:
      backend, fast_accum: as for `DelayedScaling`.

    Example:
      >>> import fp8fn
      >>> fp8fn.CurrentScaling()
      CurrentScaling(backend='auto', fast_accum=(True, False, False))
    """

    backend: str = "auto"
    fast_accum: tuple[bool, bool, bool] = FAST_ACCUM

    def __post_init__(self):
        _check_backend("CurrentScaling", self.backend, _TENSORWISE_BACKENDS)
        _check_fast_accum("CurrentScaling", self.fast_accum)


_STATELESS_BACKENDS = ("auto", "emulated")
_SCALE_ROUNDING = ("rceil", "floor")


def _check_block_size(api: str, block_size: object, allowed: tuple[int, ...]) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(
            f"fp8fn.{api}: expected `block_size` to be an int, "
            f"got {type(block_size).__name__} {block_size!r}."
        )
    if block_size not in allowed:
        raise ValueError(
            f"fp8fn.{api}: expected `block_size` in {allowed}, got {block_size}. "
            f"Other block sizes have no reference numerics to match."
        )


def _check_emulated_backend(api: str, backend: object) -> None:
    if backend not in _STATELESS_BACKENDS:
        raise ValueError(
            f"fp8fn.{api}: expected `backend` in {_STATELESS_BACKENDS}, got {backend!r}. "
            f"This recipe has no hardware kernel in fp8fn yet; use backend='emulated'."
        )


@dataclasses.dataclass(frozen=True)
class RowwiseScaling:
    """Stateless rowwise scaling: one power-of-two scale per row along each GEMM's contraction.

    Every GEMM operand is cast to `float8_e4m3fn` from high precision, with one scale per row
    of the operand along that GEMM's contraction dim (`x` per token, `weight` per output
    feature for the output, per input feature for `grad_input`, ...). Scales are
    `448 / clamp(amax, 1e-12)` in float64, rounded down to a power of two: torchao 0.18's
    `"rowwise"` recipe. With `hp_grad_weight=True` it is torchao's `"rowwise_with_gw_hp"`:
    `grad_weight` in high precision and the weight scaled per tensor for `grad_input`.

    Args:
      hp_grad_weight: compute `grad_weight` from the high-precision operands.
      backend: `"auto"` (emulation until `torch._scaled_mm` is verified on a GPU),
        `"emulated"` (dequantize, float32 matmul) or `"scaled_mm"` (on CUDA sm >= 8.9,
        torch's row-wise scaled GEMM; on the CPU, its slow reference kernel with unit scales
        and a float32 result, then the power-of-two scales, which is exact).
      fast_accum: as for `DelayedScaling`.

    Example:
      >>> import fp8fn
      >>> fp8fn.RowwiseScaling(hp_grad_weight=True)
      RowwiseScaling(hp_grad_weight=True, backend='auto', fast_accum=(True, False, False))
    """

    hp_grad_weight: bool = False
    backend: str = "auto"
    fast_accum: tuple[bool, bool, bool] = FAST_ACCUM

    def __post_init__(self):
        if not isinstance(self.hp_grad_weight, bool):
            raise TypeError(
                f"fp8fn.RowwiseScaling: expected `hp_grad_weight` to be a bool, "
                f"got {type(self.hp_grad_weight).__name__} {self.hp_grad_weight!r}."
            )
        _check_backend("RowwiseScaling", self.backend)
        _check_fast_accum("RowwiseScaling", self.fast_accum)


@dataclasses.dataclass(frozen=True)
class BlockwiseScaling:
    """Stateless blockwise scaling (DeepSeek-V3): 1 x 128 activation tiles, 128 x 128 weights.

    `x` and the output gradient are cast to `float8_e4m3fn` in tiles of `block_size`
    consecutive elements along each GEMM's contraction dim, the weight in `block_size` x
    `block_size` blocks, each with a float32 scale `448 / clamp(amax, 1e-12)` computed in
    float64. The last tile or block along a dim that is not a multiple of `block_size` holds
    the remaining elements.

    Args:
      block_size: tile length and weight block side; 128.
      backend: `"auto"` or `"emulated"` (dequantize, then a float32 matmul).

    Example:
      >>> import fp8fn
      >>> fp8fn.BlockwiseScaling()
      BlockwiseScaling(block_size=128, backend='auto')
    """

    block_size: int = 128
    backend: str = "auto"

    def __post_init__(self):
        _check_block_size("BlockwiseScaling", self.block_size, (128,))
        _check_emulated_backend("BlockwiseScaling", self.backend)


@dataclasses.dataclass(frozen=True)
class MXScaling:
    """Stateless OCP MXFP8: blocks of 32 elements along each GEMM's contraction dim.

    Each block is cast to `float8_e4m3fn` with a shared power-of-two scale stored as E8M0.
    `scale_rounding="rceil"` takes the exponent `ceil(log2(amax / 448))` (torchao's RCEIL,
    cuBLAS's rule), `"floor"` takes `floor(log2(amax)) - 8` (torchao's FLOOR, the OCP
    spec's minimal rule; the block's largest values may then saturate to 448). A block with
    a NaN dequantizes to NaN. The last block along a contraction dim that is not a multiple
    of `block_size` holds the remaining elements.

    Args:
      block_size: 32 (the OCP MX block).
      scale_rounding: `"rceil"` or `"floor"`.
      backend: `"auto"` or `"emulated"` (dequantize, then a matmul in the input dtype).

    Example:
      >>> import fp8fn
      >>> fp8fn.MXScaling(scale_rounding="floor")
      MXScaling(block_size=32, scale_rounding='floor', backend='auto')
    """

    block_size: int = 32
    scale_rounding: str = "rceil"
    backend: str = "auto"

    def __post_init__(self):
        _check_block_size("MXScaling", self.block_size, (32,))
        if self.scale_rounding not in _SCALE_ROUNDING:
            raise ValueError(
                f"fp8fn.MXScaling: expected `scale_rounding` in {_SCALE_ROUNDING}, "
                f"got {self.scale_rounding!r}."
            )
        _check_emulated_backend("MXScaling", self.backend)


@dataclasses.dataclass(frozen=True)
class NVFP4Scaling:
    """Stateless NVFP4 (4-bit): E2M1 values, 16-element blocks with E4M3 scales, a tensor scale.

    Every GEMM operand is quantized from high precision along that GEMM's contraction dim to
    E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) in blocks of 16 elements, each block with a
    `float8_e4m3fn` decode scale, and the tensor with a float32 decode scale
    `amax / (6 * 448)` from its own amax (two-level scaling: torchao 0.18's `nvfp4_quantize`).
    Emulated: quantize, dequantize, float32 matmul (there is no FP4 GEMM in fp8fn yet).

    The random parts (stochastic rounding, Hadamard signs) draw their bits from the key in the
    state (`fn.init(..., seed=...)`; `fp8fn.update` advances it), the call site and the role,
    so a recompute, either differentiation route and a compiled step draw the same bits.

    Ranks keep one key (`fp8fn.all_reduce` leaves the observation's key at 0, and `update`
    advances each rank's equal key), but the stochastic-rounding bits fold in the process's
    rank in the default process group: data-parallel ranks then round independently, so the
    rounding noise of the averaged gradient averages out over the ranks even where they hold
    the same values. Rank `r` draws what a single process of rank `r` draws (a single process
    is rank 0). The Hadamard signs are shared by all ranks: they cancel in the product.

    The per-tensor scale always comes from the tensor's own amax (as in torchao); no delayed
    (amax history) per-tensor scale is offered: it only sets the range of the E4M3 block
    scales, a delayed one would save an amax pass only in a GPU kernel, which fp8fn does not
    have for NVFP4, and a tensor that outgrew its history would clip at E2M1's 6.

    Args:
      stochastic_rounding: round the output gradient stochastically (unbiased), for both the
        `grad_input` and the `grad_weight` GEMM; activations and weights round to nearest even.
      hadamard: apply a 16 x 16 random Hadamard transform (random signs) along the tokens to
        both operands of the `grad_weight` GEMM before quantizing them.
      weight_2d: quantize the weight in 16 x 16 tiles (one scale per tile), so the forward and
        the `grad_input` GEMM use the same quantized weight; else in 1 x 16 blocks along each
        GEMM's contraction dim.
      backend: `"auto"` or `"emulated"`.

    Example:
      >>> import fp8fn
      >>> fp8fn.NVFP4Scaling(hadamard=False)
      NVFP4Scaling(stochastic_rounding=True, hadamard=False, weight_2d=True, backend='auto')
    """

    stochastic_rounding: bool = True
    hadamard: bool = True
    weight_2d: bool = True
    backend: str = "auto"

    def __post_init__(self):
        for name in ("stochastic_rounding", "hadamard", "weight_2d"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"fp8fn.NVFP4Scaling: expected `{name}` to be a bool, "
                    f"got {type(value).__name__} {value!r}."
                )
        _check_emulated_backend("NVFP4Scaling", self.backend)

    @property
    def random(self) -> bool:
        """Whether this recipe draws random bits (stochastic rounding or Hadamard signs)."""
        return self.stochastic_rounding or self.hadamard


Recipe = (
    DelayedScaling | CurrentScaling | RowwiseScaling | BlockwiseScaling | MXScaling | NVFP4Scaling
)
"""Any recipe: the type of `transform`'s `recipe` (or of what a recipe function returns)."""
RECIPES = Recipe.__args__  # the same classes, as a tuple (for isinstance and issubclass)

register_moved("fp8fn._recipe", RECIPES)  # fp8fn 0.3's module: see moved.py
