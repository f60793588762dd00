"""A naive reference of fp8fn's delayed scaling, written from DESIGN.md (not a test module).

It imports nothing from fp8fn and shares none of its code: each role of each site is a Python
list of float amaxes (newest first) and a Python float scale, scales are Python (float64)
arithmetic, casts are spelled out, and the model loop is the stateful design fp8fn replaces (a
per-step loop that records amaxes and then pushes them). Tests compare fp8fn with it, so a bug
cannot cancel out between two fp8fn code paths.

Semantics (DESIGN "Semantics"):
* forward casts input and weight to e4m3 (max 448), backward casts the output gradient to e5m2
  (max 57344): finite `x * scale` clamped to `[-max, max]`, inf and NaN cast to NaN (an overflow
  stays visible), the product taken in float32;
* `scale = fp8_max / (amax * 2**margin)` in float64, 1 for an amax that is 0, inf or NaN,
  clamped to float32's range [2**-149, float32 max], stored as float32;
* a role whose history is all zeros casts with current scaling (the tensor's own amax, margin
  included); otherwise with its stored scale;
* observations are the amaxes of input, weight and output gradient; an amax > 0 and finite is
  pushed to the front of the history (the oldest drops) and the scale recomputed from the max of
  the history ("max") or its newest entry ("most_recent"); anything else changes nothing;
* observations of one site combine by max (repeated use, microbatches), never by sum;
* grad_input and grad_weight come from the float8 operands, the bias gradient is the float32
  sum of the output gradient.

Two arithmetics for the matmuls:
* "float64" (`reference_linear(..., arithmetic="float64")`): the products of the float8
  operands summed in float64 (exact, or within 2**-50 of the magnitude), divided by the
  scales in float64. Each result comes with a rigorous elementwise bound (`*_bound`) on what
  float32 accumulation, the rounded reciprocals and the output dtype may change: fp8fn must lie
  within it whatever its summation order. A real bug (a wrong format, scale or margin) is
  orders of magnitude above it.
* "float32": DESIGN's emulated backend ("cast, widen, fp32 matmul"; `_matmul`'s contract
  `(a_fp8 @ b_fp8) * (inv_scale_a * inv_scale_b)`, float32 accumulation), operation by
  operation: `inv = 1 / scale` rounded to float32, `(a.float() @ b.float().T) * f32(inv_a *
  inv_b)`, cast to the output dtype, then `+ bias`. fp8fn must match it bit for bit. This is
  what whole training runs use: a float64 activation would flip float8 roundings in the next
  layer, and histories could not be compared exactly. It depends on torch's float32 matmul
  being deterministic for a given layout (it is, on CPU), and on fp8fn keeping that order of
  operations: a harmless reordering would show up here as a bitwise mismatch.
"""

from __future__ import annotations

import copy
import math
import struct
from dataclasses import dataclass, field

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
F32_MAX = 3.4028234663852886e38  # float32's largest finite value
F32_TINY = 2.0**-149  # float32's smallest positive value
U32 = 2.0**-24  # float32's unit roundoff
ROLES = ("input", "weight", "grad_output")
FORMATS = {"input": (E4M3, E4M3_MAX), "weight": (E4M3, E4M3_MAX), "grad_output": (E5M2, E5M2_MAX)}


def to_float32(v: float) -> float:
    """`v` rounded to the nearest float32 (ties to even), as a Python float."""
    return struct.unpack("f", struct.pack("f", v))[0]


def scale_of(amax: float, fp8_max: float, margin: int) -> float:
    """`fp8_max / (amax * 2**margin)` in float64; 1 for 0/inf/NaN; clamped; as float32."""
    if not (amax > 0 and math.isfinite(amax)):
        return 1.0
    s = fp8_max / (amax * 2.0**margin)
    return to_float32(min(max(s, F32_TINY), F32_MAX))


