"""Activation checkpointing: recompute is bit-identical and observes nothing twice.

`fp8fn.checkpoint` directly, and `fp8fn.transform(..., checkpoint_fn=...)` on a multi-block
transformer, under torch.func and plain autograd, from a fresh (empty-history) state on.
"""

import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_bit_identical
from _models import MLP, Block, ReusedLayer, Transformer
from torch import nn
from torch.utils import _pytree as pytree

import fp8fn

VOCAB, D, HEADS, BLOCKS, SEQ, BATCH = 32, 16, 2, 2, 8, 2
STEPS = 3
RECIPES = {
    "delayed": lambda: fp8fn.DelayedScaling(history_len=4),
    "current": fp8fn.CurrentScaling,
}


def is_block(name, module):
    return isinstance(module, Block)


def func_route(fn, params, state, x, y):
    """Gradients and observations with torch.func.grad."""

    def loss(p, s):
        return F.cross_entropy(fn.apply(p, s, x).flatten(0, 1), y.flatten())

    return torch.func.grad(loss, argnums=(0, 1))(params, state)


def autograd_route(fn, params, state, x, y):
    """Gradients and observations with loss.backward(), through `fp8fn.observe`."""
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    state = fp8fn.observe(state)
    F.cross_entropy(fn.apply(params, state, x).flatten(0, 1), y.flatten()).backward()
    grads = {k: v.grad for k, v in params.items()}
    return grads, fp8fn.observations(state)


ROUTES = {"func": func_route, "autograd": autograd_route}


def train(recipe, dtype, checkpoint, route, steps=STEPS):
    """`steps` SGD steps from a fresh state; per step (grads, obs, updated state)."""
    model = Transformer(VOCAB, D, HEADS, BLOCKS, SEQ).to(dtype)
    fn = fp8fn.transform(model, recipe, checkpoint_fn=is_block if checkpoint else None)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(steps)]
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fn.init(batches[0])
    out = []
    for x in batches:
        y = x.roll(-1, dims=1)
        grads, obs = ROUTES[route](fn, params, state, x, y)
        assert type(obs) is fp8fn.State and obs.static == state.static
        state = fp8fn.update(state, obs)
        out.append((grads, obs, state))
        params = {k: p - 0.5 * grads[k] for k, p in params.items()}
    return fn, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_transform_checkpoint_is_bit_identical_from_fresh_state(recipe_name, dtype):
    recipe = RECIPES[recipe_name]()
    fn, reference = train(recipe, dtype, checkpoint=False, route="func")
    assert fn.checkpointed == []
    for checkpoint, route in ((True, "func"), (False, "autograd"), (True, "autograd")):
        fn, run = train(recipe, dtype, checkpoint, route)
        assert fn.checkpointed == ([f"blocks.{i}" for i in range(BLOCKS)] if checkpoint else [])
        assert len(run) == len(reference) == STEPS
        for got, want in zip(run, reference):  # per step: grads, observations, new state
            assert_bit_identical(got, want)
    if isinstance(recipe, fp8fn.DelayedScaling):
        # The run really exercised delayed scaling: every history filled, scales moved.
        final = reference[-1][2]
        assert len(final) == 4 * BLOCKS + 1
        assert final.amax_history.shape == (len(final), 3, 4)
        assert bool((final.amax_history[..., :STEPS] > 0).all())
        assert not final.amax_history[..., STEPS:].any()
        assert bool((final.scale != 1).all())
        for _, obs, _ in reference:  # one amax per role, site and step
            assert bool((obs.amax_history[..., 0] > 0).all())
            assert not obs.amax_history[..., 1:].any() and not obs.scale.any()
    else:
        assert all(len(state) == 0 for _, _, state in reference)
    # Later steps differ from the first (the SGD step changed the params).
    assert not torch.equal(reference[0][0]["head.weight"], reference[-1][0]["head.weight"])


class _SharedAcross(nn.Module):
    """`fc` runs once before, twice inside `inner` (checkpointed), and once after it."""

    def __init__(self, d):
        super().__init__()
        self.fc = ReusedLayer(d, seed=3).fc
        self.inner = ReusedLayer(d, seed=4)
        self.inner.fc = self.fc

    def forward(self, x):
        return self.fc(self.inner(F.relu(self.fc(x))))


