"""`fp8fn.expert_parallel` in one process: the sender's pack-and-cast of token rows against
fp8fn's own casts, the fused all-to-all GEMMs on a one-rank group against the grouped op, a
one-rank expert-parallel tiny Mixtral against the plain model, and the refusals. The ranks'
runs are in `test_expert_parallel_ranks.py` (slow)."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest
import torch
from _helpers import sqnr
from _moe_models import batch, build
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

import fp8fn
from fp8fn._numerics.fp8 import E4M3, E5M2, cast_to_fp8
from fp8fn._ops.grouped import grouped_mm
from fp8fn._parallel.expert_exchange import exchange_rows, exchange_scaled_rows, plan_exchange
from fp8fn._parallel.expert_gemm import dispatch_grouped_mm, grouped_mm_combine, pack_rows

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from expert_parallel import WireMeter  # noqa: E402

transformers = pytest.importorskip("transformers")


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values on the host (`tolist`, `item`, `bool(...)`) inside,
    by the file that makes them."""

    _READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        super().__init__()
        self.files = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self._READS:
            self.files.append(pathlib.Path(sys._getframe(1).f_code.co_filename).name)
        return func(*args, **(kwargs or {}))

    def by_expert_parallel(self) -> int:
        """The reads made by expert parallel's modules."""
        mine = ("expert_exchange.py", "expert_gemm.py", "expert_parallel.py")
        return sum(f in mine for f in self.files)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_pack_rows_casts_each_row_with_its_experts_scale(dtype):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 24, generator=gen, dtype=torch.float64).float() * 30
    rows[7, 3] = 1e6  # saturates
    ids = torch.sort(torch.randint(0, 5, (40,), generator=gen)).values
    ids[ids == 3] = 2  # expert 3: no row
    scale = torch.rand(5, generator=gen) * 4
    fp8, amax = pack_rows(rows, ids, scale, dtype)
    for e in range(5):
        mine = ids == e
        want = cast_to_fp8(rows[mine], scale[e], dtype)
        assert torch.equal(fp8[mine].view(torch.uint8), want.view(torch.uint8))
        assert amax[e] == (rows[mine].abs().max() if mine.any() else 0.0)


def test_exchange_rows_sends_float8_as_bytes(one_rank_mesh):
    x = cast_to_fp8(torch.randn(6, 4), torch.tensor(10.0), E4M3)
    out = exchange_rows(x, [6], [6], one_rank_mesh.get_group())
    assert out.dtype == E4M3 and torch.equal(out.view(torch.uint8), x.view(torch.uint8))


_FILLED = {
    "first_step": (False,) * 4,
    "histories_filled": (True,) * 4,
    "experts_0_and_2_filled": (True, False, True, False),
    "expert_1_filled": (False, True, False, False),
}


def _fused_and_grouped(group, op, wire, scaled=False):
    """`op` (a fused op) on one rank's group and the grouped op on the same 30 rows of 4
    experts (expert 2 idle; `newest` 0 for the experts off the `wire`): `(ids, meter of the
    fused op's collectives, (out, grad_x, grad_w, obs) fused, the same of the grouped op)`."""
    gen = torch.Generator().manual_seed(1)
    experts = 4
    ids = torch.sort(torch.randint(0, experts, (30,), generator=gen)).values
    ids[ids == 2] = 1  # an idle expert
    x = torch.randn(30, 16, generator=gen).requires_grad_()
    w = torch.randn(experts, 24, 16, generator=gen).requires_grad_()
    newest = torch.rand(experts, 3, generator=gen) * torch.tensor(wire)[:, None]
    newest.requires_grad_()
    stored = torch.rand(experts, 3, generator=gen) * 10
    ex = plan_exchange(ids, experts, group)
    meter = WireMeter()
    with meter:
        out = op(x, w, newest, stored, ex, 0, "emulated", wire, scaled)
    offs = torch.bincount(ids, minlength=experts).cumsum(0).int()
    ref = grouped_mm(x, w, offs, newest, stored, 0, "emulated")
    g = torch.randn(out.shape, generator=gen)
    with meter:
        got = torch.autograd.grad(out, (x, w, newest), g)
    want = torch.autograd.grad(ref, (x, w, newest), g)
    return ids, meter, (out, *got), (ref, *want)


