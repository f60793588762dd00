"""fp8fn.testing: the CUDA contract check itself (it must refuse what a GPU refuses), and the
seam that sends CPU tensors down fp8fn's CUDA branches."""

import pytest
import torch
import torch.nn.functional as F

from fp8fn._core.device import cuda_capability, scaled_mm_supported
from fp8fn.testing import CudaContract, CudaContractError, cuda_path_on_cpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.ones(())


def _fp8(*shape, dtype=E4M3):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def _good_mm():
    """A call torch's CUDA `_scaled_mm` takes: a (32, 64) row-major, b (64, 48) column-major."""
    return _fp8(32, 64), _fp8(48, 64).t()


def test_the_seam_is_set_and_reset():
    cpu = torch.device("cpu")
    assert cuda_capability(cpu) is None and not scaled_mm_supported(cpu)
    with cuda_path_on_cpu((8, 0)):
        assert cuda_capability(cpu) == (8, 0) and not scaled_mm_supported(cpu)
        with cuda_path_on_cpu((10, 0)):
            assert scaled_mm_supported(cpu)
        assert cuda_capability(cpu) == (8, 0)
    assert cuda_capability(cpu) is None


def test_cuda_path_on_cpu_refuses_a_capability_that_is_not_a_pair():
    with pytest.raises(TypeError, match=r"cuda_path_on_cpu: expected `capability` a tuple"):
        with cuda_path_on_cpu("sm_90"):
            pass


def test_a_good_call_passes_and_runs_on_the_cpu_kernel():
    a, b = _good_mm()
    with cuda_path_on_cpu((9, 0)) as contract:
        out = torch._scaled_mm(a, b, ONE, ONE, out_dtype=torch.float32)
    assert torch.equal(out, a.float() @ b.float())
    assert [name for name, _ in contract.calls] == ["_scaled_mm"]


@pytest.mark.parametrize(
    "case, match",
    [
        ("row-major mat2", "mat2 must be col_major"),
        ("column-major self", "self must be row_major"),
        ("K not a multiple of 16", "divisible by 16"),
        ("N not a multiple of 16", "divisible by 16"),
        ("rowwise scale of a wrong shape", "Invalid scaling configuration"),
        ("e5m2 x e5m2", "two Float8_e5m2 matrices is not supported"),
        ("bias with a float32 output", "Bias is not supported when out_dtype is set to Float32"),
        ("float16 bias for bfloat16", "Bias must be BFloat16 to compute"),
        ("sm_80", r"compute capability >= 9.0 or 8.9.*sm_80"),
    ],
)
def test_scaled_mm_calls_a_gpu_refuses_are_refused(case, match):
    a, b = _good_mm()
    scale_a, scale_b, bias, out_dtype, capability = ONE, ONE, None, torch.bfloat16, (9, 0)
    if case == "row-major mat2":
        b = b.contiguous()
    elif case == "column-major self":
        a = a.t().contiguous().t()
    elif case == "K not a multiple of 16":
        a, b = _fp8(32, 56), _fp8(48, 56).t()
    elif case == "N not a multiple of 16":
        b = _fp8(40, 64).t()
    elif case == "rowwise scale of a wrong shape":
        scale_a, scale_b = torch.ones(32, 1), torch.ones(48, 1)
    elif case == "e5m2 x e5m2":
        a, b = a.to(E5M2), b.to(E5M2)
    elif case == "bias with a float32 output":
        bias, out_dtype = torch.zeros(48, dtype=torch.bfloat16), torch.float32
    elif case == "float16 bias for bfloat16":
        bias = torch.zeros(48, dtype=torch.float16)
    elif case == "sm_80":
        capability = (8, 0)
    with CudaContract(capability), pytest.raises(CudaContractError, match=match):
        torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    if case != "rowwise scale of a wrong shape":  # the CPU kernel alone takes the others
        torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def test_scaled_mm_v2_is_checked_too():
    a, b = _good_mm()
    tensorwise = F.ScalingType.TensorWise
    with CudaContract((9, 0)), pytest.raises(CudaContractError, match="mat2 must be col_major"):
        F.scaled_mm(a, b.contiguous(), ONE, tensorwise, ONE, tensorwise)
    rowwise = F.ScalingType.RowWise
    with CudaContract((9, 0)) as contract:
        out = F.scaled_mm(a, b, torch.ones(32, 1), rowwise, torch.ones(1, 48), rowwise)
    assert out.dtype == torch.bfloat16 and contract.calls[0][0] == "_scaled_mm_v2"


