"""The README's Python examples run as written."""

import pathlib
import re

import pytest
import torch

import fp8fn

README = pathlib.Path(__file__).parent.parent / "README.md"


def _blocks():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    return blocks


def _run(blocks):
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    return namespace


def test_readme_examples_run():
    # the example, then the plain-autograd continuation
    namespace = _run(_blocks()[:2])
    state = namespace["state"]
    assert isinstance(state, fp8fn.State)
    assert list(state) == ["0", "2"]
    assert state.amax_history.shape == (2, 3, 16) and state.scale.shape == (2, 3)
    assert not state.amax_history.requires_grad  # update returns plain data
    # ten torch.func steps, then one plain-autograd step: eleven amaxes pushed per role
    assert torch.equal(torch.count_nonzero(state.amax_history, dim=-1), torch.full((2, 3), 11))
    # the views read the packed tensors, and each scale follows its history
    for i, site in enumerate(state):
        for r, role in enumerate(("input", "weight", "grad_output")):
            view = getattr(state[site], role)
            assert torch.equal(view.amax_history, state.amax_history[i, r])
            fp8_max = 57344.0 if role == "grad_output" else 448.0
            assert torch.equal(view.scale, fp8fn.compute_scale(view.amax_history.max(), fp8_max))
    # the last step's input amax is the input's
    assert state["0"].input.amax_history[0] == namespace["x"].abs().max()


@pytest.mark.slow
def test_readme_value_and_grad_example_runs():
    # the compiled torch.func-style step, after the example
    torch._dynamo.reset()
    blocks = _blocks()
    namespace = _run([blocks[0], blocks[2]])
    state, grads = namespace["state"], namespace["grads"]
    assert torch.equal(torch.count_nonzero(state.amax_history, dim=-1), torch.full((2, 3), 11))
    assert set(grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    torch._dynamo.reset()


def test_readme_per_layer_recipe_example_runs():
    (block,) = [b for b in _blocks() if "def recipe(name, layer)" in b]
    namespace = _run([block])
    fn, state = namespace["fn"], namespace["state"]
    assert list(state) == ["mlp"] and fn.layers == ["attn", "mlp"]
    assert isinstance(fn.recipes["attn"], fp8fn.RowwiseScaling)
