"""The routes to an observation: fp8fn.observe / observations (plain autograd) and
fp8fn.value_and_grad, against torch.func.grad, with the mistakes a loop can make."""

import pytest
import torch
import torch.nn.functional as F
from _helpers import DELAYED, assert_bit_identical, loss_of
from _models import MLP

import fp8fn


def _setup(seed=0):
    model = MLP((16, 32, 8), seed=seed)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    params = {k: v.detach() for k, v in model.named_parameters()}
    return fn, params, fn.init(x), x


def test_observe_and_value_and_grad_equal_torch_func_grad():
    fn, params, state, x = _setup()
    for _ in range(3):
        grads, obs = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        observed = fp8fn.observe(state)
        assert observed.amax_history.is_leaf and observed.amax_history.requires_grad
        assert observed.scale is state.scale and observed.static == state.static
        loss_of(fn)(p, observed, x).backward()
        assert_bit_identical(fp8fn.observations(observed), obs)
        assert_bit_identical({k: v.grad for k, v in p.items()}, grads)
        value, (g2, obs2) = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))(params, state, x)
        assert_bit_identical((g2, obs2), (grads, obs))
        assert torch.equal(value, loss_of(fn)(params, state, x)) and not value.requires_grad
        state = fp8fn.update(state, obs)
    # The observation: the amaxes seen, in position 0 only, and zero scales.
    assert torch.equal(obs.scale, torch.zeros_like(obs.scale))
    assert not obs.amax_history[..., 1:].any() and (obs.amax_history[..., 0] > 0).all()


def test_value_and_grad_has_aux_and_argnums():
    fn, params, state, x = _setup()

    def f(p, s, x):
        out = fn.apply(p, s, x)
        return out.square().mean(), out.shape

    (value, aux), grads = fp8fn.value_and_grad(f, argnums=0, has_aux=True)(params, state, x)
    assert aux == (8, 8) and grads.keys() == params.keys()
    with pytest.raises(TypeError, match=r"fp8fn.value_and_grad: expected `argnums` an int"):
        fp8fn.value_and_grad(f, argnums="0")
    want = r"^fp8fn\.value_and_grad: expected each of `argnums` in \[-3, 3\) .*, got 5\.$"
    with pytest.raises(ValueError, match=want):
        fp8fn.value_and_grad(loss_of(fn), argnums=5)(params, state, x)
    with pytest.raises(ValueError, match=r"expected `f` to return a scalar tensor"):
        fp8fn.value_and_grad(lambda p, s, x: fn.apply(p, s, x), argnums=0)(params, state, x)
    # argnums left out with a state: refused, naming the order of what comes back
    want = (
        r"^fp8fn\.value_and_grad: expected `argnums` to include argument 1, an fp8fn\.State, .*"
        r"`loss, \(grads, obs\) = fp8fn\.value_and_grad\(f, argnums=\(0, 1\)\)\(\.\.\.\)`: the "
        r"value first, .*`\(\(grads, obs\), loss\)`"
    )
    with pytest.raises(ValueError, match=want):
        fp8fn.value_and_grad(loss_of(fn))(params, state, x)
    with pytest.raises(TypeError, match=r"pytree of floating tensors, got a leaf torch.int64"):
        fp8fn.value_and_grad(lambda i: i.sum())(torch.arange(3))


def test_observations_without_a_backward_names_the_fix():
    fn, params, state, x = _setup()
    observed = fp8fn.observe(state)
    with pytest.raises(RuntimeError, match=r"fp8fn.observations: nothing was observed"):
        fp8fn.observations(observed)
    with pytest.raises(RuntimeError, match=r"nothing was observed"):
        fp8fn.observations(state)  # not made with observe


def _trainable(params):
    """Leaves that `backward()` trains (detached copies would train nothing: refused)."""
    return {k: v.clone().requires_grad_() for k, v in params.items()}


def test_observe_once_before_the_loop_names_the_loop_fix():
    fn, params, state, x = _setup()
    params = _trainable(params)
    observed = fp8fn.observe(state)  # the mistake: once, outside the loop
    loss_of(fn)(params, observed, x).backward()
    with pytest.raises(RuntimeError, match=r"Call `observed = fp8fn.observe\(state\)` inside the"):
        loss_of(fn)(params, observed, x)


def test_two_backwards_of_one_forward_are_refused():
    fn, params, state, x = _setup()
    params = _trainable(params)
    observed = fp8fn.observe(state)
    out = fn.apply(params, observed, x)
    l1, l2 = out.square().mean(), out.abs().mean()
    l1.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"fp8fn.observe: a second backward pass reached"):
        l2.backward()
    # The fix the message gives: one backward of the sum; its observation is the max, once.
    observed = fp8fn.observe(state)
    out = fn.apply(params, observed, x)
    (out.square().mean() + out.abs().mean()).backward()
    single = fp8fn.observe(state)
    fn.apply(params, single, x).square().mean().backward()
    got, want = fp8fn.observations(observed), fp8fn.observations(single)
    assert torch.equal(got.amax_history[..., :2, :], want.amax_history[..., :2, :])  # x, w


def test_value_and_grad_under_vmap_and_inference_mode_name_the_fix():
    fn, params, state, x = _setup()
    per_example = fp8fn.value_and_grad(lambda p, x: loss_of(fn)(p, state, x[None]))
    with pytest.raises(RuntimeError, match=r"Under torch.vmap use torch.func.grad_and_value"):
        torch.vmap(per_example, in_dims=(None, 0))(params, x)
    # What the message advises works, one observation per example:
    grads, values = torch.vmap(
        torch.func.grad_and_value(lambda p, x: loss_of(fn)(p, state, x[None])), in_dims=(None, 0)
    )(params, x)
    assert values.shape == (8,) and grads["layers.0.weight"].shape == (8, 32, 16)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=r"inside torch.inference_mode\(\)\. Call it outs"):
            fp8fn.value_and_grad(loss_of(fn))(params, state, x)
        made_inside = x.clone()
    with pytest.raises(RuntimeError, match=r"argument 2 holds a tensor made under torch.inf"):
        fp8fn.value_and_grad(loss_of(fn), argnums=(0, 2))(params, state, made_inside)


def test_value_and_grad_matches_plain_float32_without_fp8_layers():
    model = MLP((16, 8), seed=1)
    x = torch.randn(4, 16)
    params = dict(model.named_parameters())

    def loss(p, x):
        return F.mse_loss(torch.func.functional_call(model, p, (x,)), torch.ones(4, 8))

    value, grads = fp8fn.value_and_grad(loss)(params, x)
    want_grads, want_value = torch.func.grad_and_value(loss)(params, x)
    assert_bit_identical((value, grads), (want_value, want_grads))
