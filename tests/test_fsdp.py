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


def _spawn_main(rank, world_size, port, out_dir):
    workers.main(rank, world_size, port, out_dir)


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
