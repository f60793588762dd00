"""Shared test helpers (not a test module)."""

from __future__ import annotations

import collections
import io

import torch
import torch.nn.functional as F
from _reference import ROLES  # noqa: F401 (defined once, with the float64 reference)
from torch.utils._python_dispatch import TorchDispatchMode

import fp8fn

DELAYED = fp8fn.DelayedScaling(history_len=4, backend="emulated")  # the tests' delayed recipe
DELAYED_AUTO = fp8fn.DelayedScaling(history_len=4)  # backend "auto": the device's own path
CURRENT = fp8fn.CurrentScaling(backend="emulated")
CURRENT_AUTO = fp8fn.CurrentScaling()
FP8_MAX = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}
F32_MAX = torch.finfo(torch.float32).max


def expected_scale(amax: float, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """The scale `compute_scale` must give, modelled with Python floats (float64)."""
    if not (amax > 0 and amax != float("inf")):  # 0, negative, inf or NaN
        return torch.tensor(1.0)
    scale = fp8_max / (amax * 2.0**margin)
    return torch.tensor(min(max(scale, 2.0**-149), F32_MAX), dtype=torch.float32)


def observation(state: fp8fn.State, **amaxes) -> fp8fn.State:
    """An observation of `state`'s structure: `site=(input, weight, grad_output)` amaxes (None
    for a role not observed) at history position 0, zeros elsewhere."""
    history = torch.zeros_like(state.amax_history)
    for site, values in amaxes.items():
        i = state.sites.index(site)
        for r, a in enumerate(values):
            if a is not None:
                history[i, r, 0] = a
    return state._replace(amax_history=history, scale=torch.zeros_like(state.scale))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its width (so NaN == NaN and -0 != 0 when comparing)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def saved_and_loaded(obj):
    """`obj` written with `torch.save` (to memory) and read back with
    `torch.load(weights_only=True)`, as a checkpoint loader that refuses arbitrary pickles."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (any NaN equals any NaN; -0 differs from 0)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(bits(a)[~nan_a], bits(b)[~nan_b])


def loss_of(fn):
    """The tests' loss of a transform: `(params, state, x) -> mean(fn.apply(...) ** 2)`."""
    return lambda p, s, x: fn.apply(p, s, x).square().mean()


def gelu_mlp():
    """Linear 16->32, GELU, Linear 32->32, GELU, Linear 32->8, made after seeding the global RNG
    with 0 (so the inputs a test draws next are the same at every run)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 8),
    )


def params_of(module) -> dict:
    """Detached copies of `module`'s parameters, keyed like `named_parameters()`."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def transformed_mlp(batch: int):
    """`(model, fn, x, params, state)`: `gelu_mlp()`, its DELAYED transform, an input
    `(batch, 16)`, detached copies of its parameters and `fn.init(x)`."""
    model = gelu_mlp()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(batch, 16)
    return model, fn, x, params_of(model), fn.init(x)


def stepped(fn, params, state, x):
    """`state` updated with the observation of one torch.func.grad of `loss_of(fn)` on `x`."""
    return fp8fn.update(state, torch.func.grad(loss_of(fn), argnums=1)(params, state, x))


def autograd_step(fn, params, state, x, loss=None):
    """Gradients and observations with `loss.backward()`, through `fp8fn.observe`."""
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    s = fp8fn.observe(state)
    (loss or loss_of(fn))(p, s, x).backward()
    return {k: v.grad for k, v in p.items()}, fp8fn.observations(s)


def assert_bit_identical(a, b) -> None:
    """Two pytrees have the same structure (for a `State`: its sites and static config) and
    bit-identical tensor leaves (other leaves equal); a None leaf (autograd's gradient of an
    unused parameter) equals a tensor of zeros (torch.func's)."""
    la, spec_a = torch.utils._pytree.tree_flatten(a, is_leaf=lambda t: t is None)
    lb, spec_b = torch.utils._pytree.tree_flatten(b, is_leaf=lambda t: t is None)
    assert spec_a == spec_b
    for x, y in zip(la, lb):
        if (x is None) != (y is None):
            assert torch.count_nonzero(y if x is None else x) == 0
            continue
        assert type(x) is type(y)
        if not isinstance(x, torch.Tensor):
            assert x == y
            continue
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(bits(x), bits(y)), (x, y)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal to quantization noise ratio of `x` against `ref`, in dB (float32 arithmetic)."""
    ref, x = ref.detach().float(), x.detach().float()
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


class CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it (each one a kernel call or a view): `count` in
    all, `ops` by name (`"aten.mm"`, `"fp8fn.amax_abs"`)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def mlp_run(model, x, g, linear_fn):
    """Output and per-layer weight gradients of `model` with layer i as `linear_fn(i, ...)`."""
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    h = x
    for i in range(len(model.layers)):
        h = linear_fn(i, h, params[f"layers.{i}.weight"], params[f"layers.{i}.bias"])
        if i < len(model.layers) - 1:
            h = F.relu(h)
    h.backward(g)
    return h, [params[f"layers.{i}.weight"].grad for i in range(len(model.layers))]


def outlier_mlp_case():
    """The case of the SQNR tables: `(model, x, g)`, a 128-256-128 `MLP` (seed 0), inputs
    `(4, 64, 128)` of different magnitudes per token with 4 outlier channels (x20), and an
    output gradient of the same shape, all float32."""
    from _models import MLP

    model = MLP((128, 256, 128), seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 128, generator=gen) * torch.randn(4, 64, 1, generator=gen).exp()
    x[..., :4] *= 20
    g = torch.randn(4, 64, 128, generator=gen) * torch.randn(4, 64, 1, generator=gen).exp()
    return model, x, g


HOST_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "cpu", "numpy")
HOST_READ_FUNCTIONS = ("equal", "allclose")  # torch.<name>: a Python bool from tensor values


class CountHostReads:
    """Counts the Python-level reads of tensor values inside (`bool(t)`, `t.item()`, `t.cpu()`,
    `torch.equal(a, b)`, ...): each is a device sync on a GPU. `reads` lists their names."""

    def __enter__(self):
        self.reads = []
        self.saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in HOST_READS]
        self.saved += [(torch, n, getattr(torch, n)) for n in HOST_READ_FUNCTIONS]
        for owner, name, method in self.saved:

            def counted(*args, _name=name, _method=method, **kwargs):
                self.reads.append(_name)
                return _method(*args, **kwargs)

            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc):
        for owner, name, method in self.saved:
            setattr(owner, name, method)