@pytest.mark.parametrize("route", list(ROUTES))
def test_transform_checkpoint_observes_reused_layer_once(route):
    recipe = fp8fn.DelayedScaling(history_len=4)
    model = _SharedAcross(D)
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, D, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    results = []
    for checkpoint_fn in (None, lambda name, m: name == "inner"):
        fn = fp8fn.transform(model, recipe, checkpoint_fn=checkpoint_fn)
        state = fn.init(x)
        assert list(state) == ["fc", "fc#1", "fc#2", "fc#3", "inner.out"]
        grads, obs = ROUTES[route](fn, params, state, x, y)
        results.append((grads, obs))
    assert fn.checkpointed == ["inner"]
    (grads, obs), (want_grads, want_obs) = results[1], results[0]
    assert_bit_identical(obs, want_obs)
    assert_bit_identical(grads["inner.out.weight"], want_grads["inner.out.weight"])
    # `fc`'s gradient sums four calls, two of them inside the recompute: the checkpoint adds
    # those two first, so the sum is associated differently (float rounding, not a bug).
    torch.testing.assert_close(grads, want_grads, rtol=1e-6, atol=1e-8)
    w_amax = model.fc.weight.abs().max()
    # Every role of every site observed once: one amax at position 0, nothing else.
    assert bool((obs.amax_history[..., 0] > 0).all()), obs.amax_history
    assert not obs.amax_history[..., 1:].any() and not obs.scale.any()
    for site in ("fc", "fc#1", "fc#2", "fc#3"):  # one observation of the shared weight, not
        assert torch.equal(obs[site].weight.amax_history[0], w_amax)  # two summed
    assert torch.equal(obs["inner.out"].weight.amax_history[0], model.inner.out.weight.abs().max())
    assert torch.equal(obs["fc"].input.amax_history[0], x.abs().max())


def _two_layers(p, s, x, cfg):
    """Two fp8 linears; `p` a dict of tensors, `s` an fp8fn.State, `cfg` non-tensors."""
    h = F.gelu(fp8fn.linear(x, p["w1"], p["b1"], s["l1"], cfg["recipe"]))
    h = F.dropout(h, cfg["p"], training=cfg["p"] > 0)
    return fp8fn.linear(h, p["w2"], None, s["l2"], cfg["recipe"]) * cfg["scale"]


def _problem(updated=False, p=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    recipe = fp8fn.DelayedScaling(history_len=4)
    params = {
        "w1": torch.randn(24, 16, generator=gen),
        "b1": torch.randn(24, generator=gen),
        "w2": torch.randn(8, 24, generator=gen) * 0.1,
    }
    state = fp8fn.init_state(recipe, ["l1", "l2"])
    x = torch.randn(6, 16, generator=gen)
    cfg = {"recipe": recipe, "p": p, "scale": 2, "name": "two", "unused": None}
    if updated:  # a state with history, so the forward casts with delayed (stored) scales
        _, obs = torch.func.grad(_loss(False), argnums=(0, 1))(params, state, x, cfg)
        state = fp8fn.update(state, obs)
    return params, state, x, cfg


def _loss(checkpointed):
    def loss(p, s, x, cfg):
        out = (
            fp8fn.checkpoint(_two_layers, p, s, x, cfg)
            if checkpointed
            else _two_layers(p, s, x, cfg)
        )
        return out.square().mean()

    return loss


@pytest.mark.parametrize("updated", [False, True])
def test_checkpoint_matches_under_func_grad(updated):
    args = _problem(updated)
    want = torch.func.grad(_loss(False), argnums=(0, 1, 2))(*args)
    got = torch.func.grad(_loss(True), argnums=(0, 1, 2))(*args)
    assert_bit_identical(got, want)
    assert got[1]["l2"].grad_output.amax_history[0] > 0


def test_checkpoint_matches_under_func_vjp():
    params, state, x, cfg = _problem(updated=True)
    ct = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))

    def vjp(f):
        out, vjp_fn = torch.func.vjp(lambda p, s, x: f(p, s, x, cfg), params, state, x)
        return out, vjp_fn(ct)

    want = vjp(_two_layers)
    got = vjp(lambda *a: fp8fn.checkpoint(_two_layers, *a))
    assert_bit_identical(got, want)


