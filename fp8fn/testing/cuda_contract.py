"""torch's CUDA rules for its float8 GEMMs, checked on CPU tensors.

`CudaContract(capability)` is a dispatch mode that sees every call of `torch._scaled_mm`
(`aten._scaled_mm`), `F.scaled_mm` (`aten._scaled_mm_v2`) and `torch._scaled_grouped_mm`
(`aten._scaled_grouped_mm`), below autograd and torch.func, forward and backward. For each it:

1. runs torch's own meta kernel of the op on `torch.empty_strided(shape, stride, dtype,
   device="meta")` copies of the tensor arguments. For a meta tensor torch applies its CUDA
   rules (`device_hint` says cuda): operand majorness, dims multiple of 16, scale shapes, dtypes
   and contiguity, offsets' dtype. For CPU tensors it skips them, so CPU tests cannot see a
   layout bug otherwise;
2. applies the rules of torch's CUDA kernels that the meta kernels leave out (torch 2.13,
   `aten/src/ATen/native/cuda/ScaledBlas.cpp` and `GroupedBlas.cpp`): the compute capability
   each op needs (`_scaled_mm` sm_89 or later; `_scaled_grouped_mm` sm_90 or sm_100, and with
   float32 row scales, the CUTLASS kernel of `ScaledGroupMM.cu`, sm_90 only), e5m2 x e5m2
   refused, the bias rules (none with a float32 output; bfloat16 or float16, as the output),
   row-wise scaling's output dtypes, matching inner dims, N a multiple of 16 for the grouped
   GEMM, and the offsets' values (non-decreasing, within the rows);
3. runs the op on the CPU: `_scaled_mm` by torch's CPU reference kernel, `_scaled_grouped_mm`
   (no CPU kernel) emulated in float32, its rows past the last group NaN (the CUDA kernel
   leaves them unwritten: code that reads them is caught). Under a FakeTensorMode (large shapes,
   no data) the checks run the same and the op gives only its shape.

A violated rule raises `CudaContractError` with torch's message. `calls` records each checked
call: the op and its call site, the chain of fp8fn's frames that led to it.
"""

from __future__ import annotations

import os
import traceback

import torch

from .. import _torch_private as private

E5M2 = torch.float8_e5m2
_OPS = private.scaled_gemm_ops()
_NAMES = {op: name for name, op in _OPS.items()}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIPPED = (os.path.join(_PACKAGE, "testing"), os.path.join(_PACKAGE, "_torch_private.py"))


class CudaContractError(RuntimeError):
    """A float8 GEMM call that torch's CUDA kernels would refuse on the capability checked."""


def _arch(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _as_meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _call_site() -> tuple[str, ...]:
    """The fp8fn frames (`path:line`, outermost first) that led to the GEMM call."""
    frames = []
    for frame in traceback.extract_stack():
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE) and not path.startswith(_SKIPPED):
            frames.append(f"{os.path.relpath(path, _PACKAGE)}:{frame.lineno}")
    return tuple(frames)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CudaContractError(message)


def _scaled_mm_rules(capability, a, b, scales_a, bias, out_dtype) -> None:
    """What torch's CUDA `_scaled_mm` checks beyond its meta kernel (`ScaledBlas.cpp`)."""
    _require(
        capability >= (8, 9),
        "_scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or "
        f"8.9, or ROCm MI300+ (checked for {_arch(capability)})",
    )
    _require(
        a.shape[1] == b.shape[0],
        f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
        f"{b.shape[0]}x{b.shape[1]})",
    )
    _require(
        not (a.dtype == E5M2 and b.dtype == E5M2),
        "Multiplication of two Float8_e5m2 matrices is not supported",
    )
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if bias is not None:
        _require(
            out_dtype != torch.float32, "Bias is not supported when out_dtype is set to Float32"
        )
        _require(
            bias.dtype in (torch.bfloat16, torch.float16),
            f"Bias must be BFloat16 or Half, but got {bias.dtype}",
        )
        _require(
            out_dtype != torch.bfloat16 or bias.dtype == torch.bfloat16,
            f"Bias must be BFloat16 to compute {out_dtype} output, but got {bias.dtype}",
        )
        _require(
            out_dtype != torch.float16 or bias.dtype == torch.float16,
            f"Bias must be Float16 to compute {out_dtype} output, but got {bias.dtype}",
        )
    if any(s.numel() > 1 for s in scales_a):  # row-wise scaling (fp8fn uses no other)
        _require(
            out_dtype in (torch.bfloat16, torch.float16, torch.float32),
            "Only bf16, fp16, and fp32 high precision output types are supported for row-wise "
            "scaling.",
        )


