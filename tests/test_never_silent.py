"""Never silently wrong: tied layers, changes after `transform`, computed weights, the forms of
a linear call, the module used around `apply`, and errors that name the real cause.

Each case was silently wrong (or raised a misleading error) in fp8fn 0.3. Each test compares
`apply` with `fp8fn.linear` on the same operands (the primitive, tested against a float64
reference in test_reference.py), or with a transform made after the change, bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from _helpers import CURRENT_AUTO, DELAYED_AUTO, assert_bit_identical
from _models import _seeded
from torch import nn
from torch.overrides import TorchFunctionMode

import fp8fn


def _grads(f, *args):
    """`torch.func.grad_and_value(f, argnums=(0, 1))(*args)`: ((param grads, obs), value)."""
    return torch.func.grad_and_value(f, argnums=(0, 1))(*args)


def _warmed(model, *shape, **transform_kwargs):
    """`(fn, x, params, state)`: `model`'s transform, a random input of `shape` (seed 1), the
    module's own parameters and a state warmed on `x`."""
    fn = fp8fn.transform(model, DELAYED_AUTO, **transform_kwargs)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    params = dict(model.named_parameters())
    return fn, x, params, _warm(fn, params, x)


def _warm(fn, params, x):
    """A state of `fn` updated once on `x` (so every scale is a stored one, not current)."""
    state = fn.init(x)
    obs = torch.func.grad(lambda p, s: fn.apply(p, s, x).square().sum(), argnums=1)(params, state)
    return fp8fn.update(state, obs)


# -- tied layers: each runs with its own site and recipe ----------------------------------------


