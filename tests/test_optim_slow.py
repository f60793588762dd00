"""fp8fn.optim across processes and compilers: bit-identical updates on every mesh (gloo
ranks, `_optim_workers`), the compiled step against eager, the torch.optim adapter under
FSDP2 with torch.distributed.checkpoint."""

from __future__ import annotations

import _optim_workers as workers
import pytest
from _spawn import assert_ok, spawn_results

_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("optim_workers")
    names = [s.__name__ for s in workers.SCENARIOS]
    return spawn_results(workers.main, workers.WORLD, out_dir, _TIMEOUT_S, names)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_layout_invariance(results, scenario):
    assert_ok(results, scenario)
