"""The model you hold is the model that runs: `apply` sees every change made after `transform`.

Each test changes the model after `fp8fn.transform` (buffers, dtype, hooks, swapped weights),
then compares `apply` bit for bit with a transform built after the change, and checks that the
module is left exactly as it was.
"""

import concurrent.futures
import copy

import pytest
import torch
import torch.nn.functional as F
from _helpers import DELAYED, assert_bit_identical, loss_of, stepped
from torch import nn

import fp8fn


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 8)).eval()


def _step(fn, params, state, x):
    """Output, then gradients and observations on the torch.func route."""
    out = fn.apply(params, state, x)
    return out, torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)


def _own_params_warmed(fn, model, x):
    """The module's own parameters, as a dict, and a state warmed on `x`."""
    params = dict(model.named_parameters())
    return params, stepped(fn, params, fn.init(x), x)


def _transformed_and_warmed():
    """`(model, fn, x, params, state)`: `_model()`, its transform, an input `(8, 16)`, the
    module's own parameters and a state warmed on `x`."""
    model = _model()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    return (model, fn, x, *_own_params_warmed(fn, model, x))


def _snapshot(model):
    """What must not change: classes, attributes, hooks, tensors (by identity and value)."""
    return [
        (
            type(m),
            sorted(vars(m)),
            dict(m._forward_hooks),
            dict(m._forward_pre_hooks),
            dict(m._backward_hooks),
            {
                n: (t, t.clone())
                for n, t in {**m._parameters, **m._buffers}.items()
                if t is not None
            },
        )
        for m in model.modules()
    ]


def _assert_unchanged(model, snapshot):
    now = _snapshot(model)
    assert len(now) == len(snapshot)
    for (cls, attrs, fh, fph, bh, tensors), (cls2, attrs2, fh2, fph2, bh2, tensors2) in zip(
        snapshot, now
    ):
        assert (cls, attrs, fh, fph, bh) == (cls2, attrs2, fh2, fph2, bh2)
        assert tensors.keys() == tensors2.keys()
        for name, (t, value) in tensors.items():
            assert tensors2[name][0] is t and torch.equal(tensors2[name][1], value), name


def test_a_reassigned_buffer_is_what_apply_sees():
    model, fn, x, params, state = _transformed_and_warmed()
    before = fn.apply(params, state, x)
    # What load_state_dict(assign=True), to_empty() and checkpoint loaders do.
    model[1].running_mean = torch.full((32,), 0.25)
    model[1].running_var = torch.full((32,), 4.0)
    after = fn.apply(params, state, x)
    assert not torch.equal(before, after)
    assert_bit_identical(
        _step(fn, params, state, x), _step(fp8fn.transform(model, DELAYED), params, state, x)
    )
    # The buffer is really used: the same as running the first layer by hand, then the rest.
    hidden = fp8fn.linear(x, params["0.weight"], params["0.bias"], state["0"], DELAYED)
    hidden = F.gelu(
        (hidden - 0.25) / torch.sqrt(torch.tensor(4.0 + 1e-5)) * model[1].weight + model[1].bias
    )
    want = fp8fn.linear(hidden, params["3.weight"], params["3.bias"], state["3"], DELAYED)
    torch.testing.assert_close(after, want, rtol=0, atol=1e-6)


def test_load_state_dict_assign_and_to_empty_are_what_apply_sees():
    model, other = _model(0), _model(1)
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    model.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects
    params, state = _own_params_warmed(fn, model, x)
    assert_bit_identical(
        _step(fn, params, state, x),
        _step(fp8fn.transform(other, DELAYED), dict(other.named_parameters()), state, x),
    )
    model.to_empty(device="cpu")
    model.load_state_dict(other.state_dict())
    params = dict(model.named_parameters())
    assert_bit_identical(
        _step(fn, params, state, x),
        _step(fp8fn.transform(other, DELAYED), dict(other.named_parameters()), state, x),
    )