class _TiedPair(nn.Module):
    """`b(relu(a(x)))` with `b.weight is a.weight`, no biases (nothing else tells them apart)."""

    def __init__(self, d: int = 16):
        super().__init__()
        with _seeded(0):
            self.a = nn.Linear(d, d, bias=False)
            self.b = nn.Linear(d, d, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def _tied_reference(recipe_b):
    """`fp8fn.linear` by hand: `a` delayed at site `a`, `b` with `recipe_b` (None: high
    precision; delayed: site `b`)."""

    def f(params, state, x):
        w = params["a.weight"]
        h = F.relu(fp8fn.linear(x, w, None, state["a"], DELAYED_AUTO))
        if recipe_b is None:
            return F.linear(h, w)
        site = state["b"] if isinstance(recipe_b, fp8fn.DelayedScaling) else None
        return fp8fn.linear(h, w, None, site, recipe_b)

    return f


@pytest.mark.parametrize(
    "how",
    ["filter_fn leaves b out", "recipe None for b", "recipe Current for b", "both delayed"],
)
def test_a_tied_layer_runs_with_its_own_choice(how):
    model = _TiedPair()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    recipe_b = {"recipe Current for b": CURRENT_AUTO, "both delayed": DELAYED_AUTO}.get(how)
    if how == "filter_fn leaves b out":
        fn = fp8fn.transform(model, DELAYED_AUTO, filter_fn=lambda name, m: name == "a")
    else:
        fn = fp8fn.transform(model, lambda name, m: DELAYED_AUTO if name == "a" else recipe_b)
    params = dict(model.named_parameters())
    state = _warm(fn, params, x)
    sites = ["a", "b"] if recipe_b is DELAYED_AUTO else ["a"]  # never `a#1`: b is not a's call
    assert list(state) == sites
    want_state = fp8fn.init_state(DELAYED_AUTO, sites)._replace(
        amax_history=state.amax_history, scale=state.scale
    )
    ref = _tied_reference(recipe_b)

    def loss(f):
        return lambda p, s: f(p, s, x).square().sum()

    got = _grads(loss(fn.apply), params, state)
    want = _grads(loss(ref), params, want_state)
    assert_bit_identical(got[1], want[1])
    assert_bit_identical(got[0][0], want[0][0])
    assert torch.equal(got[0][1].amax_history, want[0][1].amax_history)


def test_a_head_tied_to_a_converted_layer_kept_in_high_precision_is():
    """The README's advice (the head in high precision) for a head tied to a converted layer;
    and a raw `F.linear` on the tied tensor outside the layers is not converted either."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            with _seeded(2):
                self.proj = nn.Linear(16, 16, bias=False)
                self.head = nn.Linear(16, 16, bias=False)
            self.head.weight = self.proj.weight

        def forward(self, x):
            h = torch.tanh(self.proj(x))
            return self.head(h) + F.linear(h, self.head.weight)  # the head, and by hand

    model = Model()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    fn = fp8fn.transform(model, DELAYED_AUTO, filter_fn=lambda name, m: name != "head")
    params = dict(model.named_parameters())
    state = _warm(fn, params, x)
    w = params["proj.weight"]
    h = torch.tanh(fp8fn.linear(x, w, None, state["proj"], DELAYED_AUTO))
    assert_bit_identical(fn.apply(params, state, x), F.linear(h, w) + F.linear(h, w))


class _TiedAcrossABlock(nn.Module):
    """`out(relu(blk(x)))`, `blk` = `b(tanh(a(x)))`: `a`, `b` and `out` share one weight."""

    def __init__(self):
        super().__init__()
        with _seeded(13):
            self.blk = _TiedPair()
            self.out = nn.Linear(16, 16, bias=False)
        self.out.weight = self.blk.a.weight

    def forward(self, x):
        return self.out(torch.relu(self.blk(x)))


@pytest.mark.parametrize("route", ["func", "autograd"])
@pytest.mark.parametrize("b_recipe", [DELAYED_AUTO, None], ids=["b delayed", "b high precision"])
def test_tied_layers_in_a_checkpointed_block_recompute_bit_for_bit(b_recipe, route):
    model = _TiedAcrossABlock()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(14))

    def recipe(name, m):
        return b_recipe if name == "blk.b" else DELAYED_AUTO

    plain = fp8fn.transform(model, recipe)
    recomputed = fp8fn.transform(model, recipe, checkpoint_fn=lambda name, m: name == "blk")
    params = dict(model.named_parameters())
    state = _warm(plain, params, x)
    assert list(state) == (["blk.a", "blk.b", "out"] if b_recipe else ["blk.a", "out"])

    def run(fn):
        if route == "func":
            return _grads(lambda p, s: fn.apply(p, s, x).square().sum(), params, state)[0]
        model.zero_grad(set_to_none=True)
        observed = fp8fn.observe(state)
        fn.apply(params, observed, x).square().sum().backward()
        return {k: v.grad for k, v in params.items()}, fp8fn.observations(observed)

    assert_bit_identical(run(recomputed), run(plain))


# -- changes after transform --------------------------------------------------------------------


def _mlp(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_a_layer_replaced_after_transform_runs_in_fp8_with_frozen_params_left_out():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    state = _warm(fn, dict(model.named_parameters()), x)
    model[2] = _mlp(1)[2]  # replaced: the new layer must run in fp8 too
    trainable = {k: v for k, v in model.named_parameters() if k.startswith("0.")}

    def loss(f):
        return lambda p, s: f(p, s, x).square().sum()

    got = _grads(loss(fn.apply), trainable, state)
    assert_bit_identical(
        got, _grads(loss(fp8fn.transform(model, DELAYED_AUTO).apply), trainable, state)
    )
    hidden = F.relu(fp8fn.linear(x, model[0].weight, model[0].bias, state["0"], DELAYED_AUTO))
    want = fp8fn.linear(hidden, model[2].weight, model[2].bias, state["2"], DELAYED_AUTO)
    assert_bit_identical(fn.apply(trainable, state, x), want)


class _EmbedHead(nn.Module):
    """`head(relu(mid(emb(ids))))`; the head is tied to the embedding only after transform."""

    def __init__(self):
        super().__init__()
        with _seeded(4):
            self.emb = nn.Embedding(16, 16)
            self.mid = nn.Linear(16, 16)
            self.head = nn.Linear(16, 16, bias=False)

    def forward(self, ids):
        return self.head(F.relu(self.mid(self.emb(ids))))


def test_weights_tied_after_transform_get_both_gradients_under_torch_func():
    model = _EmbedHead()
    ids = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(5))
    fn = fp8fn.transform(model, DELAYED_AUTO)
    state = _warm(fn, dict(model.named_parameters()), ids)
    model.head.weight = model.emb.weight  # what HF's tie_weights does
    params = dict(model.named_parameters())
    assert "head.weight" not in params

    def ref(p, s):
        e = p["emb.weight"]
        h = F.relu(
            fp8fn.linear(
                F.embedding(ids, e), p["mid.weight"], p["mid.bias"], s["mid"], DELAYED_AUTO
            )
        )
        return fp8fn.linear(h, e, None, s["head"], DELAYED_AUTO).square().sum()

    got = _grads(lambda p, s: fn.apply(p, s, ids).square().sum(), params, state)
    assert_bit_identical(got, _grads(ref, params, state))


def test_a_change_that_removes_a_site_is_refused_clearly():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16)
    state = fn.init(x)
    model[2] = nn.Identity()
    model[1] = nn.Linear(32, 16)
    with pytest.raises(
        ValueError,
        match=r"fp8fn\.apply: `state` does not belong.*missing sites \['1'\], unknown sites "
        r"\['2'\]",
    ):
        fn.apply(dict(model.named_parameters()), state, x)
    assert fn.layers == ["0", "1"]  # re-read: as a transform made now


@pytest.mark.slow  # torch.compile
def test_a_compiled_apply_follows_a_replaced_layer_and_a_tie():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED_AUTO)
    compiled = torch.compile(fn.apply, fullgraph=True)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    state = _warm(fn, dict(model.named_parameters()), x)
    trainable = {k: v for k, v in model.named_parameters() if k.startswith("0.")}
    compiled(trainable, state, x)
    model[2] = _mlp(1)[2]
    fresh = torch.compile(fp8fn.transform(model, DELAYED_AUTO).apply, fullgraph=True)
    assert_bit_identical(compiled(trainable, state, x), fresh(trainable, state, x))

    tied = _EmbedHead()
    ids = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(5))
    fn = fp8fn.transform(tied, DELAYED_AUTO)
    compiled = torch.compile(fn.apply, fullgraph=True)
    state = _warm(fn, dict(tied.named_parameters()), ids)
    compiled(dict(tied.named_parameters()), state, ids)
    tied.head.weight = tied.emb.weight
    fresh = torch.compile(fp8fn.transform(tied, DELAYED_AUTO).apply, fullgraph=True)

    def grads(apply):
        params = {k: v.detach().requires_grad_() for k, v in tied.named_parameters()}
        observed = fp8fn.observe(state)
        apply(params, observed, ids).square().sum().backward()
        return {k: v.grad for k, v in params.items()}, fp8fn.observations(observed)

    assert_bit_identical(grads(compiled), grads(fresh))


# -- weights made at each call ------------------------------------------------------------------


class _Double(nn.Module):
    def forward(self, t):
        return t * 2


def _pruned(attr):
    import torch.nn.utils.prune as prune

    return lambda m: prune.l1_unstructured(m, attr, amount=0.3)


COMPUTED = {
    "prune weight": _pruned("weight"),
    "prune bias": _pruned("bias"),
    "weight_norm (hooks)": lambda m: torch.nn.utils.weight_norm(m),
    "spectral_norm (hooks)": lambda m: torch.nn.utils.spectral_norm(m),
    "parametrized weight": lambda m: torch.nn.utils.parametrizations.weight_norm(m),
    "parametrized bias": lambda m: torch.nn.utils.parametrize.register_parametrization(
        m, "bias", _Double()
    ),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the legacy weight_norm
@pytest.mark.parametrize("make", list(COMPUTED))
def test_a_weight_made_at_each_call_is_refused_naming_filter_fn(make):
    model = _mlp().eval()  # (spectral_norm's power iteration runs in train mode only)
    COMPUTED[make](model[0])
    attr = "bias" if "bias" in make else "weight"
    with pytest.raises(
        TypeError,
        match=rf"fp8fn\.transform: layer '0' has its {attr} (parametrized|made by a forward).*"
        r"`filter_fn=lambda name, module: name != '0'`",
    ):
        fp8fn.transform(model, DELAYED_AUTO)
    fn = fp8fn.transform(model, DELAYED_AUTO, filter_fn=lambda name, module: name != "0")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    params = dict(model.named_parameters())
    state = _warm(fn, params, x)
    with torch.no_grad():
        hidden = F.relu(model[0](x))  # as the module computes its weight
    want = fp8fn.linear(hidden, params["2.weight"], params["2.bias"], state["2"], DELAYED_AUTO)
    with torch.no_grad():
        assert_bit_identical(fn.apply(params, state, x), want)


ATTENTION_COMPUTED = {
    "in_proj parametrized": ("in_proj", "in_proj_weight", False),
    "in_proj pruned": ("in_proj", "in_proj_weight", True),
    "q_proj parametrized": ("q_proj", "q_proj_weight", False),
    "out_proj pruned": ("out_proj", "weight", True),
}


@pytest.mark.parametrize("case", list(ATTENTION_COMPUTED))
def test_attention_projections_made_at_each_call_are_refused(case):
    import torch.nn.utils.prune as prune

    path, attr, pruned = ATTENTION_COMPUTED[case]
    split = path == "q_proj"  # kdim != embed_dim: separate q, k, v weights
    attention = nn.MultiheadAttention(16, 2, kdim=8 if split else None, vdim=8 if split else None)
    holder = attention.out_proj if path == "out_proj" else attention
    if pruned:
        prune.l1_unstructured(holder, attr, amount=0.3)
    else:
        torch.nn.utils.parametrize.register_parametrization(holder, attr, _Double())
    with pytest.raises(TypeError, match=rf"layer '{path}' has its {attr} .*name != '{path}'"):
        fp8fn.transform(attention, DELAYED_AUTO)
    fn = fp8fn.transform(attention, DELAYED_AUTO, filter_fn=lambda name, m: name != path)
    assert path not in fn.layers


def test_pruning_after_transform_is_refused_at_apply():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16)
    state = fn.init(x)
    _pruned("weight")(model[2])
    with pytest.raises(TypeError, match=r"layer '2' has its weight made by a forward pre-hook"):
        fn.apply(dict(model.named_parameters()), state, x)


# -- every form of a linear call ----------------------------------------------------------------


class _Calls(nn.Module):
    """`fc`'s weight and bias used through `call(fc, x)`, then `out`."""

    def __init__(self, call):
        super().__init__()
        with _seeded(6):
            self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 8)
        self.call = call

    def forward(self, x):
        return self.out(F.relu(self.call(self.fc, x)))


