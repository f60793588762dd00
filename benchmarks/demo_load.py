"""The demo's wall time on an idle and on a busy machine, side by side.

Runs `python -m fp8fn.demo --quiet --steps N --threads T` in fresh processes, alone and beside
`--busy` processes that spin a CPU core each (a Python loop), for each `--threads` value,
and prints one row per run: wall seconds, the fp8 run's median step, the ratio to the same
threads alone, and the 1-minute load average (`os.getloadavg`) before and after the run, which
includes whatever else the machine was doing. Then the start-up cost: `--steps 1` alone.

A run alone and the same run beside the busy processes alternate (`--repeats` rounds; the
median of each), so that drifting load from elsewhere falls on both alike. What it shows: with
2 threads on 2 cores, a busy core stalls every parallel region (libgomp's threads spin-wait at
each barrier for the thread that lost its core), so the demo collapses under load; one thread
per process has no barrier to wait at.

    python benchmarks/demo_load.py                # 50 steps, 2 busy processes, 1 and 2 threads
    python benchmarks/demo_load.py --quick        # 5 steps of a tiny model, one round
    python benchmarks/demo_load.py --startup 3    # only the start-up, 3 rounds alone + busy
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from _common import print_table, ratio

STEP = re.compile(r"^fp8 \(\w+\)\s+\S+\s+\S+\s+([\d.]+)\s*$", re.M)


# --quick's model: the demo's smallest sizes, so that a smoke run takes seconds
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16"]
TINY += ["--batch-size", "8", "--eval-batches", "1"]


def run_demo(steps: int, threads: int, env: dict, sizes: list) -> tuple[float, float, str]:
    """`(wall s, fp8 median step ms, "load before-after")` of one demo process, with the
    model and data `sizes` (demo flags; [] for its defaults)."""
    before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fp8fn.demo", "--quiet", "--steps", str(steps)]
        + ["--threads", str(threads), *sizes],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the demo failed:\n{done.stderr[-3000:]}")
    step = float(STEP.search(done.stdout).group(1))
    return wall, step, f"{before:.1f}-{os.getloadavg()[0]:.1f}"


class Busy:
    """`n` processes that each spin a CPU core, for the time of a `with` block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        # Each spins until this process ends, even if it is killed before __exit__.
        loop = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
        spin = [sys.executable, "-c", loop]
        self.procs = [subprocess.Popen(spin) for _ in range(self.n)]
        time.sleep(0.5)  # let them take their cores
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def startup(rounds: int, busy: int, env: dict, sizes: list) -> None:
    """One row per `--steps 1 --quiet` run (the demo's fixed cost), alone and beside `busy`
    spinning processes in turn."""
    rows = []
    for _ in range(rounds):
        for n in (0, busy):
            if n:
                with Busy(n):
                    wall, _, load = run_demo(1, 1, env, sizes)
            else:
                wall, _, load = run_demo(1, 1, env, sizes)
            rows.append((n, f"{wall:.1f}", load))
    header = ("busy", "wall s", "load 1-min before-after")
    print_table(header, rows, title="python -m fp8fn.demo --quiet --steps 1", left=0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="demo steps per run (default 50)")
    p.add_argument("--busy", type=int, default=2, help="spinning processes (default 2)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="default: 1 2")
    p.add_argument("--repeats", type=int, default=1, help="rounds of alone + busy (default 1)")
    p.add_argument("--quick", action="store_true", help="5 steps of a tiny model, threads 1 only")
    p.add_argument(
        "--startup",
        type=int,
        metavar="N",
        help="only the start-up (--steps 1, default threads): N rounds alone and beside --busy",
    )
    args = p.parse_args(argv)
    sizes = TINY if args.quick else []
    if args.quick:
        args.steps, args.threads = 5, [1]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "WORLD_SIZE")}
    if args.startup:
        startup(args.startup, args.busy, env, sizes)
        return
    cores = os.cpu_count()
    rows = []
    for threads in args.threads:
        results = {0: [], args.busy: []}
        for _ in range(args.repeats):
            results[0].append(run_demo(args.steps, threads, env, sizes))
            with Busy(args.busy):
                results[args.busy].append(run_demo(args.steps, threads, env, sizes))
        alone = statistics.median(r[0] for r in results[0])
        for busy, runs in results.items():
            wall = statistics.median(r[0] for r in runs)
            step = statistics.median(r[1] for r in runs)
            loads = ", ".join(r[2] for r in runs)
            rows.append((threads, busy, f"{wall:.1f}", f"{step:.0f}", ratio(wall, alone), loads))
    model = " (a tiny model)" if sizes else ""
    title = (
        f"python -m fp8fn.demo --quiet --steps {args.steps}{model} on {cores} cores, median of "
        f"{args.repeats}; busy = processes spinning a core each"
    )
    header = ("threads", "busy", "wall s", "fp8 step ms", "x alone", "load 1-min before-after")
    print_table(header, rows, title=title, left=0)
    print()
    wall, _, load = run_demo(1, 1, env, sizes)
    print(f"start-up: --steps 1 --quiet takes {wall:.1f} s alone (load {load})")


if __name__ == "__main__":
    main()
