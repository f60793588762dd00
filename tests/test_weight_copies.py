"""Weights reached through a copy: routed to the weight's site, or reported as high precision.

fp8fn 0.4 lost a weight behind `.clone()` or `.detach()` (`F.linear(x, W[e].clone())`: no site,
`summary()` said "float8: 128 of 128" of the other weights or listed nothing, `init` warned
nothing), and a router module shared by blocks ran in float8 under its first name. A copy of a
layer's or experts weight (`.to`, `.type`, `.float`/`.bfloat16`/`.half`, `.clone`,
`.contiguous`, `.detach`) is now that weight in the calls it reaches: its site, the float8 op
on the copy (the gradient flows back to the master as autograd takes it through the copy). A
copy of any other weight is reported under the weight's name. Each case is compared with
`fp8fn.linear` on the same copies (tested against a float64 reference in test_reference.py),
bit for bit.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import DELAYED_AUTO, assert_bit_identical
from torch import nn

import fp8fn

BF16 = torch.bfloat16

COPIES = {  # (copy of weight w for activations x; the dtype of x)
    "to_dtype": (lambda w, x: w.to(x.dtype), BF16),
    "type": (lambda w, x: w.type(x.dtype), BF16),
    "bfloat16": (lambda w, x: w.bfloat16(), BF16),
    "half": (lambda w, x: w.half(), torch.float16),
    "to_float_from_bf16_x": (lambda w, x: w.float(), torch.float32),
    "clone": (lambda w, x: w.clone(), torch.float32),
    "detach": (lambda w, x: w.detach(), torch.float32),
    "t_contiguous_t": (lambda w, x: w.t().contiguous().t(), torch.float32),
    "to_device": (lambda w, x: w.to("cpu", copy=True), torch.float32),
    "to_memory_format": (lambda w, x: w.to(memory_format=torch.contiguous_format), torch.float32),
    "torch_clone": (lambda w, x: torch.clone(w), torch.float32),
    "data": (lambda w, x: w.data, torch.float32),  # (0.4: summary said float8, it ran float32)
}
# Views fp8fn does not follow (a layer's weight, an expert's matrix): reported as high precision.
VIEWS = {
    "t_contiguous_t": COPIES["t_contiguous_t"][0],  # (of an expert's matrix: followed)
    "view": lambda w, x: w.view(w.shape),
    "view_as": lambda w, x: w.view_as(w),
    "reshape": lambda w, x: w.reshape(w.shape),
    "expand": lambda w, x: w.expand(w.shape),
    "index_all": lambda w, x: w[:],
}


class _Experts(nn.Module):
    """Two experts `(2, 16, 16)` float32 masters, each half of the batch through
    `F.linear(x, copy(W[e]))`."""

    def __init__(self, copy):
        super().__init__()
        self.copy = copy
        self.w = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, x):
        a, b = x.chunk(2)
        return torch.cat(
            [F.linear(a, self.copy(self.w[0], a)), F.linear(b, self.copy(self.w[1], b))]
        )

    def reference(self, params, state, x, recipe):
        a, b = x.chunk(2)
        w = params["w"]
        return torch.cat(
            [
                fp8fn.linear(a, self.copy(w[0], a), None, state["w[0]"], recipe),
                fp8fn.linear(b, self.copy(w[1], b), None, state["w[1]"], recipe),
            ]
        )


class _UsesLinear(nn.Module):
    """A module calling `F.linear` on copies of an nn.Linear's weight and bias."""

    def __init__(self, copy):
        super().__init__()
        self.copy = copy
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return F.linear(x, self.copy(self.lin.weight, x), self.copy(self.lin.bias, x))

    def reference(self, params, state, x, recipe):
        w, b = self.copy(params["lin.weight"], x), self.copy(params["lin.bias"], x)
        return fp8fn.linear(x, w, b, state["lin"], recipe)


