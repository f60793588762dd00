"""The private torch APIs fp8fn uses (`fp8fn/_torch_private.py`) exist and behave as relied on.

A torch upgrade that renames or changes one of them fails here, by name, instead of somewhere
deep inside the op.
"""

import pytest
import torch
import torch.utils.checkpoint

from fp8fn import _torch_private as private


def test_functorch_level_is_none_outside_and_an_int_inside_transforms():
    assert private.functorch_level() is None
    levels = []

    def f(x):
        levels.append(private.functorch_level())
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    torch.func.grad(torch.func.grad(lambda x: f(x) * x.sum()))(torch.ones(()))
    assert levels == [1, 2]  # one transform, then the inner of two nested ones


def test_tracked_by_outer_differentiation_sees_plain_autograd_and_lower_levels():
    plain = torch.ones(2, requires_grad=True)
    assert private.tracked_by_outer_differentiation(plain)
    assert not private.tracked_by_outer_differentiation(torch.ones(2))
    seen = {}

    def inner(x):
        seen["inner"] = private.tracked_by_outer_differentiation(x)
        return x.sum()

    def outer(x):
        torch.func.grad(inner)(x * 2)  # x * 2 is tracked by the outer grad
        return x.sum()

    torch.func.grad(outer)(torch.ones(2))
    assert seen["inner"] is True
    torch.func.grad(inner)(torch.ones(2))  # one level, nothing outside
    assert seen["inner"] is False


def test_tracked_below_sees_grad_tracking_tensors():
    seen = []

    def f(x):
        seen.append(private.tracked_below(x))
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    assert seen == [True]
    assert private.tracked_below(torch.ones(2, requires_grad=True))
    assert not private.tracked_below(torch.ones(2))


def test_saved_tensor_hooks_active_follows_the_context():
    assert not private.saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert private.saved_tensor_hooks_active()
    assert not private.saved_tensor_hooks_active()


def test_inside_torch_checkpoint_sees_both_modes_and_stops_at_its_frame():
    seen = []

    def body(x):
        seen.append(private.inside_torch_checkpoint(None))
        return x * 2

    x = torch.ones(2, requires_grad=True)
    for reentrant in (True, False):
        torch.utils.checkpoint.checkpoint(body, x, use_reentrant=reentrant).sum().backward()
    body(x)  # not under a checkpoint
    # (each checkpoint runs `body` twice: the forward, and the recompute in the backward)
    assert seen[0] is True and seen[2] is True and seen[-1] is False

    def stop(x):
        return body(x)

    seen.clear()
    torch.utils.checkpoint.checkpoint(
        lambda x: (seen.append(private.inside_torch_checkpoint(stop.__code__)), x)[1] * 2,
        x,
        use_reentrant=True,
    )
    assert seen == [True]


def test_attention_forward_is_multi_head_attention_forward_without_dispatch():
    attention = torch.nn.MultiheadAttention(8, 2)
    q = torch.randn(5, 3, 8)
    args = (q, q, q, 8, 2, attention.in_proj_weight, attention.in_proj_bias, None, None, False)
    args += (0.0, attention.out_proj.weight, attention.out_proj.bias)
    want = torch.nn.functional.multi_head_attention_forward(*args, need_weights=False)[0]
    assert torch.equal(private.attention_forward(*args, need_weights=False)[0], want)
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.nn.functional.multi_head_attention_forward(*args, need_weights=False)
    assert torch.nn.functional.linear not in seen  # the original: one call, nothing inside
    seen.clear()
    with Mode():
        private.attention_forward(*args, need_weights=False)
    assert seen.count(torch.nn.functional.linear) == 2  # the copy: in_proj and out_proj


