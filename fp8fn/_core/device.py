"""Which CUDA path a device takes: the one seam between fp8fn's CPU and CUDA branches.

Every decision that depends on the GPU (torch's float8 GEMM or emulation, the one-call grouped
GEMM, Triton's float8 casts, row-major transposed copies) asks `cuda_capability(device)`, so
that `fp8fn.testing.cuda_path_on_cpu(capability)` can send CPU tensors down the CUDA branches,
where its dispatch mode checks every float8 GEMM call against torch's CUDA rules.
"""

from __future__ import annotations

import contextlib

import torch

# The capability the CPU stands in for, set by `fp8fn.testing.cuda_path_on_cpu`; None: the CPU
# takes its own path. (docs/semantics.md lists it among what fp8fn keeps outside the state.) A
# module global, not a context variable: torch.compile traces a global's read (and guards on its
# value: a graph compiled for one path is not reused on the other); dynamo cannot trace
# `ContextVar.get`. Process-wide: a test switch, set around a whole test or script.
_cpu_as_cuda: tuple[int, int] | None = None

FLOAT8_GEMM = (8, 9)  # torch._scaled_mm and Triton's fp8e4nv need sm_89 or later


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability `(major, minor)` of the CUDA path `device` takes, or None.

    A CUDA device gives its own; the CPU gives None (its own path: emulated GEMMs), or the
    capability set by `fp8fn.testing.cuda_path_on_cpu`; any other device gives None.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return tuple(torch.cuda.get_device_capability(device))
    if device.type == "cpu":
        return _cpu_as_cuda
    return None


@contextlib.contextmanager
def cpu_as_cuda(capability: tuple[int, int] | None):
    """Within: the CPU takes the CUDA path of `capability` (None: its own path)."""
    global _cpu_as_cuda
    previous, _cpu_as_cuda = _cpu_as_cuda, capability
    try:
        yield
    finally:
        _cpu_as_cuda = previous


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `device` takes the CUDA path on a GPU with torch's float8 GEMM (sm_89 or later)."""
    capability = cuda_capability(device)
    return capability is not None and capability >= FLOAT8_GEMM


def describe(device: torch.device) -> str:
    """`device` for an error: `cuda:0 (sm_80)`, or `cpu (standing in for sm_80)`."""
    device = torch.device(device)
    capability = cuda_capability(device)
    if capability is None:
        return str(device)
    arch = f"sm_{capability[0]}{capability[1]}"
    return f"{device} ({arch})" if device.type == "cuda" else f"{device} (standing in for {arch})"
