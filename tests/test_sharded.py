"""Sharded parameters (DTensors) through `fn.apply`, on gloo ranks on CPU: functional FSDP under
torch.func and plain autograd (2 and 4 ranks), tensor parallel with Colwise / Rowwise /
SequenceParallel (2 ranks), and 2-D, TP inside FSDP2 (4 ranks).

One spawn per world size runs its scenarios of `_sharded_workers` (spawning is the expensive
part); each test checks one scenario's outcome on every rank. The ranks' process group times out
after 60 s, so a hung collective raises, and a spawn that does not finish within its deadline
fails the tests and is killed.
"""

from __future__ import annotations

import _sharded_workers as workers
import pytest
from _spawn import assert_ok, spawn_results

pytestmark = pytest.mark.slow

RUNS = {
    2: [
        "fsdp_step1_weight_cast_with_whole_amax",
        "fsdp_functional_routes_and_steps",
        "fsdp_finer_recipe_layer_gathers_in_high_precision",
        "fsdp_errors",
        "fsdp_edges",
        "fsdp_checkpoint_fn_and_higher_order",
        "fsdp_tied_weights",
        "torch_private_dtensor_helpers",
        "tp_colwise_rowwise",
        "tp_checkpoint_fn",
        "tp_sequence_parallel",
        "current_scaling_sharded",
        "sharded_margin_bias_and_rows",
        "fsdp_rank_without_rows_steps",
    ],
    4: [
        "fsdp_step1_weight_cast_with_whole_amax",
        "fsdp_functional_routes_and_steps",
        "two_d_tp_and_fsdp2",
    ],
}
_TIMEOUT_S = {2: 300, 4: 420}


def _run(world: int, out_dir) -> dict:
    """`{rank: {scenario: "ok" | traceback}}` from one spawn of `world` ranks."""
    return spawn_results(workers.main, world, out_dir, _TIMEOUT_S[world], RUNS[world])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = _run(world, tmp_path_factory.mktemp(f"sharded{world}"))
        return cache[world]

    return get


@pytest.mark.parametrize(
    "world, scenario", [(w, s) for w, names in RUNS.items() for s in names], ids=str
)
def test_sharded_scenario(results, world, scenario):
    assert_ok(results(world), scenario, f"{world} ranks, ")