LINEAR_CALLS = {
    "F.linear(x, weight=, bias=)": lambda fc, x: F.linear(x, weight=fc.weight, bias=fc.bias),
    "F.linear(input=, weight=, bias=)": lambda fc, x: F.linear(
        input=x, weight=fc.weight, bias=fc.bias
    ),
    "F.linear(x, w, bias=)": lambda fc, x: F.linear(x, fc.weight, bias=fc.bias),
    "F.linear(weight=, input=, bias=)": lambda fc, x: F.linear(
        weight=fc.weight, input=x, bias=fc.bias
    ),
}


@pytest.mark.parametrize("form", list(LINEAR_CALLS))
def test_f_linear_by_keyword_runs_in_fp8_with_its_bias(form):
    model = _Calls(LINEAR_CALLS[form])
    fn, x, params, state = _warmed(model, 8, 16)
    assert list(state) == ["fc", "out"]

    def ref(p, s):
        h = F.relu(fp8fn.linear(x, p["fc.weight"], p["fc.bias"], s["fc"], DELAYED_AUTO))
        return (
            fp8fn.linear(h, p["out.weight"], p["out.bias"], s["out"], DELAYED_AUTO).square().sum()
        )

    got = _grads(lambda p, s: fn.apply(p, s, x).square().sum(), params, state)
    assert_bit_identical(got, _grads(ref, params, state))


