"""fp8fn's CUDA path, run on CPU under torch's CUDA rules (`fp8fn.testing.cuda_path_on_cpu`):
every float8 GEMM call that fp8fn makes, for every recipe, backend and route, dense and
grouped, forward and backward, bf16 and fp32, aligned and unaligned shapes, passes the rules of
sm_90 and of sm_100 (and the refusals below sm_89 are fp8fn's own). Nothing here has run on a
GPU: the rules are torch's meta kernels plus the CUDA kernels' checks they leave out."""

import collections
import contextlib
import warnings

import pytest
import torch
from _helpers import CountHostReads, sqnr
from torch._subclasses import FakeTensorMode

import fp8fn
from fp8fn._ops.grouped import grouped_mm
from fp8fn._torch_private import bind_op_arguments
from fp8fn.testing import cuda_path_on_cpu

CAPS = [(9, 0), (10, 0)]
RECIPES = {
    "delayed": fp8fn.DelayedScaling(),
    "delayed-scaled_mm": fp8fn.DelayedScaling(backend="scaled_mm"),
    "delayed-triton": fp8fn.DelayedScaling(backend="triton"),
    "current": fp8fn.CurrentScaling(),
    "current-triton": fp8fn.CurrentScaling(backend="triton"),
    "rowwise-scaled_mm": fp8fn.RowwiseScaling(backend="scaled_mm"),
    "rowwise_gw_hp-scaled_mm": fp8fn.RowwiseScaling(backend="scaled_mm", hp_grad_weight=True),
    "rowwise": fp8fn.RowwiseScaling(),
    "blockwise": fp8fn.BlockwiseScaling(),
    "mx": fp8fn.MXScaling(),
    "nvfp4": fp8fn.NVFP4Scaling(),
}
# float8 GEMM calls per forward + backward: the finer recipes other than rowwise emulate theirs
GEMMS = {"rowwise_gw_hp-scaled_mm": 2, "rowwise": 0, "blockwise": 0, "mx": 0, "nvfp4": 0}
GEMM_RECIPES = ("delayed", "current", "rowwise-scaled_mm")
SHAPES = [(t, k, n) for t in (37, 64) for k in (100, 256) for n in (50, 512)]


def _quick_if(quick: bool, *values):
    """A parameter set, in the slow tier unless `quick` (the quick tier keeps one of each kind:
    sm_100 differs from sm_90 only in the grouped forward, which the quick grouped tests cover;
    transformers' MoE models are all slow: the grouped op's tests cover their layouts)."""
    return pytest.param(*values, marks=() if quick else pytest.mark.slow)


def _site_state(recipe):
    if isinstance(recipe, fp8fn.DelayedScaling):
        return fp8fn.init_state(recipe, ["fc"])["fc"]
    if isinstance(recipe, fp8fn.NVFP4Scaling):
        return (torch.tensor(0.0, dtype=torch.float64), "fc")
    return None


def _dense(recipe, route, capability, shape=(37, 100, 50), dtype=torch.bfloat16, bias=True):
    """Output and gradients of one `fp8fn.linear` by `route`, under the CUDA path of
    `capability`; the contract's calls."""
    t, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen).to(dtype) for s in ((t, k), (n, k), (n,)))
    b = b if bias else None
    state = _site_state(recipe)

    def f(x, w, b):
        return fp8fn.linear(x, w, b, state, recipe).float().square().sum()

    with cuda_path_on_cpu(capability) as contract:
        if route == "func":
            out = torch.func.grad_and_value(f, argnums=(0, 1))(x, w, b)
        elif route == "value_and_grad":
            out = fp8fn.value_and_grad(f, argnums=(0, 1))(x, w, b)
        else:
            leaves = [v.requires_grad_() for v in (x, w)]
            loss = f(*leaves, b)
            loss.backward()
            out = (loss, [v.grad for v in leaves])
    return out, contract.calls


@pytest.mark.parametrize(
    "name, route, capability",
    [
        _quick_if(cap == (9, 0) and ("triton" not in name or route == "func"), name, route, cap)
        for name in RECIPES
        for route in ("func", "autograd", "value_and_grad")
        for cap in CAPS
    ],
    ids=str,
)
def test_dense_every_recipe_backend_and_route_passes_the_cuda_rules(name, route, capability):
    _, calls = _dense(RECIPES[name], route, capability)
    assert len(calls) == GEMMS.get(name, 3)


