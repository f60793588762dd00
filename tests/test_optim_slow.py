"""fp8fn.optim across processes and compilers: bit-identical updates on every mesh (gloo
ranks, `_optim_workers`), the compiled step against eager, the torch.optim adapter under
FSDP2 with torch.distributed.checkpoint."""

from __future__ import annotations

import _optim_workers as workers
import pytest
import torch
from _helpers import bits
from _spawn import assert_ok, spawn_results

import fp8fn

_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """(its directory, `{rank: {scenario: "ok" | traceback}}`) of one spawn on 2 ranks running
    every scenario, then `dcp_save`, whose checkpoint stays in the directory."""
    out_dir = tmp_path_factory.mktemp("optim_workers")
    names = [s.__name__ for s in workers.SCENARIOS] + ["dcp_save"]
    return out_dir, spawn_results(workers.main, workers.WORLD, out_dir, _TIMEOUT_S, names)


@pytest.fixture(scope="module")
def results(spawned):
    return spawned[1]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in workers.SCENARIOS])
def test_layout_invariance(results, scenario):
    assert_ok(results, scenario)


@pytest.mark.slow
def test_dcp_checkpoint_under_fsdp2_resumes_on_another_world_size(spawned):
    """fp8fn.optim.AdamW's float8 moments saved by torch.distributed.checkpoint on 2 FSDP2
    ranks, loaded on 1: the next step is bit-identical to the uninterrupted 2-rank run."""
    out_dir, saved = spawned
    assert_ok(saved, "dcp_save", "dcp_save, ")
    resumed = spawn_results(workers.main, 1, out_dir, _TIMEOUT_S, ["dcp_resume"])
    assert_ok(resumed, "dcp_resume", "dcp_resume, ")


# ----------------------------------------------------------------------------- compiled


def _leaf_bits(tree) -> list:
    return [bits(t) for t in torch.utils._pytree.tree_leaves(tree)]


def _assert_same_bits(a, b) -> None:
    la, lb = _leaf_bits(a), _leaf_bits(b)
    assert len(la) == len(lb)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.slow
@pytest.mark.parametrize("moments", ["fp8", "bf16"])
def test_compiled_update_is_eager_bit_for_bit(moments):
    """`torch.compile(opt.update, fullgraph=True)` over 3 steps of gradients of growing size,
    shapes that are not multiples of the block: params and state bit-identical to eager."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (96, 70), "b": (70,), "e": (33, 129)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    opt = fp8fn.optim.adamw(1e-2, moments=moments, min_size=64)
    compiled = torch.compile(opt.update, fullgraph=True)
    eager = fused = (params, opt.init(params))
    for i in range(3):
        grads = {k: torch.randn(s, generator=gen) * 10.0 ** (i - 2) for k, s in shapes.items()}
        eager = opt.update(grads, eager[1], eager[0])
        fused = compiled(grads, fused[1], fused[0])
    _assert_same_bits(fused, eager)


@pytest.mark.slow
def test_one_compiled_step_has_no_graph_break_and_the_eager_update():
    """`value_and_grad` + `clip_by_global_norm` + `opt.update` + `fp8fn.update` in one
    `torch.compile(fullgraph=True)` (torch 2.13 traces `torch.autograd.grad` with
    `torch._dynamo.config.trace_autograd_ops`): 0 graph breaks; the optimizer's results are
    those of the eager update on the step's own (compiled) gradients, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    x, y = torch.randn(16, 64), torch.randn(16, 32)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = fp8fn.optim.adamw(1e-2, moments="fp8", min_size=64)
    grad_fn = fp8fn.value_and_grad(lambda p, s: (fn.apply(p, s, x) - y).square().mean(), (0, 1))

    def step(params, state, opt_state):
        loss, (grads, obs) = grad_fn(params, state)
        grads, _ = fp8fn.optim.clip_by_global_norm(grads, 1.0)
        new_params, opt_state = opt.update(grads, opt_state, params)
        return loss, grads, new_params, fp8fn.update(state, obs), opt_state

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        explained = torch._dynamo.explain(step)(params, fn.init(x), opt.init(params))
        assert explained.graph_break_count == 0
        compiled = torch.compile(step, fullgraph=True)
        state, opt_state = fn.init(x), opt.init(params)
        for _ in range(2):
            _, grads, new_params, state, new_opt_state = compiled(params, state, opt_state)
            _assert_same_bits((new_params, new_opt_state), opt.update(grads, opt_state, params))
            params, opt_state = new_params, new_opt_state