def _grouped(experts=3, tokens=40, k=32, n=48):
    x = _fp8(tokens, k)
    w = _fp8(experts, n, k).transpose(-2, -1)  # (E, K, N), column-major: what torch wants
    offs = torch.tensor([16, 16, 32], dtype=torch.int32)  # an empty group, 8 tail rows
    return x, w, torch.rand(tokens) + 0.5, torch.rand(experts, n) + 0.5, offs


def test_scaled_grouped_mm_is_emulated_with_unwritten_tail_rows_nan():
    x, w, sx, sw, offs = _grouped()
    with cuda_path_on_cpu((9, 0)) as contract:
        out = torch._scaled_grouped_mm(x, w, sx, sw, offs=offs, out_dtype=torch.bfloat16)
    ref = torch.cat(
        [
            (x[:16].float() * sx[:16, None]) @ (w[0].float() * sw[0]),
            (x[16:32].float() * sx[16:32, None]) @ (w[2].float() * sw[2]),
        ]
    )
    assert torch.equal(out[:32], ref.bfloat16())
    assert out[32:].isnan().all()
    assert contract.calls[0][0] == "_scaled_grouped_mm"


@pytest.mark.parametrize(
    "case, match",
    [
        ("row-major mat_b", "Expected mat_b tensor to be column major"),
        ("K not a multiple of 16", "multiple of 16 bytes"),
        ("N not a multiple of 16", "K and N multiples of 16"),
        ("row scales of a wrong shape", "Expected scale_a to have 40 elements"),
        ("e5m2", "Expected inputs of E4M3 FP8 type"),
        ("int64 offsets", "must be integer \\(int32\\)"),
        ("decreasing offsets", "Expected offs non-decreasing"),
        ("sm_100", "built for sm_90 only.*sm_100"),
        ("sm_89", r"compute capability = \[9.0, 10.0\].*sm_89"),
    ],
)
def test_scaled_grouped_mm_calls_a_gpu_refuses_are_refused(case, match):
    x, w, sx, sw, offs = _grouped()
    capability = (9, 0)
    if case == "row-major mat_b":  # an (E, K, N) weight's fp8 copy, kept as it was stored
        w = w.contiguous()
    elif case == "K not a multiple of 16":
        x, w, sx, sw, offs = _grouped(k=40)
    elif case == "N not a multiple of 16":
        x, w, sx, sw, offs = _grouped(n=40)
    elif case == "row scales of a wrong shape":
        sx = sx[:32]
    elif case == "e5m2":
        x = x.to(E5M2)
    elif case == "int64 offsets":
        offs = offs.long()
    elif case == "decreasing offsets":
        offs = torch.tensor([16, 8, 32], dtype=torch.int32)
    else:
        capability = (10, 0) if case == "sm_100" else (8, 9)
    with CudaContract(capability), pytest.raises(CudaContractError, match=match):
        torch._scaled_grouped_mm(x, w, sx, sw, offs=offs, out_dtype=torch.bfloat16)


