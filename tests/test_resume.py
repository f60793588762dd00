"""A run saved at step k and resumed in a fresh process is bit-identical to the whole run."""

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import assert_bit_identical

import fp8fn

# One training script, run here whole and in two processes (save at step k, resume from it).
SCRIPT = textwrap.dedent(
    """
    import sys, torch, fp8fn

    start, stop, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(history_len=3, backend="emulated"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data))
               for _ in range(stop)]
    state = fn.init(batches[0][0])
    if start:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["fp8"]
    for x, y in batches[start:stop]:
        state = fp8fn.observe(state)
        loss = (fn.apply(dict(model.named_parameters()), state, x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = fp8fn.update(state, fp8fn.observations(state))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "fp8": state}, path)
    """
)


def _run(tmp_path: pathlib.Path, start: int, stop: int, name: str) -> pathlib.Path:
    path = tmp_path / name
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    subprocess.run([sys.executable, str(script), str(start), str(stop), str(path)], check=True)
    return path


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    whole = torch.load(_run(tmp_path, 0, 6, "whole.pt"), weights_only=True)
    half = _run(tmp_path, 0, 3, "resumed.pt")
    resumed = torch.load(_run(tmp_path, 3, 6, half.name), weights_only=True)
    assert isinstance(resumed["fp8"], fp8fn.State) and len(resumed["fp8"]) == 2
    assert (resumed["fp8"].amax_history[..., :3] > 0).all()  # histories full and distinct
    assert_bit_identical(resumed["fp8"], whole["fp8"])
    assert_bit_identical(resumed["model"], whole["model"])
    assert_bit_identical(resumed["opt"]["state"], whole["opt"]["state"])
