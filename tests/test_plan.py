"""The plan (`_transform/plan.py`): what `fp8fn.transform` reads from the module (`read_module`:
layers and recipes, `filter_fn`, recipe functions) and the state `fn.init` makes from it
(`initial_state`: sites and layout)."""

import ast
import dataclasses
import pathlib

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    CURRENT_AUTO,
    DELAYED,
    assert_bit_identical,
    autograd_step,
    gelu_mlp,
    loss_of,
    params_of,
)
from _models import Branchy, ReusedLayer, Tied
from torch.utils import _pytree as pytree

import fp8fn
from fp8fn._transform.plan import Plan, read_module
from fp8fn._transform.transformed import Transformed


def test_filter_fn_keeps_layers_in_high_precision():
    model = gelu_mlp()
    fn = fp8fn.transform(model, DELAYED, filter_fn=lambda name, m: name != "4")
    x = torch.randn(4, 16)
    state = fn.init(x)
    assert list(state) == ["0", "2"] and fn.layers == ["0", "2"]
    params = params_of(model)
    hidden = fp8fn.transform(model[:4], DELAYED).apply(
        {k: v for k, v in params.items() if not k.startswith("4.")}, state, x
    )
    expected = F.linear(hidden, params["4.weight"], params["4.bias"])
    assert torch.equal(fn.apply(params, state, x), expected)


def test_recipe_function_picks_a_recipe_per_layer():
    model = gelu_mlp()
    seen = []

    def recipe(name, module):
        seen.append((name, module))
        return {"0": DELAYED, "2": CURRENT_AUTO}.get(name)  # "4": None, high precision

    fn = fp8fn.transform(model, recipe)
    assert [n for n, _ in seen] == ["0", "2", "4"]
    assert all(m is model[int(n)] for n, m in seen)  # the user's layers, not the copies
    assert fn.layers == ["0", "2"] and fn.recipes == {"0": DELAYED, "2": CURRENT_AUTO}
    x = torch.randn(8, 16)
    params, state = params_of(model), fn.init(x)
    assert list(state) == ["0"] and state.static == (("0",), "max", 0)  # stateful layers only

    def by_hand(p, s, x):
        h = F.gelu(fp8fn.linear(x, p["0.weight"], p["0.bias"], s["0"], DELAYED))
        h = F.gelu(fp8fn.linear(h, p["2.weight"], p["2.bias"], None, CURRENT_AUTO))
        return F.linear(h, p["4.weight"], p["4.bias"])

    for _ in range(3):
        assert torch.equal(fn.apply(params, state, x), by_hand(params, state, x))
        got = torch.func.grad(loss_of(fn), argnums=(0, 1))(params, state, x)
        want = torch.func.grad(lambda p, s, x: by_hand(p, s, x).square().mean(), argnums=(0, 1))(
            params, state, x
        )
        assert_bit_identical(got, want)
        assert_bit_identical(autograd_step(fn, params, state, x), want)
        state = fp8fn.update(state, got[1])
        params = {k: v - 0.1 * got[0][k] for k, v in params.items()}
    assert bool((state.amax_history[..., :3] > 0).all())
    # A layer whose recipe is None stays high precision: its output is F.linear's.
    h = fp8fn.transform(model[:4], recipe).apply(
        {k: v for k, v in params.items() if not k.startswith("4.")}, state, x
    )
    assert torch.equal(
        fn.apply(params, state, x), F.linear(h, params["4.weight"], params["4.bias"])
    )
    # All None: no fp8 layer, no site, the model itself.
    with pytest.warns(UserWarning, match="fp8fn.transform: no layer was converted"):
        plain = fp8fn.transform(model, lambda name, module: None)
    assert plain.layers == [] and len(plain.init(x)) == 0
    assert torch.equal(
        plain.apply(params, plain.init(x), x), torch.func.functional_call(model, params, (x,))
    )
    # filter_fn chooses first: the recipe function sees only the layers it keeps.
    seen.clear()
    fp8fn.transform(model, recipe, filter_fn=lambda name, m: name != "2")
    assert [n for n, _ in seen] == ["0", "4"]


def test_recipe_function_errors_name_the_problem():
    model = gelu_mlp()
    longer = fp8fn.DelayedScaling(history_len=8)
    with pytest.raises(ValueError, match="fp8fn.transform: all DelayedScaling layers"):
        fp8fn.transform(model, lambda name, m: DELAYED if name == "0" else longer)
    with pytest.raises(ValueError, match="fp8fn.transform"):
        fp8fn.transform(
            model, lambda name, m: fp8fn.DelayedScaling(history_len=4, margin=int(name))
        )
    with pytest.raises(ValueError, match="fp8fn.transform"):
        fp8fn.transform(
            model,
            lambda name, m: fp8fn.DelayedScaling(
                history_len=4, amax_compute="max" if name == "0" else "most_recent"
            ),
        )
    with pytest.raises(TypeError, match="fp8fn.transform: expected the recipe of layer '0'"):
        fp8fn.transform(model, lambda name, m: "delayed")
    # The same config in several layers (one packed state) is fine, CurrentScaling alongside.
    fn = fp8fn.transform(model, lambda name, m: CURRENT_AUTO if name == "2" else DELAYED)
    assert list(fn.init(torch.randn(2, 16))) == ["0", "4"]