@pytest.mark.parametrize("filled", list(_FILLED))
@pytest.mark.parametrize("op", [dispatch_grouped_mm, grouped_mm_combine])
def test_one_rank_fused_ops_are_the_grouped_op(one_rank_mesh, op, filled):
    """Float8 on the wire for the experts whose histories hold an amax (`filled`), high
    precision for the others (one all-to-all of each kind, two when mixed), the fused op
    gives the grouped op's bits: output, grad_input, grad_weight and observation."""
    wire = _FILLED[filled]
    ids, meter, got, want = _fused_and_grouped(one_rank_mesh.get_group(), op, wire)
    width = 16 if op is dispatch_grouped_mm else 24  # x's rows, or the output gradient's
    float8 = sum(int(ids.eq(e).sum()) for e in range(4) if wire[e]) * width
    high = (30 * width - float8) * 4  # float32
    parts = [n for n in (float8, high) if n]  # float8 rows first, then high precision
    sizes = [n for _, n in meter.calls]  # + dispatch backward (grad_x) or combine forward (y)
    if op is dispatch_grouped_mm:
        assert sizes == [*parts, 30 * 16 * 4], sizes
    else:
        assert sizes == [30 * 24 * 4, *parts], sizes
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[3][2, 0] == 0 and got[3][2, 2] == 0  # the idle expert: input, grad_output


def _row_rounded(rows):
    """Each row of `rows` through e4m3 with the power of two `2**ceil(log2(amax / 448))`
    (a float64 loop of Python scalars: the reference of `float8_wire="all"`'s rows)."""
    out = torch.empty_like(rows)
    for i, row in enumerate(rows.detach().double()):
        amax = float(row.detach().abs().max())
        step = 2.0 ** math.ceil(math.log2(amax / 448)) if amax else 1.0
        out[i] = ((row / step).float().to(E4M3).double() * step).to(rows.dtype)
    return out


def test_exchange_scaled_rows_sends_k_plus_one_bytes(one_rank_mesh):
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(9, 40, generator=gen) * torch.logspace(-30, 30, 9)[:, None]
    rows[4] = 0.0
    meter = WireMeter()
    with meter:
        got = exchange_scaled_rows(rows, [9], [9], one_rank_mesh.get_group())
    assert meter.calls == [("dispatch forward", 9 * 41)]
    assert torch.equal(got, _row_rounded(rows))
    bad = rows.clone()
    bad[1, 3], bad[2, 5] = float("inf"), float("nan")
    got = exchange_scaled_rows(bad, [9], [9], one_rank_mesh.get_group())
    assert got[1, 3] == float("inf") and got[2].isnan().all()  # an overflow stays visible


@pytest.mark.parametrize("op", [dispatch_grouped_mm, grouped_mm_combine])
def test_one_rank_fused_ops_send_scaled_outputs(one_rank_mesh, op):
    """`scaled` (`float8_wire="all"`): the combine's output, or the dispatch's grad_input,
    comes back rounded to e4m3 per row (`_row_rounded` of the grouped op's), K + 1 bytes a
    row; everything else is the grouped op's, bit for bit."""
    group = one_rank_mesh.get_group()
    _, meter, got, want = _fused_and_grouped(group, op, (True,) * 4, scaled=True)
    rounded = 1 if op is dispatch_grouped_mm else 0  # grad_x, or the output
    assert torch.equal(got[rounded], _row_rounded(want[rounded]))
    for n, (a, b) in enumerate(zip(got, want)):
        assert n == rounded or torch.equal(a, b), n
    sizes = [n for _, n in meter.calls]
    assert sizes == ([30 * 16, 30 * 17] if rounded else [30 * 25, 30 * 24]), sizes


def _tiny(implementation="grouped_mm"):
    return build("mixtral", implementation)


def _not_router(name, module):
    return not name.endswith("mlp.gate")


def _step(fn, model, state, ids):
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    observed = fp8fn.observe(state)
    out = fn.apply(params, observed, ids, labels=ids)
    out.loss.backward()
    grads = {
        n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in params.items()
    }
    return out.logits, grads, fp8fn.observations(observed)


