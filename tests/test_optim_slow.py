"""fp8fn.optim across processes and compilers: bit-identical updates on every mesh (gloo
ranks, `_optim_workers`), the compiled step against eager, the torch.optim adapter under
FSDP2 with torch.distributed.checkpoint."""

from __future__ import annotations

import _optim_workers as workers
import pytest
from _spawn import assert_ok, spawn_results

_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """(its directory, `{rank: {scenario: "ok" | traceback}}`) of one spawn on 2 ranks running
    every scenario, then `dcp_save`, whose checkpoint stays in the directory."""
    out_dir = tmp_path_factory.mktemp("optim_workers")
    names = [s.__name__ for s in workers.SCENARIOS] + ["dcp_save"]
    return out_dir, spawn_results(workers.main, workers.WORLD, out_dir, _TIMEOUT_S, names)


@pytest.fixture(scope="module")
def results(spawned):
    return spawned[1]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_layout_invariance(results, scenario):
    assert_ok(results, scenario)


@pytest.mark.slow
def test_dcp_checkpoint_under_fsdp2_resumes_on_another_world_size(spawned):
    """fp8fn.optim.AdamW's float8 moments saved by torch.distributed.checkpoint on 2 FSDP2
    ranks, loaded on 1: the next step is bit-identical to the uninterrupted 2-rank run."""
    out_dir, saved = spawned
    assert_ok(saved, "dcp_save", "dcp_save, ")
    resumed = spawn_results(workers.main, 1, out_dir, _TIMEOUT_S, ["dcp_resume"])
    assert_ok(resumed, "dcp_resume", "dcp_resume, ")
