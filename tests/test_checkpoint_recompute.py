"""A recompute sees what the forward saw and changes nothing the forward already changed.

`fp8fn.checkpoint` and `checkpoint_fn` on HF transformers models (KV caches), with inputs
modified in place, with tensors read from outside `f`'s arguments, under autocast, and with
outputs that hold None: each either bit-identical to the run without checkpointing, on the
torch.func route and plain autograd, or refused with an fp8fn error that says what to do.
"""

import functools

import pytest
import torch
from _helpers import DELAYED, assert_bit_identical
from _models import MLP, Block, Transformer, tiny_hf_config

import fp8fn

ROUTES = ["func", "autograd"]


def _grads_and_obs(loss, params, state, route):
    """(grads, observations) of `loss(params, state)` with torch.func.grad or `backward()`."""
    if route == "func":
        return torch.func.grad(loss, argnums=(0, 1))(params, state)
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    observed = fp8fn.observe(state)
    loss(params, observed).backward()
    return {k: v.grad for k, v in params.items()}, fp8fn.observations(observed)


def _grad(loss, w, route):
    """The gradient of the scalar `loss(w)` at the tensor `w`, with torch.func.grad or
    `backward()` of a leaf copy."""
    if route == "func":
        return torch.func.grad(loss)(w)
    leaf = w.clone().requires_grad_()
    loss(leaf).backward()
    return leaf.grad


def _train(fn, params, state, loss, route, steps=2):
    """Per step (grads, obs) of `steps` SGD steps of `loss(fn, params, state)`."""
    out = []
    for _ in range(steps):
        grads, obs = _grads_and_obs(lambda p, s: loss(fn, p, s), params, state, route)
        out.append((grads, obs))
        state = fp8fn.update(state, obs)
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
    return out


# HF transformers decoder layers: the KV cache ----------------------------------------------------


def _hf_decoder(kind: str, use_cache: bool):
    """A tiny HF causal LM (2 layers, hidden 32, vocab 64) and its decoder-layer class."""
    transformers = pytest.importorskip("transformers")
    # GPT-2's default dropout stays on: the recompute must draw the same masks
    config = tiny_hf_config(kind)
    cls, layer = {
        "llama": (transformers.LlamaForCausalLM, "LlamaDecoderLayer"),
        "mistral": (transformers.MistralForCausalLM, "MistralDecoderLayer"),
        "gpt2": (transformers.GPT2LMHeadModel, "GPT2Block"),
    }[kind]
    assert config.use_cache  # the default the models are trained with, unless told
    config.use_cache = use_cache
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config).train()
    return model, layer


def _hf_loss(ids):
    return lambda fn, p, s: fn.apply(p, s, ids, labels=ids).loss


HF_DECODERS = {"llama": "model.layers.0", "gpt2": "transformer.h.0", "mistral": "model.layers.0"}


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", list(HF_DECODERS))
def test_hf_decoder_layers_with_kv_cache_are_refused(kind, route):
    model, layer = _hf_decoder(kind, use_cache=True)
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda n, m: type(m).__name__ == layer)
    assert fn.checkpointed == [HF_DECODERS[kind], HF_DECODERS[kind][:-1] + "1"]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    state = fn.init(ids)
    params = {k: v.detach() for k, v in model.named_parameters()}
    match = (
        rf"^fp8fn\.apply: expected no KV cache in the inputs of module '{HF_DECODERS[kind]}' "
        r"\(chosen by `checkpoint_fn`\), got a DynamicCache: .* pass `use_cache=False`"
    )
    with pytest.raises(ValueError, match=match):
        _train(fn, params, state, _hf_loss(ids), route, steps=1)
    # Without gradients there is no recompute: the cache is updated once, as without fp8fn.
    plain = fp8fn.transform(model, DELAYED)
    with torch.no_grad():
        torch.manual_seed(2)  # GPT-2's dropout
        want = plain.apply(params, state, ids)
        torch.manual_seed(2)
        got = fn.apply(params, state, ids)
    assert_bit_identical(got.logits, want.logits)
    assert got.past_key_values.get_seq_length() == want.past_key_values.get_seq_length() == 8


