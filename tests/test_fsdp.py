"""FSDP2 (`fully_shard`) with fp8fn on 2 gloo ranks on CPU, against one process.

One spawn of 2 processes runs every scenario of `_fsdp_workers.SCENARIOS` (spawning is the
expensive part); each test here checks the outcome of one scenario on both ranks. A rank that
hangs fails the tests after `_TIMEOUT_S` instead of hanging the run.
"""

from __future__ import annotations

import _fsdp_workers as workers
import pytest
import torch.distributed as dist
from _spawn import run_ranks

_TIMEOUT_S = 300


def _spawn_main(rank, world_size, port, out_dir, names=None):
    workers.main(rank, world_size, port, out_dir, names)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """`{rank: {scenario: "ok" | traceback}}` from one run of all scenarios on 2 ranks."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out_dir = tmp_path_factory.mktemp("fsdp")
    return run_ranks(_spawn_main, workers.WORLD, out_dir, _TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_fsdp_scenario(results, scenario):
    for rank, outcome in results.items():
        assert outcome.get(scenario) == "ok", f"rank {rank}:\n{outcome.get(scenario)}"


@pytest.mark.slow
def test_checkpoint_resume_on_the_same_ranks_is_bit_identical(tmp_path):
    """A run saved after 2 steps with torch.distributed.checkpoint and resumed in fresh processes
    takes a 3rd step bit-identical to the uninterrupted run (see `_fsdp_workers.dcp_resume`)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    for scenario in workers.CHECKPOINT:
        name = scenario.__name__
        results = run_ranks(_spawn_main, workers.WORLD, tmp_path, _TIMEOUT_S, [name])
        for rank, outcome in results.items():
            assert outcome.get(name) == "ok", f"{name}, rank {rank}:\n{outcome.get(name)}"
