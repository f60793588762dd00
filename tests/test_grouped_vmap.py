"""The grouped (experts) op's companions: vmap (the ensemble pattern) and the first-order guard.

fp8fn 0.4's grouped op had no vmap rule: `fp8fn.stack_states` + `torch.func.vmap` over a model
whose experts run as one bmm raised torch's "You tried to vmap over _Fp8GroupedMM" (plain torch
vmaps the model), and the finer recipes' ops (dense and grouped) let a second derivative
through their quantized backward silently. Each member of a vmap is the unbatched call, bit for
bit; a second derivative raises fp8fn's error naming the API.
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from _helpers import assert_bit_identical
from torch import nn

import fp8fn

RECIPES = [
    fp8fn.DelayedScaling(history_len=4),
    fp8fn.CurrentScaling(),
    fp8fn.RowwiseScaling(),
    fp8fn.NVFP4Scaling(),
]
IDS = ["delayed", "current", "rowwise", "nvfp4"]


class _Experts(nn.Module):
    """Two experts `(2, 32, 32)`: `bmm` with batch e as expert e (Llama 4's form), or
    `torch._grouped_mm` over rows routed by the sign of the input's first column."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(2, 32, 32) / 6)

    def forward(self, x):  # x (2, 16, 32)
        if self.form == "bmm":
            return torch.bmm(x, self.w.transpose(1, 2))
        return torch.stack([torch._grouped_mm(x[0], self.w.transpose(-2, -1), offs=_OFFS)] * 2)


_OFFS = torch.tensor([16, 16], dtype=torch.int32)  # expert 1 idle in the grouped form


def _ensemble(form, recipe, members=3):
    models = []
    for i in range(members):
        torch.manual_seed(i)
        models.append(_Experts(form))
    fn = fp8fn.transform(models[0], recipe)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(9))
    params, _ = torch.func.stack_module_state(models)
    states = []
    for i in range(members):  # members whose histories differ (a step apart)
        state = fn.init(x, seed=i)
        for _ in range(i % 2):
            p = {k: v[i] for k, v in params.items()}
            state = fp8fn.update(state, torch.func.grad(_loss(fn), argnums=1)(p, state, x))
        states.append(state)
    return fn, params, fp8fn.stack_states(states), x, states


def _loss(fn):
    return lambda p, s, x: fn.apply(p, s, x).float().square().mean()


@pytest.mark.parametrize("order", ["vmap_of_grad", "grad_of_vmap"])
@pytest.mark.parametrize("form", ["bmm", "grouped_mm"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_an_ensemble_of_experts_models_vmaps_as_each_member_alone(recipe, form, order):
    fn, params, state, x, states = _ensemble(form, recipe)
    grad = torch.func.grad_and_value(_loss(fn), argnums=(0, 1))
    if order == "vmap_of_grad":
        (grads, obs), loss = torch.func.vmap(grad, in_dims=(0, 0, None))(params, state, x)
    else:

        def total(p, s):
            losses = torch.func.vmap(_loss(fn), in_dims=(0, 0, None))(p, s, x)
            return losses.sum(), losses

        (grads, obs), loss = torch.func.grad(total, argnums=(0, 1), has_aux=True)(params, state)
    assert type(obs) is fp8fn.State
    for i, member_state in enumerate(states):
        member = {k: v[i] for k, v in params.items()}
        (g_i, obs_i), loss_i = grad(member, member_state, x)
        assert_bit_identical(loss[i], loss_i)
        assert_bit_identical({k: v[i] for k, v in grads.items()}, g_i)
        assert_bit_identical(pytree.tree_map(lambda t: t[i], obs), obs_i)


def test_an_unbatched_state_differentiated_around_the_vmap_is_refused():
    """grad of vmap with one state for all members: autograd would sum their observations
    (vmap of grad is fine: each member's grad observes its own call, as alone)."""
    fn, params, _, x, states = _ensemble("bmm", RECIPES[0])

    def total(p, s):
        return torch.func.vmap(_loss(fn), in_dims=(0, None, None))(p, s, x).sum()

    with pytest.raises(ValueError, match=r"^fp8fn\.apply: vmap over an experts weight's GEMM wit"):
        torch.func.grad(total, argnums=(0, 1))(params, states[0])
    grad = torch.func.grad(_loss(fn), argnums=(0, 1))
    grads, obs = torch.func.vmap(grad, in_dims=(0, None, None))(params, states[0], x)
    for i in range(3):
        g_i, obs_i = grad({k: v[i] for k, v in params.items()}, states[0], x)
        assert_bit_identical(
            ({k: v[i] for k, v in grads.items()}, obs.amax_history[i]), (g_i, obs_i.amax_history)
        )


GROUPED = [*RECIPES, fp8fn.MXScaling(), fp8fn.BlockwiseScaling()]


@pytest.mark.parametrize("recipe", GROUPED, ids=[*IDS, "mx", "blockwise"])
def test_a_second_derivative_through_experts_names_apply(recipe):
    """0.4: "fp8fn.linear: ..." for the per-tensor and NVFP4 grouped ops (an API the user did
    not call), nothing at all for the finer ones (a silently wrong second derivative)."""
    torch.manual_seed(0)
    model = _Experts("grouped_mm")
    fn = fp8fn.transform(model, recipe)
    x = torch.randn(2, 16, 32, requires_grad=True)
    state = fn.init(x, seed=0)
    out = fn.apply(dict(model.named_parameters()), state, x)
    (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: higher-order derivatives through an"):
        g.square().sum().backward()


@pytest.mark.parametrize(
    "recipe", GROUPED[-2:] + [fp8fn.RowwiseScaling()], ids=["mx", "blockwise", "rowwise"]
)
@pytest.mark.parametrize("wrt", ["x", "weight"])
def test_a_second_derivative_through_a_finer_linear_is_refused(recipe, wrt):
    """The dense finer op's backward quantizes too: 0.4 differentiated through it silently."""
    torch.manual_seed(0)
    weight = torch.randn(64, 128, requires_grad=True)
    x = torch.randn(32, 128, requires_grad=True)
    out = fp8fn.linear(x, weight, None, None, recipe)
    loss = F.gelu(out).square().sum()
    (g,) = torch.autograd.grad(loss, {"x": x, "weight": weight}[wrt], create_graph=True)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.linear: higher-order derivatives"):
        g.square().sum().backward()