@pytest.mark.parametrize("recipe", [fp8fn.DelayedScaling(), fp8fn.CurrentScaling()])
def test_one_rank_expert_parallel_mixtral_is_the_plain_model(one_rank_mesh, recipe):
    """Every expert on the one rank: a training step (the state after one, so the wire is
    float8 under DelayedScaling) gives the bits of the plain model with transformers'
    batched_mm experts (rows grouped in token order), and the plain forward those of the
    plain model; a transform (and state) made before `expert_parallel` runs it. Under
    CurrentScaling the rows travel in float32 (the receiver casts them)."""
    ids = batch()
    ref, model = _tiny("batched_mm"), _tiny()
    plain = ref(ids).logits
    rfn = fp8fn.transform(ref, recipe, filter_fn=_not_router)
    fn = fp8fn.transform(model, recipe, filter_fn=_not_router)  # made before expert_parallel
    made_before = fn.init(ids)
    fp8fn.expert_parallel(model, one_rank_mesh)
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, DTensor)
    assert torch.equal(model(ids).logits, plain)
    state = rfn.init(ids)
    assert fn.init(ids).sites == state.sites == made_before.sites  # rows per global expert
    state = fp8fn.update(state, _step(rfn, ref, state, ids)[2])
    assert state.filled is not None and all(state.filled)
    meter, reads = WireMeter(), HostReads()
    with meter, reads:
        got = _step(fn, model, state, ids)
    want = _step(rfn, ref, state, ids)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[2].amax_history, want[2].amax_history)
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n
    assert reads.by_expert_parallel() == 2  # one per MoE call: the counts (2 layers)
    # a state whose `filled` is not known (`_replace` forgets it): the histories are read
    # with the counts, in the same host read; the same bits
    forgot = state._replace(amax_history=state.amax_history.clone())
    assert forgot.filled is None
    reads = HostReads()
    with reads:
        again = _step(fn, model, forgot, ids)
    assert reads.by_expert_parallel() == 2
    assert torch.equal(again[0], want[0])
    assert torch.equal(again[2].amax_history, want[2].amax_history)
    # a state rebuilt on the warmed state's structure with init's values (`tree_unflatten`
    # with an old structure): its structure says "filled", its histories are empty; it casts
    # as the fresh state does (from the rows themselves), never with the stored scale 1
    fresh = rfn.init(ids)
    pytree = torch.utils._pytree
    leaves = [t.clone() for t in pytree.tree_leaves(fresh)]
    reset = pytree.tree_unflatten(leaves, pytree.tree_structure(state))
    assert reset.filled == state.filled and all(reset.filled)
    got, want = _step(fn, model, reset, ids), _step(rfn, ref, fresh, ids)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[2].amax_history, want[2].amax_history)
    rows_bytes = 2 * ids.numel() * 32  # (token, k) rows x hidden, one layer
    width = 1 if isinstance(recipe, fp8fn.DelayedScaling) else 4
    assert meter.bytes_by()["dispatch forward"] == 2 * width * rows_bytes  # 2 layers
    assert meter.bytes_by()["combine backward"] == 2 * width * rows_bytes
    assert meter.bytes_by()["combine forward"] == 2 * 4 * rows_bytes


def test_one_rank_all_wire_rounds_the_outputs_under_current_scaling(one_rank_mesh):
    """`float8_wire="all"` under CurrentScaling (the dispatch rows in float32, the receiver
    casting them): combine forward and dispatch backward send K + 1 bytes a row; the logits
    are close to, not equal to, those of the float32 outputs on the wire."""
    ids = batch()
    seen = {}
    for wire in (True, "all"):
        model = fp8fn.expert_parallel(_tiny(), one_rank_mesh, float8_wire=wire)
        fn = fp8fn.transform(model, fp8fn.CurrentScaling(), filter_fn=_not_router)
        state, meter = fn.init(ids), WireMeter()
        with meter:
            logits = _step(fn, model, state, ids)[0]
        seen[wire] = logits, meter.bytes_by()
    rows = 2 * 2 * ids.numel()  # (token, k) rows, 2 layers
    assert seen["all"][1]["combine forward"] == seen["all"][1]["dispatch backward"] == rows * 33
    assert seen[True][1]["combine forward"] == seen[True][1]["dispatch backward"] == rows * 128
    assert not torch.equal(seen["all"][0], seen[True][0])
    assert sqnr(seen[True][0], seen["all"][0]) > 20


