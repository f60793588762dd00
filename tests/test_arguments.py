"""The checks of `fp8fn.transform`'s and `fn.apply`'s arguments (`_transform/arguments.py`): each
a clear `fp8fn.` error, raised before anything runs."""

import pytest
import torch
from _helpers import (
    DELAYED,
    gelu_mlp,
    params_of,
    transformed_mlp,
)
from _models import ReusedLayer
from torch import nn

import fp8fn


def test_apply_errors_name_the_problem():
    model, fn, x, params, state = transformed_mlp(batch=4)
    with pytest.raises(
        ValueError, match=r"fp8fn.apply: .*unexpected \['extra'\]\. Key them as the model is now"
    ):
        fn.apply({**params, "extra": torch.ones(1)}, state, x)
    with pytest.raises(TypeError, match=r"expected tensors in `params`, got \{'0.bias': 'list'\}"):
        fn.apply({**params, "0.bias": [0.0] * 32}, state, x)
    with pytest.raises(TypeError, match="fp8fn.apply: expected `params` to be a dict"):
        fn.apply(list(params.values()), state, x)
    for not_a_state in (list(state.values()), dict(state.items())):
        with pytest.raises(TypeError, match="fp8fn.apply: expected `state` to be an fp8fn.State"):
            fn.apply(params, not_a_state, x)
    with pytest.raises(ValueError, match=r"missing sites \['2'\]"):
        fn.apply(params, fp8fn.init_state(DELAYED, ["0", "4"]), x)
    with pytest.raises(ValueError, match=r"unknown sites \['9'\]"):
        fn.apply(params, fp8fn.init_state(DELAYED, ["0", "2", "4", "9"]), x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: `state` was made for another recipe"):
        fn.apply(params, state._replace(amax_history=torch.zeros(3, 3, 5)), x)
    for recipe in (
        fp8fn.DelayedScaling(history_len=4, margin=1),
        fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent"),
    ):
        with pytest.raises(ValueError, match="fp8fn.apply: `state` was made for another recipe"):
            fn.apply(params, fp8fn.init_state(recipe, list(state)), x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: expected `state.amax_history` of shape"):
        fn.apply(params, state._replace(scale=torch.ones(3, 2)), x)
    with pytest.raises(ValueError, match=r"fp8fn.apply: expected `state.amax_history` of shape"):
        fn.apply(params, state._replace(amax_history=torch.zeros(2, 3, 4)), x)
    with pytest.raises(TypeError, match=r"fp8fn.apply: expected `state.amax_history` to be fl"):
        fn.apply(params, state._replace(amax_history=state.amax_history.double()), x)
    model = ReusedLayer(16)
    reused = fp8fn.transform(model, DELAYED)
    short = fp8fn.init_state(DELAYED, ["fc", "out"])
    with pytest.raises(ValueError, match=r"site 'fc#1' is not in `state`"):
        reused.apply(params_of(model), short, x)


def test_transform_errors_name_the_problem():
    class LoRA(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    # a subclass with its own forward (Llama 4's router) is left in high precision, reported
    with pytest.warns(UserWarning, match="no layer was converted"):
        lora = fp8fn.transform(nn.Sequential(LoRA(4, 4)), DELAYED)
    with pytest.warns(UserWarning, match=r"high precision, 100.0% .*'0.weight' \(F.linear\)"):
        lora.init(torch.randn(2, 4))
    with pytest.raises(TypeError, match="fp8fn.transform: expected `module` to be an nn.Module"):
        fp8fn.transform(lambda x: x, DELAYED)
    with pytest.raises(TypeError, match="fp8fn.transform: expected `recipe`"):
        fp8fn.transform(gelu_mlp(), "delayed")
    with pytest.raises(TypeError, match=r"got the class DelayedScaling\. Pass an instance: fp8fn"):
        fp8fn.transform(gelu_mlp(), fp8fn.DelayedScaling)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"filter_fn": 3},
            TypeError,
            r"^fp8fn\.transform: expected `filter_fn` to be a function \(name, module\) -> bool, "
            r"got int\. Pass e\.g\. `filter_fn=lambda name, module: \.\.\.`\.$",
        ),
        (
            {"checkpoint_fn": 3},
            TypeError,
            r"^fp8fn\.transform: expected `checkpoint_fn` to be a function \(name, module\) -> "
            r"bool, got int\. Pass e\.g\. `checkpoint_fn=lambda name, module: \.\.\.`\.$",
        ),
        (
            {"filter_fn": nn.Linear},
            TypeError,
            r"^fp8fn\.transform: expected `filter_fn` to be a function .* got type Linear\.",
        ),
        (
            {"filter_fn": lambda name: True},
            TypeError,
            r"^fp8fn\.transform: expected `filter_fn` to be a function \(name, module\) -> bool, "
            r"got .*<lambda>\(name\), which cannot be called with 2 positional arguments "
            r"\(too many positional arguments\)\. Give it the parameters \(name, module\)\.$",
        ),
        (
            {"checkpoint_fn": lambda name, module, depth: True},
            TypeError,
            r"^fp8fn\.transform: expected `checkpoint_fn` .* got "
            r".*<lambda>\(name, module, depth\), which cannot be called with 2 positional "
            r"arguments \(missing a required argument: 'depth'\)\.",
        ),
        (
            {"recipe": lambda name: DELAYED},
            TypeError,
            r"^fp8fn\.transform: expected `recipe` to be a function \(name, module\) -> recipe or "
            r"None, got .*<lambda>\(name\), which cannot be called with 2 positional arguments",
        ),
        (
            {"recipe": lambda name, m: 3},
            TypeError,
            r"^fp8fn\.transform: expected the recipe of layer '0' to be an fp8fn recipe "
            r"\(e\.g\. fp8fn\.DelayedScaling\(\)\) or None, got int\.$",
        ),
    ],
    ids=[
        "filter_fn-int",
        "checkpoint_fn-int",
        "filter_fn-class",
        "filter_fn-arity",
        "checkpoint_fn-arity",
        "recipe-arity",
        "recipe-returns-int",
    ],
)
def test_transform_refuses_bad_choice_functions_before_touching_the_module(kwargs, error, match):
    model = gelu_mlp()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    kwargs = {"recipe": DELAYED, **kwargs}
    with pytest.raises(error, match=match):
        fp8fn.transform(model, **kwargs)
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before


def test_choice_functions_with_defaults_or_star_args_are_accepted():
    fn = fp8fn.transform(
        gelu_mlp(),
        lambda *args: DELAYED,
        filter_fn=lambda name, module, extra=None: name != "2",
        checkpoint_fn=lambda name, module, **kw: False,
    )
    assert fn.layers == ["0", "4"]