def _tiny_mixtral(implementation: str):
    """A tiny HF Mixtral (2 layers, hidden 32, 4 experts, top 2) from a config, no cache."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(**{
        **tiny_hf_config("mistral").to_dict(), "num_local_experts": 4,
        "num_experts_per_tok": 2, "use_cache": False})  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config).train()
    model.set_experts_implementation(implementation)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "kind", ["mixtral-eager", "mixtral-batched_mm", "mixtral-grouped_mm", *HF_DECODERS]
)
@pytest.mark.parametrize("precision", ["float8", "high"])
def test_hf_decoder_layers_without_kv_cache_are_bit_identical(precision, kind, route):
    # Found in 0.3: under `backward()` the recompute was differentiated by torch.func, whose
    # derivatives of `F.silu` and of the MoE block round differently: on Mixtral 17 of 21
    # gradients differed in high precision, 7 in float8.
    if kind.startswith("mixtral"):
        model, layer = _tiny_mixtral(kind.partition("-")[2]), "MixtralDecoderLayer"
    else:
        model, layer = _hf_decoder(kind, use_cache=False)
    recipe = DELAYED if precision == "float8" else (lambda name, m: None)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    runs = []
    for checkpoint_fn in (None, lambda n, m: type(m).__name__ == layer):
        fn = fp8fn.transform(model, recipe, checkpoint_fn=checkpoint_fn)
        torch.manual_seed(2)  # GPT-2's dropout
        runs.append(_train(fn, params, fn.init(ids), _hf_loss(ids), route))
    assert len(fn.checkpointed) == 2
    assert_bit_identical(runs[1], runs[0])
    if precision == "float8":
        obs = runs[0][-1][1]
        assert bool((obs.amax_history[..., 0] > 0).all())  # every site observed, once


@pytest.mark.parametrize("kind", ["DynamicCache", "ReformerDynamicCache"])
def test_checkpoint_refuses_a_kv_cache_argument(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "DynamicCache":
        cache = transformers.DynamicCache()
    else:  # a model's own cache, not derived from transformers' Cache
        cache = transformers.models.reformer.modeling_reformer.ReformerDynamicCache()
    x = torch.randn(2, 3, requires_grad=True)
    match = rf"^fp8fn\.checkpoint: expected no KV cache in the inputs of `f`, got a {kind}: "
    with pytest.raises(ValueError, match=match):
        fp8fn.checkpoint(lambda x, kw: x * 2, x, {"past_key_values": cache})
    with torch.no_grad():  # no recompute, nothing to refuse
        assert torch.equal(fp8fn.checkpoint(lambda x, c: x * 2, x, cache), x * 2)


# Inputs modified in place ------------------------------------------------------------------------


def _counted(w, x, calls):
    """Modifies `calls`, an integer input, in place: a recompute would see it incremented."""
    return torch.tanh(x @ w) * calls.add_(1)


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_refuses_f_modifying_an_input_in_place(route):
    w, x = torch.randn(3, 3), torch.randn(2, 3)
    calls = torch.zeros((), dtype=torch.int64)
    match = r"^fp8fn\.checkpoint: expected `f` to leave its inputs as they are, got one modified"
    with pytest.raises(RuntimeError, match=match):
        if route == "func":
            torch.func.grad(lambda w: fp8fn.checkpoint(_counted, w, x, calls).sum())(w)
        else:
            fp8fn.checkpoint(_counted, w.requires_grad_(), x, calls).sum().backward()


class _Doubling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x.mul_(2))


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_fn_refuses_a_module_modifying_its_input_in_place(route):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Doubling())
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda n, m: n == "1")
    x = torch.randn(4, 8)
    params = {k: v.detach() for k, v in model.named_parameters()}
    match = r"^fp8fn\.apply: expected module '1' \(chosen by `checkpoint_fn`\) to leave its input"
    with pytest.raises(RuntimeError, match=match):
        _grads_and_obs(lambda p, s: fn.apply(p, s, x).sum(), params, fn.init(x), route)


# Tensors read from outside `f`'s arguments ------------------------------------------------------


def _block(dropout=0.1):
    """A transformer block with dropout in training mode (the recompute draws the same masks)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Block(8, 2, dropout=dropout).train()


