"""Edge forms of expert GEMMs in user code (issue 38.10, class F): one expert by a negative
index (`W[-1]`), `bmm` with `W[ids]` and several rows per id (ids repeated, unsorted; the
weight on either side), and `torch._grouped_mm` / `F.grouped_mm` with `out_dtype`. Each either
gives the dense `fp8fn.linear` per expert bit for bit (output, gradients, observations, on a
fresh state and on one with stored scales) or runs in high precision with fp8fn's report."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8fn

RECIPE = fp8fn.DelayedScaling(margin=2, backend="emulated")
EXPERTS, N, K, M = 4, 24, 32, 3
IDS = torch.tensor([2, 0, 2, 1, 3, 0])  # expert of each batch of M rows: repeated, unsorted


class _Experts(nn.Module):
    def __init__(self, form):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        w = (
            torch.randn(EXPERTS, N, K, generator=gen)
            * torch.logspace(-1, 1, EXPERTS)[:, None, None]
        )
        self.w, self.form = nn.Parameter(w), form

    def forward(self, x):
        w = self.w
        if self.form == "linear_last":  # F.linear(x, W[-1])
            return F.linear(x, w[-1])
        if self.form == "matmul_last":  # x @ W[-1].t()
            return x @ w[-1].t()
        if self.form == "bmm_ids":  # bmm(x, W[ids].mT), M rows per id
            return torch.bmm(x, w[IDS].transpose(1, 2))
        assert self.form == "bmm_ids_left"  # bmm(W[ids], x.mT)
        return torch.bmm(w[IDS], x.transpose(1, 2))


def _x(form, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (5, K) if form.endswith("_last") else (len(IDS), M, K)
    mags = torch.exp2(torch.rand(shape, generator=gen) * -24.0)  # down to float8's subnormals
    return torch.where(torch.rand(shape, generator=gen) < 0.5, -mags, mags) * 4.0


def _rows_of(form):
    """`(expert, index of x)` pairs: the rows of `x` each expert takes."""
    if form.endswith("_last"):
        return [(EXPERTS - 1, slice(None))]
    return [(e, IDS == e) for e in range(EXPERTS) if (IDS == e).any()]


def _dense_per_expert(form, w, state, x, g):
    """The dense op per expert at the expert's site: `(out, grad_x, grad_w, obs (E, 3))`."""
    left = form == "bmm_ids_left"
    x, w = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = torch.zeros(g.shape)
    obs = torch.zeros(EXPERTS, 3)
    parts = []
    for e, rows in _rows_of(form):
        site = state[f"w[{e}]"]
        site = site._replace(amax_history=site.amax_history.clone().requires_grad_())
        xe = x[rows].reshape(-1, K)
        out_e = fp8fn.linear(xe, w[e], None, site, RECIPE)
        if not form.endswith("_last"):
            out_e = out_e.reshape(-1, M, N)
            out_e = out_e.transpose(1, 2) if left else out_e
        out = out.index_put((IDS == e,), out_e) if not form.endswith("_last") else out_e
        parts.append((e, out_e, rows, site))
    gx, gw = torch.autograd.grad((out * g).sum(), [x, w], retain_graph=True)
    for e, out_e, rows, site in parts:
        obs[e] = torch.autograd.grad((out_e * g[rows]).sum(), site.amax_history)[0][:, 0]
    return out, gx, gw, obs


def _transformed(module, state, x, g):
    fn = fp8fn.transform(module, RECIPE)
    params = {"w": module.w.detach().clone().requires_grad_()}
    xr = x.clone().requires_grad_()
    history = state.amax_history.clone().requires_grad_()
    out = fn.apply(params, state._replace(amax_history=history), xr)
    gx, gw, obs = torch.autograd.grad((out * g).sum(), [xr, params["w"], history])
    return out, gx, gw, obs


FORMS = ["linear_last", "matmul_last", "bmm_ids", "bmm_ids_left"]


@pytest.mark.parametrize("form", FORMS)
def test_edge_forms_are_the_dense_op_per_expert(form):
    module = _Experts(form)
    fn = fp8fn.transform(module, RECIPE)
    x = _x(form)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converted: no high-precision report
        state = fn.init(x)
    assert fn.layers == ["w"] and list(state) == [f"w[{e}]" for e in range(EXPERTS)]
    g = torch.randn(module(x).shape, generator=torch.Generator().manual_seed(2)) * 1e-3
    for step in range(2):  # a fresh state (current scaling), then stored scales
        got = _transformed(module, state, x, g)
        want = _dense_per_expert(form, module.w, state, x, g)
        names = ["out", "grad_x", "grad_w", "observations"]
        for name, a, b in zip(names, (*got[:3], got[3][..., 0]), want):
            assert torch.equal(a, b), (step, name)
        state = fp8fn.update(state, state._replace(amax_history=got[3], scale=state.scale * 0))


@pytest.mark.parametrize("op", ["torch._grouped_mm", "F.grouped_mm"])
def test_grouped_mm_with_out_dtype_runs_in_high_precision_and_says_so(op):
    """An `out_dtype` is not converted: the call runs as written (exactly torch's result) and
    `init` reports the weight as run in high precision."""
    grouped = torch._grouped_mm if op == "torch._grouped_mm" else F.grouped_mm
    offs = torch.tensor([5, 5, 13, 20], dtype=torch.int32)

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(EXPERTS, N, K))

        def forward(self, x):
            return grouped(x, self.w.transpose(-2, -1), offs=offs, out_dtype=torch.float32)

    module, x = Module(), torch.randn(20, K)
    fn = fp8fn.transform(module, RECIPE)
    with pytest.warns(UserWarning, match=r"^fp8fn\.init: 1 weight\(s\) run their GEMMs in high "):
        state = fn.init(x)
    assert fn.layers == [] and list(state) == []
    assert torch.equal(fn.apply(dict(module.named_parameters()), state, x), module(x))


def test_negative_and_positive_indices_of_one_expert_share_its_sites_in_call_order():
    """`W[-1]` then `W[3]` (4 experts) are two calls of expert 3 (sites `w[3]`, `w[3]#1`), and
    a 0-d tensor index `-4` is expert 0: the dense op at those sites, bit for bit."""

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(EXPERTS, N, K))

        def forward(self, x):
            w = self.w
            return F.linear(x, w[-1]) + F.linear(x * 3, w[3]) + F.linear(x, w[torch.tensor(-4)])

    module, x = Module(), _x("linear_last")
    fn = fp8fn.transform(module, RECIPE)
    state = fn.init(x)
    assert list(state) == [f"w[{e}]" for e in range(EXPERTS)] + [
        f"w[{e}]#1" for e in range(EXPERTS)
    ]
    w = module.w.detach()
    want = (
        fp8fn.linear(x, w[3], None, state["w[3]"], RECIPE)
        + fp8fn.linear(x * 3, w[3], None, state["w[3]#1"], RECIPE)
        + fp8fn.linear(x, w[0], None, state["w[0]"], RECIPE)
    )
    assert torch.equal(fn.apply({"w": w}, state, x), want)
