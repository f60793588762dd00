"""Lazy modules (`nn.LazyLinear`, parameters uninitialized until the first forward).

fp8fn 0.3 transformed a model holding one before its first forward, and `fn.init` (a forward)
initialized it; 0.4's experts discovery raised torch's raw "Attempted to use an uninitialized
parameter" from `fp8fn.transform`. Every walk over the module in `transform`, `init` and
`summary` must take them, and the model must then train as the same model initialized first.
"""

import pytest
import torch
from _helpers import DELAYED_AUTO, assert_bit_identical
from torch import nn

import fp8fn


class _Experts(nn.Module):
    """Two experts as one 3-D weight `(E, 16, 16)`, run as `x @ W[e]` per half of the batch."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, x):
        a, b = x.chunk(2)
        return torch.cat([a @ self.weight[0], b @ self.weight[1]])


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.LazyLinear(16)
        self.experts = _Experts()

    def forward(self, x):
        return self.experts(torch.relu(self.proj(x)))


def _models():
    """`(lazy, eager)`: the same model (seed 0), its LazyLinear uninitialized in the first and
    initialized by a forward in the second."""
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        made.append(nn.Sequential(_Block(), nn.LazyLinear(8)))
    made[1](torch.zeros(4, 32))
    return made


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"checkpoint_fn": lambda name, m: isinstance(m, _Block)},
        {"filter_fn": lambda n, m: True},
    ],
    ids=["plain", "checkpoint_fn", "filter_fn"],
)
def test_a_model_with_lazy_layers_transforms_inits_and_trains_as_when_initialized(kwargs):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    results = []
    lazy, eager = _models()
    for model in (lazy, eager):
        fn = fp8fn.transform(model, DELAYED_AUTO, **kwargs)
        state = fn.init(x)  # initializes the lazy layers
        with torch.no_grad():
            model.load_state_dict(eager.state_dict())  # (they drew other random numbers)
        params = dict(model.named_parameters())
        loss = lambda p, s: fn.apply(p, s, x).square().mean()  # noqa: E731
        results.append((list(state), fn.summary(), torch.func.grad(loss, (0, 1))(params, state)))
    sites = ["0.proj", "1", "0.experts.weight[0]", "0.experts.weight[1]"]
    assert results[0][0] == results[1][0] == sites
    assert results[0][1] == results[1][1]
    assert_bit_identical(results[0][2], results[1][2])


def test_a_lazy_model_before_init_gets_fp8fn_errors_not_torch_s():
    """Before `fn.init`, `summary()` raises fp8fn's "init first", not torch's error about an
    uninitialized parameter."""
    lazy, _ = _models()
    fn = fp8fn.transform(lazy, DELAYED_AUTO)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.Transformed\.summary: expected `fn\.init"):
        fn.summary()
