"""torch.compile stays compiled over training steps: two compiles, then none.

The first step (empty histories: current scaling) and the steady state (histories filled: the
stored scales alone, `State.filled` in the tree structure) are two graphs; every later step
reuses the second. fp8fn 0.4 recompiled at every step on a tiny transformers Qwen3-MoE (52, 21,
14, 17 ... s per step until torch's recompile limit, then eager): dynamo guarded on a lookup by
`id(weight)` (a router's `F.linear` on its own weight), and the parameters are new tensors at
each step. Counted with dynamo's own counter (`CompileCounter`, a backend that runs the traced
graphs as they are: the guards, and so the compiles, are dynamo's, whatever the backend).
"""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from _models import tiny_hf_config
from torch import nn
from torch._dynamo.testing import CompileCounter

import fp8fn

pytestmark = pytest.mark.slow  # dynamo traces a model 2 x 2 times: tens of seconds

STEPS = 4


def _value_and_grad_route(fn, loss_of, backend):
    step = torch.compile(fp8fn.value_and_grad(loss_of(fn.apply), argnums=(0, 1)), backend=backend)

    def run(params, state, batch):
        _, (grads, obs) = step(params, state, batch)
        return grads, obs

    return run


def _autograd_route(fn, loss_of, backend):
    apply = torch.compile(fn.apply, backend=backend)

    def run(params, state, batch):
        leaves = {k: v.requires_grad_() for k, v in params.items()}
        observed = fp8fn.observe(state)
        loss_of(apply)(leaves, observed, batch).backward()
        return {k: v.grad for k, v in leaves.items()}, fp8fn.observations(observed)

    return run


ROUTES = {"value_and_grad": _value_and_grad_route, "autograd": _autograd_route}


def _compiles(model, batch, loss_of, route):
    """Dynamo's compiled frames after each of `STEPS` SGD steps from `fn.init`, new parameter
    tensors every step (as an optimizer's functional loop makes them)."""
    torch._dynamo.reset()
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the routers' high-precision GEMMs
        state = fn.init(batch)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    counter = CompileCounter()
    step = ROUTES[route](fn, loss_of, counter)
    frames = []
    for _ in range(STEPS):
        grads, obs = step(params, state, batch)
        state = fp8fn.update(state, obs)
        params = {k: (v - 0.1 * grads[k]).detach() for k, v in params.items()}
        frames.append(counter.frame_count)
    torch._dynamo.reset()
    return frames


def _twice(frames):
    """The second step compiles as many frames as the first (the steady graph), none after."""
    assert frames == [frames[0], 2 * frames[0], *[2 * frames[0]] * (STEPS - 2)], frames


class _SmallMoE(nn.Module):
    """A Linear, a softmax router (`F.linear` on its own weight: high precision) and two
    experts as `F.linear(h, W[e])`: the form that recompiled at every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 2, bias=False)
        self.experts = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, x):
        h = self.proj(x)
        w = F.softmax(self.gate(h), -1)
        return w[:, :1] * F.linear(h, self.experts[0]) + w[:, 1:] * F.linear(h, self.experts[1])


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_small_moe_compiles_twice(route):
    def loss_of(apply):
        return lambda p, s, x: apply(p, s, x).square().mean()

    frames = _compiles(_SmallMoE(), torch.randn(8, 16), loss_of, route)
    assert frames == [1, 2, 2, 2]


def _lm_loss(apply):
    return lambda p, s, ids: apply(p, s, ids, labels=ids).loss


# Compiled, transformers' "eager" and "batched_mm" experts implementations raise torch's
# TypeError ("arange() received ... device=torch.Size": `inputs_embeds.device` read as a shape
# in the model's forward) with fp8fn 0.4 as now, whatever the backend (seen on Mixtral; its
# grouped_mm compiles): not fixed here.
EAGER_EXPERTS_BUG = pytest.mark.xfail(
    raises=TypeError, strict=True, reason="compiled eager/batched_mm experts: TypeError (0.4 too)"
)
# Each case traces a model 2 x 2 times (30-70 s on 2 cores): the CI tier runs one per kind of
# model and experts form, both routes on the MoE the issue saw recompile (Qwen3-MoE); every
# model x experts implementation x route (46 cases, ~35 min) with FP8FN_EXHAUSTIVE=1.
EVERY = os.environ.get("FP8FN_EXHAUSTIVE") == "1"
CI_CASES = {
    ("qwen3_moe", "grouped_mm", "value_and_grad"),
    ("qwen3_moe", "grouped_mm", "autograd"),
    ("mixtral", "eager", "value_and_grad"),  # the compiled eager-experts failure, pinned
    ("llama4", "bmm", "autograd"),
    ("llama", None, "value_and_grad"),
}


def _case(*key):
    return [] if EVERY or key in CI_CASES else [pytest.mark.skip(reason="FP8FN_EXHAUSTIVE=1")]


MOE = [
    (arch, impl, EAGER_EXPERTS_BUG if impl != "grouped_mm" else ())
    for arch in ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3")
    for impl in ("eager", "batched_mm", "grouped_mm")
] + [("llama4", "bmm", ())]
MOE_CASES = [
    pytest.param(arch, impl, route, marks=[*([bug] if bug else []), *_case(arch, impl, route)],
                 id=f"{arch}-{impl}-{route}")
    for arch, impl, bug in MOE
    for route in ROUTES
]  # fmt: skip


@pytest.mark.parametrize(("arch", "impl", "route"), MOE_CASES)
def test_a_transformers_moe_model_compiles_twice(arch, impl, route):
    from _moe_models import batch, build

    _twice(_compiles(build(arch, impl), batch(), _lm_loss, route))


@pytest.mark.parametrize(
    ("kind", "route"),
    [
        pytest.param(kind, route, marks=_case(kind, None, route), id=f"{kind}-{route}")
        for kind in ("llama", "mistral", "gpt2")
        for route in ROUTES
    ],
)
def test_a_transformers_dense_model_compiles_twice(kind, route):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    _twice(_compiles(model, ids, _lm_loss, route))
