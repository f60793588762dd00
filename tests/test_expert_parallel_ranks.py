"""`fp8fn.expert_parallel` on gloo ranks on CPU (`_ep_workers`): tiny Mixtral and Qwen3-MoE,
4 experts over 2 ranks (and Mixtral over 4, alone and on a (2, 2) "dp" x "ep" mesh under FSDP2),
float8 on the wire, against one process; one spawn per rank count, every scenario within
`_TIMEOUT_S` (a hung collective fails the run)."""

from __future__ import annotations

import _ep_workers as workers
import pytest
from _spawn import assert_ok, spawn_results

pytest.importorskip("transformers")

_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ep")
    return spawn_results(workers.main, workers.WORLD, out_dir, _TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS] + ["dcp_round_trip"])
def test_expert_parallel_scenario(results, scenario):
    assert_ok(results, scenario)


@pytest.mark.slow
def test_expert_parallel_four_ranks(tmp_path):
    results = spawn_results(workers.main, 4, tmp_path, _TIMEOUT_S)
    assert_ok(results, "bit_identical_mixtral_4_ranks")
    assert_ok(results, "ep_x_dp_fsdp2")
    assert_ok(results, "ep_x_dp_without_divide_factor")
