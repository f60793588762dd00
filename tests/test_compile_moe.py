"""torch.compile of a tiny Mixtral (transformers' grouped_mm experts implementation) under fp8fn:
one graph, no graph break, the same training steps as eager. Under torch.compile transformers
runs a float32 grouped_mm through its own custom op `transformers::grouped_mm_fallback`, which
fp8fn routes as a grouped GEMM; the grouped op's per-group GEMMs are custom ops of fp8fn's (the
group offsets are read inside them), so nothing breaks the graph."""

import warnings

import pytest
import torch
from _moe_models import batch, build
from torch._dynamo.utils import counters

import fp8fn
from fp8fn._ops.grouped import grouped_mm

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # torch.compile of a model: tens of seconds on 2 cores


def _steps(apply, fn, model, steps=2):
    """`[(loss, grads, state)]` of `steps` plain-autograd SGD steps from `fn.init`."""
    ids = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the routers' high-precision GEMMs
        state = fn.init(ids)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = []
    for _ in range(steps):
        leaves = {n: p.requires_grad_() for n, p in params.items()}
        observed = fp8fn.observe(state)
        loss = apply(leaves, observed, ids, labels=ids).loss
        loss.backward()
        state = fp8fn.update(state, fp8fn.observations(observed))
        grads = {n: p.grad for n, p in leaves.items()}
        out.append((loss.detach(), grads, state))
        params = {n: (p - 0.5 * grads[n]).detach() for n, p in params.items()}
    return out


def test_compiled_mixtral_grouped_mm_matches_eager_with_no_graph_break():
    torch._dynamo.reset()
    counters.clear()
    model = build("mixtral", "grouped_mm")
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    got = _steps(torch.compile(fn.apply, fullgraph=True), fn, model)
    assert sum(counters["graph_break"].values()) == 0
    want = _steps(fn.apply, fn, model)
    # the experts in high precision (as before fp8fn routed transformers' custom op) give a
    # loss 6e-4 (relative) away from eager: the tolerance below tells the two apart
    for (loss, grads, state), (loss_e, grads_e, state_e) in zip(got, want):
        torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=0)
        torch.testing.assert_close(grads, grads_e, rtol=1e-4, atol=1e-5)
        assert state.sites == state_e.sites
        torch.testing.assert_close(state.amax_history, state_e.amax_history, rtol=1e-5, atol=0)
        torch.testing.assert_close(state.scale, state_e.scale, rtol=1e-5, atol=0)
    experts = [i for i, s in enumerate(state.sites) if "experts" in s]
    assert len(experts) == 16 and bool((state.amax_history[experts, 0, :2] > 0).all())
    torch._dynamo.reset()


STATELESS = [
    fp8fn.RowwiseScaling(),
    fp8fn.BlockwiseScaling(),
    fp8fn.MXScaling(),
    fp8fn.NVFP4Scaling(),
]
STATELESS_IDS = ["rowwise", "blockwise", "mx", "nvfp4"]


# Rowwise stands for the finer recipes here (blockwise and MXFP8 run the same two custom ops,
# and the op-level test below compiles all four bit for bit); NVFP4 has its own ops.
@pytest.mark.parametrize("recipe", STATELESS[::3], ids=STATELESS_IDS[::3])
def test_compiled_mixtral_experts_under_a_stateless_recipe_match_eager_with_no_graph_break(recipe):
    """The experts alone in float8 or NVFP4 (the rest in high precision): one step, compiled with
    fullgraph against eager. The grouped op itself is bit-identical (next test); what differs
    is inductor's rounding of the float32 attention and norms, which a float8 cast can amplify
    (a 1-ulp change of a tile's amax rescales the tile): one step keeps that to < 1e-6 here
    (a second step from the diverged weights reached 8e-4 under BlockwiseScaling)."""
    torch._dynamo.reset()
    counters.clear()
    model = build("mixtral", "grouped_mm")
    fn = fp8fn.transform(model, lambda name, module: recipe if "experts" in name else None)
    [(loss, grads, _)] = _steps(torch.compile(fn.apply, fullgraph=True), fn, model, steps=1)
    assert sum(counters["graph_break"].values()) == 0
    [(loss_e, grads_e, _)] = _steps(fn.apply, fn, model, steps=1)
    torch.testing.assert_close(loss, loss_e, rtol=1e-6, atol=0)
    torch.testing.assert_close(grads, grads_e, rtol=1e-5, atol=1e-6)
    # the experts did run in float8 when compiled: their gradients in high precision lie
    # 100x farther off than eager's
    with pytest.warns(UserWarning, match="no layer was converted"):
        hp = fp8fn.transform(model, lambda name, module: None)
    [(_, grads_hp, _)] = _steps(hp.apply, hp, model, steps=1)
    experts = [n for n in grads if "experts" in n]
    assert len(experts) == 4
    for n in experts:
        off = (grads[n] - grads_e[n]).abs().max()
        assert (grads[n] - grads_hp[n]).abs().max() > 100 * off + 1e-6
    torch._dynamo.reset()


