"""NVFP4 numerics: E2M1 data, E4M3 block scales, an FP32 tensor scale; SR, RHT and random bits.

NVFP4 stores each element as E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), one `float8_e4m3fn`
scale per 16 consecutive elements along the last dim (or per 16 x 16 tile), and one float32
tensor scale `amax / (6 * 448)`. Both scales are *decode* scales:
`hp ~= value(code) * block_scale * tensor_scale`. This module holds pure functions only.

The round-to-nearest-even quantizer is torchao 0.18's `nvfp4_quantize` (and `NVFP4Tensor`'s
`dequantize`) bit for bit, on the same device. Its arithmetic, kept here in the same form:

* `block_scale = amax_block / 6` (float32), then `/ tensor_scale`, clamped to
  `[2**-6, 448]` and cast to e4m3 round-to-nearest-even. The lower clamp is e4m3's smallest
  *normal*: e4m3 subnormal block scales are never used.
* `encode = (1 / tensor_scale) / block_scale_e4m3` (a reciprocal, then a division), and the data
  is `hp * encode`, clamped to +-6, then rounded to E2M1. No division of the data.
* Dequantization: `value(code) * (tensor_scale * float32(block_scale_e4m3))`, then a cast.
* `x / 6.0` and `amax / 2688.0` divide by a Python scalar: a true division on CPU, but on CUDA
  torch multiplies by the float32 reciprocal of the scalar. fp8fn writes the same expressions,
  so it follows torchao on every device (CPU and CUDA results may differ in the last bit).

torchao's quantizer without a tensor scale ("single level") is this one with `tensor_scale = 1`.
Where fp8fn deliberately differs: a tensor scale computed from the amax is clamped below at
`2**-121`, so it differs for tensors with amax < 2688 * 2**-121 ~ 1.0e-33.
Below ~5e-34 torchao's `(1 / tensor_scale) / block_scale` overflows for small block scales
(zeros become NaN, other values saturate), and an all-zero tensor gets NaN block scales
(0 / 0). And E2M1 codes inside a block whose scale is NaN are 0 with the element's sign
(torchao's come from the NaN's payload bits; either way the block dequantizes to NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fp8 import E4M3, pad_last

BLOCK = 16
MASK32 = 0xFFFFFFFF
# Floats are literals inside the functions (see fp8.py's top): 448.0 is e4m3's max, 6.0 E2M1's;
# a block scale is clamped below at 2**-6, e4m3's smallest normal (`torch.finfo(e4m3).tiny`, as
# torchao); a tensor scale at 2**-121, the smallest power of two for which
# `(1 / tensor_scale) / block_scale` is finite for every block scale >= 2**-6 (2**121 * 2**6 =
# 2**127; 2**-122 would give 2**128 = inf).


class NVFP4(NamedTuple):
    """A tensor quantized to NVFP4 (see `quantize_nvfp4`)."""

    codes: torch.Tensor  # (..., k) uint8: one E2M1 code per element, bit 3 = sign
    block_scale: torch.Tensor  # (..., ceil(k / 16)) float8_e4m3fn, decode scale per block
    tensor_scale: torch.Tensor  # () float32, decode scale of the whole tensor


# -- E2M1 ------------------------------------------------------------------------------------------


def _e2m1_steps(y: torch.Tensor, random_bits: torch.Tensor | None):
    """`(n, e, inv)`: `|y|` (float32, clamped to 6, NaN as 0) rounded to E2M1 in steps of its
    range (`n` float32, integers 0 to 4), the exponent field of the range's start (`e` int32:
    that of 1, 2 or 4), and `1 / step` (`inv` float32: 2, 1 or 0.5). See `round_to_e2m1`."""
    a = y.abs().clamp_max_(6.0).nan_to_num_(0.0)  # (clamp_ has no vmap rule)
    # the exponent field of 1, 2 or 4 (a <= 6): the range's start (0 below 2, whose step is 0.5)
    e = (a.view(torch.int32) & 0x7F800000).clamp_min_(0x3F800000)
    inv = (0x7F800000 - e).view(torch.float32)
    t = a.mul_(inv)  # |y| / step, exact
    if random_bits is None:  # 2**23 + t rounds t to an integer, ties to even
        return t.add_(2.0**23).sub_(2.0**23), e, inv
    # frac(t) * 2**32 is exact in float32; r < it <=> r < its ceil
    lower = torch.floor(t)
    up = t.sub_(lower).mul_(2.0**32).ceil_().long() > random_bits
    return lower + up, e, inv  # (not in place: the bits may be batched, y not)


def round_to_e2m1(y: torch.Tensor, random_bits: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes of `y`, saturated to +-6: round-to-nearest-even, or stochastic rounding.

    The E2M1 grid is uniform within three ranges: step 0.5 on [0, 2), 1 on [2, 4), 2 on
    [4, 6]. In steps (`t = |y| / step`, exact in float32), the magnitude rounds to nearest,
    ties to the even code (= even mantissa), or, given `random_bits` `r`, rounds up when
    `r < frac(t) * 2**32`: up with probability `ceil(frac(t) * 2**32) / 2**32`, so exactly
    representable values never move.

    Computed on the float32 bits, without selects (a few times faster on CPU than
    `torch.where` per range): the step is `2**(e - 1)` for the exponent `e` of `|y|` clamped
    below at 0, the code is `2 * e + t` rounded (RTNE: adding and taking `2**23`, ulp 1).

    Args:
      y: `(...)` float32, already scaled; `+-inf` saturates to +-6; NaN gives code 0 (with
        its sign bit; E2M1 has no NaN: a NaN block is marked by its NaN block scale).
      random_bits: `(...)` int64 in `[0, 2**32)`, or None for round-to-nearest-even.

    Returns:
      `(...)` uint8 codes: bit 3 the sign, bits 0-2 the magnitude's index in the grid.
    """
    _check_e2m1_input(y, "round_to_e2m1")
    n, e, _ = _e2m1_steps(y, random_bits)
    start = e.bitwise_right_shift_(22).sub_(254)  # 0, 2, 4: the code of the range's start
    sign = y.view(torch.int32) >> 28
    return start.add_(n.int()).bitwise_or_(sign.bitwise_and_(8)).to(torch.uint8)


