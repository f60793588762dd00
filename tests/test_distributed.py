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