def amax_of(t: torch.Tensor) -> float:
    """The largest magnitude of `t` as a Python float (NaN if any NaN, 0 if empty)."""
    if t.numel() == 0:
        return 0.0
    if torch.isnan(t).any():
        return math.nan
    return float(t.detach().double().abs().max())


def saturating_cast(hp: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """`clamp(hp * scale, -max, max)` (product in float32) in the float8 format `fmt`, with
    inf and NaN products made NaN."""
    fp8_max = E4M3_MAX if fmt == E4M3 else E5M2_MAX
    y = hp.detach().float() * scale
    return torch.where(torch.isfinite(y), y.clamp(-fp8_max, fp8_max), math.nan).to(fmt)


@dataclass
class Role:
    """One role of one site: amax history (newest first; 0 = never observed) and scale."""

    fp8_max: float
    history: list
    scale: float = 1.0

    def empty(self) -> bool:
        return all(a == 0 for a in self.history)

    def cast_scale(self, tensor_amax: float, margin: int) -> float:
        """The scale this step's cast uses: stored, or current scaling while never observed."""
        return scale_of(tensor_amax, self.fp8_max, margin) if self.empty() else self.scale

    def push(self, amax: float, amax_compute: str, margin: int) -> None:
        if not (amax > 0 and math.isfinite(amax)):
            return
        self.history = [amax] + self.history[:-1]
        window = self.history if amax_compute == "max" else self.history[:1]
        self.scale = scale_of(max(window), self.fp8_max, margin)


@dataclass
class Site:
    """The three roles of one call site."""

    history_len: int
    amax_compute: str = "max"
    margin: int = 0
    roles: dict = field(default_factory=dict)

    def __post_init__(self):
        for r in ROLES:
            self.roles.setdefault(r, Role(FORMATS[r][1], [0.0] * self.history_len))

    def __getitem__(self, role: str) -> Role:
        return self.roles[role]

    def push(self, amaxes) -> None:
        for r, a in zip(ROLES, amaxes):
            self.roles[r].push(a, self.amax_compute, self.margin)

    def history(self) -> torch.Tensor:
        """float32 `(3, history_len)`, fp8fn's layout of one site."""
        return torch.tensor([self.roles[r].history for r in ROLES], dtype=torch.float32)

    def scales(self) -> torch.Tensor:
        return torch.tensor([self.roles[r].scale for r in ROLES], dtype=torch.float32)


def merge_amaxes(a, b):
    """Observations of one site combined: elementwise max, inf/NaN counting as not observed."""
    if a is None:
        return list(b)
    clean = [v if math.isfinite(v) else 0.0 for v in a]
    return [max(p, q if math.isfinite(q) else 0.0) for p, q in zip(clean, b)]


# -- one linear layer ---------------------------------------------------------------------------

_UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_TINY = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}


def _scaled_mm(a_fp8, sa: float, b_fp8, sb: float, dtype, arithmetic: str):
    """`(a @ b.T)` of dequantized float8 operands; with its float32-vs-exact bound.

    Returns `(value, bound)`: in "float64", value float64 and bound float64 (elementwise, for a
    float32 accumulation of `k` terms, two rounded reciprocals, their rounded product, the
    rounded scaling and the cast to `dtype`); in "float32", value in `dtype` and bound None.
    """
    if arithmetic == "float32":
        inv = to_float32(to_float32(1.0 / sa) * to_float32(1.0 / sb))
        return (a_fp8.float() @ b_fp8.float().t() * inv).to(dtype), None
    a, b = a_fp8.double(), b_fp8.double()
    value = (a @ b.t()) / (sa * sb)
    magnitude = (a.abs() @ b.abs().t()) / (sa * sb)
    k = a.shape[1]
    bound = ((k + 4) * U32 + 2.0**-50 + 2 * _UNIT[dtype]) * magnitude + 2 * _TINY[dtype]
    return value, 1.01 * bound


@dataclass
class Forward:
    out: torch.Tensor
    out_bound: torch.Tensor | None
    x_fp8: torch.Tensor
    w_fp8: torch.Tensor
    x_scale: float
    w_scale: float
    x_amax: float
    w_amax: float


