"""What runs in float8: the model's matmul weights (every weight of 2 or more dims that a GEMM
used while `fn.init` ran, and every chosen layer's), each in its format (float8, NVFP4) or
high precision, with its share; the report of the weights that stay in high precision though
nothing chose so (routers and gates next to experts are high precision by default: not
reported)."""

from __future__ import annotations

import warnings

from torch import nn

from .._core.owners import owner_of
from .._core.recipes import NVFP4Scaling
from .layers import is_linear_weight, linear_base

LOW = ("float8", "NVFP4")  # the formats a converted weight's GEMMs run in, as the rows name them
ROUTER = "router or gate, by default"


def _format(recipe) -> str:
    """How a weight converted with `recipe` runs: "NVFP4" (4-bit E2M1 blocks) or "float8"."""
    return "NVFP4" if isinstance(recipe, NVFP4Scaling) else "float8"


def _rows(plan, weights: dict) -> list[tuple[str, int, str]]:
    """`[(weight name, elements, how it runs)]`, float8 and NVFP4 first, in module order."""
    params = dict(plan.module.named_parameters())
    how = {m.weight: f"{_format(m.recipe)} {type(m.recipe).__name__}" for m in plan.layers}
    for entry in plan.experts:
        if entry.path in plan.confirmed:
            recipe = entry.recipe
            how[entry.path] = f"{_format(recipe)} {type(recipe).__name__}, per expert"
    for name, op in weights.items():
        if op is not None and name in how and name in params:  # a converted layer's weight,
            how[name] = f"high precision ({op}; not converted)"  # in a form not followed only
        elif name not in how and name in params:
            chosen = "chosen" if _chosen_out(plan, name) else "not converted"
            layer = name.rpartition(".")[0]
            sub = plan.module.get_submodule(layer)
            every = plan.module.named_modules(remove_duplicate=False)
            paths = {n for n, m in every if m is sub}  # a router shared by blocks: any of them
            if plan.gates & paths:  # left out by default: reported as the routers
                asked = layer if isinstance(sub, nn.Linear) else name  # as `filter_fn` is asked
                chosen = "chosen" if plan.chosen(asked, sub) is None else ROUTER
            how[name] = "float8" if op is None else f"high precision ({op}; {chosen})"
    order = {n: i for i, n in enumerate(params)}
    rows = [(n, params[n].numel(), h) for n, h in how.items() if n in params]
    return sorted(rows, key=lambda r: (not r[2].startswith(LOW), order[r[0]]))


def _chosen_out(plan, name: str) -> bool:
    """Whether `filter_fn` or a recipe of None left the weight `name` in high precision."""
    module = plan.module
    owner, _ = owner_of(module, name)
    if is_linear_weight(module, name):
        base = linear_base(owner)
        if base is None or type(owner).forward is base.forward:
            return True  # a layer fp8fn converts (or an attention projection), not chosen
        name = name.rpartition(".")[0]  # a subclass with its own forward: asked as a layer
    return plan.chosen(name, owner) is None


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0%"


def summarize(plan, weights: dict) -> str:
    """The table of `Transformed.summary()`."""
    rows = _rows(plan, weights)
    total = sum(n for _, n, _ in rows)
    fp8 = sum(n for _, n, h in rows if h.startswith("float8"))
    fp4 = sum(n for _, n, h in rows if h.startswith("NVFP4"))
    head = f"float8: {fp8:,} of {total:,} matmul weight elements ({_share(fp8, total)})"
    if fp4:  # 4-bit weights are not counted as float8
        head += f"; NVFP4 (4-bit): {fp4:,} ({_share(fp4, total)})"
    width = max([len(n) for n, _, _ in rows] + [6])
    lines = [head, f"{'weight':<{width}}  {'elements':>12}  {'share':>6}  runs"]
    lines += [f"{n:<{width}}  {k:>12,}  {_share(k, total):>6}  {h}" for n, k, h in rows]
    return "\n".join(lines)


def report_high_precision(plan, weights: dict) -> bool:
    """Warn (once: returns True when it did) about the weights whose GEMMs ran in high
    precision during `init` though neither `filter_fn` nor a recipe of None chose so, and that
    are not routers or gates next to experts (high precision by default, nothing to act on)."""
    rows = _rows(plan, weights)
    total = sum(n for _, n, _ in rows)
    silent = [(n, k, h) for n, k, h in rows if h.endswith("not converted)")]
    if not silent:
        return False
    share = _share(sum(k for _, k, _ in silent), total)
    named = ", ".join(
        f"{n!r} ({h[len('high precision (') : -len('; not converted)')]})" for n, _, h in silent
    )
    warnings.warn(
        f"fp8fn.init: {len(silent)} weight(s) run their GEMMs in high precision, {share} of the "
        f"model's matmul weights: {named}. fp8fn converts nn.Linear, HF Conv1D, "
        "nn.MultiheadAttention and experts weights (3-D, in F.linear, matmul, bmm and "
        "grouped_mm forms); a module that calls F.linear on its own weight is not converted. "
        "`fn.summary()` lists them all. To keep them in high precision without this warning, "
        "have `filter_fn` return False (or the recipe function None) for these names.",
        stacklevel=3,
    )
    return True
