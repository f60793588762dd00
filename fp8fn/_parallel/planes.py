"""Weight planes of the finer recipes, cast shard by shard to the bytes of the whole weight.

A *plane* is a weight `(n, k)` (`out_features, in_features`) quantized for one of the GEMMs
that read it: its e4m3 bytes `(n, k)` and one scale per group of `bn x bk` elements, all
groups of a plane of one shape (a partial group at the end holds the rest):

| recipe | output GEMM (contraction k) | grad_input GEMM (contraction n) |
|---|---|---|
| `RowwiseScaling` | `"rows"`: 1 x k | `"columns"`: n x 1 (`hp_grad_weight`: `"tensor"`, n x k) |
| `MXScaling` | `"rows"`: 1 x 32 | `"columns"`: 32 x 1 |
| `BlockwiseScaling` | `"blocks"`: 128 x 128, the one plane of both GEMMs |

Each group's scale is a function of a *statistic* of the group: its E8M0 exponent under MX,
its power-of-two scale's exponent under rowwise (both uint8, as codes that do not decrease as
the amax grows), its float32 amax under blockwise. Since the statistic does not decrease with
the amax, the max of the statistics of a group's pieces is the whole group's. So a rank that
holds rows `[first, first + rows)` of the weight (FSDP2's dim-0 shard) takes the statistics of
its pieces of the groups it touches (`piece_stats`); the max over the ranks' pieces is each
group's statistic (`assemble`), the same on every rank, whether or not the shard cut splits a
group; and each rank casts its rows with it (`cast_rows`), elementwise, to the bytes that
casting the whole weight gives. `operand` turns the whole plane into the weight operand that
`_ops/rowwise_blockwise_mx`'s GEMMs take, the same values (and layout where the GEMM reads it) as
those GEMMs' own quantizers of the high-precision weight give. Bit for bit:
`tests/test_fsdp_finer.py`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .._core.recipes import BlockwiseScaling, MXScaling, RowwiseScaling
from .._numerics import fp8 as q


@dataclasses.dataclass(frozen=True)
class Plane:
    """One quantization of a weight `(n, k)` for a GEMM: `recipe` (a finer recipe) and `kind`
    (`"rows"`, `"columns"`, `"tensor"` or `"blocks"`, see the module docstring)."""

    recipe: object
    kind: str

    def groups(self, n: int, k: int) -> tuple[int, int]:
        """`(bn, bk)`: a group's rows and columns, for a weight `(n, k)`."""
        size = getattr(self.recipe, "block_size", 1)
        return {
            "rows": (1, k if isinstance(self.recipe, RowwiseScaling) else size),
            "columns": (n if isinstance(self.recipe, RowwiseScaling) else size, 1),
            "tensor": (n, k),
            "blocks": (size, size),
        }[self.kind]

    def grid(self, n: int, k: int) -> tuple[int, int]:
        """`(gn, gk)`: the groups along n and along k."""
        bn, bk = self.groups(n, k)
        return q.ceil_div(n, max(bn, 1)), q.ceil_div(k, max(bk, 1))

    @property
    def stat_dtype(self) -> torch.dtype:
        """float32 amaxes (blockwise), else uint8 codes."""
        return torch.float32 if isinstance(self.recipe, BlockwiseScaling) else torch.uint8


def plane_of(recipe, gemm: int) -> Plane:
    """The plane the output (`gemm` 0) or grad_input (`gemm` 1) GEMM reads under `recipe` (its
    numerics: the recipe's `backend` does not change a plane)."""
    recipe = dataclasses.replace(recipe, backend="auto")
    if isinstance(recipe, BlockwiseScaling):
        return Plane(recipe, "blocks")
    if gemm == 0:
        return Plane(recipe, "rows")
    hp = isinstance(recipe, RowwiseScaling) and recipe.hp_grad_weight
    return Plane(recipe, "tensor" if hp else "columns")


def swapped(plane: Plane) -> Plane:
    """The same groups seen in the transposed weight `(k, n)`: `"rows"` and `"columns"` trade
    places (`"tensor"` and 128 x 128 `"blocks"` are their own transposes)."""
    kind = {"rows": "columns", "columns": "rows"}.get(plane.kind, plane.kind)
    return Plane(plane.recipe, kind)


