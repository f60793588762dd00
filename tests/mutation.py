"""Mutation testing of fp8fn's core: would the test suite catch the next bug?

Usage (from anywhere; not a test module):

    python tests/mutation.py            # every mutation against the default test subset
    python tests/mutation.py --quick    # only tests/test_reference.py, without the slow cases
    python tests/mutation.py --tests tests/test_scaling.py tests/test_linear.py
    python tests/mutation.py --only e4m3-grad-output margin-current --keep

For each mutation the package `fp8fn/` is copied to a temporary directory, one small edit is
applied by exact string replacement (a pattern that does not occur exactly once aborts the run:
the code moved, update the mutation), and pytest runs the chosen tests with `-x -q` against the
copy (its directory first on `sys.path` and in `PYTHONPATH`; checked before anything runs).
The unmutated copy runs first and must pass. Prints a table: mutation | caught? | by which test.
Exit status 0 when every mutation is caught, 1 when some survive, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "fp8fn"

DEFAULT_TESTS = [
    "tests/test_reference.py",
    "tests/test_scaling.py",
    "tests/test_linear.py",
    "tests/test_compositions.py",
]
QUICK_TESTS = ["tests/test_reference.py"]
QUICK_DESELECT = ["compiled", "transformer"]  # tests left out by --quick (-k "not ...")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    file: str  # relative to fp8fn/
    edits: tuple  # ((old, new), ...): each `old` must occur exactly once


MUTATIONS = [
    Mutation(
        "e4m3-grad-output",
        "grad_output cast to e4m3 instead of e5m2",
        "_linear.py",
        (
            (
                "cast_to_fp8(grad_out, g_scale, E5M2)",
                "cast_to_fp8(grad_out, g_scale, E4M3)",
            ),
        ),
    ),
    Mutation(
        "margin-current",
        "margin dropped from the current-scaling fallback",
        "_linear.py",
        (
            (
                "current = scale_from_amax(amaxes, fp8_max, margin)",
                "current = scale_from_amax(amaxes, fp8_max, 0)",
            ),
        ),
    ),
    Mutation(
        "merge-sums",
        "merge sums observations instead of taking their max",
        "_scaling.py",
        (
            (
                "amax_history=torch.maximum(_observed(obs_a.amax_history), "
                "_observed(obs_b.amax_history)),",
                "amax_history=_observed(obs_a.amax_history) + _observed(obs_b.amax_history),",
            ),
        ),
    ),
    Mutation(
        "update-pushes-nonfinite",
        "update pushes NaN and inf observations",
        "_scaling.py",
        (("push = (amax > 0) & torch.isfinite(amax)", "push = amax != 0"),),
    ),
    Mutation(
        "bias-grad-no-float",
        "bias gradient summed in the output gradient's dtype (no .float())",
        "_linear.py",
        (
            (
                "grads[2] = grad_out.float().sum(0).to(b_dtype)",
                "grads[2] = grad_out.sum(0).to(b_dtype)",
            ),
        ),
    ),
    Mutation(
        "roll-drops-newest",
        "history roll drops the newest entry instead of the oldest",
        "_scaling.py",
        (
            (
                "rolled = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)",
                "rolled = torch.cat([amax.unsqueeze(-1), history[..., 1:]], dim=-1)",
            ),
        ),
    ),
    Mutation(
        "most-recent-uses-max",
        '"most_recent" uses the max of the history',
        "_scaling.py",
        (
            (
                'window = history if state.amax_compute == "max" else history[..., :1]',
                "window = history",
            ),
        ),
    ),
    Mutation(
        "stored-scale-ignored",
        "the stored scale ignored (always current scaling)",
        "_linear.py",
        (
            (
                "return current if newest is None else torch.where(newest > 0, stored, current)",
                "return current if newest is None else torch.where(newest > 0, current, current)",
            ),
        ),
    ),
    Mutation(
        "vmap-no-fold",
        "the op's vmap rule does not fold the batch (the generated per-member rule)",
        "_linear.py",
        (("out = _Fp8Linear.apply(", "out = _Fp8LinearOp.apply("),),
    ),
    Mutation(
        "no-saturation",
        "the saturating clamp removed from the cast",
        "_cast.py",
        (
            (
                "return (hp.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)",
                "return (hp.float() * scale).to(dtype)",
            ),
        ),
    ),
    Mutation(
        "no-reuse-check",
        "the reuse check (one state in two recorded forward passes) removed",
        "_state.py",
        (('if getattr(history, "_fp8fn_used", False):', "if False:"),),
    ),
    Mutation(
        "margin-update",
        "update recomputes the scale without the margin",
        "_scaling.py",
        (
            (
                "new_scale = scale_from_amax(window.amax(dim=-1), ROLE_FP8_MAX, state.margin)",
                "new_scale = scale_from_amax(window.amax(dim=-1), ROLE_FP8_MAX, 0)",
            ),
        ),
    ),
    Mutation(
        "stale-scale",
        "update pushes the amax but keeps the old scale",
        "_scaling.py",
        (
            (
                "scale = torch.where(push, new_scale, scale)",
                "scale = torch.where(push, scale, scale)",
            ),
        ),
    ),
    Mutation(
        "empty-history-uses-stored",
        "an empty history casts with the stored scale (1) instead of current scaling",
        "_linear.py",
        (
            (
                "return current if newest is None else torch.where(newest > 0, stored, current)",
                "return current if newest is None else torch.where(newest >= 0, stored, current)",
            ),
        ),
    ),
    Mutation(
        "grad-output-observes-weight",
        "the grad_output observation is the weight's amax",
        "_linear.py",
        (
            (
                "grads[3] = torch.stack([x_amax, w_amax, g_amax])",
                "grads[3] = torch.stack([x_amax, w_amax, w_amax])",
            ),
        ),
    ),
]


class SetupError(Exception):
    pass


def mutate(root: Path, mutation: Mutation | None) -> None:
    """Copy the package under `root` and apply `mutation` to the copy."""
    target = root / "fp8fn"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "_fp8fn_mutation_check.py").write_text(_PLUGIN)
    if mutation is None:
        return
    path = target / mutation.file
    text = path.read_text()
    for old, new in mutation.edits:
        count = text.count(old)
        if count != 1:
            raise SetupError(
                f"mutation {mutation.name!r}: expected the pattern exactly once in "
                f"fp8fn/{mutation.file}, found it {count} times:\n    {old}\n"
                "The code moved: update the mutation in tests/mutation.py."
            )
        text = text.replace(old, new)
    path.write_text(text)


_PLUGIN = """\
import os

