"""Timing and tables shared by the benchmark scripts (a helper, not a benchmark).

The scripts run as `python benchmarks/<name>.py`, which puts this folder first on `sys.path`,
so they import it as `_common`. Nothing here imports fp8fn or the tests.

* `median_times(fns, repeats)`: the median seconds per call of each function, timed in
  interleaved rounds (every round calls each function once in turn), so that drift and machine
  load fall on all variants alike; by the host's clock (`wall_clock`) or CUDA events
  (`cuda_clock`).
* `print_table(header, rows)`: a plain-text table, the name columns left-aligned, the others
  right-aligned, each as wide as its widest cell.
* `ratio(a, b)`: `a / b` as a table cell, `"1.23x"`.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence


def median_times(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 1,
    inner: int = 1,
    before: Callable[[], object] | None = None,
    shuffle: int | None = None,
    rewarm: bool = False,
    clock: Callable[[Callable[[], object]], float] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds.

    Args:
      fns: `{name: fn}`, each called with no arguments.
      repeats: timed rounds; each round times every function once.
      warmup: untimed rounds first (compilation, caches, allocator).
      inner: calls per timing (their total is divided by `inner`): for calls too short to time
        one by one.
      before: called, untimed, before each timing (e.g. `torch.distributed.barrier`, so that
        the ranks start together).
      shuffle: a seed: call the functions in a new random order every round, so that the
        after-effects of one fall on all alike (default: their order in `fns`).
      rewarm: call each function once, untimed, right before its timed call (caches warm for
        that case, whatever ran before it).
      clock: `clock(run)` runs `run()` once and returns the seconds it took: `wall_clock`
        (the default) or `cuda_clock`.

    Returns:
      `{name: median seconds per call}`, in the order of `fns`.
    """
    clock = clock or wall_clock
    order = list(fns)
    rng = random.Random(shuffle)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + repeats):
        if shuffle is not None:
            rng.shuffle(order)
        for name in order:
            fn = fns[name]

            def run(fn=fn):
                for _ in range(inner):
                    fn()

            if rewarm:
                fn()
            if before is not None:
                before()
            elapsed = clock(run)
            if i >= warmup:
                times[name].append(elapsed / inner)
    return {name: statistics.median(t) for name, t in times.items()}


def wall_clock(run: Callable[[], object]) -> float:
    """Seconds of host time `run()` takes."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def cuda_clock(run: Callable[[], object]) -> float:
    """Seconds of GPU time between CUDA events recorded before and after `run()`."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def ratio(a: float, b: float, digits: int = 2) -> str:
    """`a / b` as a table cell: `"1.23x"` (`"-"` when `b` is missing or zero)."""
    return f"{a / b:.{digits}f}x" if b else "-"


def print_table(
    header: Sequence[str], rows: Sequence[Sequence[object]], title: str = "", left: int = 1
) -> None:
    """Print `rows` under `header` (and under `title`, if given), columns aligned.

    Cells are printed with `str`: format numbers before (`f"{ms:.2f}"`, `ratio(a, b)`). The
    first `left` columns (names) are left-aligned, the others right-aligned, two spaces apart.
    """
    lines = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(header))]
    if title:
        print(title)
    for line in lines:
        cells = (
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))
        )
        print("  ".join(cells).rstrip())