def test_checkpoint_nested_under_func_grad():
    args = _problem(updated=True)

    def outer(p, s, x, cfg):
        h = fp8fn.checkpoint(_two_layers, p, s, x, cfg)  # a checkpoint inside a checkpoint
        return torch.tanh(h).sum(-1)

    def loss(nested):
        def f(p, s, x, cfg):
            out = fp8fn.checkpoint(outer, p, s, x, cfg) if nested else outer(p, s, x, cfg)
            return out.square().mean()

        return f

    want = torch.func.grad_and_value(loss(False), argnums=(0, 1))(*args)
    got = torch.func.grad_and_value(loss(True), argnums=(0, 1))(*args)
    assert_bit_identical(got, want)


def _autograd_grads(loss, params, state, x, cfg):
    leaves = (params, state, x)
    leaves = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), leaves)
    loss(*leaves, cfg).backward()
    # A leaf the loss does not depend on gets None plainly, zeros through the checkpoint.
    return pytree.tree_map(lambda t: torch.zeros_like(t) if t.grad is None else t.grad, leaves)


@pytest.mark.parametrize("updated", [False, True])
def test_checkpoint_matches_under_autograd(updated):
    args = _problem(updated)
    got = _autograd_grads(_loss(True), *args)
    want = _autograd_grads(_loss(False), *args)
    assert_bit_identical(got, want)
    assert_bit_identical(got, torch.func.grad(_loss(True), argnums=(0, 1, 2))(*args))


def _silu_grads(f, a, b, route):
    if route == "func":
        return torch.func.grad(f, argnums=(0, 1))(a, b)
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    f(a, b).backward()
    return a.grad, b.grad


@pytest.mark.parametrize("route", ["func", "autograd"])
def test_checkpoint_differentiates_the_recompute_on_the_callers_route(route):
    # torch.func's derivative of `F.silu` rounds differently from autograd's (torch 2.13): a
    # recompute differentiated by torch.func under `backward()` changed the last bits. Nested
    # checkpoints too.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 32, generator=gen), torch.randn(32, 48, generator=gen)

    def f(a, b):
        return torch.nn.functional.silu(a @ b).square().sum()

    def nested(a, b):
        return fp8fn.checkpoint(lambda a, b: fp8fn.checkpoint(f, a, b) * 2, a, b)

    want = _silu_grads(f, a, b, route)
    assert_bit_identical(_silu_grads(lambda a, b: fp8fn.checkpoint(f, a, b), a, b, route), want)
    doubled = _silu_grads(nested, a, b, route)
    assert_bit_identical(doubled, tuple(g * 2 for g in want))
    other = _silu_grads(f, a, b, "autograd" if route == "func" else "func")
    assert not torch.equal(other[0], want[0])  # the two engines differ here


@pytest.mark.parametrize("route", ["func", "autograd"])
def test_checkpoint_restores_rng_for_dropout(route):
    args = _problem(updated=True, p=0.5)
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(123)
        if route == "func":
            grads = torch.func.grad(_loss(checkpointed), argnums=(0, 1, 2))(*args)
        else:
            grads = _autograd_grads(_loss(checkpointed), *args)
        results.append((grads, torch.rand(4)))  # the global RNG advanced by the same draws
    assert_bit_identical(results[1], results[0])
    torch.manual_seed(124)
    other = torch.func.grad(_loss(False), argnums=0)(*args)
    assert not torch.equal(other["w1"], results[0][0][0]["w1"])  # dropout is really random


def test_checkpoint_passes_non_tensor_leaves_through():
    params, state, x, cfg = _problem()
    seen = []

    def f(p, s, x, cfg):
        seen.append(cfg)
        out = _two_layers(p, s, x, cfg)
        return {"out": out, "argmax": out.argmax(-1), "n": torch.tensor(cfg["scale"])}

    def loss(p, s, x):
        out = fp8fn.checkpoint(f, p, s, x, cfg)
        assert out["argmax"].dtype == torch.int64
        return out["out"].square().mean()

    def plain(p, s, x):
        return _two_layers(p, s, x, cfg).square().mean()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(params, state, x)
    assert len(seen) == 2  # the forward, then the recompute
    for c in seen:
        assert c == cfg and c["recipe"] is cfg["recipe"] and c["unused"] is None
    assert_bit_identical(got, torch.func.grad(plain, argnums=(0, 1, 2))(params, state, x))


