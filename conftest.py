"""pytest setup for the whole repository (tests and doctests), loaded before any module."""

import importlib.util
import logging
import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU under Triton's interpreter. The variable is read when a kernel is
    # defined (`fp8fn._kernels.triton_jit`, imported on first use), so set it before anything runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Without Triton the kernel module cannot even be imported for doctest collection.
collect_ignore = [] if importlib.util.find_spec("triton") else ["fp8fn/_kernels/triton_jit.py"]

# One intra-op thread in the test process: on a shared 2-core machine OpenMP threads spin-wait
# (benchmarks/demo_load.py). FP8FN_TEST_THREADS overrides it: tests/test_compile.py runs the
# transformer case with 2 threads in a subprocess (inductor's CPU tile2d scatter-add bug, which
# fp8fn's emulated GEMM avoids: see fp8fn/_ops/gemm.py, _widen_stored).
torch.set_num_threads(int(os.environ.get("FP8FN_TEST_THREADS", "1")))

# torchao 0.18 (the parity tests' pin; transformers imports it too) logs "Failed to load" for
# each prebuilt extension it cannot load on this torch (CUDA, another Python), and torch 2.13
# logs that its pytree registration of two Enums is deprecated: nothing a test run acts on.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