def _bf16_grouped(k=32, n=48):
    """A bfloat16 grouped GEMM's operands: x (40, k), w (3, k, n), an empty group, 8 tail rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, k, generator=gen).bfloat16()
    w = torch.randn(3, k, n, generator=gen).bfloat16()
    return x, w, torch.tensor([16, 16, 32], dtype=torch.int32)


def test_grouped_mm_runs_on_the_cpu_kernel_with_unwritten_parts_nan():
    """`F.grouped_mm` (`aten._grouped_mm`) is checked and run by torch's CPU kernel; the parts
    the CUDA kernel leaves unwritten are NaN: rows past the last group, and with two 2-D
    operands, the (n, k) of a group with no rows."""
    x, w, offs = _bf16_grouped()
    g = torch.randn(40, 24, generator=torch.Generator().manual_seed(1)).bfloat16()
    with cuda_path_on_cpu((9, 0)) as contract:
        rows = F.grouped_mm(x, w, offs=offs)
        per_expert = F.grouped_mm(g.t(), x, offs=offs)
    ref = torch.cat([x[:16].float() @ w[0].float(), x[16:32].float() @ w[2].float()])
    assert torch.equal(rows[:32], ref.bfloat16()) and rows[32:].isnan().all()
    assert torch.equal(per_expert[2], (g[16:32].t().float() @ x[16:32].float()).bfloat16())
    assert per_expert[1].isnan().all() and not per_expert[0].isnan().any()
    assert [name for name, _ in contract.calls] == ["_grouped_mm"] * 2
    assert contract.host_loops == []  # bfloat16 on sm_90: the offsets read on the device


@pytest.mark.parametrize(
    "case, match",
    [
        ("rows of 200 bytes", "multiple of 16 bytes"),
        ("neither row- nor column-major", "Invalid strides"),
        ("a view 2 bytes in", "aligned to 16 bytes"),
        ("float32 output", "output dtype.*bfloat16"),
        ("float8 operands", "Float32, BFloat16 or Float16"),
        ("int64 offsets", "int32"),
        ("decreasing offsets", "Expected offs non-decreasing"),
        ("offsets past the rows", "Expected offs non-decreasing and at most 40"),
        ("1024 groups", "more than 1024 groups"),
    ],
)
def test_grouped_mm_calls_a_gpu_refuses_are_refused(case, match):
    x, w, offs = _bf16_grouped()
    kwargs = {}
    if case == "rows of 200 bytes":
        x, w, offs = _bf16_grouped(k=100)
    elif case == "neither row- nor column-major":
        x = torch.cat([x, x], 1)[:, ::2]  # strides (64, 2)
    elif case == "a view 2 bytes in":
        x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(40, 32)  # storage offset 1
    elif case == "float32 output":
        kwargs = {"out_dtype": torch.float32}
    elif case == "float8 operands":
        x, w = x.to(E4M3), w.to(E4M3)
    elif case == "int64 offsets":
        offs = offs.long()
    elif case == "decreasing offsets":
        offs = torch.tensor([16, 8, 32], dtype=torch.int32)
    elif case == "offsets past the rows":
        offs = torch.tensor([16, 16, 41], dtype=torch.int32)
    else:
        w = w[:1].expand(1024, 32, 48)
        offs = torch.arange(1024, dtype=torch.int32).clamp(max=40)
    with CudaContract((9, 0)), pytest.raises(CudaContractError, match=match):
        F.grouped_mm(x, w, offs=offs, **kwargs)


@pytest.mark.parametrize("capability, dtype", [((8, 9), torch.bfloat16), ((9, 0), torch.float32)])
def test_grouped_mm_that_torch_runs_as_a_host_loop_is_recorded(capability, dtype):
    """Off sm_90 and sm_100, or with float32 operands, torch's CUDA `_grouped_mm` is a loop over
    the groups that reads the offsets on the host: allowed, and listed in `host_loops`."""
    x, w, offs = _bf16_grouped()
    with CudaContract(capability) as contract:
        F.grouped_mm(x.to(dtype), w.to(dtype), offs=offs)
    assert contract.host_loops == contract.calls and len(contract.calls) == 1


def test_the_check_runs_under_fake_tensors():
    """Large shapes cost nothing under FakeTensorMode: the meta check still sees CUDA rules."""
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(4095, 4112, dtype=E4M3)
        b = torch.empty(11008, 4112, dtype=E4M3)
        one = torch.ones(())
        with CudaContract((9, 0)) as contract:
            out = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
            with pytest.raises(CudaContractError, match="mat2 must be col_major"):
                torch._scaled_mm(a, b.t().contiguous(), one, one)
    assert out.shape == (4095, 11008) and len(contract.calls) == 2