class _Tied(torch.nn.Module):
    """`fc` registered twice (`fc`, `again`), and `out` sharing `fc`'s weight, transposed."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc = self.again = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 8, bias=False)
        self.out.weight = self.fc.weight

    def forward(self, x):
        return self.out(torch.tanh(self.again(torch.relu(self.fc(x)))))


class _Outer(torch.nn.Module):
    """Runs `inner` through `call(inner, h)` between two linears."""

    def __init__(self, inner, call):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.first, self.last = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.inner, self._call = inner, call

    def forward(self, x):
        return self.last(self._call(self.inner, self.first(x)))


MODULE_CALLS = {
    "module": lambda inner, h: inner(h),
    "checkpoint(module)": lambda inner, h: fp8fn.checkpoint(inner, h),
    "checkpoint(bound method)": lambda inner, h: fp8fn.checkpoint(inner.forward, h),
    "checkpoint(partial)": lambda inner, h: fp8fn.checkpoint(functools.partial(inner), h),
}


def _module_grads(inner, call, route):
    """Gradients of every parameter and of the input, with `inner` run through `call`."""
    model = _Outer(inner, call)
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    torch.manual_seed(3)  # dropout
    if route == "func":

        def loss(p, x):
            return torch.func.functional_call(model, p, (x,)).square().sum()

        return torch.func.grad(loss, argnums=(0, 1))(params, x)
    x = x.requires_grad_()
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return {k: v.grad for k, v in model.named_parameters()}, x.grad


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("call", list(MODULE_CALLS)[1:])
@pytest.mark.parametrize("inner", [_block, _Tied], ids=["block", "tied"])
def test_checkpoint_of_a_module_differentiates_its_parameters(inner, call, route):
    want = _module_grads(inner(), MODULE_CALLS["module"], route)
    got = _module_grads(inner(), MODULE_CALLS[call], route)
    assert all(g is not None and bool(g.any()) for g in [*got[0].values(), got[1]])
    assert_bit_identical(got, want)


def _mlp_problem():
    model = MLP([8, 16, 8])
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    params = {k: v.detach() for k, v in model.named_parameters()}
    return fn, params, fn.init(x), x


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_refuses_tensors_f_closes_over(route):
    fn, params, state, x = _mlp_problem()
    w = torch.randn(8, 8)
    match = r"^fp8fn\.checkpoint: expected `f` to take every tensor it differentiates through as an"

    def closures(p, s, w):
        def nested(z):
            return fn.apply(p, s, z)

        return {
            "closure": lambda z: fn.apply(p, s, z),
            "nested function": lambda z: nested(z),
            "default": lambda z, w=w: z @ w,
            "partial of a closure": functools.partial(lambda z, k: fn.apply(p, s, z) * k, k=2),
        }

    names = list(closures(params, state, w))
    for name in names:

        def loss(p, s, w, name=name):
            return fp8fn.checkpoint(closures(p, s, w)[name], x).sum()

        with pytest.raises(ValueError, match=match):
            _grads_and_obs(lambda p, s: loss(p, s, p["layers.0.weight"]), params, state, route)


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_refuses_a_closed_over_module_being_differentiated(route):
    def call(inner, h):
        return fp8fn.checkpoint(lambda z: inner(z), h)

    if route == "func":  # the module runs under functional_call: its tensors are tracked
        with pytest.raises(ValueError, match=r"^fp8fn\.checkpoint: .* got `inner\.ln1\.weight`"):
            _module_grads(_block(), call, route)
    else:  # read only by the recompute: refused there
        with pytest.raises(RuntimeError, match=r"^fp8fn\.checkpoint: .* got its recompute readi"):
            _module_grads(_block(), call, route)
        inner = _block()  # nothing else requires grad: refused in the forward
        x = torch.randn(2, 4, 8)
        with pytest.raises(ValueError, match=r"^fp8fn\.checkpoint: .* got `inner\.ln1\.weight`"):
            fp8fn.checkpoint(lambda z: inner(z), x)
        with torch.no_grad():  # no gradient recorded: nothing to lose
            assert fp8fn.checkpoint(lambda z: inner(z), x).shape == x.shape


_GLOBAL_WEIGHT = torch.randn(8, 8, requires_grad=True)


def test_checkpoint_refuses_a_recompute_reading_a_global_that_requires_grad():
    x = torch.randn(2, 8, requires_grad=True)
    out = fp8fn.checkpoint(lambda z: z @ _GLOBAL_WEIGHT, x)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.checkpoint: .* got its recompute reading"):
        out.sum().backward()


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_of_partial_and_of_functional_call_over_a_closed_over_module(route):
    fn, params, state, x = _mlp_problem()
    runs = []
    for apply in (
        fn.apply,
        lambda p, s, z: fp8fn.checkpoint(fn.apply, p, s, z),
        lambda p, s, z: fp8fn.checkpoint(functools.partial(fn.apply, p, s), z),
        lambda p, s, z: fp8fn.checkpoint(functools.partial(fn.apply, p), s, z),
    ):
        runs.append(
            _grads_and_obs(lambda p, s: apply(p, s, x).square().sum(), params, state, route)
        )
    for run in runs[1:]:
        assert_bit_identical(run, runs[0])
    # `f` closes over a module whose parameters require grad, but swaps in its arguments.
    inner = _block()
    h = torch.randn(2, 4, 8)

    def f(p, z):
        return torch.func.functional_call(inner, p, (z,))

    results = []
    for checkpointed in (False, True):

        def loss(p, checkpointed=checkpointed):
            return (fp8fn.checkpoint(f, p, h) if checkpointed else f(p, h)).square().sum()

        params = {k: v.detach().clone() for k, v in inner.named_parameters()}
        torch.manual_seed(3)
        if route == "func":
            results.append(torch.func.grad(loss)(params))
        else:
            params = {k: v.requires_grad_() for k, v in params.items()}
            loss(params).backward()
            results.append({k: v.grad for k, v in params.items()})
    assert_bit_identical(results[1], results[0])


# The forward's context: autocast, fp8fn.apply --------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_fn_recomputes_under_the_forwards_autocast(route):
    model = Transformer(32, 16, 2, 2, 8, dropout=0.1)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss(fn, p, s):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the backward runs outside it
            logits = fn.apply(p, s, ids)
        assert logits.dtype == torch.bfloat16
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())

    params = {k: v.detach() for k, v in model.named_parameters()}
    runs = []
    for checkpoint_fn in (None, lambda n, m: isinstance(m, Block)):
        fn = fp8fn.transform(model, DELAYED, checkpoint_fn=checkpoint_fn)
        torch.manual_seed(2)  # dropout
        runs.append(_train(fn, params, fn.init(ids), loss, route))
    assert fn.checkpointed == ["blocks.0", "blocks.1"]
    assert_bit_identical(runs[1], runs[0])


def _mixed(w, x):
    return torch.tanh(x @ w) @ w  # matmuls: bfloat16 under autocast


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("forward", ["autocast", "float32"])
def test_checkpoint_recomputes_under_the_forwards_autocast(forward, route):
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    on = forward == "autocast"
    results = []
    for checkpointed in (False, True):

        def loss(w, checkpointed=checkpointed):
            # The forward under its autocast; the backward under the other setting.
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                out = fp8fn.checkpoint(_mixed, w, x) if checkpointed else _mixed(w, x)
            assert out.dtype == (torch.bfloat16 if on else torch.float32)
            return out.float().square().sum()

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not on):
            results.append(_grad(loss, w, route))
    assert_bit_identical(results[1], results[0])


class _CheckpointsInside(torch.nn.Module):
    """Calls `fp8fn.checkpoint` on its second linear inside its forward."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return fp8fn.checkpoint(self.b, torch.relu(self.a(x)))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("checkpoint_fn", [None, lambda n, m: n == "0"], ids=["model", "block"])