def _conv1d(nx, nf):
    transformers = pytest.importorskip("transformers")
    with _seeded(7):
        layer = transformers.pytorch_utils.Conv1D(nf, nx)
        layer.bias.data.normal_()
    return layer


def _calling_conv1d(call):
    """A module holding an HF Conv1D `c` (16 -> 8) whose forward is `call(c, x)`."""
    model = nn.Module()
    model.c = _conv1d(16, 8)
    model.forward = lambda x: call(model.c, x)
    return model


ADDMM_CALLS = {
    "module": lambda c, x: c(x),
    "torch.addmm by keyword": lambda c, x: torch.addmm(input=c.bias, mat1=x, mat2=c.weight),
    "torch.addmm(b, mat1=, mat2=)": lambda c, x: torch.addmm(c.bias, mat1=x, mat2=c.weight),
    "beta=1, alpha=1": lambda c, x: torch.addmm(c.bias, x, c.weight, beta=1, alpha=1),
    "bias.addmm(x, w)": lambda c, x: c.bias.addmm(x, c.weight),
}


@pytest.mark.parametrize("form", list(ADDMM_CALLS))
def test_addmm_of_a_conv1d_weight_in_every_form_runs_in_fp8(form):
    model = _calling_conv1d(ADDMM_CALLS[form])
    fn, x, params, state = _warmed(model, 4, 16)
    want = fp8fn.linear(x, params["c.weight"].t(), params["c.bias"], state["c"], DELAYED_AUTO)
    assert_bit_identical(fn.apply(params, state, x), want)