@dataclass
class Backward:
    grad_input: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor | None
    g_amax: float
    grad_input_bound: torch.Tensor | None = None
    grad_weight_bound: torch.Tensor | None = None
    grad_bias_bound: torch.Tensor | None = None


def linear_forward(x, w, b, site: Site | None, arithmetic="float32") -> Forward:
    """`x (m, k) @ w (n, k).T + b` in float8. `site` None: current scaling, margin 0."""
    margin = 0 if site is None else site.margin
    x_amax, w_amax = amax_of(x), amax_of(w)
    if site is None:
        sx, sw = scale_of(x_amax, E4M3_MAX, 0), scale_of(w_amax, E4M3_MAX, 0)
    else:
        sx, sw = site["input"].cast_scale(x_amax, margin), site["weight"].cast_scale(w_amax, margin)
    x_fp8, w_fp8 = saturating_cast(x, sx, E4M3), saturating_cast(w, sw, E4M3)
    out, bound = _scaled_mm(x_fp8, sx, w_fp8, sw, x.dtype, arithmetic)
    if b is not None:
        if arithmetic == "float32":
            out = out + b.detach().to(out.dtype)
        else:
            unit = _UNIT[x.dtype]
            out = out + b.detach().double()
            bound = bound + 2.02 * unit * b.detach().double().abs()
    return Forward(out, bound, x_fp8, w_fp8, sx, sw, x_amax, w_amax)


def linear_backward(g, fwd: Forward, site: Site | None, dtypes, arithmetic="float32") -> Backward:
    """Gradients of `linear_forward` for the output gradient `g (m, n)`.

    `dtypes`: (x, weight, bias) dtypes (bias None without a bias).
    """
    x_dtype, w_dtype, b_dtype = dtypes
    g_amax = amax_of(g)
    if site is None:
        sg = scale_of(g_amax, E5M2_MAX, 0)
    else:
        sg = site["grad_output"].cast_scale(g_amax, site.margin)
    g_fp8 = saturating_cast(g, sg, E5M2)
    # grad_input = g @ w, grad_weight = g.T @ x: as `a @ b.T` of float8 operands.
    gi, gi_bound = _scaled_mm(g_fp8, sg, fwd.w_fp8.t(), fwd.w_scale, x_dtype, arithmetic)
    gw, gw_bound = _scaled_mm(g_fp8.t(), sg, fwd.x_fp8.t(), fwd.x_scale, w_dtype, arithmetic)
    gb = gb_bound = None
    if b_dtype is not None:
        if arithmetic == "float32":
            gb = g.detach().float().sum(0).to(b_dtype)
        else:
            gd = g.detach().double()
            gb = gd.sum(0)
            m, total = gd.shape[0], gd.abs().sum(0)
            gb_bound = 1.01 * (
                (m * U32) * total + _UNIT[b_dtype] * (gb.abs() + m * U32 * total) + _TINY[b_dtype]
            )
    return Backward(gi, gw, gb, g_amax, gi_bound, gw_bound, gb_bound)


@dataclass
class LinearResult:
    """Everything one call of the reference linear gives (float64 values with bounds, or
    bit-exact values with bounds None)."""

    fwd: Forward
    bwd: Backward

    @property
    def amaxes(self):
        return [self.fwd.x_amax, self.fwd.w_amax, self.bwd.g_amax]


def reference_linear(x, w, b, g, site: Site | None, arithmetic="float64") -> LinearResult:
    """One forward and backward of the float8 linear, for the output gradient `g`.

    `x (..., k)` is flattened to `(m, k)`; `g` is `(..., n)`. The site's state is read, not
    changed: call `site.push(result.amaxes)` for the update.
    """
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    fwd = linear_forward(x2, w, b, site, arithmetic)
    dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
    return LinearResult(fwd, linear_backward(g2, fwd, site, dtypes, arithmetic))


