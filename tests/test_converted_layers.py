"""What `transform` converts: nn.Linear, HF Conv1D (GPT-2 family); what it leaves, loudly."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import DELAYED, assert_bit_identical, sqnr
from _models import tiny_hf_config

import fp8fn

transformers = pytest.importorskip("transformers")


def _gpt2(seed=0):
    config = tiny_hf_config("gpt2", n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_conv1d_layers_are_sites():
    model = _gpt2()
    fn = fp8fn.transform(model, DELAYED)
    blocks = [
        f"transformer.h.{i}.{p}"
        for i in range(2)
        for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert fn.layers == [*blocks, "lm_head"]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert list(fn.init(ids)) == [*blocks, "lm_head"]


def test_conv1d_is_the_fp8_linear_of_its_transposed_weight():
    conv = _gpt2().transformer.h[0].mlp.c_fc  # weight (in, out)
    model = torch.nn.Sequential(conv)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(3, 5, 32)
    state = fn.init(x)
    want = fp8fn.linear(x, conv.weight.t(), conv.bias, state["0"], DELAYED)
    assert torch.equal(fn.apply(dict(model.named_parameters()), state, x), want)


def test_gpt2_trains_through_fp8fn_on_both_routes():
    model = _gpt2()
    fn = fp8fn.transform(model, DELAYED)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 12), generator=gen) for _ in range(3)]
    state = fn.init(batches[0])
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, s, ids):
        return fn.apply(p, s, ids, labels=ids).loss

    for ids in batches:
        (grads, obs), value = torch.func.grad_and_value(loss, argnums=(0, 1))(params, state, ids)
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        observed = fp8fn.observe(state)
        loss(p, observed, ids).backward()
        assert_bit_identical(obs, fp8fn.observations(observed))
        assert all(torch.equal(grads[k], p[k].grad) for k in grads)
        ref = torch.func.functional_call(model, params, (ids,), {"labels": ids}).loss
        assert abs(value.item() - ref.item()) < 0.02 * ref.item()  # fp8 noise, not a bug
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
        state = fp8fn.update(state, obs)
    # every site observed every step: three amaxes pushed per role
    assert torch.equal((state.amax_history[..., :3] > 0).all(), torch.tensor(True))


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")  # the old name
def test_hf_gradient_checkpointing_under_torch_func_is_refused_by_fp8fn():
    model = _gpt2().train()
    model.gradient_checkpointing_enable()
    fn = fp8fn.transform(model, DELAYED)
    ids = torch.randint(0, 64, (2, 8))
    state = fn.init(ids)
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = lambda p: fn.apply(p, state, ids, labels=ids).loss  # noqa: E731
    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: the model calls requires_grad_"):
        torch.func.grad(loss)(params)
    # Plain autograd: the model's own torch.utils.checkpoint would recompute without fp8fn.
    observed = fp8fn.observe(state)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: the model runs torch.utils.check"):
        fn.apply(params, observed, ids, labels=ids)
    # Turned off after fp8fn.transform: the live model runs as it is now.
    model.gradient_checkpointing_disable()
    with pytest.raises(RuntimeError, match=r"model.disable_input_require_grads\(\)"):
        torch.func.grad(loss)(params)
    model.disable_input_require_grads()
    grads = torch.func.grad(loss)(params)
    fresh = fp8fn.transform(model, DELAYED)
    want = torch.func.grad(lambda p: fresh.apply(p, state, ids, labels=ids).loss)(params)
    assert_bit_identical(grads, want)


def test_no_converted_layer_warns():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    with pytest.warns(UserWarning, match=r"^fp8fn\.transform: no layer was converted"):
        fn = fp8fn.transform(model, DELAYED)
    assert fn.layers == [] and len(fn.init(torch.randn(1, 3, 8, 8))) == 0


class _Attention(torch.nn.Module):
    """nn.MultiheadAttention then a head; `forward(x, memory=None, other=None)`: self-attention,
    or cross-attention on `memory` (one key/value source) or `memory`, `other` (two)."""

    def __init__(self, kdim=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True, kdim=kdim, vdim=kdim)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, memory=None, other=None):
        k = x if memory is None else memory
        v = k if other is None else other
        return self.head(self.attn(x, k, v, need_weights=False)[0])


def _attention_step(fn, params, state, *args):
    loss = lambda p, s: fn.apply(p, s, *args).square().mean()  # noqa: E731
    grads, obs = torch.func.grad(loss, argnums=(0, 1))(params, state)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    observed = fp8fn.observe(state)
    loss(p, observed).backward()
    assert_bit_identical((grads, obs), ({k: v.grad for k, v in p.items()},
                                        fp8fn.observations(observed)))  # fmt: skip
    return grads, obs


@pytest.mark.parametrize("kind", ["self", "cross", "three"])
def test_multihead_attention_projections_run_in_fp8(kind):
    model = _Attention()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left in high precision
        fn = fp8fn.transform(model, DELAYED)
    assert fn.layers == ["attn.in_proj", "attn.out_proj", "head"]
    gen = torch.Generator().manual_seed(1)
    x, m1, m2 = (torch.randn(3, n, 16, generator=gen) for n in (5, 7, 7))
    args = {"self": (x,), "cross": (x, m1), "three": (x, m1, m2)}[kind]
    calls = {"self": 1, "cross": 2, "three": 3}[kind]  # in_proj's GEMMs: packed, q + kv, q k v
    state = fn.init(*args)
    want_sites = ["attn.in_proj"] + [f"attn.in_proj#{k}" for k in range(1, calls)]
    assert list(state) == [*want_sites, "attn.out_proj", "head"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    grads, obs = _attention_step(fn, params, state, *args)
    # Each in-projection GEMM observed its input and its slice of the packed weight.
    w = params["attn.in_proj_weight"]
    slices = {1: [w], 2: [w[:16], w[16:]], 3: [w[:16], w[16:32], w[32:]]}[calls]
    for site, inp, part in zip(want_sites, args, slices):
        assert obs[site].input.amax_history[0] == inp.abs().max()
        assert obs[site].weight.amax_history[0] == part.abs().max()
    assert obs["attn.out_proj"].weight.amax_history[0] == params["attn.out_proj.weight"].abs().max()
    assert (obs.amax_history[..., 0] > 0).all()
    # fp8 numerics: close to the float32 model, and not equal to it.
    state = fp8fn.update(state, obs)
    out, ref = fn.apply(params, state, *args), model(*args)
    assert 25 < sqnr(ref, out) < 60
    ref_grads = torch.func.grad(
        lambda p: torch.func.functional_call(model, p, args).square().mean()
    )(params)
    assert sqnr(ref_grads["attn.in_proj_weight"], grads["attn.in_proj_weight"]) > 15


def test_multihead_attention_with_its_own_kdim_has_three_projections():
    model = _Attention(kdim=8)
    fn = fp8fn.transform(model, DELAYED)
    assert fn.layers == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "head"]
    gen = torch.Generator().manual_seed(2)
    x, m = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 6, 8, generator=gen)
    state = fn.init(x, m)
    params = {k: v.detach() for k, v in model.named_parameters()}
    _, obs = _attention_step(fn, params, state, x, m)
    for role, inp in (("q", x), ("k", m), ("v", m)):
        assert obs[f"attn.{role}_proj"].input.amax_history[0] == inp.abs().max()
        want = params[f"attn.{role}_proj_weight"].abs().max()
        assert obs[f"attn.{role}_proj"].weight.amax_history[0] == want
    # filter_fn and recipe functions see the projections by these names.
    kept = fp8fn.transform(model, DELAYED, filter_fn=lambda name, m: name != "attn.k_proj")
    assert kept.layers == ["attn.q_proj", "attn.v_proj", "attn.out_proj", "head"]


def test_a_model_with_converted_layers_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8fn.transform(torch.nn.Sequential(torch.nn.Linear(4, 4)), DELAYED)


def test_per_layer_recipes_with_gpt2():
    """Delayed scaling in the MLPs, rowwise in attention, lm_head in high precision."""
    model = _gpt2()

    def recipe(name, layer):
        if name == "lm_head":
            return None
        return DELAYED if ".mlp." in name else fp8fn.RowwiseScaling()

    fn = fp8fn.transform(model, recipe)
    ids = torch.randint(0, 64, (2, 8))
    state = fn.init(ids)
    assert list(state) == [
        f"transformer.h.{i}.mlp.{p}" for i in range(2) for p in ("c_fc", "c_proj")
    ]
    assert isinstance(fn.recipes["transformer.h.0.attn.c_attn"], fp8fn.RowwiseScaling)
    assert "lm_head" not in fn.recipes
    params = {k: v.detach() for k, v in model.named_parameters()}
    grads, obs = torch.func.grad(lambda p, s: fn.apply(p, s, ids, labels=ids).loss, (0, 1))(
        params, state
    )
    assert (obs.amax_history[..., 0] > 0).all()
    out = fn.apply(params, state, ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # the fp8 body's output, after the final layer norm
    tied = params["transformer.wte.weight"]  # lm_head's weight is tied to the embedding
    assert torch.equal(out.logits, F.linear(hidden, tied))  # lm_head in high precision