def round_to_e2m1_values(y: torch.Tensor, random_bits: torch.Tensor | None = None) -> torch.Tensor:
    """`e2m1_to_float32(round_to_e2m1(y, random_bits))`, bit for bit, without the codes:
    `(...)` float32 E2M1 values with `y`'s sign (`-0.0` where a negative `y` rounds to 0)."""
    _check_e2m1_input(y, "round_to_e2m1_values")
    n, _, inv = _e2m1_steps(y, random_bits)
    return n.div_(inv).copysign_(y)  # n * step: exact


def _check_e2m1_input(y, api: str) -> None:
    if y.dtype != torch.float32:  # (its bits are read as int32)
        raise TypeError(f"fp8fn._numerics.nvfp4.{api}: expected float32 `y`, got {y.dtype}.")


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of E2M1 `codes` (`(...)` uint8 in [0, 16)); code 8 is -0.0.

    Gathered from a table of the 16 values (a few times faster on CPU than arithmetic; with
    int32 indices, `index_select` is a few times faster than indexing with int64).
    """
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = torch.tensor(grid + [-v for v in grid], dtype=torch.float32, device=codes.device)
    return table.index_select(0, codes.int().reshape(-1)).reshape(codes.shape)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte: `(..., 2n)` uint8 -> `(..., n)` uint8, even elements in the low
    nibble (torchao's `pack_uint4` layout, the `float4_e2m1fn_x2` byte order)."""
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_e2m1`: `(..., n)` uint8 -> `(..., 2n)` uint8 codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


# -- quantize / dequantize ---------------------------------------------------------------------


def tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The decode tensor scale `amax / (6 * 448)` (float32 `()`), at least `2**-121`.

    As torchao's `per_tensor_amax_to_scale` but for the lower clamp, which keeps an all-zero
    or tiny tensor finite. inf or NaN `amax` gives an inf or NaN scale: the whole tensor then
    dequantizes to NaN, so an overflow stays visible.
    """
    return (amax.float() / 2688.0).clamp(min=2.0**-121)  # 2688 = 6 * 448


def _check_quantize_args(hp, tensor_scale, tile_2d, sr_bits) -> None:
    api = "fp8fn._numerics.nvfp4.quantize_nvfp4"
    if not isinstance(hp, torch.Tensor) or not hp.is_floating_point():
        got = hp.dtype if isinstance(hp, torch.Tensor) else type(hp).__name__
        raise TypeError(f"{api}: expected a floating-point tensor `hp`, got {got}.")
    if hp.dim() < (2 if tile_2d else 1):
        raise ValueError(
            f"{api}: expected `hp` with at least {2 if tile_2d else 1} dims"
            f"{' for tile_2d=True' if tile_2d else ''}, got shape {tuple(hp.shape)}."
        )
    if tensor_scale is not None and (
        not isinstance(tensor_scale, torch.Tensor) or tensor_scale.shape != ()
    ):
        got = tuple(tensor_scale.shape) if isinstance(tensor_scale, torch.Tensor) else tensor_scale
        raise ValueError(
            f"{api}: expected `tensor_scale` to be a 0-dim float32 tensor or None, got {got}. "
            "Use torch.tensor(value) or tensor_scale_from_amax(amax)."
        )
    if sr_bits is not None:
        if not isinstance(sr_bits, torch.Tensor) or sr_bits.is_floating_point():
            got = sr_bits.dtype if isinstance(sr_bits, torch.Tensor) else type(sr_bits).__name__
            raise TypeError(
                f"{api}: expected `sr_bits` to be an integer tensor, got {got}. "
                "Use random_bits(key, site, role, hp.shape)."
            )
        if sr_bits.shape != hp.shape:
            raise ValueError(
                f"{api}: expected `sr_bits` of shape {tuple(hp.shape)} (one per element of "
                f"`hp`), got {tuple(sr_bits.shape)}."
            )


def quantize_nvfp4(
    hp: torch.Tensor,
    tensor_scale: torch.Tensor | None = None,
    *,
    tile_2d: bool = False,
    sr_bits: torch.Tensor | None = None,
) -> NVFP4:
    """Quantize `hp` to NVFP4 along its last dim.

    Blocks are 16 consecutive elements of the last dim (`tile_2d=False`) or 16 x 16 tiles of
    the last two dims (`tile_2d=True`: one scale per tile, so `W` and `W.T` quantize to the
    same values). A partial block or tile is padded with zeros, which leave its amax unchanged.

    Args:
      hp: `(..., k)` floating point (float32, bfloat16, float16; converted to float32 first).
      tensor_scale: `()` float32 decode scale, or None for `tensor_scale_from_amax` of `hp`'s
        amax (two-level scaling). `torch.tensor(1.0)` gives torchao's single-level scaling.
      tile_2d: one scale per 16 x 16 tile of the last two dims (`hp` at least 2-D).
      sr_bits: None for round-to-nearest-even; else stochastic rounding of the data (the scales
        still round to nearest) with these bits: an integer tensor of `hp`'s shape, whose low 32
        bits are used (see `random_bits`).

    Returns:
      `NVFP4(codes, block_scale, tensor_scale)`: codes `(..., k)` uint8 (see `round_to_e2m1`),
      block_scale `(..., ceil(k / 16))` float8_e4m3fn (with `tile_2d`, a tile's scale is
      repeated on each of its rows: `block_scale[..., ::16, :]` is the tile grid), and
      tensor_scale `()` float32.

    Example:
      >>> x = torch.tensor([[6.0, -2.6, 0.7, 0.25] + [0.0] * 12])
      >>> q = quantize_nvfp4(x, torch.tensor(1.0))
      >>> q.codes[0, :4].tolist(), q.block_scale.float().tolist()
      ([7, 13, 1, 0], [[1.0]])
      >>> dequantize_nvfp4(*q)[0, :4].tolist()
      [6.0, -3.0, 0.5, 0.0]
    """
    _check_quantize_args(hp, tensor_scale, tile_2d, sr_bits)
    scaled, block_scale, tensor_scale = _scaled(hp, tensor_scale, tile_2d)
    return NVFP4(round_to_e2m1(scaled, _low_bits(sr_bits)), block_scale, tensor_scale)


def quantize_dequantize_nvfp4(
    hp: torch.Tensor,
    tensor_scale: torch.Tensor | None = None,
    *,
    tile_2d: bool = False,
    sr_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dequantize_nvfp4(*quantize_nvfp4(hp, ...))` in float32, bit for bit, without the codes
    (what a GEMM operand that is not saved needs; about a quarter less time on CPU).

    Args and the quantization: as `quantize_nvfp4`. Returns `(..., k)` float32.
    """
    _check_quantize_args(hp, tensor_scale, tile_2d, sr_bits)
    scaled, block_scale, tensor_scale = _scaled(hp, tensor_scale, tile_2d)
    values = round_to_e2m1_values(scaled, _low_bits(sr_bits))
    return _times_scales(values, block_scale, tensor_scale, torch.float32)


def _scaled(hp, tensor_scale, tile_2d):
    """`(scaled, block_scale, tensor_scale)` of `quantize_nvfp4`: `hp * encode` `(..., k)`
    float32 (not yet clamped: the rounding clamps), and the two decode scales."""
    hp32 = hp.float()
    k = hp.shape[-1]
    blocks = pad_last(hp32, BLOCK).unflatten(-1, (-1, BLOCK))  # (..., m, kb, 16)
    if tile_2d:
        m = hp.shape[-2]
        tiles = F.pad(blocks, (0, 0, 0, 0, 0, -m % BLOCK)).unflatten(-3, (-1, BLOCK))
        tile_amax = tiles.abs().amax((-3, -1))  # (..., mb, kb)
        amax = tile_amax.repeat_interleave(BLOCK, dim=-2)[..., :m, :]
    else:
        tile_amax = amax = blocks.abs().amax(-1)
    if tensor_scale is None:  # the amax of the blocks' amaxes: the tensor's
        tensor_scale = tensor_scale_from_amax(tile_amax.amax())
    # torchao's order of operations: amax / 6 first, then / tensor_scale, clamp, e4m3.
    block_scale = (amax / 6.0 / tensor_scale).clamp(2.0**-6, 448.0).to(E4M3)
    encode = (1.0 / tensor_scale) / block_scale.float()
    return (blocks * encode.unsqueeze(-1)).flatten(-2)[..., :k], block_scale, tensor_scale


def _low_bits(sr_bits):
    """The low 32 bits of integer `sr_bits` as int64 in `[0, 2**32)`, or None."""
    return None if sr_bits is None else sr_bits.long() & MASK32


def _times_scales(values, block_scale, tensor_scale, dtype):
    """`values` `(..., k)` float32 times `tensor_scale * block_scale` per block, in `dtype`."""
    k = values.shape[-1]
    scale = tensor_scale * block_scale.float()
    blocks = pad_last(values, BLOCK).unflatten(-1, (-1, BLOCK))
    return (blocks * scale.unsqueeze(-1)).flatten(-2)[..., :k].to(dtype)


def dequantize_nvfp4(
    codes: torch.Tensor,
    block_scale: torch.Tensor,
    tensor_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`value(code) * (tensor_scale * block_scale)` per block along the last dim, in `dtype`.

    Computed in float32, then cast once (torchao's `NVFP4Tensor.dequantize`); a NaN block
    scale makes its block NaN. `dequantize_nvfp4(*quantize_nvfp4(x))` works.

    Args:
      codes: `(..., k)` uint8 E2M1 codes.
      block_scale: `(..., ceil(k / 16))` float8_e4m3fn.
      tensor_scale: `()` float32.
      dtype: the result's dtype.

    Returns:
      `(..., k)` in `dtype`.
    """
    return _times_scales(e2m1_to_float32(codes), block_scale, tensor_scale, dtype)


