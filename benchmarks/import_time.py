"""Import time: `import torch` against `import fp8fn` (which imports torch), in fresh processes.

Standalone: `python benchmarks/import_time.py [--repeats N] [--quick]`. The package never imports
it. Each measurement is a new Python process that times its one import statement with
`time.perf_counter` (interpreter start-up excluded); the two imports alternate, and the table
gives the median of `--repeats` (5) processes each and the ratio to `import torch`. `import
fp8fn` must import neither Triton nor torch._dynamo (torch.compile's machinery): the last column
says which of them the import left in `sys.modules`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import subprocess
import sys

from _common import print_table, ratio

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("triton", "torch._dynamo", "torch._inductor")
PROBE = """
import json, sys, time
start = time.perf_counter()
import {module}
seconds = time.perf_counter() - start
print(json.dumps([seconds, [m for m in {heavy!r} if m in sys.modules]]))
"""


def time_import(module: str) -> tuple[float, list[str]]:
    """Seconds `import module` takes in a fresh interpreter, and the heavy modules it loaded."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, heavy=HEAVY)],
        cwd=ROOT,  # this checkout's fp8fn
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    return seconds, heavy


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="processes per import")
    parser.add_argument("--quick", action="store_true", help="3 processes each (a smoke run)")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    modules = ("torch", "fp8fn")
    times = {m: [] for m in modules}
    heavy = {m: set() for m in modules}
    for _ in range(repeats):  # alternating, so that machine load falls on both alike
        for m in modules:
            seconds, loaded = time_import(m)
            times[m].append(seconds)
            heavy[m].update(loaded)
    median = {m: statistics.median(t) for m, t in times.items()}
    print_table(
        ["import", "heavy modules loaded", "median s", "min s", "x torch"],
        [
            [
                f"import {m}",
                ", ".join(sorted(heavy[m])) or "none",
                f"{median[m]:.3f}",
                f"{min(times[m]):.3f}",
                ratio(median[m], median["torch"]),
            ]
            for m in modules
        ],
        title=f"import time in a fresh process, median of {repeats}, "
        f"Python {platform.python_version()}",
        left=2,
    )


if __name__ == "__main__":
    main()