import pytest


def pytest_collection_finish(session):
    import fp8fn

    root = os.path.realpath(os.environ["FP8FN_MUTATION_ROOT"])
    if not os.path.realpath(fp8fn.__file__).startswith(root + os.sep):
        pytest.exit(
            f"mutation.py: the tests imported fp8fn from {fp8fn.__file__}, not the copy in {root}",
            returncode=3,
        )
"""


def environment(root: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO / "tests")])
    env["FP8FN_MUTATION_ROOT"] = str(root)
    env["COLUMNS"] = "400"  # pytest cuts the short summary's messages to the terminal's width
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import(root: Path) -> None:
    """The copy under `root`, not the working tree, is the `fp8fn` the tests import."""
    out = subprocess.run(
        [sys.executable, "-c", "import fp8fn; print(fp8fn.__file__)"],
        cwd=root,
        env=environment(root),
        capture_output=True,
        text=True,
    )
    where = out.stdout.strip()
    if out.returncode or not where.startswith(str(root)):
        raise SetupError(
            f"the tests would import fp8fn from {where or out.stderr!r}, not from the copy in "
            f"{root}: mutations would test the working tree."
        )


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", re.MULTILINE)


def run_tests(root: Path, tests: list, select: str | None, timeout: float):
    """Run pytest on the copy under `root`: (status, first failing test, its message, seconds)."""
    cmd = [sys.executable, "-m", "pytest", *[str(REPO / t) for t in tests]]
    cmd += ["-x", "-q", "-p", "no:cacheprovider", "-p", "_fp8fn_mutation_check"]
    cmd += [f"--rootdir={REPO}", "--import-mode=importlib", "-W", "ignore"]
    if select:
        cmd += ["-k", select]
    start = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=root, env=environment(root), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", "", f"no result within {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    failed = _FAILED.search(out.stdout)
    if out.returncode == 0:
        return "passed", "", "", seconds
    if out.returncode == 3 and "mutation.py:" in out.stdout + out.stderr:
        raise SetupError((out.stdout + out.stderr).strip().splitlines()[-1])
    if failed:
        test = failed.group(2).split("tests/", 1)[-1]
        return "failed", test, (failed.group(3) or "").strip(), seconds
    tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
    return f"rc {out.returncode}", "", " | ".join(tail), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="test_reference.py, fast cases")
    parser.add_argument("--tests", nargs="+", help="test files (relative to the repository)")
    parser.add_argument("--only", nargs="+", help="mutation names to run")
    parser.add_argument("-k", dest="select", help="pytest -k expression choosing tests")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)

    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28} fp8fn/{m.file:12} {m.what}")
        return 0
    tests = args.tests or (QUICK_TESTS if args.quick else DEFAULT_TESTS)
    select = " and ".join(f"not {k}" for k in QUICK_DESELECT) if args.quick else None
    if args.select:
        select = f"({args.select})" + (f" and {select}" if select else "")
    mutations = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTATIONS}
        if unknown:
            print(f"unknown mutations: {sorted(unknown)}", file=sys.stderr)
            return 2
        mutations = [m for m in MUTATIONS if m.name in args.only]

    workdir = Path(tempfile.mkdtemp(prefix="fp8fn-mutation-"))
    rows = []
    try:
        # Every pattern first: a stale mutation aborts before anything runs.
        for i, m in enumerate(mutations):
            mutate(workdir / f"check{i}", m)
        baseline = workdir / "baseline"
        mutate(baseline, None)
        check_import(baseline)
        print(f"tests: {' '.join(tests)}" + (f"  -k {select!r}" if select else ""))
        status, test, message, seconds = run_tests(baseline, tests, select, args.timeout * 2)
        print(f"baseline (no mutation): {status} in {seconds:.0f} s", flush=True)
        if status != "passed":
            print(f"the unmutated package fails {test}: {message}", file=sys.stderr)
            return 2
        for i, m in enumerate(mutations):
            root = workdir / f"mutant{i}"
            mutate(root, m)
            status, test, message, seconds = run_tests(root, tests, select, args.timeout)
            caught = {"passed": "NO", "failed": "yes"}.get(status, f"yes ({status})")
            rows.append((m, caught, test, message, seconds))
            print(f"  {m.name}: caught={caught} {test} ({seconds:.0f} s)", flush=True)
    except SetupError as e:
        print(f"setup error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"copies kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print("| mutation | caught? | by which test | how |")
    print("|---|---|---|---|")
    for m, caught, test, message, _ in rows:
        how = message.replace("|", "/")[:90]
        print(f"| {m.what} (`{m.name}`) | {caught} | {f'`{test}`' if test else ''} | {how} |")
    survivors = [m.name for m, caught, *_ in rows if caught == "NO"]
    print(f"\n{len(rows) - len(survivors)} of {len(rows)} caught; survivors: {survivors or 'none'}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