# -- random Hadamard transform -------------------------------------------------------------------


def random_hadamard(x: torch.Tensor, signs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """`x @ (D @ H16)` in blocks of 16 along the last dim (or the inverse, `x @ (H16 @ D)`).

    `H16` is the 16 x 16 Sylvester Hadamard matrix divided by 4 (orthogonal and symmetric),
    `D = diag(signs)`. Applied to both operands of a GEMM along its contraction dim it leaves
    the product unchanged, while spreading outliers over 16 elements. Computed as a fast
    Walsh-Hadamard transform (4 stages of `(a + b, a - b)`, then `* 0.25`): a fixed order of
    exactly rounded additions, so every device and `torch.compile` give the same bits.

    Args:
      x: `(..., k)` floating point; a partial last block is padded with zeros, so the result
        has `16 * ceil(k / 16)` columns (the padding's columns are generally nonzero: transform
        both GEMM operands alike).
      signs: `(16,)` of +-1 (see `hadamard_signs`).
      inverse: apply the inverse (= transpose) instead.

    Returns:
      `(..., 16 * ceil(k / 16))` float64 if `x` is float64, else float32.
    """
    if not isinstance(signs, torch.Tensor) or signs.shape != (BLOCK,):
        got = tuple(signs.shape) if isinstance(signs, torch.Tensor) else type(signs).__name__
        raise ValueError(
            f"fp8fn._numerics.nvfp4.random_hadamard: expected `signs` of shape (16,), got {got}. "
            "Use hadamard_signs(key, site, role)."
        )
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = pad_last(x.to(dtype), BLOCK).contiguous()  # (a transposed operand: strided is slow)
    d = signs.to(dtype).repeat(y.shape[-1] // BLOCK)
    src = y if inverse else y * d
    dst = torch.empty_like(src)
    for half in (1, 2, 4, 8):  # each stage written into the other buffer (in place: vmap-safe)
        pairs, out = src.unflatten(-1, (-1, 2, half)), dst.unflatten(-1, (-1, 2, half))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        out[..., 0, :].copy_(a).add_(b)
        out[..., 1, :].copy_(a).sub_(b)
        src, dst = dst, (torch.empty_like(src) if src is y else src)  # y may be `x`: kept
    src = src.mul_(0.25)
    return src * d if inverse else src


# -- randomness as data: a counter-based generator --------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`(x * c) mod 2**32` for `x` int64 in [0, 2**32) and a 32-bit constant `c`.

    Split into 16-bit halves of `c` so no int64 product overflows (no reliance on wrapping).
    """
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**32) with good avalanche (C. Wellons' `lowbias32` hash); int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_wrapping(x: torch.Tensor) -> torch.Tensor:
    """`mix32` of int32 `x` holding the 32 bits (two's complement), in place: the same bits.

    Multiplies with int32 wrap-around (the low 32 bits of the product, as torch's CPU kernels
    and inductor's CPU code compute it, tested against `mix32`; CUDA and Triton are expected to
    wrap alike, not verified: no GPU has run it) and shifts logically
    (the arithmetic shift, masked): 4 bytes an element and a third of `mix32`'s passes.
    """
    x ^= (x >> 16) & 0xFFFF
    x *= 0x7FEB352D
    x ^= (x >> 15) & 0x1FFFF
    x *= 0x846CA68B - 2**32  # as int32
    x ^= (x >> 16) & 0xFFFF
    return x


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 `x` in `[0, 2**32)` as int32 holding the same 32 bits."""
    return ((x ^ 0x80000000) - 0x80000000).to(torch.int32)


def _int32(word: int) -> int:
    """The low 32 bits of `word` as a signed 32-bit value."""
    return ((word & MASK32) ^ 0x80000000) - 0x80000000


def _check_key(key, api: str) -> None:
    if not isinstance(key, torch.Tensor) or key.dtype != torch.int64 or key.dim() != 0:
        got = (
            f"{key.dtype} of shape {tuple(key.shape)}"
            if isinstance(key, torch.Tensor)
            else (type(key).__name__)
        )
        raise TypeError(
            f"{api}: expected `key` to be a 0-dim int64 tensor, got {got}. Use make_key(seed)."
        )


def random_bits(
    key: torch.Tensor,
    site: int | torch.Tensor,
    role: int | torch.Tensor,
    shape: Sequence[int],
    *,
    stream: int = 0,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Deterministic random 32-bit integers, a pure function of `(key, site, role, stream)`.

    A counter-based generator: two 32-bit lanes absorb the key's halves, `site`, `role` and
    `stream` through `mix32`; element `i` (row-major index) gets two more rounds mixing `i`
    with the lanes, in int32 with wrap-around (`_mix32_wrapping`: the bits of `mix32`'s exact
    int64 arithmetic), so they are the same on every device, eagerly and under
    `torch.compile`.

    Args:
      key: `()` int64 tensor (see `make_key`).
      site: the call site's index (int or int64 tensor); low 32 bits used.
      role: the role's index (int or int64 tensor); low 32 bits used.
      shape: the result's shape.
      stream: separates independent uses at one `(key, site, role)` (`hadamard_signs` uses 1).
      index: int64 of `shape`, each element's counter (its row-major index in a larger tensor,
        e.g. a shard's global indices: `fp8fn.optim`); None: `arange` of the elements.

    Returns:
      `shape` int64 with values in `[0, 2**32)`, on `key`'s device.
    """
    _check_key(key, "fp8fn._numerics.nvfp4.random_bits")
    # the two lanes side by side (`lane_b` absorbs each word salted): 1/3 the small ops
    lanes = torch.tensor([0x243F6A88, 0x13198A2E], dtype=torch.int32, device=key.device)
    salt = torch.tensor([0, 0x85A308D3 - 2**32], dtype=torch.int32, device=key.device)
    for word in (key, key >> 32, site, role, stream):
        word = _as_int32(word & MASK32) if isinstance(word, torch.Tensor) else _int32(word)
        lanes = _mix32_wrapping(lanes ^ salt ^ word)
    lane_a, lane_b = lanes[0], lanes[1]
    n = torch.Size(shape).numel()
    high = None  # the counters' high words' term, 0 below 2**32
    if index is None and n <= 2**31:  # the counters in int32
        x = torch.arange(n, dtype=torch.int32, device=key.device).view(shape)
    else:  # given counters may lie anywhere: the full form
        if index is None:
            index = torch.arange(n, device=key.device).view(shape)
        x = _as_int32(index & MASK32)
        high = _as_int32(_mul32(index >> 32, 0x9E3779B9))
    x = _mix32_wrapping(x ^ lane_a)  # (not in place: a vmapped key batches x)
    x ^= lane_b
    if high is not None:
        x ^= high
    return _mix32_wrapping(x).long() & MASK32


def hadamard_signs(
    key: torch.Tensor, site: int | torch.Tensor, role: int | torch.Tensor
) -> torch.Tensor:
    """`(16,)` float32 random signs (+-1) for `random_hadamard`: the top bit of
    `random_bits(key, site, role, (16,), stream=1)`."""
    bits = random_bits(key, site, role, (BLOCK,), stream=1)
    return 1.0 - 2.0 * (bits >> 31).float()


def make_key(seed: int) -> torch.Tensor:
    """A `()` int64 key from an integer seed (splitmix64 of the seed, in [0, 2**62)).

    Spreading seeds over 2**62 keys keeps the key sequences of different seeds apart (a
    state's key advances by one per step: `fp8fn._core.keys`).
    """
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return torch.tensor((z ^ (z >> 31)) >> 2, dtype=torch.int64)
