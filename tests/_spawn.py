"""Run scenarios on gloo ranks in fresh processes, with a deadline (not a test module).

The test side: `run_ranks` (or `spawn_results`, which skips without torch.distributed) spawns the
ranks; each runs `main(rank, world_size, port, out_dir, *args)`, which writes
`out_dir/rank{r}.json`. A rank still running at the deadline is killed and the calling test
fails, so a hung collective fails the run instead of hanging it. `assert_ok` checks one
scenario's outcome on every rank.

The rank side: a worker module's `main` calls `run_scenarios`, which gives the process group a
timeout (a hung collective raises), runs the scenarios in order and writes the rank's JSON.
Inside a scenario, `same_on_all_ranks` and `assert_state_same_on_all_ranks` compare across ranks.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(main, world_size: int, out_dir, timeout_s: float, *args) -> None:
    """Run `main(rank, world_size, port, out_dir, *args)` on `world_size` spawned ranks; fail the
    calling test (and kill the ranks) if they have not finished after `timeout_s`."""
    context = mp.start_processes(
        main,
        args=(world_size, free_port(), str(out_dir), *args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def run_ranks(main, world_size: int, out_dir, timeout_s: float, *args) -> dict:
    """`{rank: the rank's JSON}` after `spawn_ranks`.

    gloo sometimes aborts a process at exit, after its work is done ("terminate called without an
    active exception" as its threads are torn down; seen once in ~200 spawns). A rank killed by a
    signal is therefore accepted when every rank wrote its JSON; otherwise the spawn runs once
    more (every worker is a pure function of its arguments and of files it only reads), and a
    second death fails the test."""
    out_dir = pathlib.Path(out_dir)
    files = [out_dir / f"rank{r}.json" for r in range(world_size)]
    for attempt in range(2):
        for f in files:
            f.unlink(missing_ok=True)
        try:
            spawn_ranks(main, world_size, out_dir, timeout_s, *args)
            break
        except mp.ProcessExitedException as e:
            if e.exit_code < 0 and all(f.exists() for f in files):
                break  # killed at exit, after writing its results
            if e.exit_code >= 0 or attempt == 1:
                raise
    return {r: json.loads(f.read_text()) for r, f in enumerate(files)}


def spawn_results(main, world_size: int, out_dir, timeout_s: float, *args) -> dict:
    """`run_ranks`, skipping the calling test where torch.distributed is not available."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    return run_ranks(main, world_size, out_dir, timeout_s, *args)


def all_scenarios_results(workers, timeout_s: float):
    """A module-scoped fixture `results`: `{rank: {scenario: "ok" | traceback}}` from one spawn
    of `workers.main` on `workers.WORLD` ranks running all of `workers.SCENARIOS` (spawning is
    the expensive part, so the module's tests share it), killed after `timeout_s`."""

    @pytest.fixture(scope="module", name="results")
    def results(tmp_path_factory):
        out_dir = tmp_path_factory.mktemp(workers.__name__.strip("_"))
        return spawn_results(workers.main, workers.WORLD, out_dir, timeout_s)

    return results


def assert_ok(results: dict, scenario: str, where: str = "") -> None:
    """Every rank of `results` (`{rank: {scenario: "ok" | traceback}}`) ran `scenario` to the
    end; the message shows the failing rank's traceback, after `where`."""
    for rank, outcome in results.items():
        assert outcome.get(scenario) == "ok", f"{where}rank {rank}:\n{outcome.get(scenario)}"


def same_on_all_ranks(t: torch.Tensor, group=None) -> bool:
    """Whether `t` is equal, bit for bit, on every rank of `group` (a collective: all ranks
    call it)."""
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t.contiguous(), group=group)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def assert_on_every_rank(checks: dict) -> None:
    """Assert `checks` (`{what: bool}`, this rank's outcomes of rank-local checks) on every rank
    at once (a collective: all ranks call it with the same keys): a check that fails on one
    rank fails every rank with an AssertionError naming it, so none is left waiting in the
    next collective (a timeout, which is no assertion)."""
    ok = torch.tensor([float(v) for v in checks.values()])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    failed = [what for what, v in zip(checks, ok.tolist()) if v == 0.0]
    mine = [what for what, v in checks.items() if not v]
    assert not failed, f"failed on some rank: {failed} (on this rank: {mine})"


def assert_state_same_on_all_ranks(state) -> None:
    """An `fp8fn.State`'s histories and scales are the same on every rank (a collective)."""
    assert same_on_all_ranks(state.amax_history), "amax histories differ across ranks"
    assert same_on_all_ranks(state.scale), "scales differ across ranks"


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """This rank's gloo process group on localhost, one thread; a collective that hangs raises
    after `timeout_s`."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run_scenarios(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    scenarios: list,
    measured: dict,
    group_timeout_s: float,
) -> None:
    """One rank: init the gloo group (its collectives time out after `group_timeout_s`), run
    each of `scenarios` (`scenario(rank)`) in order with a barrier after each, and write
    `out_dir/rank{rank}.json`: `{name: "ok" | traceback}`, `"_measured": measured`, and
    `"_aborted_after": name` where a failed rank broke the group (the barrier raised) and the
    rest were not run."""
    init_gloo(rank, world_size, port, group_timeout_s)
    results = {}
    try:
        for scenario in scenarios:
            try:
                scenario(rank)
                results[scenario.__name__] = "ok"
            except Exception:
                results[scenario.__name__] = traceback.format_exc()
            try:
                dist.barrier()
            except RuntimeError:  # another rank failed inside a collective: the group is gone
                results["_aborted_after"] = scenario.__name__
                break
    finally:
        results["_measured"] = measured
        out = pathlib.Path(out_dir) / f"rank{rank}.json"
        partial = out.with_suffix(".partial")
        partial.write_text(json.dumps(results, default=str))
        partial.replace(out)  # whole or absent: `run_ranks` reads a rank's file as its results
        dist.destroy_process_group()
