"""`import fp8fn` is light, and Triton is optional.

`import fp8fn` imports neither Triton nor torch._dynamo (torch.compile's machinery, ~1.5 s):
Triton is imported on first use of `backend="triton"`, and without it that use raises a clear
error naming the `triton` extra.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

import fp8fn
import fp8fn._kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("triton", "torch._dynamo", "torch._inductor")


def test_import_fp8fn_imports_neither_triton_nor_dynamo():
    code = f"import sys, fp8fn; print([m for m in {HEAVY!r} if m in sys.modules], fp8fn.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, path = done.stdout.split()
    assert loaded == "[]"
    assert pathlib.Path(path).is_relative_to(ROOT / "fp8fn")  # this checkout's fp8fn


@pytest.fixture
def without_triton(monkeypatch):
    """As if Triton were not installed: `import triton` raises ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "fp8fn._kernels.triton_jit", raising=False)
    monkeypatch.delattr(fp8fn._kernels, "triton_jit", raising=False)  # so the import runs again


@pytest.mark.parametrize(
    "recipe, site",
    [
        (fp8fn.DelayedScaling(backend="triton"), True),
        (fp8fn.CurrentScaling(backend="triton"), False),
    ],
    ids=["delayed", "current"],
)
def test_triton_backend_without_triton_names_the_extra(without_triton, recipe, site):
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    state = fp8fn.init_state(recipe, ["fc"])["fc"] if site else None
    message = r'fp8fn.linear: backend="triton" needs Triton.*pip install "fp8fn\[triton\]"'
    with pytest.raises(ImportError, match=message):
        fp8fn.linear(x, w, None, state, recipe)


@pytest.mark.parametrize("recipe", [fp8fn.DelayedScaling, fp8fn.CurrentScaling])
def test_triton_recipe_without_triton_is_refused_where_it_is_made(without_triton, recipe):
    name = recipe.__name__
    message = rf'^fp8fn\.{name}: backend="triton" needs Triton.*pip install "fp8fn\[triton\]"'
    with pytest.raises(ImportError, match=message):
        recipe(backend="triton")


def test_default_backend_without_triton_trains(without_triton):
    # Nothing but backend="triton" needs Triton: a step with the default backend runs.
    recipe = fp8fn.DelayedScaling()
    state = fp8fn.init_state(recipe, ["fc"])
    x, w = torch.randn(4, 8), torch.randn(6, 8)

    def loss(w, state):
        return fp8fn.linear(x, w, None, state["fc"], recipe).square().sum()

    grad_w, obs = torch.func.grad(loss, argnums=(0, 1))(w, state)
    assert grad_w.shape == w.shape and bool((obs.amax_history[:, :, 0] > 0).all())
