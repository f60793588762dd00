"""The router (`_transform/routing.py`, with `forms.py`, `tracking.py`, `refusals.py`): each call of
a layer is its own site, with its own observations; errors name `apply` and the layer."""

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    DELAYED,
    assert_bit_identical,
    autograd_step,
    loss_of,
    params_of,
)
from _models import Branchy, ReusedLayer
from torch import nn

import fp8fn


class HashNamed(nn.Module):
    """`fc` and a module named `fc#1`, each called twice, interleaved.

    Sites, in module order then call order: `fc`, `fc#1` (`fc`'s second call), `fc##1` (the
    module `fc#1`), `fc##1#1` (the second call of `fc#1`).
    """

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            self.fc = nn.Linear(16, 16)
            self.add_module("fc#1", nn.Linear(16, 16))

    def forward(self, x):
        other = getattr(self, "fc#1")
        x = F.relu(other(F.relu(self.fc(x))))
        return other(F.relu(self.fc(x)))


def test_init_names_a_module_whose_name_contains_hash_apart_from_repeated_calls():
    model = HashNamed()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    params, state = params_of(model), fn.init(x)
    assert list(state) == ["fc", "fc#1", "fc##1", "fc##1#1"]  # module order, then calls
    assert fn.layers == ["fc", "fc#1"]
    fc, other = model.fc, getattr(model, "fc#1")

    def reference(p, s, x):
        """The model by hand, each call with its own site; also the calls' inputs."""
        w, o = (p["fc.weight"], p["fc.bias"]), (p["fc#1.weight"], p["fc#1.bias"])
        h1 = F.relu(fp8fn.linear(x, *w, s["fc"], DELAYED))
        h2 = F.relu(fp8fn.linear(h1, *o, s["fc##1"], DELAYED))
        h3 = F.relu(fp8fn.linear(h2, *w, s["fc#1"], DELAYED))
        return fp8fn.linear(h3, *o, s["fc##1#1"], DELAYED), (x, h1, h2, h3)

    def ref_loss(p, s, x):
        return reference(p, s, x)[0].square().mean()

    for step in range(3):
        want, inputs = reference(params, state, x)
        assert torch.equal(fn.apply(params, state, x), want)
        obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
        assert_bit_identical(obs, torch.func.grad(ref_loss, argnums=1)(params, state, x))
        assert_bit_identical(autograd_step(fn, params, state, x)[1], obs)
        # Each site saw its own call: its input, its layer's weight.
        newest = obs.amax_history[..., 0]
        x_, h1, h2, h3 = (h.detach().abs().max() for h in inputs)  # calls: fc, fc#1, fc, fc#1
        assert torch.equal(newest[:, 0], torch.stack([x_, h2, h1, h3]))
        w_fc, w_other = fc.weight.abs().max(), other.weight.abs().max()
        assert torch.equal(newest[:, 1], torch.stack([w_fc, w_fc, w_other, w_other]))
        assert bool((newest > 0).all()) and not obs.amax_history[..., 1:].any()
        state = fp8fn.update(state, obs)
        assert bool((state.amax_history[..., : step + 1] > 0).all())


def test_observations_are_amaxes_of_each_call():
    model = ReusedLayer(16)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    state = fn.init(x)
    params = params_of(model)
    obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
    fc = (params["fc.weight"], params["fc.bias"])

    def by_hand(p, s, x):
        h1 = F.relu(fp8fn.linear(x, *fc, s["fc"], DELAYED))
        h2 = F.relu(fp8fn.linear(h1, *fc, s["fc#1"], DELAYED))
        return fp8fn.linear(h2, p["out.weight"], p["out.bias"], s["out"], DELAYED), h1, h2

    with torch.no_grad():
        _, h1, h2 = by_hand(params, state, x)
    assert obs["fc"].input.amax_history[0] == x.abs().max()
    assert obs["fc#1"].input.amax_history[0] == h1.abs().max()
    assert obs["out"].input.amax_history[0] == h2.abs().max()
    assert obs["fc"].weight.amax_history[0] == model.fc.weight.abs().max()
    assert obs["fc#1"].weight.amax_history[0] == model.fc.weight.abs().max()
    assert obs["out"].weight.amax_history[0] == model.out.weight.abs().max()
    # The whole packed observation, grad_output amaxes included, is the calls' by hand.
    want = torch.func.grad(lambda p, s, x: by_hand(p, s, x)[0].square().mean(), argnums=1)(
        params, state, x
    )
    assert_bit_identical(obs, want)
    assert bool((obs.amax_history[..., 0] > 0).all())
    assert torch.count_nonzero(obs.amax_history[..., 1:]) == 0
    assert torch.count_nonzero(obs.scale) == 0


def test_site_that_did_not_run_keeps_its_state():
    model = Branchy(16)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    params, state = params_of(model), fn.init(x)
    assert list(state) == ["fc1", "extra", "fc2"]
    for _ in range(2):
        obs = torch.func.grad(loss_of(fn), argnums=1)(params, state, x)
        assert torch.count_nonzero(obs["extra"].amax_history) == 0
        state = fp8fn.update(state, obs)
    assert torch.equal(state["extra"].amax_history, torch.zeros(3, 4))
    assert torch.equal(state["extra"].scale, torch.ones(3))
    assert bool((state.amax_history[[0, 2], :, :2] > 0).all())
    assert torch.count_nonzero(state.amax_history[..., 2:]) == 0
    _, auto_obs = autograd_step(fn, params, state, x)
    assert torch.count_nonzero(auto_obs["extra"].amax_history) == 0
    updated = fp8fn.update(state, auto_obs)
    assert_bit_identical(updated["extra"], state["extra"])
    assert not torch.equal(updated["fc1"].amax_history, state["fc1"].amax_history)


@pytest.mark.parametrize(
    "recipe, x, error, match",
    [
        (
            fp8fn.MXScaling(),
            torch.ones(2, 32, dtype=torch.float16),
            TypeError,
            r"expected `x` and `weight` in float32 or bfloat16 under MXScaling, got float16",
        ),
        (
            fp8fn.NVFP4Scaling(),
            torch.ones(0, 32),
            ValueError,
            r"expected non-empty `x` and `weight` under NVFP4Scaling, got x \(0, 32\)",
        ),
    ],
    ids=["mx-float16", "nvfp4-empty"],
)
def test_op_errors_through_apply_name_apply_and_the_layer(recipe, x, error, match):
    model = nn.Sequential(nn.Linear(32, 16)).to(x.dtype)
    fn = fp8fn.transform(model, recipe)
    state = fn.init(torch.ones(2, 32, dtype=x.dtype))
    with pytest.raises(error, match=r"^fp8fn\.apply: layer '0': " + match):
        fn.apply(params_of(model), state, x)
