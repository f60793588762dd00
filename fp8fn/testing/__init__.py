"""fp8fn.testing: fp8fn's CUDA path, run and checked on a machine without a GPU.

`cuda_path_on_cpu(capability)` makes CPU tensors take fp8fn's CUDA branches (torch's float8
GEMMs, the one-call grouped GEMM, the backends' refusals below sm_89) as on a GPU of that
compute capability, and checks every float8 GEMM call against torch's CUDA rules
(`CudaContract`): a layout, shape or dtype that a GPU would refuse raises `CudaContractError`
on the CPU, before a GPU is rented. See docs/cuda.md.
"""

from __future__ import annotations

import contextlib

from .._core.device import cpu_as_cuda
from .cuda_contract import CudaContract, CudaContractError

__all__ = ["CudaContract", "CudaContractError", "cuda_path_on_cpu"]


@contextlib.contextmanager
def cuda_path_on_cpu(capability: tuple[int, int]):
    """Run fp8fn's CUDA path on CPU tensors, checked against torch's CUDA rules.

    Inside, fp8fn treats the CPU as a CUDA device of `capability` (`backend="auto"` picks
    torch's float8 GEMM from sm_89; the grouped forward is one `torch._scaled_grouped_mm` on
    sm_90; `backend="scaled_mm"` and `"triton"` are refused below sm_89), and every call of
    `torch._scaled_mm`, `F.scaled_mm` and `torch._scaled_grouped_mm` (fp8fn's or the user's
    own) is checked by torch's meta kernels and the CUDA kernels' further rules, then run on
    the CPU (the grouped GEMM emulated). The GEMMs run on torch's CPU reference kernel: exact,
    and slow beyond a few hundred rows; check large shapes under
    `torch._subclasses.FakeTensorMode` (no data, the same checks).

    Args:
      capability: `(major, minor)`, e.g. `(9, 0)` for H100, `(10, 0)` for B200, `(8, 0)` for
        A100.

    Yields:
      The `CudaContract` mode; its `calls` lists the float8 GEMM calls checked.

    Raises:
      CudaContractError: on the first call a GPU of `capability` would refuse.

    Example:
      >>> import torch, fp8fn
      >>> from fp8fn.testing import cuda_path_on_cpu
      >>> recipe = fp8fn.CurrentScaling()
      >>> x, w = torch.randn(8, 32), torch.randn(16, 32)
      >>> with cuda_path_on_cpu((9, 0)) as contract:
      ...     y = fp8fn.linear(x, w, None, None, recipe)
      >>> [name for name, site in contract.calls]
      ['_scaled_mm']
    """
    if (
        not isinstance(capability, tuple)
        or len(capability) != 2
        or not all(isinstance(c, int) and not isinstance(c, bool) for c in capability)
    ):
        raise TypeError(
            "fp8fn.testing.cuda_path_on_cpu: expected `capability` a tuple (major, minor) of "
            f"ints, e.g. (9, 0), got {capability!r}."
        )
    with cpu_as_cuda(capability), CudaContract(capability) as contract:
        yield contract
