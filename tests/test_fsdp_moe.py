"""FSDP2 (`fully_shard`) of tiny Mixtral, GPT-OSS and Llama 4 experts weights (float32, and
under a bfloat16 `MixedPrecisionPolicy`) on 2 gloo ranks on CPU, against
one process: FSDP2's unsharded experts weights, swapped in for the forward, run in float8
(`_fsdp_moe_workers`, all scenarios in one spawn within `_TIMEOUT_S`), under the per-tensor
recipes and, one plane per phase, the finer ones (3 experts: a padded shard); and their float8
GEMM calls under torch's CUDA rules for sm_90 and sm_100 (`fp8fn.testing.cuda_path_on_cpu`)."""

from __future__ import annotations

import _fsdp_moe_workers as workers
import pytest
from _spawn import all_scenarios_results, assert_ok

pytest.importorskip("transformers")

_TIMEOUT_S = 480  # (19 scenarios: 122-142 s on 2 shared cores)

results = all_scenarios_results(workers, _TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_fsdp_moe_scenario(results, scenario):
    assert_ok(results, scenario)
