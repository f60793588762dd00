"""The README's Python examples run as written."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace = {}
    for block in blocks[:2]:  # the example, then the plain-autograd continuation
        exec(compile(block, str(README), "exec"), namespace)
    state = namespace["state"]
    assert list(state) == ["0", "2"]
    # ten torch.func steps, then one plain-autograd step: eleven amaxes pushed per role
    assert all(torch.count_nonzero(s.amax_history) == 11 for s in state["0"])
