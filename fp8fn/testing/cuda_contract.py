"""torch's CUDA rules for its float8 GEMMs (and its bfloat16 grouped GEMM), checked on CPU
tensors.

`CudaContract(capability)` is a dispatch mode that sees every call of `torch._scaled_mm`
(`aten._scaled_mm`), `F.scaled_mm` (`aten._scaled_mm_v2`), `torch._scaled_grouped_mm`
(`aten._scaled_grouped_mm`) and `F.grouped_mm` (`aten._grouped_mm`: the grouped backward's
GEMMs on sm_90 and sm_100), below autograd and torch.func, forward and backward. For each it:

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
   GEMM, and the offsets' values (non-decreasing, within the rows); for `_grouped_mm`
   (`GroupedMMUtils.h`, `GroupMM.cu`; its meta kernel takes bfloat16 only, its CUDA kernel
   float32 and float16 too) the layouts, 16-byte alignment, dtypes, offsets and group count,
   and whether torch runs it as the kernel that reads the offsets on the device (sm_90 and
   sm_100, bfloat16) or as its fallback loop that reads them on the host (`host_loops`);
3. runs the op on the CPU: `_scaled_mm` by torch's CPU reference kernel, `_scaled_grouped_mm`
   (no CPU kernel) emulated in float32, its rows past the last group NaN (the CUDA kernel
   leaves them unwritten: code that reads them is caught); `_grouped_mm` by torch's CPU
   kernel, with NaN where the CUDA kernel writes nothing (rows past the last group; with two
   2-D operands, a group with no rows). Under a FakeTensorMode (large shapes, no data) the
   checks run the same and the op gives only its shape. `_grouped_mm`'s check and run read
   no tensor value in Python (its offsets are checked by a device-side assert), so a count
   of host reads around fp8fn's backward under the mode is fp8fn's own.

A violated rule raises `CudaContractError` with torch's message. `calls` records each checked
call: the op and its call site, the chain of fp8fn's frames that led to it.
"""

from __future__ import annotations

import os
import traceback

import torch

from .. import _torch_private as private

E5M2 = torch.float8_e5m2
_OPS = {**private.scaled_gemm_ops(), "_grouped_mm": private.grouped_gemm_op()}
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


def _grouped_mm_rules(capability, a, b, offs, out_dtype) -> None:
    """torch's CUDA `_grouped_mm` (`GroupedBlas.cpp`, `GroupedMMUtils.h`, `GroupMM.cu`): the
    operands' dtypes, dims and layouts (row- or column-major in the last two dims, rows of 16
    bytes, data 16-byte aligned), the output dtype that of `a`, int32 1-D offsets, fewer than
    1024 groups, and the offsets' values. The kernel that reads the offsets on the device
    needs sm_90 or sm_100 and bfloat16 operands; elsewhere torch falls back to a loop that
    reads them on the host (a device sync), which `grouped_mm_takes_the_host_loop` tells."""
    hp = (torch.bfloat16, torch.float32, torch.float16)
    _require(
        a.dtype in hp and b.dtype in hp,
        f"Expected mat_a and mat_b to be Float32, BFloat16 or Float16 matrices, got {a.dtype} "
        f"and {b.dtype}",
    )
    _require(a.dim() in (2, 3) and b.dim() in (2, 3), "mat_a and mat_b have to be 2 or 3d")
    _require(
        (a.dim() == 2 and b.dim() == 2) or a.shape[-1] == b.shape[-2],
        "contraction dimension of mat_a and mat_b must match",
    )
    for name, t in (("mat_a", a), ("mat_b", b)):
        rows, cols = t.stride(-2), t.stride(-1)
        size = 16 // t.element_size()
        _require(
            (rows == 1 and cols >= max(1, t.shape[-2]) and cols % size == 0)
            or (cols == 1 and rows >= max(1, t.shape[-1]) and rows % size == 0),
            f"{name}: expected row- or column-major with strides a multiple of 16 bytes, got "
            f"strides {t.stride()} for sizes {tuple(t.shape)}",
        )
        _require(
            t.storage_offset() * t.element_size() % 16 == 0,
            f"{name}: expected data_ptr to be aligned to 16 bytes (storage offset "
            f"{t.storage_offset()})",
        )
    _require(
        (offs is not None) == (a.dim() == 2 or b.dim() == 2),
        "Have to provide offsets if there is a 2d matrix, or no offset if both are 3d",
    )
    _require(out_dtype is None or out_dtype == a.dtype, "output dtype must match mat_a dtype")
    if offs is None:
        return
    _require(offs.dim() == 1 and offs.dtype == torch.int32, "offs has to be 1D int32")
    _require(offs.shape[0] < 1024, "Can't process more than 1024 groups")
    if not private.is_fake(offs):  # values, checked on the device: no host read here either
        rows = a.shape[0] if b.dim() == 3 else a.shape[-1]
        ends = offs.to(torch.int64)
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        valid = (starts <= ends).all() & (ends <= rows).all()
        private.assert_in_graph(
            valid, f"Expected offs non-decreasing and at most {rows} (the grouped dim)"
        )