# -- models -------------------------------------------------------------------------------------


class _Linear(torch.autograd.Function):
    """The reference linear under plain autograd ("float32" arithmetic, bit for bit)."""

    @staticmethod
    def forward(ctx, x, w, b, model, name):
        site = model.sites[name]
        fwd = linear_forward(x, w, b, site, "float32")
        model.observe(name, [fwd.x_amax, fwd.w_amax, 0.0])
        ctx.fwd, ctx.site, ctx.model, ctx.name = fwd, site, model, name
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return fwd.out

    @staticmethod
    def backward(ctx, g):
        bwd = linear_backward(g, ctx.fwd, ctx.site, ctx.dtypes, "float32")
        ctx.model.observe(ctx.name, [0.0, 0.0, bwd.g_amax])
        # For a bound on a bias gradient summed in another order: rows and sum of |g|.
        ctx.model.bias_grad_terms[ctx.name] = (g.shape[0], g.detach().double().abs().sum(0))
        return bwd.grad_input, bwd.grad_weight, bwd.grad_bias, None, None


class ReferenceModel:
    """A model whose nn.Linear layers run the reference float8 linear with delayed scaling.

    The naive, stateful design: a deep copy of `module` whose linear layers read the sites'
    state, record their amaxes as a side effect (merged by max when a site runs more than once
    before `update`), and `update()` pushes them. Site names as in DESIGN: the layer's path,
    `path#k` for its k-th further call in one forward. Parameters are passed in (as a dict
    keyed like `named_parameters()`), so a training loop can be written functionally.
    """

    def __init__(self, module: nn.Module, history_len: int, amax_compute="max", margin=0):
        self.module = copy.deepcopy(module)
        self.config = (history_len, amax_compute, margin)
        self.sites: dict[str, Site] = {}
        self.observed: dict[str, list] = {}
        self.bias_grad_terms: dict[str, tuple] = {}
        self._calls: dict[str, int] = {}
        for path, layer in self.module.named_modules():
            if isinstance(layer, nn.Linear):
                layer.forward = self._forward_of(path, layer)

    def _forward_of(self, path, layer):
        def forward(x):
            k = self._calls.get(path, 0)
            self._calls[path] = k + 1
            name = path if k == 0 else f"{path}#{k}"
            if name not in self.sites:
                self.sites[name] = Site(*self.config)
            x2 = x.reshape(-1, x.shape[-1])
            out = _Linear.apply(x2, layer.weight, layer.bias, self, name)
            return out.reshape(*x.shape[:-1], out.shape[-1])

        return forward

    def observe(self, name, amaxes) -> None:
        """Record one call's amaxes (0 = not seen in this half of the call)."""
        previous = self.observed.get(name, [0.0, 0.0, 0.0])
        combined = []
        for p, a in zip(previous, amaxes):
            combined.append(a if p == 0 else (p if a == 0 else max(p, a)))
        self.observed[name] = combined

    def __call__(self, params: dict, *args, **kwargs):
        """The model's forward with `params` (one forward pass: call counts start at 0)."""
        self._calls = {}
        return torch.func.functional_call(self.module, params, args, kwargs)

    def bias_grad_bound(self, name: str) -> torch.Tensor:
        """The most a float32 bias gradient of site `name` (last backward) may differ from the
        reference's by summing its rows in another order: `2 * m * 2**-24 * sum(|g|)`."""
        m, total = self.bias_grad_terms[name]
        return 2 * m * U32 * total

    def update(self) -> dict:
        """Push this step's observations into the histories; returns them (then cleared)."""
        observed, self.observed = self.observed, {}
        for name, amaxes in observed.items():
            self.sites[name].push(amaxes)
        return observed


def sgd(params: dict, grads: dict, lr: float) -> dict:
    """`p - lr * g` for every parameter (float32, the same formula on both sides)."""
    return {k: (p - lr * grads[k]).detach() for k, p in params.items()}