def test_checkpoint_inside_fp8fn_apply_is_refused(checkpoint_fn, route):
    model = torch.nn.Sequential(_CheckpointsInside(), torch.nn.Linear(8, 4))
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=checkpoint_fn)
    x = torch.randn(4, 8)
    state = fn.init(x)  # no gradient recorded: no recompute, nothing to refuse
    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"^fp8fn\.checkpoint: expected to run outside fp8fn\.a"):
        _grads_and_obs(lambda p, s: fn.apply(p, s, x).sum(), params, state, route)


# Outputs holding None (HF layers' outputs) -------------------------------------------------------


def _with_nones(w, x):
    h = torch.tanh(x @ w)
    return h, None, {"attention": None, "out": (h @ w).sin()}


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_returns_none_leaves_as_none(route):
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    results = []
    for checkpointed in (False, True):

        def loss(w, checkpointed=checkpointed):
            out = fp8fn.checkpoint(_with_nones, w, x) if checkpointed else _with_nones(w, x)
            assert out[1] is None and out[2]["attention"] is None
            return out[0].sum() + out[2]["out"].square().sum()

        results.append(_grad(loss, w, route))
    assert_bit_identical(results[1], results[0])


def test_checkpoint_refuses_a_recompute_returning_another_structure():
    calls = []

    def f(x):
        calls.append(1)
        return (x * 2, None) if len(calls) == 1 else (x * 2, x * 3)

    out, _ = fp8fn.checkpoint(f, torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"^fp8fn\.checkpoint: expected `f` to return the same"):
        out.sum().backward()


class _Labelled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x), None, "label"


def test_checkpoint_fn_refuses_a_module_returning_other_non_tensors():
    model = torch.nn.Sequential(_Labelled())
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda n, m: n == "0")
    x = torch.randn(4, 8)
    params = {k: v.detach() for k, v in model.named_parameters()}
    match = r"^fp8fn\.apply: expected module '0' \(chosen by `checkpoint_fn`\) to return a pytree"
    with pytest.raises(TypeError, match=match + r".*\['NoneType', 'Tensor', 'str'\]"):
        fn.apply(params, fn.init(x), x)