REFUSED_ADDMM = {
    "beta=0.5": lambda c, x: torch.addmm(c.bias, x, c.weight, beta=0.5),
    "alpha=2": lambda c, x: torch.addmm(c.bias, x, c.weight, alpha=2),
    "beta=0": lambda c, x: torch.addmm(c.bias, x, c.weight, beta=0),
    "out_dtype": lambda c, x: torch.addmm(c.bias, x, c.weight, torch.float32),
    "out_dtype=": lambda c, x: torch.addmm(c.bias, x, c.weight, out_dtype=torch.float32),
    "deprecated (beta, input, alpha, mat1, mat2)": lambda c, x: torch.addmm(
        1, c.bias, 1, x, c.weight
    ),
}


@pytest.mark.filterwarnings("ignore:This overload of addmm is deprecated")
@pytest.mark.parametrize("form", list(REFUSED_ADDMM))
def test_addmm_of_a_layer_weight_in_a_form_fp8fn_does_not_convert_is_refused(form):
    model = _calling_conv1d(REFUSED_ADDMM[form])
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(4, 16)
    options = form.startswith(("beta", "alpha"))
    what = f"calls torch\\.addmm with {form}" if options else "passes its weight to torch\\.addmm"
    with pytest.raises(ValueError, match=rf"fp8fn\.init: layer 'c' {what}.*filter_fn"):
        fn.init(x)
    state = fp8fn.init_state(DELAYED_AUTO, ["c"])
    with pytest.raises(ValueError, match=rf"fp8fn\.apply: layer 'c' {what}"):
        fn.apply(dict(model.named_parameters()), state, x)


def test_addmm_into_out_on_a_layer_weight_is_refused():
    model = _calling_conv1d(lambda c, x: torch.addmm(c.bias, x, c.weight, out=torch.empty(4, 8)))
    state = fp8fn.init_state(DELAYED_AUTO, ["c"])
    fn = fp8fn.transform(model, DELAYED_AUTO)
    with torch.no_grad(), pytest.raises(ValueError, match=r"calls torch\.addmm with out=a tensor"):
        fn.apply(dict(model.named_parameters()), state, torch.randn(4, 16))


# -- the module around apply --------------------------------------------------------------------


class _Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.linears = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.linears.append(args[1])
        return func(*args, **(kwargs or {}))


