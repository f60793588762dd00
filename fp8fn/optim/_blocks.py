"""Block-scaled float8 moments: the formats, the block scale, quantize and dequantize on a
parameter's global blocks (docs/optim.md has the formulas and the measurements behind them).

A moment `x` (float32, the local shard of a parameter's moment) is cut into blocks of `block`
elements of the *global* flat index (`_layout`). Per block `b`:

    amax_b  = max |x_i| over the block (over every rank holding a part of it)
    scale_b = float32(min(fp8_max / amax_b, 2**126))     (in float64; 2**126 for amax_b = 0)
    q_i     = float8(clamp(x_i * scale_b, -fp8_max, fp8_max))   (round to nearest even)
    x_i    ~= float32(q_i) / scale_b

Every step is one correctly rounded IEEE operation on tensors (no division by a constant,
which inductor turns into a multiplication), so the bits depend only on the block's values:
the same eagerly, compiled, and on every mesh. The clamp catches the one-ulp overshoot of a
rounded scale. A power-of-two scale (exact products) was measured and rejected: it leaves the
grid fixed while the second moment decays, and values stick (docs/optim.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._layout import Layout, global_index, reduce_max

# name -> (torch dtype, exponent of the largest finite value; both maxima are 1.75 * 2**e)
FORMATS = {"e4m3": (torch.float8_e4m3fn, 8), "e5m2": (torch.float8_e5m2, 15)}
MAX_EXPONENT = 126  # the largest scale, 2**126: it and its reciprocal are normal float32


def fp8_max(fmt: str) -> float:
    """The largest finite value of the format `fmt` (448 for e4m3, 57344 for e5m2)."""
    return 1.75 * 2.0 ** FORMATS[fmt][1]


def block_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 `min(fp8_max / amax, 2**126)` of `amax` (float32 >= 0), divided in float64."""
    top = torch.full_like(amax, fp8_max(fmt), dtype=torch.float64)
    return (top / amax.double()).clamp(max=2.0**MAX_EXPONENT).float()


def _rows(x: torch.Tensor, start: int, block: int) -> tuple[torch.Tensor, int]:
    """The flat `x` (global indices `[start, start + numel)`) zero-padded to whole blocks, as
    `(blocks, block)`, and the number of pad elements in front."""
    lead = start % block
    tail = -(lead + x.numel()) % block
    flat = x.reshape(-1)
    if lead or tail:
        flat = F.pad(flat, (lead, tail))
    return flat.view(-1, block), lead


def n_blocks(numel: int, block: int) -> int:
    """The number of blocks of a parameter of `numel` elements."""
    return -(-numel // block)


def block_amax(x: torch.Tensor, layout: Layout, block: int) -> torch.Tensor:
    """float32 `(n_blocks,)`: the amax of each global block of `x` (the local shard, of
    `layout.local_shape`), the max over the ranks that share a block (blocks without a local
    element hold 0 before that max)."""
    total = n_blocks(layout.numel, block)
    mag = x.abs()
    if layout.start is None:
        index = global_index(layout, x.device) // block
        full = mag.new_zeros(total).scatter_reduce(0, index.reshape(-1), mag.reshape(-1), "amax")
        return reduce_max(full, layout)
    amax = _rows(mag, layout.start, block)[0].amax(1)
    if amax.shape[0] == total:
        return reduce_max(amax, layout)
    first = layout.start // block
    full = mag.new_zeros(total)
    full[first : first + amax.shape[0]] = amax
    return reduce_max(full, layout)


def _per_element(fn, x: torch.Tensor, per_block: torch.Tensor, layout: Layout, block: int):
    """`fn(x, s)` with `s` the value of `per_block` (the global blocks') at each element of `x`."""
    if layout.start is not None:
        rows, lead = _rows(x, layout.start, block)
        first = layout.start // block
        s = per_block[first : first + rows.shape[0], None]
        return fn(rows, s).reshape(-1)[lead : lead + x.numel()].view(x.shape)
    return fn(x, per_block[global_index(layout, x.device) // block])


def cast(x: torch.Tensor, scale: torch.Tensor, layout: Layout, block: int, fmt: str):
    """float8 `fmt` of `x`'s shape: `x` (float32, the local shard) times its block's `scale`
    (float32 `(n_blocks,)`, the global blocks'), saturated."""
    limit = fp8_max(fmt)

    def scaled(v, s):
        return (v * s).clamp(-limit, limit).to(FORMATS[fmt][0])

    return _per_element(scaled, x, scale, layout, block)


def quantize(
    x: torch.Tensor, layout: Layout, block: int, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)`: `x` (float32, finite, the local shard) in float8 `fmt` with one scale per
    global block; `q` of `x`'s shape, `scale` float32 `(n_blocks,)`."""
    scale = block_scale(block_amax(x, layout, block), fmt)
    return cast(x, scale, layout, block, fmt), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, layout: Layout, block: int) -> torch.Tensor:
    """float32 of `q`'s shape: `float32(q) / scale` of each element's block."""
    return _per_element(torch.div, q.float(), scale, layout, block)