def stored_plane(recipe, gemm: int, flipped: bool) -> Plane:
    """The plane of a GEMM in the coordinates of the weight as it is stored: `plane_of`'s, or
    for a weight the GEMM reads transposed (`flipped`: an experts weight stored `(E, K, N)`),
    its `swapped` plane."""
    plane = plane_of(recipe, gemm)
    return swapped(plane) if flipped else plane


def touched(plane: Plane, first: int, rows: int, n: int, k: int) -> tuple[int, int]:
    """`(g0, g1)`: the group rows that rows `[first, first + rows)` of the weight touch."""
    bn, _ = plane.groups(n, k)
    if rows == 0:
        return 0, 0
    return first // bn, q.ceil_div(first + rows, bn)


# -- statistics ---------------------------------------------------------------------------------


def _rowwise_code(amax: torch.Tensor) -> torch.Tensor:
    """uint8 `128 - e`, `e = floor(log2(448 / clamp(amax, 1e-12)))` the exponent of rowwise's
    power-of-two scale (in [-120, 48]); 254 for an inf amax (scale 0), 255 for NaN. Does not
    decrease as `amax` grows."""
    exponent = torch.floor(torch.log2(q.fp8_scale(amax)))
    code = (128 - exponent.clamp(-126, 127)).to(torch.uint8)
    code = torch.where(torch.isinf(amax), 254, code)
    return torch.where(torch.isnan(amax), 255, code).to(torch.uint8)


def _rowwise_scale(code: torch.Tensor) -> torch.Tensor:
    """float32 `2**(128 - code)` (0 for 254, NaN for 255): the scale `quantize_rowwise` takes."""
    scale = torch.exp2(128 - code.float())
    scale = torch.where(code == 254, 0.0, scale)
    return torch.where(code == 255, float("nan"), scale)


def _stat(plane: Plane, amax: torch.Tensor) -> torch.Tensor:
    """The groups' statistics from their float32 amaxes."""
    if isinstance(plane.recipe, BlockwiseScaling):
        return amax
    if isinstance(plane.recipe, MXScaling):
        return q.mx_exponent(amax, plane.recipe.scale_rounding)
    return _rowwise_code(amax)