def test_a_users_function_mode_around_apply_sees_the_fp8_layers_calls():
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED_AUTO, filter_fn=lambda name, m: name == "0")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    params = dict(model.named_parameters())
    state = _warm(fn, params, x)
    with _Seen() as seen:
        out = fn.apply(params, state, x)
    assert [w is params[n] for w, n in zip(seen.linears, ["0.weight", "2.weight"])] == [True] * 2
    hidden = F.relu(fp8fn.linear(x, params["0.weight"], params["0.bias"], state["0"], DELAYED_AUTO))
    assert_bit_identical(out, F.linear(hidden, params["2.weight"], params["2.bias"]))


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_around_apply_is_bit_identical_under_plain_autograd(reentrant):
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    params = dict(model.named_parameters())
    state = _warm(fn, params, x.detach())

    def run(checkpointed):
        model.zero_grad(set_to_none=True)
        x.grad = None
        observed = fp8fn.observe(state)
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(
                fn.apply, params, observed, x, use_reentrant=reentrant
            )
        else:
            out = fn.apply(params, observed, x)
        out.square().sum().backward()
        grads = {k: v.grad for k, v in params.items()}
        return grads, x.grad, fp8fn.observations(observed)

    assert_bit_identical(run(True), run(False))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_transformer_encoder_fast_path_differs_only_at_masked_positions():
    """The documented limit: inside apply torch's nested-tensor fast path is not taken, so the
    masked positions hold the regular path's values, not zeros; the others agree."""
    with _seeded(11):
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(12))
    mask = torch.tensor([[False] * 5, [False, False, True, True, True]])
    with pytest.warns(UserWarning, match="no layer was converted"):
        fn = fp8fn.transform(encoder, lambda name, m: None)  # all in high precision
    params = dict(encoder.named_parameters())
    with torch.no_grad():
        plain = encoder(x, src_key_padding_mask=mask)
        state = fn.init(x, src_key_padding_mask=mask)
        applied = fn.apply(params, state, x, src_key_padding_mask=mask)
    assert torch.equal(plain[mask], torch.zeros(3, 16))  # the fast path's zeros
    assert applied[mask].abs().min() > 0
    torch.testing.assert_close(applied[~mask], plain[~mask], rtol=0, atol=1e-5)


def test_a_full_backward_hook_under_torch_func_is_named():
    model = _mlp()
    model[2].register_full_backward_hook(lambda m, gi, go: None)
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16)
    state = fn.init(x)
    with pytest.raises(
        RuntimeError, match=r"fp8fn\.apply: expected no full backward hooks .*'2'.*plain autograd"
    ):
        torch.func.grad(lambda p, s: fn.apply(p, s, x).sum())(dict(model.named_parameters()), state)


def test_apply_owns_the_module_while_it_runs():
    """The documented story for threads (docs/semantics.md): while `apply` runs, the module
    holds apply's tensors (functional_call swaps them into the one module), so a plain
    `model(x)` overlapping it in another thread would see them; after apply it holds its own."""
    model = _mlp()
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16)
    params = dict(model.named_parameters())
    other = {k: v.detach() * 2 for k, v in params.items()}
    state, held = fn.init(x), []
    handle = model[2].register_forward_pre_hook(lambda m, args: held.append(m.weight))
    try:
        fn.apply(other, state, x)
    finally:
        handle.remove()
    assert len(held) == 1 and held[0] is other["2.weight"]
    assert all(p is params[n] for n, p in model.named_parameters())


# -- classes of bugs the tests must catch (tools/mutation.py) ------------------------------------


class _Block(nn.Module):
    """`tanh(fc(x))`, counting its forward runs (recomputes included) in `runs`."""

    def __init__(self, runs: list, i: int):
        super().__init__()
        self.fc, self.runs, self.i = nn.Linear(8, 8), runs, i

    def forward(self, x):
        self.runs.append(self.i)
        return torch.tanh(self.fc(x))


class _Blocks(nn.Module):
    """Eleven blocks: `blocks.1` is a prefix of `blocks.10`, but not its path's."""

    def __init__(self, runs: list):
        super().__init__()
        with _seeded(8):
            self.blocks = nn.ModuleList(_Block(runs, i) for i in range(11))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_checkpoint_fn_tells_blocks_1_from_blocks_10():
    runs = []
    model = _Blocks(runs)
    chosen = {"blocks.1", "blocks.10"}
    fn = fp8fn.transform(model, DELAYED_AUTO, checkpoint_fn=lambda name, m: name in chosen)
    assert fn.checkpointed == ["blocks.1", "blocks.10"]
    plain = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    params = dict(model.named_parameters())
    state = _warm(plain, params, x)
    want = _grads(lambda p, s: plain.apply(p, s, x).square().sum(), params, state)
    runs.clear()
    got = _grads(lambda p, s: fn.apply(p, s, x).square().sum(), params, state)
    assert_bit_identical(got, want)
    assert sorted(runs) == sorted([*range(11), 1, 10])  # the two chosen blocks recomputed


