"""fp8fn.all_reduce and data-parallel training on torch.distributed: 2 gloo ranks on CPU.

One spawn of 2 processes runs every scenario of `_distributed_workers.SCENARIOS` (spawning is the
expensive part); each test here checks the outcome of one scenario on both ranks. A worker that
hangs fails the tests after `_TIMEOUT_S` instead of hanging the run.
"""

from __future__ import annotations

import _distributed_workers as workers
import pytest
import torch
import torch.distributed as dist
from _spawn import run_ranks

import fp8fn

_TIMEOUT_S = 150


def _spawn_main(rank, world_size, port, out_dir):
    workers.main(rank, world_size, port, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """`{rank: {scenario: "ok" | traceback}}` from one run of all scenarios on 2 ranks."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out_dir = tmp_path_factory.mktemp("distributed")
    return run_ranks(_spawn_main, workers.WORLD, out_dir, _TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_distributed_scenario(results, scenario):
    for rank, outcome in results.items():
        assert outcome.get(scenario) == "ok", f"rank {rank}:\n{outcome.get(scenario)}"


def test_all_reduce_refuses_without_process_group():
    state = fp8fn.init_state(fp8fn.DelayedScaling(), ["fc"])
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match=r"fp8fn.all_reduce: expected an initialized torch"):
        fp8fn.all_reduce(state)


def test_all_reduce_checks_obs_before_group():
    with pytest.raises(TypeError, match=r"fp8fn.all_reduce: expected `obs` to be an fp8fn.State"):
        fp8fn.all_reduce(torch.zeros(1, 3, 16))