def test_compiled_stateless_grouped_op_is_bit_identical_to_eager():
    """The grouped op of each stateless recipe, forward and backward, compiled in one graph:
    the same bits as eager (NVFP4: the same random bits from a key given as an input), with an
    idle expert, rows past `offs[-1]` and partial blocks."""
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(40, 48, generator=gen), torch.randn(40, 80, generator=gen)
    w = torch.randn(4, 80, 48, generator=gen) * 0.2
    offs = torch.tensor([0, 10, 25, 36], dtype=torch.int32)
    key = torch.tensor(7.0, dtype=torch.float64)

    def loss(x, w, key):
        return sum(
            (
                grouped_mm(
                    x,
                    w,
                    offs,
                    recipe=r,
                    random=(key, "e") if isinstance(r, fp8fn.NVFP4Scaling) else None,
                )
                * g
            ).sum()
            for r in STATELESS
        )

    def grads(f):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        f(xl, wl, key).backward()
        return xl.grad, wl.grad

    got = grads(torch.compile(loss, fullgraph=True))
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(got, grads(loss)):
        assert torch.equal(a, b)
    torch._dynamo.reset()


class _Experts(torch.nn.Module):
    """User code: a `(4, 24, 32)` bfloat16 experts weight (compiled, torch 2.13's CPU
    `_grouped_mm` takes no other dtype) in one GEMM form; 20 tokens, 5 per expert."""

    def __init__(self, form):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 24, 32, dtype=torch.bfloat16))
        self.form = form

    def forward(self, x):
        w = self.w.transpose(-2, -1)
        if self.form == "bmm":
            return torch.bmm(x.view(4, 5, 32), w).view(20, 24)
        offs = torch.tensor([5, 10, 15, 20], dtype=torch.int32)
        gemm = (
            torch.nn.functional.grouped_mm if self.form == "F.grouped_mm" else (torch._grouped_mm)
        )
        return gemm(x, w, offs=offs)


@pytest.mark.parametrize(
    "recipe",
    [
        fp8fn.DelayedScaling(),
        fp8fn.RowwiseScaling(),
        fp8fn.NVFP4Scaling(stochastic_rounding=False, hadamard=False),
    ],
    ids=["delayed", "rowwise", "nvfp4"],
)
def test_compiled_func_grad_of_experts_raises_fp8fns_error(recipe):
    """torch.compile of torch.func.grad over the experts' grouped op: fp8fn's refusal (as for
    the linear op: dynamo would drop the op's backward, pytorch#193279), not dynamo's error
    from the custom ops' fake call."""
    torch._dynamo.reset()
    module, x = _Experts("bmm"), torch.randn(20, 32, dtype=torch.bfloat16)
    fn = fp8fn.transform(module, recipe)
    state = fn.init(x)

    def loss(params):
        return fn.apply(params, state, x).float().square().sum()

    with pytest.raises(
        RuntimeError,
        match=r"^fp8fn\.apply: experts 'w': torch.compile cannot "
        r"trace fp8fn's float8 ops inside a torch.func",
    ):
        torch.compile(torch.func.grad(loss), fullgraph=True)(dict(module.named_parameters()))
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["F.grouped_mm", "torch._grouped_mm"])
def test_compiled_user_grouped_mm_raises_fp8fns_error(form):
    """Dynamo (torch 2.13) does not hand `torch._grouped_mm` to fp8fn's TorchFunctionMode: the
    experts ran in high precision, silently (the bits of the plain module). Now compiled
    `apply` raises fp8fn's error, with fullgraph at trace time, without it when run; eager
    `apply` runs them in float8."""
    torch._dynamo.reset()
    module, x = _Experts(form), torch.randn(20, 32, dtype=torch.bfloat16)
    fn = fp8fn.transform(module, fp8fn.DelayedScaling())
    state = fn.init(x)
    params = dict(module.named_parameters())
    assert not torch.equal(fn.apply(params, state, x), module(x))
    for fullgraph in (True, False):
        torch._dynamo.reset()
        with pytest.raises(
            RuntimeError,
            match=r"^fp8fn\.apply: expected the GEMMs of experts "
            r"weights \['w'\] routed to fp8fn, as in fn.init, "
            r"got none: under torch.compile",
        ):
            torch.compile(fn.apply, fullgraph=fullgraph)(params, state, x)
    torch._dynamo.reset()
