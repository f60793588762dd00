import dataclasses
import types

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
        "RowwiseScaling",
        "ScaleState", "SiteState", "State", "Transformed", "all_reduce", "checkpoint",
        "compute_scale", "flatten_state", "float8_all_gather", "init_state", "linear", "merge",
        "observations", "observe", "stack_states", "transform", "unflatten_state", "update",
        "value_and_grad",
    ]  # fmt: skip
    assert fp8fn.__all__ == want  # sorted, no duplicates
    assert all(hasattr(fp8fn, name) for name in want)
    public = {
        name
        for name, value in vars(fp8fn).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(want)