@pytest.mark.parametrize(
    "shape, dtype, capability",
    [
        _quick_if(cap == (9, 0), shape, dtype, cap)
        for shape in SHAPES
        for dtype in (torch.bfloat16, torch.float32)
        for cap in CAPS
    ],
    ids=str,
)
def test_dense_aligned_and_unaligned_shapes_pass_the_cuda_rules(shape, dtype, capability):
    for name in GEMM_RECIPES:
        (loss, grads), calls = _dense(RECIPES[name], "autograd", capability, shape, dtype)
        assert len(calls) == 3 and loss.isfinite() and all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("capability", CAPS, ids=str)
@pytest.mark.parametrize("shape", [(4095, 4112, 11008), (4096, 4100, 11000)], ids=str)
def test_dense_large_shapes_pass_the_cuda_rules_under_fake_tensors(shape, capability):
    t, k, n = shape
    for name in GEMM_RECIPES:
        recipe, state = RECIPES[name], _site_state(RECIPES[name])
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(t, k, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(n, k, dtype=torch.bfloat16, requires_grad=True)
            with warnings.catch_warnings(), cuda_path_on_cpu(capability) as contract:
                warnings.simplefilter("ignore")  # (a FakeTensor's data_ptr, read by the state)
                y = fp8fn.linear(x, w, None, state, recipe)
                y.sum().backward()
        assert y.shape == (t, n) and len(contract.calls) == 3


@pytest.mark.parametrize("name", ["delayed-scaled_mm", "current-triton", "rowwise-scaled_mm"])
def test_float8_backends_are_refused_below_sm_89_naming_recipe_and_device(name):
    recipe = RECIPES[name]
    match = rf"fp8fn.linear: {type(recipe).__name__}\(.*backend='(scaled_mm|triton)'.*\) needs a "
    match += r"CUDA device of compute capability >= 8.9.*got cpu \(standing in for sm_80\)"
    with pytest.raises(ValueError, match=match):
        _dense(recipe, "autograd", (8, 0))
    (_, _), calls = _dense(RECIPES["delayed"], "autograd", (8, 0))  # "auto": emulated there
    assert calls == []


# -- grouped --------------------------------------------------------------------------------


def _grouped(recipe, capability, layout, dtype=torch.bfloat16, k=256, n=512, backend=None):
    """Output and gradients of the grouped op over 4 experts, one of them empty, 7 tail rows,
    with the weight stored `(E, N, K)` or `(E, K, N)` (then reached through a transpose, as
    Llama 4's bmm and transformers' batched_mm do). `capability` None: the CPU's own path."""
    gen = torch.Generator().manual_seed(0)
    experts, tokens = 4, 64
    x = torch.randn(tokens, k, generator=gen).to(dtype).requires_grad_()
    stored = torch.randn((experts, n, k) if layout == "ENK" else (experts, k, n), generator=gen)
    w = stored.to(dtype).requires_grad_()
    offs = torch.tensor([20, 20, 41, 57], dtype=torch.int32)  # expert 1 empty, 57.. tail rows
    newest = stored_scales = None
    if isinstance(recipe, fp8fn.DelayedScaling):
        newest, stored_scales = torch.zeros(experts, 3), torch.ones(experts, 3)
    if backend is None:
        backend = recipe.backend if recipe.backend != "auto" else "scaled_mm"
    weight = w if layout == "ENK" else w.transpose(-2, -1)
    fake = capability is None
    with cuda_path_on_cpu(capability or (9, 0)) if not fake else _nothing() as contract:
        out = grouped_mm(x, weight, offs, newest, stored_scales, 0, backend, recipe)
        out.float().square().sum().backward()
    return out, (x.grad, w.grad), contract


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


GROUPED = {
    "delayed": fp8fn.DelayedScaling(backend="scaled_mm"),
    "current": fp8fn.CurrentScaling(backend="scaled_mm"),
    "rowwise": fp8fn.RowwiseScaling(backend="scaled_mm"),
    "mx": fp8fn.MXScaling(),
}


@pytest.mark.parametrize("capability", CAPS, ids=str)
@pytest.mark.parametrize("layout", ["ENK", "EKN"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", GROUPED)
def test_grouped_passes_the_cuda_rules_with_either_weight_layout(name, dtype, layout, capability):
    recipe = GROUPED[name]
    out, grads, contract = _grouped(recipe, capability, layout, dtype)
    ops = collections.Counter(op for op, _ in contract.calls)
    one_call = capability == (9, 0) and dtype == torch.bfloat16 and name in ("delayed", "current")
    if name == "mx":
        assert ops == {}
    elif name == "rowwise":  # 3 experts with tokens, 3 GEMMs each
        assert ops == {"_scaled_mm": 9}
    else:  # the backward: one bfloat16 grouped GEMM per gradient (e5m2 operands, widened)
        forward = {"_scaled_grouped_mm": 1} if one_call else {"_scaled_mm": 3}
        assert ops == {**forward, "_grouped_mm": 2} and not contract.host_loops
    assert torch.equal(out[57:], torch.zeros_like(out[57:]))  # tail rows 0, not unwritten
    assert grads[0][57:].abs().sum() == 0 and grads[1][1].abs().sum() == 0  # no token, no grad
    ref_out, ref_grads, _ = _grouped(recipe, None, layout, dtype, backend="emulated")
    assert sqnr(ref_out[:57], out[:57]) > 40 and all(
        sqnr(r, g) > 40 for r, g in zip(ref_grads, grads)
    )


@pytest.mark.parametrize("capability", CAPS, ids=str)
@pytest.mark.parametrize("k, n", [(100, 50), (256, 50), (100, 512)], ids=str)
def test_grouped_unaligned_dims_take_the_per_group_path(k, n, capability):
    for name in ("delayed", "rowwise"):
        out, grads, contract = _grouped(GROUPED[name], capability, "EKN", k=k, n=n)
        assert {op for op, _ in contract.calls} == {"_scaled_mm"}


def _grouped_step(capability, dtype, k=64, n=96, backend="scaled_mm"):
    """The delayed grouped op's output, gradients and observation (4 experts, expert 1 empty,
    7 tail rows), and the host reads of its backward; `capability` None: the CPU's own path."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, k, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(4, n, k, generator=gen).to(dtype).requires_grad_()
    g = (torch.randn(64, n, generator=gen) * torch.rand(64, 1, generator=gen).exp()).to(dtype)
    offs = torch.tensor([20, 20, 41, 57], dtype=torch.int32)
    newest, stored = torch.zeros(4, 3, requires_grad=True), torch.ones(4, 3)
    path = contextlib.nullcontext() if capability is None else cuda_path_on_cpu(capability)
    with path:
        out = grouped_mm(x, w, offs, newest, stored, 0, backend)
        with CountHostReads() as host:
            out.backward(g)
    return out, (x.grad, w.grad), newest.grad, host.reads


@pytest.mark.parametrize("capability", CAPS, ids=str)
def test_grouped_backward_reads_nothing_on_the_host_on_sm_90_and_sm_100(capability):
    """On sm_90 and sm_100 the grouped backward's GEMMs are one `F.grouped_mm` call each, the
    offsets read on the device: 0 host reads (a device sync each on a GPU). The CPU's own
    path (per-group GEMMs) reads the offsets twice, and so does the CUDA path where N or K is
    not a multiple of 8 (`F.grouped_mm` wants 16-byte rows)."""
    assert _grouped_step(capability, torch.bfloat16)[3] == []
    assert _grouped_step(capability, torch.float32)[3] == []
    assert _grouped_step(capability, torch.bfloat16, k=36)[3] == ["tolist"] * 2
    assert _grouped_step(None, torch.bfloat16, backend="emulated")[3] == ["tolist"] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("capability", CAPS, ids=str)
def test_grouped_backward_on_the_device_is_the_per_group_one_but_one_bfloat16_rounding(
    capability, dtype
):
    """The device backward widens the float8 operands to bfloat16 (exact) and rounds each
    group's unscaled product to bfloat16 before its scale: against the CPU's path (bit for bit
    the dense op per expert, test_grouped_exact.py), each gradient element is within that
    rounding (2**-8 relative, and one more rounding of a bfloat16 gradient), the observation
    is the same bits, and the tail rows and the empty expert get exact zeros."""
    out, grads, obs, _ = _grouped_step(capability, dtype)
    ref_out, ref_grads, ref_obs, _ = _grouped_step(None, dtype, backend="emulated")
    assert torch.equal(obs, ref_obs)
    assert torch.equal(grads[0][57:], torch.zeros_like(grads[0][57:]))
    assert torch.equal(grads[1][1], torch.zeros_like(grads[1][1]))
    rel = 2.0**-8 if dtype == torch.float32 else 2.0**-6
    for got, want in zip(grads, ref_grads):
        got, want = got.double(), want.double()
        bound = rel * want.abs() + 2.0**-20 * want.abs().max()
        assert ((got - want).abs() <= bound).all()
        assert not torch.equal(got, want)  # (the rounding is there: this test can tell)


@pytest.mark.slow
def test_the_device_grouped_backward_compiles_fullgraph_to_the_eager_bits():
    """Compiled (fullgraph, the CPU standing in for sm_100: no dispatch mode, which
    torch.compile refuses), the grouped backward's `F.grouped_mm` calls trace without a graph
    break and give eager's bits (~50 s)."""
    from fp8fn._core.device import cpu_as_cuda

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=gen, requires_grad=True)
    w = torch.randn(4, 48, 64, generator=gen, requires_grad=True)
    g = torch.randn(37, 48, generator=gen)
    offs = torch.tensor([10, 10, 25, 33], dtype=torch.int32)

    def step(x, w, offs):
        return grouped_mm(x, w, offs, None, None, 0, "scaled_mm")

    grads = []
    with cpu_as_cuda((10, 0)):
        for fn in (step, torch.compile(step, fullgraph=True)):
            x.grad = w.grad = None
            fn(x, w, offs).backward(g)
            grads.append((x.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize(
    "arch, implementation, capability",
    [
        pytest.param(arch, implementation, cap, marks=pytest.mark.slow)  # (the models: ~5 s)
        for arch, implementation in (
            ("llama4", "grouped_mm"),
            ("gpt_oss", "grouped_mm"),
            ("gpt_oss", "batched_mm"),
            ("mixtral", "eager"),
        )
        for cap in CAPS
    ],
    ids=str,
)
def test_moe_models_in_bfloat16_pass_the_cuda_rules(arch, implementation, capability):
    """transformers' experts through fp8fn.transform (torch.func route): Llama 4's bmm and
    GPT-OSS's batched_mm reach `(E, K, N)` weights through a transpose."""
    import _moe_models

    model = _moe_models.build(arch, implementation).to(torch.bfloat16)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    with warnings.catch_warnings(), cuda_path_on_cpu(capability) as contract:
        warnings.simplefilter("ignore")  # (the routers stay in high precision)
        losses = _moe_models.train(model, steps=2, fn=fn)[0]
    ops = collections.Counter(op for op, _ in contract.calls)
    assert ops["_scaled_mm"] > 0 and all(torch.tensor(losses).isfinite())
    grouped_forward = implementation != "eager" and capability == (9, 0)
    assert (ops["_scaled_grouped_mm"] > 0) == grouped_forward


# -- the native row-wise GEMM ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_native_rowwise_gemm_agrees_with_the_unit_scale_reference(dtype):
    """On the CUDA path, rowwise's `"scaled_mm"` is torch's row-wise scaled GEMM (scales in its
    epilogue); the CPU's own path keeps the unit-scale GEMM then the power-of-two scales. Both
    are the same products up to the GEMM's accumulation order: within 2 ulps of the output
    dtype relative to the row's magnitude (measured on CPU: bit-identical)."""
    recipe = RECIPES["rowwise-scaled_mm"]
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen).to(dtype) for s in ((64, 256), (512, 256), (512,)))
    cpu = fp8fn.linear(x, w, b, None, recipe)
    with cuda_path_on_cpu((9, 0)) as contract:
        cuda = fp8fn.linear(x, w, b, None, recipe)
    assert [op for op, _ in contract.calls] == ["_scaled_mm"]
    eps = torch.finfo(dtype).eps
    scale = cpu.float().abs().amax(1, keepdim=True)
    assert ((cuda.float() - cpu.float()).abs() <= 2 * eps * scale).all()


# -- fast accumulation ---------------------------------------------------------------------------


class _FastAccum(torch.utils._python_dispatch.TorchDispatchMode):
    """The `use_fast_accum` of each float8 GEMM call, in order."""

    def __init__(self):
        super().__init__()
        self.flags = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            bound = bind_op_arguments(func, args, kwargs or {})
            self.flags.append(bound["use_fast_accum"])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cls", [fp8fn.DelayedScaling, fp8fn.CurrentScaling, fp8fn.RowwiseScaling])
def test_fast_accum_is_torchaos_by_default_and_the_recipes_choice(cls):
    """On the output GEMM only, by default (torchao's); `fast_accum` chooses per GEMM."""
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    for fast_accum in (None, (False, True, True)):
        fields = {} if fast_accum is None else {"fast_accum": fast_accum}
        recipe = cls(backend="scaled_mm", **fields)
        with cuda_path_on_cpu((9, 0)), _FastAccum() as spy:
            fp8fn.linear(x, w, None, _site_state(recipe), recipe).sum().backward()
        assert spy.flags == ([True, False, False] if fast_accum is None else [False, True, True])


def test_fast_accum_must_be_three_bools():
    with pytest.raises(TypeError, match=r"fp8fn.CurrentScaling: expected `fast_accum` a tuple"):
        fp8fn.CurrentScaling(fast_accum=True)


class _GemmShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """The `(mat_a, mat_b)` shapes of each float8 GEMM call, in order."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def test_only_k_and_n_are_padded_to_16_not_the_tokens():
    """37 tokens, K 100, N 50: the output GEMM's M stays 37 (no copy of x for it); K -> 112 and
    N -> 64. The weight gradient's contraction dim is the tokens: 37 -> 48 there."""
    recipe = fp8fn.CurrentScaling()
    x = torch.randn(37, 100, requires_grad=True)
    w = torch.randn(50, 100, requires_grad=True)
    with cuda_path_on_cpu((9, 0)), _GemmShapes() as spy:
        fp8fn.linear(x, w, None, None, recipe).sum().backward()
    # output x @ w.T; grad_input g @ w; grad_weight g.T @ x
    assert spy.shapes == [((37, 112), (112, 64)), ((37, 64), (64, 112)), ((50, 48), (48, 112))]


# -- coverage ----------------------------------------------------------------------------------

_GEMM_NAMES = {
    "fp8_mm",
    "scaled_mm",
    "torch_scaled_mm",
    "_rowwise_mm",
    "scaled_grouped_mm",
    "grouped_mm",  # F.grouped_mm: the grouped backward's GEMMs on sm_90 and sm_100
}
# The calls that are not on the CUDA path: rowwise's unit-scale GEMM, the CPU's reference.
_CPU_ONLY = {"_ops/rowwise_blockwise_mx.py:scaled_mm(a_fp8, b_fp8, one, one, torch.float32)"}


def _gemm_call_sites():
    """`{"path:call source": (path, first line, last line)}` of every call in fp8fn/_ops of a
    function that reaches a float8 GEMM."""
    import ast
    import pathlib

    ops = pathlib.Path(fp8fn.__file__).parent / "_ops"
    sites = {}
    for path in sorted(ops.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name in _GEMM_NAMES:
                    where = f"_ops/{path.name}"
                    sites[f"{where}:{ast.unparse(node)}"] = (where, node.lineno, node.end_lineno)
    return sites


def test_every_float8_gemm_call_site_of_fp8fn_is_checked():
    """Each line of fp8fn/_ops that calls into a float8 GEMM is reached, on the CUDA path of
    sm_90 or sm_100, by a call the contract checked (a new call site fails here until a test
    reaches it): 14 call sites (and the CPU-only unit-scale one). The whole file reaches them
    through 22 distinct call chains, ~2000 checked GEMM calls."""
    reached = set()
    for capability in CAPS:  # (sm_90 alone reaches the one-call grouped forward)
        for name in ("delayed", "rowwise-scaled_mm", "rowwise_gw_hp-scaled_mm"):
            reached |= {
                s for _, chain in _dense(RECIPES[name], "autograd", capability)[1] for s in chain
            }
        for name, k in (("delayed", 256), ("delayed", 100), ("rowwise", 256)):
            # (K 100: the per-group backward of dims that are not multiples of 8)
            contract = _grouped(GROUPED[name], capability, "EKN", k=k)[2]
            reached |= {s for _, chain in contract.calls for s in chain}
    frames = {(s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1])) for s in reached}
    sites = _gemm_call_sites()
    missed = [
        key
        for key, (path, first, last) in sites.items()
        if key not in _CPU_ONLY
        and not any(p == path and first <= line <= last for p, line in frames)
    ]
    assert missed == [] and len(sites) == 15, (missed, sorted(sites))


@pytest.mark.slow
def test_a_transforms_layers_and_experts_on_sm_80_refuse_scaled_mm_naming_apply():
    import _moe_models

    model = _moe_models.build("gpt_oss", "grouped_mm")
    recipe = fp8fn.CurrentScaling(backend="scaled_mm")
    ids = _moe_models.batch()
    params = dict(model.named_parameters())
    sm_80 = r"CurrentScaling\(backend='scaled_mm'.*got cpu \(standing in for sm_80\)"
    for chosen, where in ((None, "layer 'model.layers.0.self_attn.q_proj': "), ("experts", "")):
        fn = fp8fn.transform(model, lambda n, m: recipe if chosen is None or chosen in n else None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the routers stay in high precision)
            state = fn.init(ids)
            with (
                cuda_path_on_cpu((8, 0)),
                pytest.raises(ValueError, match=rf"^fp8fn.apply: {where}{sm_80}"),
            ):
                fn.apply(params, state, ids)
