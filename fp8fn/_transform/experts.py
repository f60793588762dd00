"""Experts: 3-D weights `(E, A, B)` whose GEMMs run per expert in float8, and the forms in
which a forward pass reaches them.

An experts weight is a 3-D floating parameter chosen by `filter_fn` and given a recipe
(asked with the weight's own name and the module holding it); `fn.init` confirms it when a
GEMM uses it. Nothing is known by class name: the weight is followed by identity through the
views and copies a forward makes of it (`derive`), and a GEMM on such a tensor is read as
one of three forms (`read_gemm`):

* one expert: `F.linear(x, W[e])`, `x @ W[e]` (transformers' eager loop, GPT-OSS's);
* all experts with group offsets: `torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)`
  (`F.grouped_mm`; transformers' grouped_mm);
* a batch over experts: `torch.bmm(x, W)` with batch `e` for expert `e` (Llama 4), or over
  tokens, `torch.bmm(W[ids], x)` / `torch.bmm(x, W[ids])` (transformers' batched_mm: `W[ids]`
  is a copy, so the weight is reached through the recorded indexing, not `._base`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .._core.experts import Experts
from .._core.state import site_name
from .._torch_private import private_grouped_mm

GROUPED_MM = tuple({f for f in (private_grouped_mm(), getattr(F, "grouped_mm", None)) if f})
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm)
_BMMS = (torch.bmm, torch.Tensor.bmm)
# Every op that multiplies a weight: a weight reaching one of these and not converted is
# reported (`Transformed.init`).
GEMMS = (
    F.linear,
    torch.addmm,
    torch.Tensor.addmm,
    torch.Tensor.__rmatmul__,
    torch.baddbmm,
    torch.einsum,
    *_MATMULS,
    *_BMMS,
    *GROUPED_MM,
)


def grouped_ops() -> tuple:
    """`GROUPED_MM`, and transformers' custom op `transformers::grouped_mm_fallback` (same
    arguments as `torch._grouped_mm`) where transformers has registered it: its grouped_mm
    experts run through it under torch.compile with a weight not in bfloat16, and on CPU where
    `torch._grouped_mm` cannot run. Read at `transform` (it appears when transformers loads)."""
    hf = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    return GROUPED_MM if hf is None else (*GROUPED_MM, hf)


_TRANSPOSES = (
    torch.Tensor.transpose,
    torch.transpose,
    torch.Tensor.swapaxes,
    torch.swapaxes,
    torch.Tensor.swapdims,
    torch.swapdims,
)
_FLIPS = (torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__)
# Copies of a tensor, whatever their dtype, device or layout (`.data`: a detached alias): a
# copy of a weight is the weight.
COPIES = (
    torch.Tensor.to,
    torch.Tensor.type,
    torch.Tensor.float,
    torch.Tensor.double,
    torch.Tensor.bfloat16,
    torch.Tensor.half,
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.contiguous,
    torch.Tensor.detach,
    torch.detach,
    torch.Tensor.data.__get__,
)
DERIVING = (
    torch.Tensor.__getitem__,
    torch.Tensor.select,
    torch.select,
    torch.Tensor.unbind,
    torch.unbind,
    *_TRANSPOSES,
    *_FLIPS,
)


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    """One expert of an `Experts`, called alone (`F.linear(x, W[e])`): a layer for `Call`."""

    path: str
    recipe: object
    transposed: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Derived:
    """A tensor made from an experts weight: per-expert matrices `M(e)` = `source[e]`, or its
    transpose when `flipped`; `expert` says which: None (all, dim 0 = e: then `source` is the
    tensor itself), an int (one: the tensor is `M(e)`), or an int64 tensor of ids (dim 0 = rows,
    row r being `M(ids[r])`)."""

    entry: Experts
    source: torch.Tensor  # (E, A, B), the weight or a view of it
    expert: object = None
    flipped: bool = False

    def full(self) -> torch.Tensor:
        """`(E, ., .)`: `M(e)` for every expert."""
        return self.source.transpose(-2, -1) if self.flipped else self.source

    def expert_layer(self) -> ExpertLayer:
        """Expert `expert` (an int) of its experts weight, as a layer of its own."""
        return ExpertLayer(self.entry.expert(self.expert), self.entry.recipe)


def _index(idx):
    """An int, an int64 `(n,)` tensor of ids, or None for an index of another kind."""
    if isinstance(idx, tuple) and len(idx) == 1:
        idx = idx[0]
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    if isinstance(idx, torch.Tensor) and not idx.is_floating_point() and idx.dtype != torch.bool:
        if idx.dim() == 0:  # (compiled: a graph break; dynamo runs the indexing eagerly)
            return int(idx)
        if idx.dim() == 1:
            return idx.long()
    return None


def derive(func, args, kwargs, d: Derived, result):
    """The `Derived` of `result = func(*args, **kwargs)`, made from the tracked `args[0]` (`d`),
    or None when `result` is not a form of the weight followed here. For `unbind`, a list."""
    t = args[0]
    if func in (torch.Tensor.__getitem__, torch.Tensor.select, torch.select):
        if d.expert is not None:
            return None
        if func is torch.Tensor.__getitem__:
            idx = _index(args[1])
        else:
            dim, idx = (*args[1:], *kwargs.values())[:2]
            idx = idx if dim in (0, -t.dim()) else None
        if idx is None:
            return None
        if isinstance(idx, int):
            idx = idx % d.entry.experts
        return dataclasses.replace(d, expert=idx)
    if func in (torch.Tensor.unbind, torch.unbind):
        dim = (*args[1:], *kwargs.values(), 0)[0]
        if d.expert is not None or dim not in (0, -t.dim()):
            return None
        return [dataclasses.replace(d, expert=e) for e in range(len(result))]
    if func in _FLIPS:
        if func in (torch.Tensor.t, torch.t, torch.Tensor.T.__get__) and t.dim() != 2:
            return None
    else:  # a transpose of two dims: the last two
        dims = [a % t.dim() for a in (*args[1:], *kwargs.values())[:2]]
        if sorted(dims) != [t.dim() - 2, t.dim() - 1]:
            return None
    if d.expert is None:
        return Derived(d.entry, result)
    return dataclasses.replace(d, flipped=not d.flipped)


def _equal_groups(experts: int, rows: int, device) -> torch.Tensor:
    return (torch.arange(1, experts + 1, device=device) * rows).int()


@dataclasses.dataclass
class Gemm:
    """A GEMM on an experts weight, as `x @ weight[e].T` per group.

    One expert (`expert` an int): `x` any shape, `weight` `(N, K)`, `bias` or None.
    Grouped: `x` `(T, K)` rows sorted by expert, `weight` `(E, N, K)`, `offs` int32 `(E,)`;
    `finish` turns the `(T, N)` result into the op's own output.
    """

    derived: Derived
    x: torch.Tensor
    weight: torch.Tensor
    expert: int | None = None
    bias: torch.Tensor | None = None
    offs: torch.Tensor | None = None
    finish: object = None


def _grouped_by_ids(d: Derived, a: torch.Tensor, weight: torch.Tensor, left: bool) -> Gemm:
    """`bmm` of `(S, M, K)` rows `a` (right operand form) with `M(ids[s])`: rows sorted by
    expert (stable), grouped, and put back in order."""
    rows, m, k = a.shape
    perm = torch.argsort(d.expert, stable=True)
    # (not `bincount`, whose shape depends on the ids: a graph break under torch.compile)
    counts = torch.zeros(d.entry.experts, dtype=torch.int64, device=a.device)
    counts = counts.scatter_add(0, d.expert, torch.ones_like(d.expert))
    offs = (counts * m).cumsum(0).int()
    back = torch.argsort(perm)

    def finish(out):
        out = out.reshape(rows, m, -1)[back]
        return out.transpose(1, 2) if left else out

    return Gemm(d, a[perm].reshape(rows * m, k), weight, offs=offs, finish=finish)


def read_gemm(func, args, kwargs, derived_of, grouped=GROUPED_MM) -> Gemm | None:
    """The `Gemm` of a call that multiplies an experts weight in a form fp8fn converts, or
    None (`F.linear` is read by `Call`, as for linear layers). `derived_of(t)` is the `Derived`
    of a tensor, or None; `grouped` the grouped GEMM ops (`grouped_ops()`)."""
    if any(func is op for op in grouped):  # (by identity: an OpOverloadPacket's `==` is not)
        if func is getattr(F, "grouped_mm", None):
            names = ("mat_a", "mat_b")
        else:
            names = ("input", "mat2" if func is private_grouped_mm() else "weight")
        names += ("offs", "bias", "out_dtype")
        if len(args) > len(names) or kwargs.keys() - set(names):
            return None
        bound = {**dict(zip(names, args)), **kwargs}
        a, b, offs = bound.get(names[0]), bound.get(names[1]), bound.get("offs")
        d = derived_of(b) if isinstance(b, torch.Tensor) else None
        if d is None or d.expert is not None or b.dim() != 3 or a is None:
            return None
        if bound.get("bias") is not None or bound.get("out_dtype") is not None:
            return None
        if a.dim() == 2 and offs is not None:
            return Gemm(d, a, b.transpose(-2, -1), offs=offs, finish=lambda out: out)
        if a.dim() == 3 and offs is None:
            return _batch_over_experts(d, a, b.transpose(-2, -1), False)
        return None
    if func not in _MATMULS and func not in _BMMS or len(args) != 2 or kwargs:
        return None
    a, b = args
    da, db = derived_of(a), derived_of(b)
    if (da is None) == (db is None):
        return None
    left = da is not None
    d, x = (da, b) if left else (db, a)
    if isinstance(d.expert, int):
        if left or func in _BMMS or x.dim() < 1 or b.dim() != 2:
            return None
        return Gemm(d, x, b.t(), expert=d.expert)
    if x.dim() != 3 or func in _MATMULS and (a.dim() != 3 or b.dim() != 3):
        return None
    full = d.full()
    weight = full if left else full.transpose(-2, -1)
    x = x.transpose(1, 2) if left else x
    if d.expert is None:
        return _batch_over_experts(d, x, weight, left)
    return _grouped_by_ids(d, x, weight, left)


def _batch_over_experts(d: Derived, x, weight, left) -> Gemm:
    """Batch `e` of `x` `(E, C, K)` is expert `e`'s rows."""
    experts, rows, k = x.shape

    def finish(out):
        out = out.reshape(experts, rows, -1)
        return out.transpose(1, 2) if left else out

    offs = _equal_groups(experts, rows, x.device)
    return Gemm(d, x.reshape(experts * rows, k), weight, offs=offs, finish=finish)


def expert_rows(api: str, positions: dict, path: str, experts: int, call: int) -> int:
    """The first of the `experts` consecutive state rows of call `call` of the experts weight
    at `path` (expert `e`'s site `site_name(f"{path}[{e}]", call)` at row `first + e`: the
    grouped op and the float8 all-gather take them as one slice).

    Raises:
      ValueError: `fp8fn.<api>: ...` when a site is missing or the rows are apart (a state made
        by hand, or with inputs that called the experts differently).
    """
    rows = [positions.get(site_name(f"{path}[{e}]", call)) for e in range(experts)]
    first = rows[0]
    if first is None or rows != list(range(first, first + experts)):
        raise ValueError(
            f"fp8fn.{api}: expected the sites of the {experts} experts of {path!r} (call "
            f"{call}) in `state`, one after another, got "
            f"{'none' if first is None else 'them apart or missing'}. Make the state with "
            "`fn.init` with inputs that call the experts as often."
        )
    return first
