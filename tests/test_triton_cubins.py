"""fp8fn's Triton kernels compile to cubins for the GPUs they target (sm_90, sm_100), on CPU
with Triton's bundled ptxas; on sm_80 the e4m3 variants do not (Triton's fp8e4nv needs sm_89:
why `backend="triton"` is refused there, tests/test_cuda_paths.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

_SCRIPT = pathlib.Path(__file__).with_name("_triton_cubins.py")
_ROOT = _SCRIPT.parent.parent


@pytest.mark.slow
def test_every_kernel_and_dtype_pair_compiles_for_sm_90_and_sm_100_not_e4m3_on_sm_80(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(_ROOT)}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not read from an earlier run
    run = subprocess.run(
        [sys.executable, str(_SCRIPT), "90", "100", "80"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    first, *failures = run.stdout.strip().splitlines()
    assert json.loads(first) == {"90": [28, 0], "100": [28, 0], "80": [14, 14]}, run.stdout
    assert all("sm_80" in f and "float8_e4m3fn" in f and "fp8e4nv" in f for f in failures)