class Holder(torch.nn.Module):
    """An experts module alone, called as a MoE block calls it."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, top_k_index, top_k_weights):
        return self.experts(x, top_k_index, top_k_weights)


def _experts(kind, seed=0):
    """`Holder` of one of transformers' experts classes in `kind`'s layout (batched_mm), 4
    experts, hidden 32, random weights of `seed`."""
    import types

    from transformers.models.aria.modeling_aria import AriaExperts
    from transformers.models.ergo.modeling_ergo import ErgoExpertProjections
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = types.SimpleNamespace(
        _experts_implementation="batched_mm", hidden_size=32, intermediate_size=48,
        moe_intermediate_size=48, num_experts=4, num_local_experts=4, moe_num_experts=4,
        n_routed_experts=4, moe_latent_size=None, hidden_act="silu", mlp_hidden_act="relu2",
        swiglu_alpha=1.702, swiglu_limit=7.0,
    )  # fmt: skip
    classes = {
        "mixtral": MixtralExperts,
        "aria_transposed": AriaExperts,
        "nemotron_h_no_gate": NemotronHExperts,
        "ergo_no_gate_transposed": ErgoExpertProjections,
        "gpt_oss_biases": GptOssExperts,
    }
    experts = classes[kind](config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return Holder(experts)


@pytest.mark.parametrize(
    "kind, autocast",
    [
        ("aria_transposed", False),
        ("nemotron_h_no_gate", False),
        ("ergo_no_gate_transposed", False),
        ("mixtral", True),
        ("aria_transposed", True),
        ("gpt_oss_biases", False),
        ("gpt_oss_biases", True),
    ],
)
def test_one_rank_expert_parallel_layouts_and_autocast(one_rank_mesh, kind, autocast):
    """Experts stored transposed (`is_transposed`), without a gate (`up_proj`), with biases
    (GPT-OSS: interleaved gate, transposed, a bias per expert and projection), and under
    `torch.autocast` (bfloat16: the rows cast to it before the wire, as the grouped op casts
    `x`): a step of the expert-parallel experts gives the bits of transformers' `batched_mm`
    experts under the same transform (output, both weights' gradients, the input's gradient,
    the observations), on a state whose histories are filled (float8 on the wire)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, 32, generator=gen)
    top_k = torch.randint(0, 4, (24, 2), generator=gen)
    weights = torch.rand(24, 2, generator=gen)
    ref, model = _experts(kind), fp8fn.expert_parallel(_experts(kind), one_rank_mesh)
    rfn = fp8fn.transform(ref, fp8fn.DelayedScaling())
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    g = torch.randn(24, 32, generator=gen)

    def step(fn, module, state):
        params = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
        xs = x.clone().requires_grad_()
        observed = fp8fn.observe(state)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn.apply(params, observed, xs, top_k, weights)
        (out.float() * g).sum().backward()
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params.values()
        ]
        return out, [xs.grad, *grads], fp8fn.observations(observed)

    state = rfn.init(x, top_k, weights)
    assert fn.init(x, top_k, weights).sites == state.sites
    state = fp8fn.update(state, step(rfn, ref, state)[2])
    meter = WireMeter()
    with meter:
        got = step(fn, model, state)
    want = step(rfn, ref, state)
    assert got[0].dtype == want[0].dtype == torch.float32  # (`batched_mm` casts back to x's)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    assert torch.equal(got[2].amax_history, want[2].amax_history)
    assert meter.bytes_by()["dispatch forward"] == 48 * 32  # e4m3: 1 byte an element
    row_bytes = 2 if autocast else 4  # the rows that travel in high precision
    assert meter.bytes_by()["combine forward"] == 48 * 32 * row_bytes
    # a down_proj bias's gradient sums the output gradients in high precision: off the wire
    biased = kind == "gpt_oss_biases"
    assert meter.bytes_by()["combine backward"] == 48 * 32 * (row_bytes if biased else 1)