def _t5(use_cache: bool):
    """A tiny HF T5ForConditionalGeneration (2 layers, d_model 32, vocab 64)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    assert config.use_cache and config.dropout_rate > 0  # the recompute draws the same masks
    config.use_cache = use_cache
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(config).train()


# The decoder blocks' cross-attention reads the encoder output twice each (keys, values). Without
# checkpointing, autograd adds the four contributions to its gradient one by one; a checkpointed
# block hands back its two already added: the same sum, associated differently (float rounding,
# as for a layer reused across a checkpoint in test_checkpoint.py), which no checkpoint can
# avoid. So the encoder's gradients, and the shared embedding's, agree to rounding (and its
# output-gradient amaxes may differ in the last bit); the rest of the step is bit-identical.
def _encoder_side(name: str) -> bool:
    return name.startswith("encoder.") or name == "shared.weight"


def _sqnr(ref, x) -> float:
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_fn_t5_blocks_match_without_checkpointing(route):
    gen = torch.Generator().manual_seed(1)
    ids, labels = (
        torch.randint(1, 64, (2, 8), generator=gen),
        torch.randint(1, 64, (2, 6), generator=gen),
    )
    losses = []

    def loss(fn, p, s):
        value = fn.apply(p, s, ids, labels=labels).loss
        losses.append(float(value.detach()))  # exact: a float32 in a double
        return value

    def is_block(name, module):
        return type(module).__name__ == "T5Block"

    model = _t5(use_cache=False)
    params = {k: v.detach() for k, v in model.named_parameters()}
    runs = []
    for checkpoint_fn in (None, is_block):
        fn = fp8fn.transform(model, DELAYED, checkpoint_fn=checkpoint_fn)
        state = fn.init(ids, labels=labels)
        torch.manual_seed(2)  # dropout
        runs.append(_train(fn, params, state, loss, route, steps=3))
    assert fn.checkpointed == [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in (0, 1)]
    assert losses[3] == losses[0]  # the first forward, bit for bit
    assert losses[2] < losses[1] < losses[0] and losses[5] < losses[4] < losses[3]  # it trains
    torch.testing.assert_close(losses[3:], losses[:3], rtol=1e-6, atol=0)
    (want, want_obs), (got, got_obs) = runs[0][0], runs[1][0]  # the first step
    assert bool((want_obs.amax_history[..., 0] > 0).all())  # every site observed
    encoder = [i for i, site in enumerate(want_obs.sites) if _encoder_side(site)]
    decoder = [i for i in range(len(want_obs.sites)) if i not in encoder]
    assert len(encoder) == 2 * 6 and len(decoder) == 2 * 10 + 1  # and lm_head
    assert_bit_identical(got_obs.amax_history[:, :2], want_obs.amax_history[:, :2])
    assert_bit_identical(got_obs.amax_history[decoder], want_obs.amax_history[decoder])
    torch.testing.assert_close(got_obs.amax_history, want_obs.amax_history, rtol=1e-6, atol=0)
    assert_bit_identical(
        {k: v for k, v in got.items() if not _encoder_side(k)},
        {k: v for k, v in want.items() if not _encoder_side(k)},
    )
    assert min(_sqnr(want[k], got[k]) for k in want if _encoder_side(k)) > 120
    # With the cache on (T5's default), the decoder blocks' KV cache is refused.
    model = _t5(use_cache=True)
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=is_block)
    match = r"^fp8fn\.apply: .* of module 'decoder\.block\.0' .* got a EncoderDecoderCache"
    with pytest.raises(ValueError, match=match):
        _train(fn, params, fn.init(ids, labels=labels), loss, route, steps=1)


def test_checkpoint_fn_without_gradients_runs_the_forward_once(monkeypatch):
    # Evaluation under no_grad has no backward to recompute in: the chosen blocks run as
    # without checkpoint_fn, bit for bit, and no checkpoint is made.
    torch.manual_seed(0)
    model = Transformer(64, 16, 2, 2, 8)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    plain = fp8fn.transform(model, DELAYED)
    chosen = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda n, m: isinstance(m, Block))
    assert len(chosen.checkpointed) == 2
    state = plain.init(ids)
    params = dict(model.named_parameters())
    made, real = [], fp8fn._transform.recompute.checkpoint_with_constants

    def counted(*args, **kwargs):
        made.append(kwargs["subject"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8fn._transform.recompute, "checkpoint_with_constants", counted)
    with torch.no_grad():
        assert_bit_identical(chosen.apply(params, state, ids), plain.apply(params, state, ids))
    assert made == []
    chosen.apply(params, state, ids)  # with gradients: each chosen block is checkpointed
    assert made == [f"module {p!r} (chosen by `checkpoint_fn`)" for p in chosen.checkpointed]