@pytest.mark.parametrize("bad", [lambda x: (x, "label"), lambda x: None, lambda x: [x, 3]])
def test_checkpoint_rejects_non_tensor_output(bad):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="fp8fn.checkpoint: expected `f` to return a pytree"):
        fp8fn.checkpoint(bad, x)
    with pytest.raises(TypeError, match="fp8fn.checkpoint"):
        torch.func.grad(lambda x: fp8fn.checkpoint(bad, x)[0].sum())(x.detach())


@pytest.mark.parametrize("f", [3, None, torch.ones(2)], ids=["int", "None", "tensor"])
def test_checkpoint_refuses_a_non_function(f):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(
        TypeError,
        match=rf"^fp8fn\.checkpoint: expected `f` to be a function of the arguments that follow "
        rf"it, got {type(f).__name__}\. Call it as fp8fn\.checkpoint\(f, \*args\)\.$",
    ):
        fp8fn.checkpoint(f, x)


def _saved_bytes(fn, params, state, x):
    """The tensors fn.apply saves for the backward, split into activations and the rest."""
    exclude = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((params, state))}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn.apply(params, state, x)
    activations = {}
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            activations[ptr] = t  # deduplicated by storage
    return activations, saved


class _BatchNormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)))


def _batch_norm_step(checkpointed: bool, route: str):
    """The batch norm's buffers after one training step of a fresh model, and the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(_BatchNormBlock(), nn.Linear(8, 4)).train()
    chosen = (lambda name, module: name == "0") if checkpointed else None
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(history_len=4), checkpoint_fn=chosen)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    state = fn.init(x)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, s):
        return fn.apply(p, s, x).square().sum()

    if route == "func":
        grads = torch.func.grad(loss, argnums=(0, 1))(params, state)
    elif route == "value_and_grad":
        grads = fp8fn.value_and_grad(loss, argnums=(0, 1))(params, state)[1]
    else:
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        observed = fp8fn.observe(state)
        loss(leaves, observed).backward()
        grads = ({k: v.grad for k, v in leaves.items()}, fp8fn.observations(observed))
    return dict(model[0].norm.named_buffers()), grads


@pytest.mark.parametrize("route", ["autograd", "value_and_grad", "func"])
def test_checkpoint_fn_updates_batch_norm_statistics_once(route):
    # The recompute in the backward runs the block's forward again; the running statistics
    # must be those of one forward, bit for bit: as without checkpoint_fn.
    buffers, grads = _batch_norm_step(True, route)
    # (torch.func refuses batch norm's in-place update without checkpoint_fn: the reference is
    # plain autograd, which gives torch.func's numbers elsewhere.)
    want, want_grads = _batch_norm_step(False, "autograd" if route == "func" else route)
    assert int(buffers["num_batches_tracked"]) == 1
    assert not torch.equal(want["running_mean"], torch.zeros(8))  # the step moved them
    assert not torch.equal(want["running_var"], torch.ones(8))
    assert_bit_identical(buffers, want)
    assert_bit_identical(grads, want_grads)


def test_transform_checkpoint_saves_only_block_inputs():
    recipe = fp8fn.DelayedScaling(history_len=4)
    model = nn.Sequential(*(Block(D, HEADS) for _ in range(BLOCKS)))
    x = torch.randn(BATCH, SEQ, D, requires_grad=True)
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    plain = fp8fn.transform(model, recipe)
    state = plain.init(x)
    ckpt = fp8fn.transform(model, recipe, checkpoint_fn=is_block)
    # A fresh observed state per forward (apply refuses a second use of an observed state).
    want, _ = _saved_bytes(plain, params, fp8fn.observe(state), x)
    got, saved = _saved_bytes(ckpt, params, fp8fn.observe(state), x)
    # Saved: each block's input (x, then the previous block's output), its parameters and
    # the scaling state; nothing else.
    assert len(got) == BLOCKS and x.untyped_storage().data_ptr() in got
    assert all(t.shape == x.shape and t.dtype == x.dtype for t in got.values())
    block_params = sum(len(list(b.parameters())) for b in model)
    n_state = len(pytree.tree_leaves(state))
    assert n_state == 2  # the packed state: two tensors, whatever the number of sites
    assert len(saved) == BLOCKS * (1 + n_state) + block_params
    got_bytes = sum(t.nbytes for t in got.values())
    want_bytes = sum(t.nbytes for t in want.values())
    assert got_bytes == BLOCKS * x.nbytes
    assert want_bytes > 10 * got_bytes, (want_bytes, got_bytes)


def test_transform_checkpoint_saved_state_under_func():
    """Under torch.func.grad the same checkpointed forward gives the same result as plain."""
    model = MLP([D, 2 * D, D])
    recipe = fp8fn.DelayedScaling(history_len=4)
    x = torch.randn(BATCH, D)
    params = {k: v.detach() for k, v in model.named_parameters()}
    outs = []
    for checkpoint_fn in (None, lambda name, m: name == ""):
        fn = fp8fn.transform(model, recipe, checkpoint_fn=checkpoint_fn)
        state = fn.init(x)
        outs.append(
            torch.func.grad(lambda p, s: fn.apply(p, s, x).square().sum(), argnums=(0, 1))(
                params, state
            )
        )
    assert fn.checkpointed == [""]
    assert_bit_identical(outs[1], outs[0])


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_apply_refuses_model_own_torch_checkpoint(mode):
    model = Transformer(VOCAB, D, HEADS, BLOCKS, SEQ, torch_checkpoint=mode)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, dims=1)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(history_len=4))
    state = fn.init(x)
    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(RuntimeError, match="fp8fn.apply: .*torch.utils.checkpoint"):
        func_route(fn, params, state, x, y)
    with pytest.raises(RuntimeError, match="fp8fn.apply: .*torch.utils.checkpoint"):
        autograd_route(fn, params, state, x, y)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_apply_model_own_torch_checkpoint_without_fp8_layers_is_never_silently_wrong(mode):
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    runs = []
    for torch_checkpoint in (None, mode):
        model = Transformer(VOCAB, D, HEADS, BLOCKS, SEQ, torch_checkpoint=torch_checkpoint)
        # Only the head runs in fp8: the checkpointed blocks hold no converted layer.
        fn = fp8fn.transform(model, fp8fn.DelayedScaling(history_len=4), lambda n, m: n == "head")
        # Parameters other than the module's own, as after a functional optimizer step.
        params = {k: v.detach() * 1.5 for k, v in model.named_parameters()}
        runs.append((fn, params, fn.init(x)))
    y = x.roll(-1, dims=1)
    autograd_route(*runs[0], x, y)  # without the model's own checkpointing: fine
    with pytest.raises(RuntimeError, match=r"fp8fn.apply: the model runs torch.utils.checkpoint"):
        autograd_route(*runs[1], x, y)


@pytest.mark.slow
def test_transform_checkpoint_under_compile_is_eager_or_refused():
    model = Transformer(VOCAB, D, HEADS, BLOCKS, SEQ)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(history_len=4), checkpoint_fn=is_block)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, dims=1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fn.init(x)
    eager_grads, eager_obs = autograd_route(fn, params, state, x, y)
    torch._dynamo.reset()
    compiled = types.SimpleNamespace(apply=torch.compile(fn.apply, fullgraph=True))
    with pytest.raises(Exception, match="fp8fn.checkpoint: torch.compile cannot trace"):
        autograd_route(compiled, params, state, x, y)
    torch._dynamo.reset()
    compiled = types.SimpleNamespace(apply=torch.compile(fn.apply))  # blocks then run eagerly
    grads, obs = autograd_route(compiled, params, state, x, y)
    torch._dynamo.reset()
    for k in eager_grads:
        torch.testing.assert_close(grads[k], eager_grads[k], rtol=1e-4, atol=1e-6)
    assert type(obs) is fp8fn.State and obs.static == eager_obs.static
    assert_bit_identical(obs["blocks.0.fc1"].input, eager_obs["blocks.0.fc1"].input)
    assert_bit_identical(obs.amax_history[:, 1], eager_obs.amax_history[:, 1])  # weight amaxes


@pytest.mark.slow
@pytest.mark.parametrize("fp8_layers", [False, True], ids=["no_fp8_layer", "fp8_layers"])
def test_transform_checkpoint_under_compiled_value_and_grad_runs_blocks_eagerly(fp8_layers):
    # The checkpointed blocks run eagerly under torch.compile, forward and recompute, whether or
    # not they hold an fp8 layer (whose guard refuses dynamo on its own). Without fp8 layers
    # dynamo used to compile the recompute's torch.func.grad, and AOTAutograd then raised
    # "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
    # implemented" (python -m fp8fn.demo --compile, its float32 run).
    model = Transformer(VOCAB, D, HEADS, BLOCKS, SEQ)
    filter_fn = None if fp8_layers else (lambda name, m: False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "fp8fn.transform: no layer was converted")
        fn = fp8fn.transform(
            model, fp8fn.DelayedScaling(history_len=4), filter_fn=filter_fn, checkpoint_fn=is_block
        )
    assert fn.checkpointed == ["blocks.0", "blocks.1"] and bool(fn.layers) == fp8_layers
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, dims=1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fn.init(x)

    def loss(params, state):
        return F.cross_entropy(fn.apply(params, state, x).flatten(0, 1), y.flatten())

    want = fp8fn.value_and_grad(loss, argnums=(0, 1))(params, state)
    torch._dynamo.reset()
    try:
        got = torch.compile(fp8fn.value_and_grad(loss, argnums=(0, 1)))(params, state)
    finally:
        torch._dynamo.reset()
    assert_bit_identical(got[0], want[0])
    assert_bit_identical(got[1][1], want[1][1])  # observations: the blocks' casts ran eagerly
    for k in want[1][0]:  # the compiled head and embeddings round differently
        torch.testing.assert_close(got[1][0][k], want[1][0][k], rtol=1e-4, atol=1e-6)


class _TopOneBlock(nn.Module):
    """A hard top-1 router over two experts (the router's weight gets no gradient: argmax),
    an expert no token of the batch picks, and a layer the forward never calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(16, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.unused = nn.Linear(16, 16)

    def forward(self, x):
        pick = self.router(x).argmax(-1, keepdim=True)
        pick = torch.zeros_like(pick)  # every token to expert 0: expert 1 not reached
        return torch.where(pick == 0, self.experts[0](x), self.experts[1](x).detach())


@pytest.mark.parametrize(
    "recipe", [fp8fn.DelayedScaling(), fp8fn.CurrentScaling()], ids=["delayed", "current"]
)
def test_checkpoint_fn_gives_the_gradients_of_the_model_without_it_none_included(recipe):
    """Plain autograd: `.grad` of every parameter exactly as without `checkpoint_fn`, None
    where the loss does not reach it (0.4 gave zeros, and AdamW's weight decay then moved the
    router by 2.5e-4 in one step)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    grads, weights = [], []
    for checkpoint_fn in (None, lambda name, m: isinstance(m, _TopOneBlock)):
        model = nn.Sequential(_TopOneBlock(), nn.Linear(16, 16))
        fn = fp8fn.transform(model, recipe, checkpoint_fn=checkpoint_fn)
        state = fn.init(x)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        fn.apply(dict(model.named_parameters()), fp8fn.observe(state), x).square().sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
        opt.step()
        weights.append({k: p.detach().clone() for k, p in model.named_parameters()})
    unreached = {"0.router.weight", "0.experts.1.weight", "0.experts.1.bias"}
    unreached |= {"0.unused.weight", "0.unused.bias"}
    for got in grads:  # (assert_bit_identical takes None for zeros)
        assert {k for k, g in got.items() if g is None} == unreached
    assert_bit_identical(grads[1], grads[0])
    assert_bit_identical(weights[1], weights[0])


def test_checkpoint_leaves_the_gradient_of_an_unreached_argument_none():
    """`fp8fn.checkpoint` under `loss.backward()`: an argument the output does not reach keeps
    `.grad` None, as without the checkpoint (0.4: zeros)."""
    p = {k: torch.randn(4, 4).requires_grad_() for k in ("used", "unused", "argmax")}
    x = torch.randn(2, 4)

    def f(p, x):
        pick = (x @ p["argmax"]).argmax(-1, keepdim=True).float()
        return (torch.tanh(x @ p["used"]) * (pick + 1)).sum()

    fp8fn.checkpoint(f, p, x).backward()
    assert p["unused"].grad is None and p["argmax"].grad is None
    want = {k: t.detach().requires_grad_() for k, t in p.items()}
    f(want, x).backward()
    assert torch.equal(p["used"].grad, want["used"].grad)