def test_a_dtype_move_after_transform_is_what_apply_sees():
    model = _model()
    fn = fp8fn.transform(model, DELAYED)
    model.to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    params, state = _own_params_warmed(fn, model, x)
    out, (grads, obs) = _step(fn, params, state, x)
    assert out.dtype == torch.bfloat16 and grads["0.weight"].dtype == torch.bfloat16
    assert_bit_identical(
        (out, (grads, obs)), _step(fp8fn.transform(model, DELAYED), params, state, x)
    )


def test_hooks_added_after_transform_fire_in_apply():
    model, fn, x, params, state = _transformed_and_warmed()
    plain = fn.apply(params, state, x)
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model[3].register_forward_hook(lambda m, args, out: seen.append(out.shape) or out + 1)
    hooked = fn.apply(params, state, x)
    assert seen == [(8, 8)]
    assert_bit_identical(hooked, fp8fn.transform(model, DELAYED).apply(params, state, x))
    assert not torch.equal(hooked, plain)
    assert_bit_identical(
        _step(fn, params, state, x), _step(fp8fn.transform(model, DELAYED), params, state, x)
    )


def test_a_weight_swapped_in_by_the_module_runs_in_fp8():
    """FSDP2's hooks give each layer its unsharded weight for the forward: a tensor `apply` was
    not given. fp8fn finds the layer that holds it and casts it."""
    model = _model()
    swapped = model[3].weight.detach() * 2

    def swap_in(module, args):
        module._parameters["weight"] = swapped

    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    params, state = _own_params_warmed(fn, model, x)
    original = model[3].weight
    handle = model[3].register_forward_pre_hook(swap_in)
    try:
        out = fn.apply(params, state, x)
    finally:
        handle.remove()
        model[3]._parameters["weight"] = original
    hidden = F.gelu(
        model[1](fp8fn.linear(x, params["0.weight"], params["0.bias"], state["0"], DELAYED))
    )
    want = fp8fn.linear(hidden, swapped, params["3.bias"], state["3"], DELAYED)
    assert_bit_identical(out, want)


def test_apply_leaves_the_module_as_it_was_even_when_it_raises():
    model = _model()
    model[0].register_forward_hook(lambda m, args, out: out)
    fn = fp8fn.transform(model, DELAYED, checkpoint_fn=lambda name, m: name == "3")
    x = torch.randn(8, 16)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    state = fn.init(x)
    snapshot = _snapshot(model)
    loss_of(fn)(params, fp8fn.observe(state), x).backward()
    torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)
    _assert_unchanged(model, snapshot)
    wrong = {**params, "3.weight": torch.randn(8, 7)}
    with pytest.raises(ValueError, match=r"fp8fn.apply: layer '3': expected `x` of shape"):
        fn.apply(wrong, state, x)  # raises in the middle of the forward
    _assert_unchanged(model, snapshot)
    plain = copy.deepcopy(model)
    assert torch.equal(model(x), plain(x))  # still the plain high-precision model


def test_params_may_leave_out_frozen_tensors():
    model, fn, x, params, state = _transformed_and_warmed()
    trainable = {k: v.detach().clone() for k, v in params.items() if k.startswith("3.")}
    grads = torch.func.grad(loss_of(fn))(trainable, state, x)
    assert grads.keys() == trainable.keys()
    want = torch.func.grad(loss_of(fn))({**params, **trainable}, state, x)
    assert_bit_identical(grads, {k: want[k] for k in trainable})


def test_one_transform_applied_from_several_threads():
    model = _model()
    fn = fp8fn.transform(model, DELAYED)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=gen) for _ in range(4)]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = stepped(fn, params, fn.init(xs[0]), xs[0])
    # Each thread its own inputs and parameters (not the module's: functional_call swaps them).
    inputs = [({k: v * (1 + i) for k, v in params.items()}, xs[i]) for i in range(4)]
    expected = [_step(fn, p, state, x) for p, x in inputs]

    def work(i):
        p, x = inputs[i]
        return [_step(fn, p, state, x) for _ in range(10)]

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = [f.result() for f in [pool.submit(work, i) for i in range(4)]]
    for runs, want in zip(results, expected):
        for got in runs:
            assert_bit_identical(got, want)