def test_differentiated_sees_autograd_and_every_transform_level():
    assert private.differentiated(torch.ones(2, requires_grad=True))
    assert not private.differentiated(torch.ones(2))
    assert not private.differentiated_by_transform(torch.ones(2, requires_grad=True))
    seen = {}

    def inner(y, x):
        seen["x"] = (private.differentiated(x), private.differentiated_by_transform(x))
        seen["fresh"] = private.differentiated(torch.ones(2))
        return y.sum()

    def outer(x):
        return torch.func.grad(inner)(x * 2, x)  # x: tracked by the outer level only

    torch.func.grad(lambda x: outer(x).sum())(torch.ones(2))
    assert seen == {"x": (True, True), "fresh": False}
    torch.func.vmap(lambda x: inner(x, x))(torch.ones(3, 2))  # batched, not differentiated
    assert seen["x"] == (False, False)


def test_function_modes_lists_the_modes_in_effect_outermost_first():
    class A(torch.overrides.TorchFunctionMode):
        pass

    class B(torch.overrides.TorchFunctionMode):
        pass

    assert private.function_modes() == []
    with A() as a, B() as b:
        assert private.function_modes() == [a, b]
    assert private.function_modes() == []


def test_constant_under_compile_marks_as_torch_compiler_assume_constant_result():
    def f():
        return 1

    def g():
        return 1

    private.constant_under_compile(f)
    torch.compiler.assume_constant_result(g)
    marks = {k: v for k, v in vars(g).items() if k.startswith("_dynamo")}
    assert marks and vars(f) == marks


def test_recomputing_in_torch_checkpoint_is_seen_in_the_recompute_only():
    seen = []

    def f(x):
        seen.append(private.recomputing_in_torch_checkpoint())
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False).sum().backward()
    assert seen == [False, True]


def test_raised_by_backward_hook_tells_the_hook_from_other_errors():
    model = torch.nn.Linear(2, 2)
    model.register_full_backward_hook(lambda m, gi, go: None)
    params = dict(model.named_parameters())
    try:
        torch.func.grad(lambda p: torch.func.functional_call(model, p, (torch.ones(2),)).sum())(
            params
        )
    except RuntimeError as e:
        assert private.raised_by_backward_hook(e)
    else:
        raise AssertionError("torch.func accepted a full backward hook")
    assert not private.raised_by_backward_hook(RuntimeError("x"))


def test_innermost_function_mode_enters_below_the_modes_in_effect():
    order = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.sin:
                order.append(self.name)
            return func(*args, **(kwargs or {}))

    with Mode("user"):
        with private.innermost_function_mode(Mode("fp8fn")):
            torch.sin(torch.ones(1))
        assert private.function_modes()[-1].name == "user"
    assert order == ["user", "fp8fn"] and private.function_modes() == []


def test_tensor_version_grows_with_in_place_changes_of_views_and_detached_copies():
    t = torch.ones(3)
    before = private.tensor_version(t)
    t[1:].zero_()  # through a view
    assert private.tensor_version(t) > before
    before = private.tensor_version(t)
    t.detach().add_(1)  # detach shares the counter
    assert private.tensor_version(t) > before
    assert private.tensor_version(t + 1) == 0  # a new tensor starts at 0


def test_assert_in_graph_raises_its_message_where_false_only():
    private.assert_in_graph(torch.tensor(True), "never")
    with pytest.raises(RuntimeError, match="fp8fn.x: expected y"):
        private.assert_in_graph(torch.tensor(False), "fp8fn.x: expected y")


def test_refuse_fullgraph_trace_raises_past_dynamo_under_fullgraph_only():
    def f(x):
        private.refuse_fullgraph_trace("fp8fn.test: refused")
        return x + 1

    x = torch.ones(2)
    with pytest.raises(private.TraceRefused, match="^fp8fn.test: refused") as e:
        torch.compile(f, fullgraph=True, backend="eager")(x)
    assert isinstance(e.value, RuntimeError)  # what the user catches; dynamo's types are not
    assert not isinstance(e.value, torch._dynamo.exc.TorchDynamoException)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, backend="eager")(x), x + 1)  # no fullgraph: no error
    assert vars(private.refuse_fullgraph_trace)["_dynamo_marked_constant"]