def test_init_sites_in_call_order_with_reuse_and_branches():
    x = torch.randn(4, 16)
    assert list(fp8fn.transform(ReusedLayer(16), DELAYED).init(x)) == ["fc", "fc#1", "out"]
    # The branch not taken at init still gets a site; sites follow the module tree.
    assert list(fp8fn.transform(Branchy(16), DELAYED).init(x)) == ["fc1", "extra", "fc2"]
    # Two modules sharing one weight are two sites (and the head tied to the embedding is one).
    ids = torch.randint(0, 16, (4,))
    assert list(fp8fn.transform(Tied(16, 16), DELAYED).init(ids)) == ["a", "b", "head"]


def test_init_state_layout():
    state = fp8fn.transform(gelu_mlp(), DELAYED).init(torch.randn(4, 16))
    assert type(state) is fp8fn.State
    assert list(state) == ["0", "2", "4"] and len(state) == 3
    assert state.static == (("0", "2", "4"), "max", 0)
    assert state.amax_history.dtype == state.scale.dtype == torch.float32
    assert torch.equal(state.amax_history, torch.zeros(3, 3, 4))  # never observed
    assert torch.equal(state.scale, torch.ones(3, 3))
    # A site's rows and a role's entries are views of the two packed tensors.
    site = state["2"]
    assert type(site) is fp8fn.SiteState and site.amax_history.shape == (3, 4)
    assert site.amax_history.data_ptr() == state.amax_history[1].data_ptr()
    s = site.grad_output
    assert type(s) is fp8fn.ScaleState and s.amax_history.shape == (4,) and s.scale.shape == ()
    assert s.amax_history.data_ptr() == state.amax_history[1, 2].data_ptr()
    assert s.scale.data_ptr() == state.scale[1, 2].data_ptr()
    assert fp8fn.SiteState._fields == fp8fn.ScaleState._fields == ("amax_history", "scale")
    # The recipe's static config lives in the tree structure, not in leaves.
    recipe = fp8fn.DelayedScaling(history_len=2, amax_compute="most_recent", margin=3)
    other = fp8fn.transform(gelu_mlp(), recipe).init(torch.randn(4, 16))
    assert other.static == (("0", "2", "4"), "most_recent", 3)
    assert other.amax_history.shape == (3, 3, 2)
    assert pytree.tree_structure(other) != pytree.tree_structure(state)
    # A stateless recipe: a State without sites.
    current = fp8fn.transform(gelu_mlp(), CURRENT_AUTO).init(torch.randn(4, 16))
    assert type(current) is fp8fn.State and len(current) == 0 and list(current) == []
    assert current.amax_history.shape[:2] == (0, 3) and current.scale.shape == (0, 3)


def test_read_module_gives_a_frozen_plan_that_transform_holds():
    model = gelu_mlp()
    fn = fp8fn.transform(model, DELAYED, filter_fn=lambda name, m: name != "2")
    plan = fn.plan
    assert type(plan) is Plan and plan.module is model
    assert [m.path for m in plan.layers] == ["0", "4"] and plan.stateful == ("0", "4")
    assert dict(plan.recipes) == {"0": DELAYED, "4": DELAYED} and plan.delayed == DELAYED
    assert plan.current() and not plan.checkpointed and not plan.experts
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers = ()
    with pytest.raises(TypeError):
        plan.recipes["2"] = DELAYED  # a read-only mapping
    fn.recipes["2"] = DELAYED  # a copy: the plan is not changed through it
    assert fn.layers == ["0", "4"] and list(plan.recipes) == ["0", "4"]
    again = read_module(model, DELAYED, lambda name, m: name != "2", None)
    assert again is not plan and [m.path for m in again.layers] == ["0", "4"]
    x = torch.randn(4, 16)
    fn.init(x)
    fn.apply(params_of(model), fn.init(x), x)
    assert fn.plan is plan  # the module did not change: the same plan


def test_a_changed_module_gets_a_new_plan_and_the_old_one_stays_as_it_was():
    model = gelu_mlp()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(4, 16)
    old = fn.plan
    layer = old.layers[1]
    model[2] = torch.nn.Linear(32, 32)  # a layer replaced after transform
    assert not old.current()
    state = fn.init(x)
    assert fn.plan is not old and fn.plan.current()
    assert fn.plan.layers[1].module is model[2] and old.layers[1] is layer
    assert layer.module is not model[2]  # the old plan still names the old layer
    obs = torch.func.grad(loss_of(fn), argnums=1)(params_of(model), state, x)
    assert obs["2"].weight.amax_history[0] == model[2].weight.abs().max()


def test_no_module_outside_transformed_reads_a_private_attribute_of_transformed():
    names = {n for n in vars(Transformed) if n.startswith("_") and not n.startswith("__")} | {
        "_choices",
        "_torch_grouped",
        "_weights",
        "_reported",
        "_held",
        "_known",
        "_torch_checkpointed",
    }
    package = pathlib.Path(fp8fn.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "transformed.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
    assert names >= {"_read", "_prepare", "_current_plan"} and found == []
