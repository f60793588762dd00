"""The two CPU speed paths of eager fp8fn, each dispatched as one op.

On CPU, two of torch's kernels are slow for what fp8fn asks of them: the inf-norm (the amax)
and the conversion of `float8_e4m3fn` to float32. From 64K elements fp8fn takes faster routes
(`amax_abs`, `widen_e4m3` below), each a few ATen ops. Both run as one custom op,
`fp8fn::amax_abs` and `fp8fn::widen_e4m3` (CPU kernel: the same function), so that each is one
dispatched op: one dispatcher entry for the caller (a `TorchDispatchMode` sees one op), the
ATen ops inside running below it. Where the op cannot run, the function runs as it is (the
same ops, the same bits): under torch.func's transforms (wrapped tensors, which an op without
transform rules does not take), and where autograd records ops on the tensor (the op has no
derivative). Compiled code never reaches here (the callers take other paths under
torch.compile, which inductor fuses); the ops' fake implementations give the shapes for
tracing all the same.

The ops are registered in the namespace of the package's top-level name (`fp8fn`; a renamed
copy imported beside it, as `tools/before_after_overhead.py` does, registers its own).
"""

from __future__ import annotations

import torch

from .._torch_private import functorch_level

_NAMESPACE = __name__.partition(".")[0]
_LIBRARY = torch.library.Library(_NAMESPACE, "FRAGMENT")


def amax_abs(hp: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of `hp` (floating, any shape, not empty), float32 `()`, by
    `aminmax`: the larger magnitude of its two (one pass, and three ops on scalars; the same
    value as an inf-norm: a max is exact; NaN in `hp` gives NaN). `abs` makes it +0 for zeros.
    """
    low, high = torch.aminmax(hp)
    return torch.maximum(high, low.neg()).abs().float()


def widen_e4m3(fp8: torch.Tensor) -> torch.Tensor:
    """float32 `hp`, `fp8`'s shape and layout, with `fp8.float() == hp * 256` exactly, for
    `float8_e4m3fn` `fp8`, through float16 bits.

    Its seven magnitude bits placed at float16's bit 7 give the value times 2**-8 (float16's
    exponent bias is 15, e4m3's 7; subnormals land on float16 subnormals), and magnitude 0x7F
    (NaN) gets float16's all-ones exponent. (On CPU, `fp8.float()` is 5-6x slower than these
    integer ops.)
    """
    # The byte sign-extended, times 128: the magnitude at bit 7, and bits 14 and 15 set for a
    # negative one: clear bit 14 (-16385 is 0xBFFF). In place: every tensor here is ours.
    half = fp8.view(torch.int8).to(torch.int16).mul_(128).bitwise_and_(-16385)
    # Magnitude 0x7F (NaN), 0x3F80 here, is the only one that carries into bit 14 when 0x80 is
    # added: that bit, shifted to bit 0, times 0x7C00 (float16's all-ones exponent).
    nan = half.bitwise_and(0x3FFF).add_(0x80).bitwise_right_shift_(14).mul_(0x7C00)
    return half.bitwise_or_(nan).view(torch.float16).float()


def _register(name: str, fn, fake):
    """`fn` as the op `<namespace>::<name>(Tensor t) -> Tensor` (its CPU kernel; `fake` its
    fake implementation: the output's shape, dtype and layout), returned as its overload."""
    _LIBRARY.define(f"{name}(Tensor t) -> Tensor")
    _LIBRARY.impl(name, fn, "CPU")
    torch.library.register_fake(f"{_NAMESPACE}::{name}", fake, lib=_LIBRARY)
    return getattr(getattr(torch.ops, _NAMESPACE), name).default


_AMAX_ABS = _register("amax_abs", amax_abs, lambda t: t.new_empty((), dtype=torch.float32))
_WIDEN_E4M3 = _register(
    "widen_e4m3", widen_e4m3, lambda t: torch.empty_like(t, dtype=torch.float32)
)


def _one_op(op, fn, t: torch.Tensor) -> torch.Tensor:
    """`op(t)`, or `fn(t)` (the same bits) under torch.func's transforms or where autograd
    records ops on `t`."""
    if functorch_level() is None and not (t.requires_grad and torch.is_grad_enabled()):
        return op(t)
    return fn(t)


def fast_amax(hp: torch.Tensor) -> torch.Tensor:
    """`amax_abs(hp)`, one dispatched op where it can be (plain CPU `hp`, not empty)."""
    return _one_op(_AMAX_ABS, amax_abs, hp)


def fast_widen(fp8: torch.Tensor) -> torch.Tensor:
    """`widen_e4m3(fp8)`, one dispatched op where it can be (CPU `fp8`)."""
    return _one_op(_WIDEN_E4M3, widen_e4m3, fp8)
