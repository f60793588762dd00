"""Tensor swapping (`_transform/swap.py`): the given tensors in the module for one call, buffers
from the module unless given, tied parameters given once or under every name."""

import pytest
import torch
from _helpers import (
    DELAYED,
    assert_bit_identical,
    loss_of,
    params_of,
)
from _models import Tied
from torch import nn

import fp8fn


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.register_buffer("shift", torch.full((8,), 0.5))

    def forward(self, x):
        return self.fc(x) + self.shift


def test_buffers_come_from_module_unless_given():
    model = WithBuffer()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(4, 16)
    params, state = params_of(model), fn.init(x)
    default = fn.apply(params, state, x)
    given = fn.apply({**params, "shift": torch.zeros(8)}, state, x)
    assert torch.allclose(default - given, torch.full_like(default, 0.5))


def test_tied_parameters_given_under_every_name():
    model = Tied(16, 16)
    fn = fp8fn.transform(model, DELAYED)
    ids = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(0))
    state = fn.init(ids)
    params = params_of(model)
    every = dict(model.named_parameters(remove_duplicate=False))
    assert {"b.weight", "head.weight"} <= every.keys() - params.keys()
    want_out = fn.apply(params, state, ids)
    assert torch.equal(fn.apply(every, state, ids), want_out)  # the same tensors: fine
    # value_and_grad keeps a tensor given twice as one leaf: each name gets its gradient.
    _, (want, want_obs) = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))(params, state, ids)
    _, (grads, obs) = fp8fn.value_and_grad(loss_of(fn), argnums=(0, 1))(every, state, ids)
    assert_bit_identical(obs, want_obs)
    assert all(torch.equal(grads[k], want[k]) for k in want)
    assert torch.equal(grads["head.weight"], want["emb.weight"])
    # torch.func.grad wraps each name on its own: two tensors for one tied parameter.
    with pytest.raises(ValueError, match=r"gives the tied tensor 'a.weight' twice, as 'b.weight'"):
        torch.func.grad(loss_of(fn))(every, state, ids)
