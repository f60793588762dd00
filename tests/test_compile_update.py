import math

import pytest
import torch
from _helpers import assert_bit_identical
from torch._dynamo.utils import counters

import fp8fn

pytestmark = pytest.mark.slow  # torch.compile: tens of seconds a test on 2 cores


def _obs(state: fp8fn.State, amaxes) -> fp8fn.State:
    """An observation like `state`: `amaxes[site][role]` in `[..., 0]`, zeros elsewhere."""
    history = torch.zeros_like(state.amax_history)
    history[:, :, 0] = torch.tensor(amaxes, dtype=torch.float32)
    return state._replace(amax_history=history, scale=torch.zeros_like(state.scale))


STEPS = [  # per site: (input, weight, grad_output) amaxes
    [(3.0, 5.0, 7.0), (1.0, 2.0, 3.0), (4.0, 0.5, 2.0)],
    [(0.5, math.nan, 0.0), (0.0, 0.0, 0.0), (math.inf, -math.inf, 1e-30)],
    [(2.5, math.inf, 1e-30), (1e-45, 3e38, 8.0), (0.25, 0.0, math.nan)],
    [(6.0, 1e-3, 3e4), (7.0, 7.0, 7.0), (1.0, 1.0, 1.0)],
]


@pytest.mark.parametrize(
    "recipe",
    [
        fp8fn.DelayedScaling(history_len=4),
        fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent", margin=1),
        fp8fn.DelayedScaling(history_len=2, margin=3),
    ],
    ids=["max", "most_recent-margin1", "h2-margin3"],
)
def test_update_compiled_fullgraph_bit_identical_to_eager(recipe):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fp8fn.update, fullgraph=True)
    eager = state = fp8fn.init_state(recipe, ["fc1", "fc2", "fc3"])
    for amaxes in STEPS:
        obs = _obs(eager, amaxes)
        eager = fp8fn.update(eager, obs)
        state = compiled(state, obs)
        assert_bit_identical(state, eager)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every step's values
    h = recipe.history_len
    assert eager["fc1"].input.amax_history.tolist() == [6.0, 2.5, 0.5, 3.0][:h]
    # fc3's grad_output: 2.0, 1e-30 (tiny but > 0: pushed), NaN (ignored), 1.0
    want = torch.tensor([1.0, 1e-30, 2.0, 0.0])[:h]
    assert torch.equal(eager["fc3"].grad_output.amax_history, want)
    torch._dynamo.reset()


def test_merge_compiled_fullgraph_bit_identical_to_eager():
    torch._dynamo.reset()
    compiled = torch.compile(fp8fn.merge, fullgraph=True)
    state = fp8fn.init_state(fp8fn.DelayedScaling(history_len=3), ["a", "b", "c"])
    a, b = _obs(state, STEPS[1]), _obs(state, STEPS[2])
    assert_bit_identical(compiled(a, b), fp8fn.merge(a, b))
    torch._dynamo.reset()
