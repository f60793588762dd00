import dataclasses
import types
import typing
from pathlib import Path

import pytest

import fp8fn


def test_delayed_scaling_defaults():
    r = fp8fn.DelayedScaling()
    assert (r.history_len, r.amax_compute, r.margin, r.backend) == (16, "max", 0, "auto")


def test_current_scaling_defaults():
    assert fp8fn.CurrentScaling().backend == "auto"


@pytest.mark.parametrize(
    "recipe, field",
    [
        (fp8fn.DelayedScaling(), "history_len"),
        (fp8fn.DelayedScaling(), "margin"),
        (fp8fn.CurrentScaling(), "backend"),
    ],
)
def test_recipe_frozen(recipe, field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(recipe, field, 1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"history_len": 0}, ValueError, r"`history_len` >= 1, got 0\."),
        ({"history_len": -3}, ValueError, r"`history_len` >= 1, got -3\."),
        ({"history_len": 2.0}, TypeError, r"`history_len` to be an int, got float 2\.0\."),
        ({"history_len": True}, TypeError, r"`history_len` to be an int, got bool True\."),
        ({"history_len": "4"}, TypeError, r"`history_len` to be an int, got str '4'\."),
        ({"amax_compute": "mean"}, ValueError, r"`amax_compute` in .*, got 'mean'\."),
        ({"amax_compute": None}, ValueError, r"`amax_compute` in .*, got None\."),
        ({"margin": -1}, ValueError, r"`margin` an int from 0 to 64, got -1\."),
        ({"margin": 65}, ValueError, r"`margin` an int from 0 to 64, got 65\."),
        ({"margin": 0.5}, TypeError, r"`margin` an int from 0 to 64, got float 0\.5\."),
        ({"margin": 1.0}, TypeError, r"`margin` an int from 0 to 64, got float 1\.0\."),
        ({"margin": False}, TypeError, r"`margin` an int from 0 to 64, got bool False\."),
        ({"backend": "cuda"}, ValueError, r"`backend` in .*, got 'cuda'\."),
    ],
)
def test_delayed_scaling_invalid(kwargs, error, match):
    with pytest.raises(error, match=r"^fp8fn\.DelayedScaling: expected " + match):
        fp8fn.DelayedScaling(**kwargs)


def test_current_scaling_invalid_backend():
    with pytest.raises(ValueError, match=r"^fp8fn\.CurrentScaling: expected `backend` in .*'tpu'"):
        fp8fn.CurrentScaling(backend="tpu")


@pytest.mark.parametrize("backend", ["auto", "emulated", "scaled_mm"])
def test_recipe_valid_backends(backend):
    assert fp8fn.DelayedScaling(backend=backend).backend == backend
    assert fp8fn.CurrentScaling(backend=backend).backend == backend


def test_public_api_is_exactly_all():
    want = [
        "BlockwiseScaling", "CurrentScaling", "DelayedScaling", "MXScaling", "NVFP4Scaling",
        "Recipe", "RowwiseScaling",
        "ScaleState", "SiteState", "State", "Transformed", "__version__", "all_reduce",
        "checkpoint", "compute_scale", "expert_parallel", "flatten_state", "float8_all_gather",
        "fold_in",
        "init_state", "linear", "merge",
        "observations", "observe", "optim", "stack_states", "transform", "unflatten_state",
        "update", "value_and_grad",
    ]  # fmt: skip
    assert fp8fn.__all__ == want  # sorted, no duplicates
    assert all(hasattr(fp8fn, name) for name in want)
    public = {
        name
        for name, value in vars(fp8fn).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(want) - {"__version__", "optim"}  # (fp8fn.optim: a subpackage)


def test_version_is_the_package_metadata_one():
    # One source: pyproject.toml reads fp8fn.__version__ (setuptools' `attr`).
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(fp8fn.__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fp8fn.__version__"}
    assert fp8fn.__version__ == "0.5.0.dev0"


def test_recipe_alias_is_the_union_of_the_recipes():
    recipes = (
        fp8fn.DelayedScaling(), fp8fn.CurrentScaling(), fp8fn.RowwiseScaling(),
        fp8fn.BlockwiseScaling(), fp8fn.MXScaling(), fp8fn.NVFP4Scaling(),
    )  # fmt: skip
    assert typing.get_args(fp8fn.Recipe) == tuple(type(r) for r in recipes)
    assert all(isinstance(r, fp8fn.Recipe) for r in recipes)
    assert not isinstance("fp8", fp8fn.Recipe)