def test_autocast_of_another_device_type_leaves_the_op_alone():
    """Autocast enabled for CUDA (torch's default device type) does not reach a CPU call:
    the op reads autocast for its input's device."""
    model = _mlp()
    fn, x, params, state = _warmed(model, 8, 16)
    want = fn.apply(params, state, x)
    torch.set_autocast_enabled("cuda", True)
    try:
        got = fn.apply(params, state, x)
        direct = fp8fn.linear(x, params["0.weight"], params["0.bias"], state["0"], DELAYED_AUTO)
    finally:
        torch.set_autocast_enabled("cuda", False)
    assert got.dtype == torch.float32
    assert_bit_identical(got, want)
    assert_bit_identical(
        direct, fp8fn.linear(x, params["0.weight"], params["0.bias"], state["0"], DELAYED_AUTO)
    )


@pytest.mark.parametrize("route", ["func", "autograd"])
def test_the_observation_is_first_order_only_too(route):
    """Differentiating the observation again (not only the gradients) is refused: one layer,
    so that no other layer's guarded gradient stands between the observation and `x`."""
    model = _mlp()[0]
    fn = fp8fn.transform(model, DELAYED_AUTO)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fn.init(x)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: layer '': higher-order derivatives"):
        if route == "func":

            def observed(x):
                loss = lambda s: fn.apply(params, s, x).square().sum()  # noqa: E731
                return torch.func.grad(loss)(state).amax_history.sum()

            torch.func.grad(observed)(x)
        else:
            x = x.requires_grad_()
            observed = fp8fn.observe(state)
            loss = fn.apply(params, observed, x).square().sum()
            (obs,) = torch.autograd.grad(loss, observed.amax_history, create_graph=True)
            torch.autograd.grad(obs.sum(), x)


# -- sharded: functional FSDP's cross-attention, FSDP2's ties (two gloo ranks) -----------------


class _CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        with _seeded(9):
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, q, kv):
        return self.attn(q, kv, kv, need_weights=False)[0]


def _cross_attention_under_functional_fsdp(rank):
    """The packed in_proj weight, given as a `Shard(0)` DTensor, split by cross-attention:
    bit for bit one process's output, gradients and (all-reduced) observations."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = _CrossAttention()
    gen = torch.Generator().manual_seed(10)
    q, kv = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 6, 16, generator=gen)
    fn = fp8fn.transform(model, DELAYED_AUTO)
    plain = {k: v.detach() for k, v in model.named_parameters()}
    sharded = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in plain.items()}

    def loss(p, s):
        return fn.apply(p, s, q, kv).square().sum()

    state = fn.init(q, kv)
    for _ in range(2):  # current scaling (empty histories), then the stored scales
        (grads, obs), value = _grads(loss, sharded, state)
        (want_grads, want_obs), want_value = _grads(loss, plain, state)
        assert_bit_identical(value, want_value)
        assert_bit_identical({k: g.full_tensor() for k, g in grads.items()}, want_grads)
        assert_bit_identical(fp8fn.all_reduce(obs).amax_history, want_obs.amax_history)
        state = fp8fn.update(state, want_obs)


def _fsdp2_tied_layers_with_two_choices_refused(rank):
    """Under FSDP2 the tied layers hold the one unsharded weight FSDP2 swaps in: a tied layer
    left in high precision would run as the converted one. Refused at transform."""
    from torch.distributed.fsdp import fully_shard

    model = _TiedPair()
    fully_shard(model)
    with pytest.raises(ValueError, match=r"fp8fn\.transform: expected the layers sharing one "):
        fp8fn.transform(model, DELAYED_AUTO, filter_fn=lambda name, m: name == "a")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    fn = fp8fn.transform(model, DELAYED_AUTO)  # one choice: runs
    fn.apply(dict(model.named_parameters()), fn.init(x), x)


SCENARIOS = [_cross_attention_under_functional_fsdp, _fsdp2_tied_layers_with_two_choices_refused]


def _two_ranks(rank, world_size, port, out_dir):
    from _spawn import run_scenarios

    run_scenarios(rank, world_size, port, out_dir, SCENARIOS, {}, 60)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from _spawn import spawn_results

    return spawn_results(_two_ranks, 2, tmp_path_factory.mktemp("never_silent"), 180)


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("scenario", [f.__name__ for f in SCENARIOS])
def test_on_two_gloo_ranks(two_ranks, scenario):
    from _spawn import assert_ok

    assert_ok(two_ranks, scenario)