def _scaled_grouped_mm_rules(capability, a, b, scale_a, offs) -> None:
    """What torch's CUDA `_scaled_grouped_mm` checks beyond its meta kernel (`GroupedBlas.cpp`,
    `ScaledGroupMM.cu`)."""
    _require(
        capability[0] in (9, 10),
        "_scaled_grouped_mm is only supported on CUDA devices with compute capability = "
        f"[9.0, 10.0], or ROCm MI300+ (checked for {_arch(capability)})",
    )
    _require(
        scale_a.dtype != torch.float32 or capability[0] == 9,
        "_scaled_grouped_mm with float32 (row-wise) scales runs torch's CUTLASS kernel "
        "built for sm_90 only (ScaledGroupMM.cu: ArchTag Sm90; torch's tests gate it on "
        f"SM90OrLater and not SM100OrLater), checked for {_arch(capability)}",
    )
    _require(
        a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0,
        f"Expected K and N multiples of 16, got mat_a {tuple(a.shape)}, mat_b {tuple(b.shape)}",
    )
    if offs is not None and not private.is_fake(offs):  # values: only real tensors have them
        ends = offs.tolist()
        rows = a.shape[0] if a.dim() == 2 else b.shape[-1]
        _require(
            all(s <= t for s, t in zip([0, *ends], ends)) and (not ends or ends[-1] <= rows),
            f"Expected offs non-decreasing and at most {rows}, got {ends}",
        )


def _emulate_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """`torch._scaled_grouped_mm` of a 2-D `a` `(T, K)` and a 3-D `b` `(E, K, N)`, float32
    row scales `(T,)` and column scales `(E, N)`, in float32: `(T, N)` in `out_dtype`, rows
    past `offs[-1]` NaN (unwritten by the CUDA kernel)."""
    if a.dim() != 2 or b.dim() != 3:
        raise NotImplementedError(
            "fp8fn.testing: the CPU emulation of torch._scaled_grouped_mm takes a 2-D mat_a "
            f"and a 3-D mat_b (fp8fn's forward), got {a.dim()}-D and {b.dim()}-D."
        )
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=out_dtype or torch.bfloat16)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = (a[start:end].float() * scale_a[start:end, None]) @ (b[e].float() * scale_b[e])
        out[start:end] = rows.to(out.dtype)
        start = end
    return out


class CudaContract(private.DispatchMode):
    """The dispatch mode described in the module docstring, for `capability` `(major, minor)`.

    Attributes:
      capability: the compute capability whose rules are checked.
      calls: `[(op name, call site)]` of every float8 GEMM call checked, in order.
    """

    def __init__(self, capability: tuple[int, int]):
        super().__init__()
        self.capability = tuple(capability)
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _NAMES.get(func)
        if name is None:
            return func(*args, **kwargs)
        self.calls.append((name, _call_site()))
        self.check(name, func, args, kwargs)
        bound = private.bind_op_arguments(func, args, kwargs)
        if name == "_scaled_grouped_mm" and not private.is_fake(bound["self"]):
            return _emulate_scaled_grouped_mm(
                bound["self"],
                bound["mat2"],
                bound["scale_a"],
                bound["scale_b"],
                bound["offs"],
                bound["out_dtype"],
            )
        return func(*args, **kwargs)

    def check(self, name: str, func, args: tuple, kwargs: dict) -> None:
        """Raise `CudaContractError` unless the call passes torch's CUDA rules (see above)."""
        bound = private.bind_op_arguments(func, args, kwargs)
        prefix = f"fp8fn.testing: torch.{name} would fail on CUDA ({_arch(self.capability)}): "
        try:
            with private.outside_fake_mode():
                meta_args = [
                    [_as_meta(t) for t in a] if isinstance(a, list) else _as_meta(a) for a in args
                ]
                meta_kwargs = {k: _as_meta(v) for k, v in kwargs.items()}
                func(*meta_args, **meta_kwargs)
            a, b = bound["self"], bound["mat2"]
            if name == "_scaled_grouped_mm":
                _scaled_grouped_mm_rules(self.capability, a, b, bound["scale_a"], bound["offs"])
            else:
                scales_a = bound["scale_a"]
                scales_a = scales_a if isinstance(scales_a, list) else [scales_a]
                _scaled_mm_rules(self.capability, a, b, scales_a, bound["bias"], bound["out_dtype"])
        except (RuntimeError, ValueError) as e:
            raise CudaContractError(prefix + str(e)) from None
