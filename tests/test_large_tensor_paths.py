"""The eager large-tensor paths (2**16 elements or more, CPU): the same values as the small ones.

From 64K elements, eager `amax` takes the larger magnitude of `aminmax`'s two, and the cast
clamps its own float32 temporary in place (`may_overwrite`). A slip in either (the extreme's
sign, a NaN or inf that the in-place pass handles otherwise) is invisible to tests of small
tensors: each case here compares the large path with an independent formula and with the small
path on the same values, bit for bit, in every input dtype (issue 38.10, class C).
"""

import pytest
import torch
from _helpers import bits

from fp8fn._numerics.fp8 import E4M3, E5M2, amax, cast_to_fp8

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [2**16 - 1, 2**16, 3 * 2**16 + 5]  # the small path, the large path from its first size


def _data(n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 3).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", [0, -1, 12345])
def test_amax_whose_extreme_is_negative(dtype, n, where):
    x = _data(n, dtype)
    x[where] = -1000.0  # the largest magnitude, negative (the max is ~15)
    got = amax(x)
    assert got.dtype == torch.float32 and got.item() == 1000.0
    x[where] = 0.0
    x[:] = -x.abs() - 1  # every value negative: the max is -1, the magnitude is not
    assert bits(amax(x)) == bits(x.float().abs().max())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_amax_of_a_large_tensor_with_nan_is_nan_and_zeros_give_plus_zero(dtype, n):
    x = _data(n, dtype)
    x[n // 2] = float("nan")
    assert amax(x).isnan()
    z = -torch.zeros(n, dtype=dtype)  # -0.0 everywhere
    assert bits(amax(z)) == bits(torch.tensor(0.0))


def _reference_cast(x, scale, fmax, dtype):
    """Independent of fp8fn: float32 product, NaN for every non-finite value, clamp, round."""
    p = x.float() * scale
    return torch.where(p.isfinite(), p.clamp(-fmax, fmax), float("nan")).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fp8", [(E4M3, 448.0), (E5M2, 57344.0)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cast_keeps_inf_visible_on_every_path(dtype, fp8, n):
    """+inf, -inf, NaN, values beyond the max and a product that overflows float32: NaN for
    each non-finite one, +-max for the finite, as the small path; the input left as it was."""
    fp8_dtype, fmax = fp8
    x = _data(n, dtype)
    x[[0, 7, n // 2, n - 1]] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e4]).to(
        dtype
    )
    x[n // 3] = -1e4
    scale = torch.tensor(2.0**100 if dtype == torch.float32 else 30.0)
    if dtype == torch.float32:
        x[5] = 3e38  # * 2**100: inf in float32, then NaN
    before = x.clone()
    got = cast_to_fp8(x, scale, fp8_dtype)
    assert torch.equal(bits(x), bits(before))  # the in-place pass touched its own temporary
    assert torch.equal(
        got.view(torch.uint8), _reference_cast(x, scale, fmax, fp8_dtype).view(torch.uint8)
    )
    small = torch.cat([cast_to_fp8(c, scale, fp8_dtype) for c in x.split(1000)])
    assert torch.equal(got.view(torch.uint8), small.view(torch.uint8))
    assert got[0].float().isnan() and got[7].float().isnan()  # inf -> NaN, visible
