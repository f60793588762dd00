"""The experts weights' GEMMs a `Call` (`routing.py`) runs: all experts at once on the grouped
float8 op, and the rows of state fp8fn's expert-parallel forward (`expert_parallel.py`) takes."""

from __future__ import annotations

from .._core.checks import check_dtypes
from .._core.recipes import DelayedScaling, NVFP4Scaling
from .._core.state import known_filled, site_name
from .._ops.gemm import resolve_backend
from .._ops.grouped import grouped_mm
from .experts import expert_rows


def grouped(call, gemm):
    """A GEMM of all of an experts weight's experts (`experts.Gemm`), run by `call` on the
    grouped float8 op with the rows of their sites."""
    entry = gemm.derived.entry
    k = call.count_experts(entry)
    newest = stored = None
    if isinstance(entry.recipe, DelayedScaling):
        first = expert_rows("apply", call.state._positions(), entry.path, entry.experts, k)
        newest = call.newest_rows()[first : first + entry.experts]
        stored = call.state.scale[first : first + entry.experts]
    x, weight = gemm.x, gemm.weight
    check_dtypes(f"apply: experts {entry.path!r}", x, weight[0], None)
    backend = resolve_backend(entry.recipe, x.device, "apply")
    margin = getattr(entry.recipe, "margin", 0)
    random = None  # NVFP4: expert e draws with the key folded with e, at the call's site
    if isinstance(entry.recipe, NVFP4Scaling):
        random = (call.state.key, site_name(entry.path, k))
    return gemm.finish(
        grouped_mm(
            x,
            weight,
            gemm.offs,
            newest,
            stored,
            margin,
            backend,
            recipe=entry.recipe,
            random=random,
            api=f"apply: experts {entry.path!r}",
        )
    )


def expert_parallel_rows(call, module, attrs) -> list | None:
    """For fp8fn's expert-parallel forward (`expert_parallel.py`): `call`'s call of the experts
    weights `attrs` of `module`, counted as one grouped call of all their experts, as
    `[(recipe, newest, stored, filled)]` (`newest`, `stored`: float32 `(E, 3)` state rows
    under DelayedScaling, else None; None while discovering; `filled`: `State.filled` of
    those rows, `3 * E` bools expert-major, where `known_filled` knows them, else None); None
    when fp8fn does not run them.

    Raises:
      ValueError: `fp8fn.apply: ...` (`fp8fn.init: ...`) for a recipe other than
        DelayedScaling or CurrentScaling, or when only some of `attrs` are chosen.
    """
    entries = [
        next((e for e in call.plan.experts if e.module is module and e.attr == a), None)
        for a in attrs
    ]
    if all(e is None for e in entries):
        return None
    known = next(e.path for e in entries if e is not None).rpartition(".")[0]
    names = [f"{known}.{a}" for a in attrs]
    kinds = {type(e.recipe).__name__ if e else None for e in entries}
    if None in kinds or not kinds <= {"DelayedScaling", "CurrentScaling"}:
        api = "init" if call.state is None else "apply"
        raise ValueError(
            f"fp8fn.{api}: expected the expert-parallel experts weights {names} to use "
            "DelayedScaling or CurrentScaling together (fp8fn.expert_parallel runs their "
            f"GEMMs on each rank's experts), got {sorted(map(str, kinds))}. Choose one of "
            "those for both weights, or None for both (high precision)."
        )
    out = []
    for entry in entries:
        k = call.count_experts(entry)
        if call.state is None:
            call.tracked.weights[entry.path] = None  # runs in float8 (`Tracked.note`)
            out.append((entry.recipe, None, None, None))
            continue
        newest = stored = filled = None
        if isinstance(entry.recipe, DelayedScaling):
            positions = call.state._positions()
            first = expert_rows("apply", positions, entry.path, entry.experts, k)
            newest = call.newest_rows()[first : first + entry.experts]
            stored = call.state.scale[first : first + entry.experts]
            known = known_filled(call.state)  # never the structure's word alone
            if known is not None:
                filled = known[3 * first : 3 * (first + entry.experts)]
        out.append((entry.recipe, newest, stored, filled))
    return out


def note_orientation(weight) -> None:
    """While discovering: an experts weight gathered in float8 under a finer recipe learns how
    its GEMMs read it, as `weight` (the GEMM's `(N, K)` or `(E, N, K)`) stands to it
    (`note_orientation`, duck-typed)."""
    note = getattr(type(weight), "note_orientation", None)
    if note is not None:
        note(weight)