def test_expert_parallel_refuses_bad_input(one_rank_mesh):
    def refused(model, match, mesh=one_rank_mesh, error=ValueError, **kwargs):
        before = dict(model.named_parameters())
        forwards = [vars(m).get("forward") for m in model.modules()]
        with pytest.raises(error, match=r"^fp8fn\.expert_parallel: expected " + match):
            fp8fn.expert_parallel(model, mesh, **kwargs)
        assert dict(model.named_parameters()) == before
        assert [vars(m).get("forward") for m in model.modules()] == forwards

    refused(torch.nn.Sequential(torch.nn.Linear(4, 4)), "a model with experts modules")
    for wire in ("bf16", 1, None):
        refused(_tiny(), r'`float8_wire` True, False or "all", got ' + repr(wire), float8_wire=wire)
    refused(_tiny(), "`mesh` to be a torch.distributed DeviceMesh", mesh="mesh", error=TypeError)
    twice = fp8fn.expert_parallel(_tiny(), one_rank_mesh)
    refused(twice, "plain experts weights, got 'model.layers.0.mlp.experts.gate_up_proj' already")

    class UserExperts(torch.nn.Module):  # a user experts form: no transformers interface
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8, 8))

    refused(UserExperts(), r"experts modules with transformers 5.x's experts interface")
    llama4 = r"experts modules with .*, got '.*experts' \(Llama4TextExperts\).* every token"
    refused(build("llama4"), llama4)
    from torch.distributed.device_mesh import init_device_mesh

    two_d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    refused(_tiny(), "a 1-D mesh or `mesh_dim`, got a 2-D mesh", mesh=two_d)
    model = fp8fn.expert_parallel(_tiny(), two_d, mesh_dim="ep")
    assert model.model.layers[0].mlp.experts.down_proj.device_mesh.mesh_dim_names == ("ep",)


def test_expert_parallel_refuses_a_finer_recipe_for_the_experts(one_rank_mesh):
    model = fp8fn.expert_parallel(_tiny(), one_rank_mesh)
    fn = fp8fn.transform(model, fp8fn.RowwiseScaling(), filter_fn=_not_router)
    with pytest.raises(ValueError, match=r"^fp8fn\.init: expected the expert-parallel experts"):
        fn.init(batch())


@pytest.mark.slow
def test_compiled_expert_parallel_forward_is_refused(one_rank_mesh):
    """torch.compile(fullgraph=True) of `apply` over expert-parallel experts: fp8fn's error at
    trace time. (Without fullgraph the graph breaks at `apply`'s start, and dynamo, tracing the
    model's frames under fp8fn's mode, fails inside transformers: docs/moe.md.)"""
    model = fp8fn.expert_parallel(_tiny(), one_rank_mesh)
    model.config.use_cache = False  # (with the cache, dynamo fails earlier, in transformers)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(), filter_fn=_not_router)
    ids = batch()
    state = fn.init(ids)
    params = dict(model.named_parameters())
    compiled = torch.compile(fn.apply, fullgraph=True)
    with pytest.raises(Exception, match=r"^fp8fn\.expert_parallel: expected an eager forward"):
        compiled(params, state, ids)


@pytest.mark.parametrize("divisions", [[(None, 2)], [(None, 1), (None, 2)]])
def test_a_forgotten_divide_factor_is_refused_at_the_forward(one_rank_mesh, monkeypatch, divisions):
    """FSDP2's default division (None) over more than one data-parallel rank, with more than
    one expert-parallel rank (faked here: the ranks' run is `ep_x_dp_without_divide_factor`),
    raises at the experts' forward; a factor set, or one data-parallel rank, passes."""
    from fp8fn._transform import expert_parallel as ep

    model = fp8fn.expert_parallel(_tiny(), one_rank_mesh)
    forward = model.model.layers[0].mlp.experts.forward

    class TwoRanks:  # the expert-parallel group, as two ranks
        def size(self):
            return 2

    monkeypatch.setattr(forward, "group", TwoRanks())
    for fine in ([], [(8.0, 2)], [(None, 1)]):
        monkeypatch.setattr(ep, "fsdp_gradient_divisions", lambda *a, found=fine: found)
        forward.divisions_checked.clear()
        forward._check_gradient_division()
    monkeypatch.setattr(ep, "fsdp_gradient_divisions", lambda *a: divisions)
    forward.divisions_checked.clear()
    match = (
        r"^fp8fn\.expert_parallel: expected the FSDP2 parameter group holding "
        r"'model\.layers\.0\.mlp\.experts'.* by its data-parallel size 2 alone.* 2 times too large"
    )
    with pytest.raises(ValueError, match=match):
        forward._check_gradient_division()
