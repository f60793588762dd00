"""The grouped (experts) op bit for bit against the dense `fp8fn.linear` per expert, where a
slip of a scale shows (issue 38.10, classes A and D).

A power-of-two error in a scale cancels exactly for normal float8 values: it shows only where
values fall in float8's subnormal range or saturate. The data here span 2**0 down to 2**-32 of
each group's amax (e4m3's subnormals lie near 2**-14 of the amax, e5m2's near 2**-29 with a
margin of 2-3), under DelayedScaling with margin 2 and 3, each expert's roles with an empty
history (current scaling with the margin) or a stored scale.
"""

import pytest
import torch

import fp8fn
from fp8fn._core import keys as fp8keys
from fp8fn._core.keys import fold_key
from fp8fn._ops.grouped import grouped_mm

ENDS = [9, 9, 30, 47]  # expert 1 receives no token


def _log_spread(shape, gen, low=-32.0):
    """Random signs times magnitudes log-uniform in [2**low, 1]: float32 `shape`."""
    mags = torch.exp2(torch.rand(shape, generator=gen) * low)
    return torch.where(torch.rand(shape, generator=gen) < 0.5, -mags, mags)


def _data(experts=4, k=32, n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = ENDS[-1]
    x = _log_spread((rows, k), gen) * 3.0
    w = _log_spread((experts, n, k), gen) * torch.arange(1.0, experts + 1)[:, None, None]
    g = _log_spread((rows, n), gen) * 1e-3
    return x, w, torch.tensor(ENDS, dtype=torch.int32), g


def _site_rows(experts, empty):
    """Per expert `(newest, stored)` float32 `(E, 3)`: a role in `empty` (expert, role) has an
    empty history (newest 0), the others a stored scale that is not a power of two."""
    newest = torch.tensor([[1.5, 2.5, 0.25]]).repeat(experts, 1)
    stored = torch.tensor([[7.3, 11.9, 3.1e5]]) * torch.linspace(1.0, 1.7, experts)[:, None]
    for e, role in empty:
        newest[e, role] = 0.0
    return newest, stored


def _grouped(x, w, offs, g, newest, stored, margin):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    newest = newest.clone().requires_grad_()
    out = grouped_mm(x, w, offs, newest, stored, margin, "emulated")
    return (out, *torch.autograd.grad(out, [x, w, newest], g))


def _dense_per_expert(x, w, g, newest, stored, margin):
    """The dense op per expert, its `SiteState` built from the expert's rows: `(out, grad_x,
    grad_w, observations (E, 3))`; an idle expert observes only its weight (0 elsewhere)."""
    recipe = fp8fn.DelayedScaling(margin=margin, backend="emulated")
    template = fp8fn.init_state(recipe, ["fc"])["fc"]
    out = torch.zeros(x.shape[0], w.shape[1])
    gx, gw, obs = torch.zeros_like(x), torch.zeros_like(w), torch.zeros(w.shape[0], 3)
    start = 0
    for e, end in enumerate(ENDS):
        history = template.amax_history.clone()
        history[:, 0] = newest[e]
        history = history.requires_grad_()
        site = template._replace(amax_history=history, scale=stored[e].clone())
        xe, we = x[start:end].clone().requires_grad_(), w[e].clone().requires_grad_()
        if end > start:
            out_e = fp8fn.linear(xe, we, None, site, recipe)
            out[start:end] = out_e
            gx[start:end], gw[e], h = torch.autograd.grad(out_e, [xe, we, history], g[start:end])
            obs[e] = h[:, 0]
        else:
            obs[e, 1] = w[e].abs().max()
        start = end
    return out, gx, gw, obs


EMPTY = {
    "all-empty": [(e, r) for e in range(4) for r in range(3)],
    "mixed": [(0, 0), (0, 2), (2, 1), (3, 2), (1, 0)],
}


@pytest.mark.parametrize("margin", [2, 3])
@pytest.mark.parametrize("empty", EMPTY, ids=list(EMPTY))
def test_delayed_with_margin_and_subnormals_is_the_dense_op_per_expert(margin, empty):
    x, w, offs, g = _data(seed=margin)
    newest, stored = _site_rows(4, EMPTY[empty])
    got = _grouped(x, w, offs, g, newest, stored, margin)
    want = _dense_per_expert(x, w, g, newest, stored, margin)
    for name, a, b in zip(["out", "grad_x", "grad_w", "observations"], got, want):
        assert torch.equal(a, b), name


def test_the_data_reach_float8_subnormals_so_a_power_of_two_shows():
    """The test above can fail: the same call with every scale doubled (a margin off by one)
    changes each of out, grad_x and grad_w."""
    x, w, offs, g = _data(seed=2)
    newest, stored = _site_rows(4, EMPTY["all-empty"])
    base = _grouped(x, w, offs, g, newest, stored, 2)
    off = _grouped(x, w, offs, g, newest, stored, 1)
    for a, b in zip(base[:3], off[:3]):
        assert not torch.equal(a, b)


# -- class D: grouped NVFP4 on a rank other than 0 ------------------------------------------------

NVFP4 = fp8fn.NVFP4Scaling()


def _nvfp4_grouped(x, w, offs, g, key):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_mm(x, w, offs, recipe=NVFP4, random=(key, "experts"))
    return (out, *torch.autograd.grad(out, [x, w], g))


def _nvfp4_dense(x, w, g, key):
    out = torch.zeros(x.shape[0], w.shape[1])
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(ENDS):
        if end > start:
            xe, we = x[start:end].clone().requires_grad_(), w[e].clone().requires_grad_()
            out_e = fp8fn.linear(xe, we, None, (fold_key(key, e), "experts"), NVFP4)
            out[start:end] = out_e
            gx[start:end], gw[e] = torch.autograd.grad(out_e, [xe, we], g[start:end])
        start = end
    return out, gx, gw


def test_grouped_nvfp4_folds_the_rank_into_the_gradient_rounding_bits(monkeypatch):
    """As the dense op (test_nvfp4_linear's rank test): rank r rounds its gradients with its
    own bits, the forward draws nothing; per expert the dense op on the same rank, bit for
    bit."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(ENDS[-1], 64, generator=gen)
    w = torch.randn(4, 32, 64, generator=gen) * 0.1
    g = torch.randn(ENDS[-1], 32, generator=gen)
    offs, key = torch.tensor(ENDS, dtype=torch.int32), torch.tensor(99.0, dtype=torch.float64)
    rank0 = _nvfp4_grouped(x, w, offs, g, key)
    monkeypatch.setattr(fp8keys, "process_rank", lambda: 1)
    rank1 = _nvfp4_grouped(x, w, offs, g, key)
    assert torch.equal(rank1[0], rank0[0])  # the forward draws nothing
    assert not torch.equal(rank1[1], rank0[1]) and not torch.equal(rank1[2], rank0[2])
    for name, a, b in zip(["out", "grad_x", "grad_w"], rank1, _nvfp4_dense(x, w, g, key)):
        assert torch.equal(a, b), name