def piece_stats(plane: Plane, hp: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """The statistics of the pieces of the groups that `hp` touches.

    Args:
      plane: the plane.
      hp: `(rows, k)`, rows `[first, first + rows)` of the weight `(n, k)`; floating.
      first: its first row in the weight. n: the weight's rows.

    Returns:
      `(g1 - g0, gk)` of `plane.stat_dtype` (`touched`'s group rows): of each group, the
      statistic of its elements in `hp`.
    """
    rows, k = hp.shape
    bn, bk = plane.groups(n, k)
    g0, g1 = touched(plane, first, rows, n, k)
    if rows == 0:
        return torch.zeros(0, plane.grid(n, k)[1], dtype=plane.stat_dtype, device=hp.device)
    amax = q.pad_last(hp, bk).unflatten(-1, (-1, bk)).abs().amax(-1)  # (rows, gk)
    if g1 - g0 == 1:
        amax = amax.amax(0, keepdim=True)
    else:
        top = first - g0 * bn
        amax = F.pad(amax, (0, 0, top, (g1 - g0) * bn - top - rows))
        amax = amax.unflatten(0, (g1 - g0, bn)).amax(1)
    return _stat(plane, amax.float())


def assemble(plane: Plane, pieces, n: int, k: int) -> torch.Tensor:
    """The whole grid of statistics `(gn, gk)` from every rank's `(first, stats)` pieces
    (`piece_stats` of its rows): each group's max over the pieces that touch it (NaN wins)."""
    pieces = list(pieces)
    grid = torch.zeros(plane.grid(n, k), dtype=plane.stat_dtype, device=pieces[0][1].device)
    for first, stats in pieces:
        g0 = first // plane.groups(n, k)[0]
        part = grid[g0 : g0 + len(stats)]
        part.copy_(torch.maximum(part, stats))
    return grid


# -- the cast -----------------------------------------------------------------------------------


def _multiplier(plane: Plane, stats: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`(t, divide)`: each group's elements are cast as `x * t` (`x / t` when `divide`)."""
    recipe = plane.recipe
    if isinstance(recipe, BlockwiseScaling):
        return q.fp8_scale(stats), False
    if isinstance(recipe, MXScaling):
        return q.mx_cast_factor(stats, recipe.scale_rounding)
    return _rowwise_scale(stats), False


def cast_rows(plane: Plane, hp: torch.Tensor, first: int, n: int, grid: torch.Tensor):
    """Rows `[first, first + rows)` of the weight, `hp` `(rows, k)`, cast to e4m3 `(rows, k)`
    with the whole weight's statistics `grid` (`(gn, gk)`, from `assemble`): bit for bit
    those rows of the whole weight's plane."""
    rows, k = hp.shape
    bn, bk = plane.groups(n, k)
    g0, g1 = touched(plane, first, rows, n, k)
    if rows == 0:
        return torch.empty(0, k, dtype=q.E4M3, device=hp.device)
    factor, divide = _multiplier(plane, grid[g0:g1])
    if g1 - g0 > 1:  # one row of factors per row of `hp` (expanded: no host read)
        top, (g, gk) = first - g0 * bn, factor.shape
        factor = factor[:, None].expand(g, bn, gk).reshape(g * bn, gk)[top : top + rows]
    blocks = q.pad_last(hp.float(), bk).unflatten(-1, (-1, bk))
    factor = factor.unsqueeze(-1)
    scaled = (blocks / factor if divide else blocks * factor).flatten(-2)[..., :k]
    return q.saturate(scaled, q.E4M3, keep_nonfinite=False)


def quantize(plane: Plane, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole plane of `weight` `(n, k)` in one process: `(e4m3 (n, k), stats (gn, gk))`."""
    n, k = weight.shape
    grid = assemble(plane, [(0, piece_stats(plane, weight, 0, n))], n, k)
    return cast_rows(plane, weight, 0, n, grid), grid


def expert_stats(plane: Plane, shard: torch.Tensor) -> torch.Tensor:
    """The statistics of each whole expert matrix of `shard` `(r, a, b)`: `(r, gn, gk)`, each
    expert's own grid (an experts weight is sharded along its experts: no group spans two
    ranks)."""
    r, a, b = shard.shape
    if r == 0:
        return torch.zeros(0, *plane.grid(a, b), dtype=plane.stat_dtype, device=shard.device)
    return torch.stack([assemble(plane, [(0, piece_stats(plane, w, 0, a))], a, b) for w in shard])


def cast_experts(plane: Plane, shard: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """Each expert matrix of `shard` `(r, a, b)` cast with its grid (`grids` `(r, gn, gk)`):
    e4m3 `(r, a, b)`, bit for bit each expert's whole plane."""
    r, a, b = shard.shape
    if r == 0:
        return torch.empty(0, a, b, dtype=q.E4M3, device=shard.device)
    return torch.stack([cast_rows(plane, w, 0, a, g) for w, g in zip(shard, grids)])


# -- the GEMMs' operand -------------------------------------------------------------------------


def operand(plane: Plane, fp8: torch.Tensor, grid: torch.Tensor) -> tuple:
    """The weight operand of the plane's GEMM (`_ops/rowwise_blockwise_mx`'s form) from the whole
    plane: e4m3 `(n, k)` and its statistics `(gn, gk)`.

    Returns:
      rowwise: `(fp8 (n, k), float32 scale)`, the scale `(n, 1)` (`"rows"`), `(1, k)`
      (`"columns"`) or `()` (`"tensor"`); MX: `(fp8, uint8 exponent)`, `(n, k)` and
      `(n, k / 32)` (`"rows"`) or, transposed, `(k, n)` and `(k, n / 32)` (`"columns"`);
      blockwise: `(fp8 (n, k), float32 inverse scale (n / 128, k / 128))`.
    """
    recipe = plane.recipe
    if isinstance(recipe, BlockwiseScaling):
        return fp8, q.fp8_scale(grid).reciprocal()
    if isinstance(recipe, MXScaling):
        if plane.kind == "columns":
            return fp8.t().contiguous(), grid.t().contiguous()
        return fp8, grid
    scale = _rowwise_scale(grid)
    return fp8, scale.reshape(()) if plane.kind == "tensor" else scale