def _run(model, x, f):
    """`(loss, param grads, obs)` of `f(params, state, x)` by torch.func, on a warmed state."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, s):
        return f(p, s, x).float().square().mean()

    return lambda state: torch.func.grad_and_value(loss, argnums=(0, 1))(params, state)


CASES = [(m, c) for m in (_Experts, _UsesLinear) for c in COPIES]
CASES.remove((_UsesLinear, "t_contiguous_t"))  # a layer's transpose is not followed: reported


@pytest.mark.parametrize(
    ("make", "copy"), CASES, ids=[f"{m.__name__.strip('_')}-{c}" for m, c in CASES]
)
def test_a_weight_reached_through_a_copy_runs_at_its_site(make, copy):
    fn_copy, dtype = COPIES[copy]
    torch.manual_seed(0)
    model = make(fn_copy)
    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    fn = fp8fn.transform(model, DELAYED_AUTO)
    state = fn.init(x)
    sites = ["w[0]", "w[1]"] if make is _Experts else ["lin"]
    assert list(state) == sites
    assert fn.summary().splitlines()[0].endswith("(100.0%)")
    got = _run(model, x, fn.apply)
    want = _run(model, x, lambda p, s, x: model.reference(p, s, x, DELAYED_AUTO))
    for _ in range(2):  # step 1 (current scaling) and a step with stored scales
        (got_grads, got_obs), got_loss = got(state)
        (want_grads, want_obs), want_loss = want(state)
        assert_bit_identical((got_loss, got_grads, got_obs), (want_loss, want_grads, want_obs))
        assert bool(got_obs.amax_history[..., 0].all())  # every role of every site observed
        state = fp8fn.update(state, got_obs)


class _Proj(nn.Module):
    """A raw 2-D parameter (no layer of its own) reached through a copy."""

    def __init__(self, copy):
        super().__init__()
        self.copy = copy
        self.proj = nn.Parameter(torch.randn(16, 16) / 4)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(x @ self.copy(self.proj, x).T)


@pytest.mark.parametrize("copy", list(COPIES), ids=list(COPIES))
def test_another_weight_reached_through_a_copy_is_reported_as_high_precision(copy):
    fn_copy, dtype = COPIES[copy]
    torch.manual_seed(0)
    model = _Proj(fn_copy).to(dtype if dtype != torch.float32 else torch.float32)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    fn = fp8fn.transform(model, DELAYED_AUTO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn.init(x)
    assert any("'proj' (torch.matmul)" in str(w.message) for w in caught), caught
    lines = fn.summary().splitlines()
    assert lines[0] == "float8: 256 of 512 matmul weight elements (50.0%)"
    assert any(
        line.split()[0] == "proj" and "high precision (torch.matmul" in line for line in lines
    )


class _Router(nn.Module):
    """Top-1 routing over two experts by a router it is given."""

    def __init__(self, router):
        super().__init__()
        self.gate = router
        self.experts = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, x):
        pick = self.gate(x).argmax(-1, keepdim=True)
        w = self.experts
        return torch.where(pick == 0, F.linear(x, w[0]), F.linear(x, w[1]))


class _SharedRouter(nn.Module):
    """One router module held at the top (its first name) and by two MoE blocks."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 2)
        self.blocks = nn.ModuleList([_Router(self.router), _Router(self.router)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_router_shared_by_two_moe_blocks_stays_high_precision_under_every_name():
    """0.4 ran it in float8 (sites 'router', 'router#1'): the gates rule saw the first name
    only, which is not next to the experts."""
    torch.manual_seed(0)
    model = _SharedRouter()
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16)
    state = fn.init(x)
    assert list(state) == [f"blocks.{b}.experts[{e}]" for b in (0, 1) for e in (0, 1)]
    assert "router.weight 32 3.0% high precision (F.linear; router or gate, by default)" in [
        " ".join(line.split()) for line in fn.summary().splitlines()
    ]


VIEW_CASES = [(m, v) for m in (_Experts, _UsesLinear) for v in VIEWS]
VIEW_CASES.remove((_Experts, "t_contiguous_t"))


@pytest.mark.parametrize(("make", "view"), VIEW_CASES)
def test_a_weight_in_a_view_not_followed_is_reported_as_high_precision(make, view):
    """`F.linear(x, lin.weight.t().contiguous().t())` (or `.view`, `.reshape`, `.expand`,
    `[:]`) from another module, likewise of an expert's matrix `W[e]`: the weight reaches a
    GEMM through a view fp8fn does not follow, and runs in high precision: warned, and so in
    `summary()` (0.4: summary said float8 of `t().contiguous().t()`, nothing warned)."""
    torch.manual_seed(0)
    model = make(VIEWS[view])
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = fn.init(x)
    name, size = ("w", 512) if make is _Experts else ("lin.weight", 256)
    assert any(f"'{name}' (F.linear)" in str(w.message) for w in caught), caught
    assert fn.summary().splitlines()[2].split() == [
        name,
        str(size),
        "100.0%",
        "high",
        "precision",
        "(F.linear;",
        "not",
        "converted)",
    ]
    assert torch.equal(fn.apply(dict(model.named_parameters()), state, x), model(x))
