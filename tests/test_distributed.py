"""fp8fn.all_reduce and data-parallel training on torch.distributed: 2 gloo ranks on CPU.

`test_distributed_scenario` checks, on both ranks, one scenario of `_distributed_workers`, all
run in one spawn within 150 s (see `_spawn.all_scenarios_results`).
"""

from __future__ import annotations

import _distributed_workers as workers
import pytest
import torch
import torch.distributed as dist
from _spawn import all_scenarios_results, assert_ok

import fp8fn

results = all_scenarios_results(workers, timeout_s=150)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_distributed_scenario(results, scenario):
    assert_ok(results, scenario)


def test_all_reduce_refuses_without_process_group():
    state = fp8fn.init_state(fp8fn.DelayedScaling(), ["fc"])
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match=r"fp8fn.all_reduce: expected an initialized torch"):
        fp8fn.all_reduce(state)


def test_all_reduce_checks_obs_before_group():
    with pytest.raises(TypeError, match=r"fp8fn.all_reduce: expected `obs` to be an fp8fn.State"):
        fp8fn.all_reduce(torch.zeros(1, 3, 16))


def _dies_at_exit(rank, world_size, port, out_dir, write_first):
    """A rank that writes its JSON (or not) and is then killed by a signal, as gloo sometimes kills
    a finished process at exit; a second spawn (a `retried` file exists) exits cleanly."""
    import json
    import os
    import pathlib
    import time

    out = pathlib.Path(out_dir)
    retried = (out / "retried").exists()
    if write_first or retried:
        (out / f"rank{rank}.json").write_text(json.dumps({"retried": retried}))
    if rank == 0 and not retried:
        while write_first and not (out / "rank1.json").exists():
            time.sleep(0.01)  # both finished, as at a real exit
        (out / "retried").touch()
        os.abort()


@pytest.mark.slow
def test_a_rank_killed_at_exit_after_writing_its_results_is_accepted_else_spawned_again(tmp_path):
    from _spawn import run_ranks

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    written = run_ranks(_dies_at_exit, 2, tmp_path / "a", 60, True)
    assert written == {0: {"retried": False}, 1: {"retried": False}}
    unwritten = run_ranks(_dies_at_exit, 2, tmp_path / "b", 60, False)
    assert unwritten == {0: {"retried": True}, 1: {"retried": True}}