def grouped_mm_takes_the_host_loop(capability, a, b) -> bool:
    """Whether torch's CUDA `_grouped_mm` runs its fallback, a loop over the groups that reads
    the offsets on the host (a device sync), rather than the kernel of sm_90 and sm_100 that
    reads them on the device (bfloat16 operands and output only)."""
    fast = capability[0] in (9, 10) and a.dtype == b.dtype == torch.bfloat16
    return not fast


def _poison_unwritten_groups(out, a, b, offs):
    """`_grouped_mm`'s CPU result with NaN where the CUDA kernel writes nothing: rows past the
    last group (`a` and `b` 2-D, 3-D) and, both 2-D, the `(n, k)` of a group with no rows
    (whether the kernel zeroes it is not documented: fp8fn must not read it). On the device."""
    ends = offs.to(torch.int64)
    if b.dim() == 3 and a.dim() == 2:
        past = torch.arange(out.shape[0]) >= ends[-1:]
        return torch.where(past[:, None], float("nan"), out)
    if a.dim() == 2 and b.dim() == 2:
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        return torch.where((ends == starts)[:, None, None], float("nan"), out)
    return out


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
      host_loops: the entries of `calls` whose `_grouped_mm` torch runs as its fallback loop on
        this capability, reading the offsets on the host (a device sync each).
    """

    def __init__(self, capability: tuple[int, int]):
        super().__init__()
        self.capability = tuple(capability)
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.host_loops: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _NAMES.get(func)
        if name is None:
            return func(*args, **kwargs)
        self.calls.append((name, _call_site()))
        self.check(name, func, args, kwargs)
        bound = private.bind_op_arguments(func, args, kwargs)
        if name == "_grouped_mm":
            a, b = bound["self"], bound["mat2"]
            if grouped_mm_takes_the_host_loop(self.capability, a, b):
                self.host_loops.append(self.calls[-1])
            out = func(*args, **kwargs)
            if private.is_fake(out) or bound["offs"] is None:
                return out
            return _poison_unwritten_groups(out, a, b, bound["offs"])
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
            grouped_hp = name == "_grouped_mm" and bound["self"].dtype != torch.bfloat16
            with private.outside_fake_mode():  # (torch's meta `_grouped_mm` takes bfloat16
                # only, its CUDA kernel float32 and float16 too: those are checked below)
                meta_args = [
                    [_as_meta(t) for t in a] if isinstance(a, list) else _as_meta(a) for a in args
                ]
                meta_kwargs = {k: _as_meta(v) for k, v in kwargs.items()}
                if not grouped_hp:
                    func(*meta_args, **meta_kwargs)
            a, b = bound["self"], bound["mat2"]
            if name == "_grouped_mm":
                _grouped_mm_rules(self.capability, a, b, bound["offs"], bound["out_dtype"])
            elif name == "_scaled_grouped_mm":
                _scaled_grouped_mm_rules(self.capability, a, b, bound["scale_a"], bound["offs"])
            else:
                scales_a = bound["scale_a"]
                scales_a = scales_a if isinstance(scales_a, list) else [scales_a]
                _scaled_mm_rules(self.capability, a, b, scales_a, bound["bias"], bound["out_dtype"])
        except (RuntimeError, ValueError) as e:
            raise CudaContractError(prefix + str(e)) from None
