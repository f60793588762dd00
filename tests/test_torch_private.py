"""The private torch APIs fp8fn uses (`fp8fn/_torch_private.py`) exist and behave as relied on.

A torch upgrade that renames or changes one of them fails here, by name, instead of somewhere
deep inside the op.
"""

import ast
import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

import fp8fn
from fp8fn import _torch_errors as errors
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


@pytest.mark.slow  # (dynamo's import and two traces: ~10 s on 2 busy cores)
def test_never_compiled_alone_runs_eagerly_from_eager_code_and_is_traced_where_inlined():
    from torch._dynamo.testing import CompileCounter

    def helper(x):
        return x * 2

    def marked(x):
        return helper(x) + 1

    assert private.never_compiled_alone(marked) is marked
    x = torch.ones(3)
    counter = CompileCounter()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(marked, backend=counter)(x), x * 2 + 1)
    assert counter.frame_count == 0  # neither `marked` nor `helper`, which it calls
    out = torch.compile(lambda x: marked(x) * 3, backend=counter, fullgraph=True)(x)
    assert torch.equal(out, (x * 2 + 1) * 3)
    assert (counter.frame_count, counter.op_count) == (1, 3)  # traced inside: one graph
    torch._dynamo.reset()


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


def test_traced_functorch_level_is_functorch_level_marked_constant_for_dynamo():
    assert private.traced_functorch_level._dynamo_marked_constant is True
    seen = []

    def f(x):
        seen.append((private.traced_functorch_level(), private.functorch_level()))
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    assert seen == [(1, 1)] and private.traced_functorch_level() is None


def test_unwrapped_is_the_plain_tensor_under_grad_and_vmap_wrappers():
    x = torch.arange(6.0).reshape(3, 2)
    seen = []

    def f(row):
        seen.append(private.unwrapped(row))
        return row.sum()

    torch.func.vmap(torch.func.grad(f))(x)
    assert type(seen[0]) is torch.Tensor and seen[0].shape == (3, 2)
    assert torch.equal(seen[0], x)
    assert private.unwrapped(x) is x


def test_view_base_is_the_viewed_tensor_or_none():
    t = torch.ones(4)
    assert private.view_base(t) is None
    assert private.view_base(t[1:]) is t
    assert private.view_base(t[1:][1:]) is t  # a view of a view: the tensor with the memory


def test_pytree_functions_flatten_states_with_their_key_paths():
    fn = fp8fn.transform(torch.nn.Linear(4, 2), fp8fn.DelayedScaling(history_len=2))
    state = fn.init(torch.ones(1, 4))
    leaves, spec = private.tree_flatten(state)
    assert [t.shape for t in leaves] == [(1, 3, 2), (1, 3)]
    assert private.tree_leaves(state) == leaves
    rebuilt = private.tree_unflatten(leaves, spec)
    assert type(rebuilt) is fp8fn.State and rebuilt.sites == state.sites
    doubled = private.tree_map(lambda t: t * 2, state)
    assert torch.equal(doubled.scale, state.scale * 2)
    only = private.tree_map_only(int, lambda v: v + 1, (1, 2.0, [3]))
    assert only == (2, 2.0, [4])
    paths = [path for path, _ in torch.utils._pytree.tree_flatten_with_path(state)[0]]
    assert paths == [(private.GetAttrKey("amax_history"),), (private.GetAttrKey("scale"),)]
    assert private.register_pytree_node is torch.utils._pytree.register_pytree_node


def test_is_fake_tells_fake_tensors_from_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(2)
    assert private.is_fake(fake) and not private.is_fake(torch.ones(2))


def test_dynamo_imported_follows_sys_modules(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    assert not private.dynamo_imported()
    monkeypatch.setitem(sys.modules, "torch._dynamo", object())
    assert private.dynamo_imported()


def test_autograd_leaves_are_the_leaves_a_backward_accumulates_into():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    frozen = torch.ones(2)
    out = (a * b).sin() + a + frozen
    leaves = private.autograd_leaves([out, (b * 3).sum()])
    assert sorted(map(id, leaves)) == sorted({id(a), id(b)}) and len(leaves) == 2
    assert private.autograd_leaves([frozen * 2]) == []


def test_module_dicts_are_the_live_own_parameters_buffers_and_children():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    linear, norm = model[0], model[1]
    assert private.module_parameters(linear) == {"weight": linear.weight, "bias": linear.bias}
    assert set(private.module_buffers(norm)) == {
        "running_mean",
        "running_var",
        "num_batches_tracked",
    }
    assert private.module_parameters(model) == {}  # its own only, not its children's
    assert list(private.module_children(model).values()) == [linear, norm]
    linear.extra = torch.nn.Parameter(torch.ones(1))  # the live dict, not a copy
    assert private.module_parameters(linear)["extra"] is linear.extra
    assert private.children_in_attributes(vars(model)) is private.module_children(model)
    assert private.children_in_attributes({}) is None


def test_has_backward_hooks_sees_full_hooks_and_pre_hooks_of_the_module_only():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not private.has_backward_hooks(model[0])
    model[0].register_full_backward_pre_hook(lambda m, g: None)
    assert private.has_backward_hooks(model[0]) and not private.has_backward_hooks(model)
    model.register_full_backward_hook(lambda m, gi, go: None)
    assert private.has_backward_hooks(model)


class _Wrapper(torch.Tensor):
    """A wrapper subclass built by the fence's helpers: every op runs on `inner`."""

    __torch_function__ = private.disabled_torch_function

    @staticmethod
    def __new__(cls, inner, dtype=None):
        return private.make_wrapper_subclass(cls, inner, dtype, requires_grad=False)

    def __init__(self, inner, dtype=None):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.seen.append((func, private.op_mutates(func)))
        args, kwargs = private.tree_map_only(cls, lambda t: t.inner, (args, kwargs or {}))
        return func(*args, **kwargs)


def test_wrapper_subclass_helpers_make_a_storage_free_tensor_seeing_every_op():
    inner = torch.arange(6.0).reshape(2, 3).t()
    w = _Wrapper(inner)
    assert (w.shape, w.stride(), w.dtype, w.device) == ((3, 2), (1, 3), torch.float32, inner.device)
    assert _Wrapper(inner, torch.bfloat16).dtype == torch.bfloat16
    _Wrapper.seen = []
    out = torch.add(w, 1)  # __torch_function__ disabled: straight to __torch_dispatch__
    w.mul_(2)
    w.to(torch.float64)
    aten = torch.ops.aten
    assert _Wrapper.seen == [
        (aten.add.Tensor, False),
        (aten.mul_.Tensor, True),
        (aten._to_copy.default, False),
    ]
    want = torch.arange(6.0).reshape(2, 3).t()
    assert torch.equal(out, want + 1) and torch.equal(inner, want * 2)  # mul_ reached `inner`
    assert _Wrapper.seen[-1][0] in private.aten_copy_ops()
    assert private.aten_copy_ops() == (aten._to_copy.default, aten._pin_memory.default)


def test_scaled_mm_multiplies_with_dequantizing_scales():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(8, 32, generator=gen).to(torch.float8_e4m3fn).t()
    sa, sb = torch.tensor(2.0), torch.tensor(0.25)
    out = private.scaled_mm(a, b, sa, sb, torch.float32)
    want = (a.double() * 2.0) @ (b.double() * 0.25)
    assert out.dtype == torch.float32 and out.shape == (16, 8)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_dtensor_helpers_read_and_build_dtensors_without_collectives(one_rank_mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    local = torch.arange(6.0).reshape(3, 2)
    d = distribute_tensor(local, one_rank_mesh, [Shard(0)])
    assert torch.equal(private.dtensor_local(d), local)
    assert private.dtensor_local_or_none(d) is private.dtensor_local(d)
    assert private.dtensor_local_or_none(local) is None
    spec = private.dtensor_spec(d)
    assert (spec.mesh, spec.placements, spec.shape) == (one_rank_mesh, (Shard(0),), (3, 2))
    spec = private.new_dtensor_spec(one_rank_mesh, [Replicate()], (3, 2), torch.bfloat16)
    assert (spec.placements, spec.shape, spec.stride, spec.tensor_meta.dtype) == (
        (Replicate(),),
        (3, 2),
        (2, 1),
        torch.bfloat16,
    )
    made = private.make_dtensor(local.bfloat16(), spec)
    assert isinstance(made, DTensor) and made.placements == (Replicate(),)
    assert private.dtensor_local(made).dtype == torch.bfloat16 and not made.requires_grad


def test_process_group_devices_are_the_backends_device_types(one_rank_mesh):
    devices = private.process_group_devices(dist.group.WORLD)
    assert {d.type for d in devices} == {"cpu", "cuda"}  # gloo reduces both
    assert private.process_group_devices(object()) is None


# torch's error messages that `_torch_errors.py` matches: each provoked for real -----------------


def _message(f) -> str:
    with pytest.raises(RuntimeError) as info:
        f()
    return str(info.value)


def test_torch_checkpoint_under_func_messages_still_match():
    x = torch.ones(2)
    for reentrant, marker in ((False, 0), (True, 1)):
        message = _message(
            lambda: torch.func.grad(
                lambda x: torch.utils.checkpoint.checkpoint(
                    torch.sin, x, use_reentrant=reentrant
                ).sum()
            )(x)
        )
        assert errors._TORCH_CHECKPOINT_UNDER_FUNC[marker] in message, message


def test_torch_mutates_captured_message_still_matches():
    buffer = torch.zeros(2)
    message = _message(lambda: torch.func.grad(lambda x: buffer.add_(x).sum())(torch.ones(2)))
    assert errors._TORCH_MUTATES_CAPTURED in message, message


def test_torch_requires_grad_under_func_message_still_matches():
    message = _message(
        lambda: torch.func.grad(lambda x: (x * 2).requires_grad_(True).sum())(torch.ones(2))
    )
    assert errors._TORCH_REQUIRES_GRAD_UNDER_FUNC in message, message


def test_torch_no_setup_context_message_still_matches():
    class Legacy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    message = _message(lambda: torch.func.grad(lambda x: Legacy.apply(x).sum())(torch.ones(2)))
    assert errors._NO_SETUP_CONTEXT in message, message


def test_torch_mixed_dtensor_message_still_matches(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    d = distribute_tensor(torch.ones(3, 2), one_rank_mesh, [Shard(0)])
    message = _message(lambda: d + torch.ones(3, 2))
    assert errors._MIXED in message, message


# the fence stays closed ---------------------------------------------------------------------------

_PACKAGE = pathlib.Path(fp8fn.__file__).parent
_FENCE = _PACKAGE / "_torch_private.py"
# Attributes of torch objects flagged even where fp8fn happens to use the same name for its own.
_TORCH_ATTRIBUTES = {
    "_backward_hooks",
    "_backward_pre_hooks",
    "_base",
    "_buffers",
    "_device_types",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_local_tensor",
    "_make_wrapper_subclass",
    "_modules",
    "_parameters",
    "_schema",
    "_spec",
    "_version",
}
# Public torch attributes that are walks of autograd's undocumented graph.
_AUTOGRAD_GRAPH = {"next_functions"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(trees) -> set[str]:
    """The underscored names fp8fn defines itself: functions, classes, variables, attributes it
    assigns, arguments, `__slots__`/`_fields` entries and `setattr` names."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in ("__slots__", "_fields") for t in node.targets
            ):
                own.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
            elif _call_of(node, "setattr") and isinstance(node.args[1], ast.Constant):
                own.add(node.args[1].value)
    return {n for n in own if isinstance(n, str) and _private(n)} - _TORCH_ATTRIBUTES


def _call_of(node, *names) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in names
        and len(node.args) > 1
    )


def _private_torch_uses(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """`[(line, what)]`: the places in `tree` that touch a private torch name. Imports of an
    underscored torch module or name; underscored attributes of a name bound to torch (by an
    import, or an assignment from one); an underscored attribute, `getattr`-family name or
    `.get` key that fp8fn does not define itself (an attribute of someone else's object: torch's
    tensors, modules, process groups); `torch._...` module names in strings; autograd graph
    walks."""
    torch_names, found = set(), []

    def rooted(e) -> bool:
        while isinstance(e, (ast.Attribute, ast.Call, ast.Subscript)):
            e = e.func if isinstance(e, ast.Call) else e.value
        return isinstance(e, ast.Name) and e.id in torch_names

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
                    if any(map(_private, a.name.split("."))):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if any(map(_private, [*node.module.split("."), a.name])):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
            if rooted(node.value):
                torch_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (
            node.attr in _AUTOGRAD_GRAPH
            or (_private(node.attr) and (rooted(node.value) or node.attr not in own))
        ):
            found.append((node.lineno, ast.unparse(node)))
        elif _call_of(node, "getattr", "hasattr", "setattr", "delattr") or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            key = node.args[1] if isinstance(node.func, ast.Name) else node.args[0]
            name = key.value if isinstance(key, ast.Constant) else None
            if isinstance(name, str) and _private(name) and name not in own:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts = node.value.split(".")
            if parts[0] == "torch" and len(parts) > 1 and any(map(_private, parts)):
                found.append((node.lineno, repr(node.value)))
    return sorted(found)


@functools.cache
def _package_trees() -> dict[pathlib.Path, ast.AST]:
    return {p: ast.parse(p.read_text()) for p in sorted(_PACKAGE.rglob("*.py"))}


@functools.cache
def _package_own_names() -> frozenset[str]:
    """The underscored names fp8fn defines outside the fence."""
    return frozenset(_own_names(t for p, t in _package_trees().items() if p != _FENCE))


def test_no_module_outside_the_fence_touches_a_private_torch_name():
    trees = _package_trees()
    assert _FENCE in trees and len(trees) > 30
    own = _package_own_names()
    found = {
        str(p.relative_to(_PACKAGE)): uses
        for p, t in trees.items()
        if p != _FENCE and (uses := _private_torch_uses(t, own))
    }
    assert found == {}, (
        "private torch APIs outside fp8fn/_torch_private.py (put each behind a named function "
        f"there, with a test here): {found}"
    )
    assert _private_torch_uses(trees[_FENCE], own)  # the scan sees the fence's own uses


@pytest.mark.parametrize(
    "source",
    [
        "import torch._dynamo",
        "from torch.utils import _pytree",
        "from torch.distributed.tensor._dtensor_spec import DTensorSpec",
        "import torch\nf = torch._C._disabled_torch_function_impl",
        "import torch\naten = torch.ops.aten\nop = aten._to_copy.default",
        "from torch import nn\nnn.Module._apply",
        "def f(t):\n    return t._version",
        "def f(m):\n    return m._parameters",
        "def f(g):\n    return getattr(g, '_device_types', None)",
        "def f(attributes):\n    return attributes.get('_modules')",
        "import sys\nloaded = 'torch._inductor' in sys.modules",
        "def f(node):\n    return node.next_functions",
    ],
)
def test_the_fence_scan_flags_each_kind_of_private_access(source):
    assert _private_torch_uses(ast.parse(source), _package_own_names()), source


def test_the_fence_scan_passes_fp8fns_own_underscored_names():
    source = "import torch\nclass A:\n    def __init__(self):\n        self._x = 1\n"
    source += "def f(a, t):\n    return a._x, t.__torch_function__, torch.ops.aten.add.Tensor"
    tree = ast.parse(source)
    assert _private_torch_uses(tree, _own_names([tree])) == []


def test_private_grouped_mm_is_torchs_grouped_gemm():
    grouped = private.private_grouped_mm()
    assert grouped is torch._grouped_mm
    a, b = torch.randn(6, 8), torch.randn(2, 8, 4)  # rows 8 floats: 16-byte strides
    offs = torch.tensor([2, 6], dtype=torch.int32)
    want = torch.cat([a[:2] @ b[0], a[2:] @ b[1]])
    torch.testing.assert_close(grouped(a, b, offs=offs), want, rtol=1e-6, atol=1e-6)


def test_scaled_grouped_mm_binds_its_arguments_and_has_no_cpu_kernel():
    # A CUDA kernel: on CPU the dispatcher refuses the device, after the arguments bound (a
    # renamed or removed keyword would raise TypeError first).
    assert private.scaled_grouped_mm_available()
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 16, 16, dtype=torch.float8_e4m3fn)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="'aten::_scaled_grouped_mm' with arguments"):
        private.scaled_grouped_mm(a, b, torch.ones(16), torch.ones(2, 16), offs, torch.bfloat16)


def test_is_convolution_is_every_torch_convolution_only():
    convs = (torch.nn.Conv1d(2, 2, 1), torch.nn.Conv2d(2, 2, 1), torch.nn.ConvTranspose3d(2, 2, 1))
    assert all(map(private.is_convolution, convs))
    assert not private.is_convolution(torch.nn.Linear(2, 2))


def test_scaled_gemm_ops_bind_their_arguments_by_schema_name():
    ops = private.scaled_gemm_ops()
    assert set(ops) == {"_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm"}
    one = torch.ones(())
    bound = private.bind_op_arguments(ops["_scaled_mm"], ("a", "b", one, one), {"bias": "c"})
    assert bound["self"] == "a" and bound["bias"] == "c" and bound["use_fast_accum"] is False
    assert bound["out_dtype"] is None
    grouped = private.bind_op_arguments(ops["_scaled_grouped_mm"], (1, 2, 3, 4), {"offs": 5})
    assert [grouped[k] for k in ("self", "mat2", "scale_a", "scale_b", "offs")] == [1, 2, 3, 4, 5]


def test_outside_fake_mode_makes_plain_meta_tensors_inside_a_fake_mode():
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        assert private.is_fake(torch.empty(2, device="meta"))
        with private.outside_fake_mode():
            t = torch.empty(2, device="meta")
    assert not private.is_fake(t) and t.device.type == "meta"
    assert issubclass(private.DispatchMode, torch.utils._python_dispatch.TorchDispatchMode)


def test_experts_gate_is_transformers_gating_of_the_up_projection():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=8, intermediate_size=6, num_local_experts=2, num_hidden_layers=1
    )
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    h = torch.randn(5, 12)
    gate, up = h.chunk(2, dim=-1)
    assert torch.equal(private.experts_gate(experts, h), experts.act_fn(gate) * up)


def test_tree_flatten_with_path_and_keystr_name_the_leaves():
    leaves, _ = private.tree_flatten_with_path({"a": [torch.zeros(1), torch.ones(1)]})
    assert [private.keystr(path) for path, _ in leaves] == ["['a'][0]", "['a'][1]"]


def test_fsdp_gradient_divisions_are_the_factor_and_size_of_the_groups_holding_the_weights(
    one_rank_mesh,
):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    held = model[1]
    assert private.fsdp_gradient_divisions(model, held, ("weight",)) == []
    fully_shard(held, mesh=one_rank_mesh)
    fully_shard(model, mesh=one_rank_mesh)
    assert private.fsdp_gradient_divisions(model, held, ("weight",)) == [(None, 1)]
    assert private.fsdp_gradient_divisions(model, model[0], ("weight",)) == [(None, 1)]
    assert private.fsdp_gradient_divisions(model, held, ("other",)) == []
    held.set_gradient_divide_factor(4.0)
    assert private.fsdp_gradient_divisions(model, held, ("weight", "bias")) == [(4.0, 1)]


class _Scale(private.Function):
    """`x * k`, backward `g * k`: a `private.Function` (its `apply` is `apply_function`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, k):
        return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class _TorchScale(torch.autograd.Function):
    """`_Scale` as torch runs it (`Function.apply`), the reference."""

    generate_vmap_rule = True
    forward, setup_context, backward = _Scale.forward, _Scale.setup_context, _Scale.backward


def test_apply_function_is_function_apply_without_its_per_call_work(monkeypatch):
    """Plain autograd (the Function's own backward node), torch.func.grad (one level and
    nested, with grad mode on and off around it), vmap around grad: the values and gradients
    of torch's `Function.apply`, without one call of `inspect.signature` (what `Function.apply`
    binds with; but in torch's vmap rule) and with torch.func's single-level Function of the
    innermost transform generated once per level and grad mode, not per call. (Compiled, it
    is `apply`: the compiled steps of test_compile.py run through it.)"""
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = _Scale.apply(x, 3.0)
    assert type(y.grad_fn).__name__ == "_ScaleBackward"
    y.sum().backward()
    assert x.grad.tolist() == [3.0, 3.0, 3.0]
    generated = []
    make = private._autograd_function.generate_single_level_function
    monkeypatch.setattr(
        private._autograd_function,
        "generate_single_level_function",
        lambda *a: generated.append(a[0].level()) or make(*a),
    )
    monkeypatch.setattr(private, "SINGLE_LEVEL_FUNCTIONS", {})

    def refuse(*args, **kwargs):
        raise AssertionError("inspect.signature called")

    def cases(op):  # (each a function of t, its expected value)
        once = torch.func.grad(lambda t: (op.apply(t, 5.0) * op.apply(t, 2.0)).sum())
        twice = torch.func.grad(lambda t: once(t).sum())  # d/dt of 20 t: 20
        return [
            (lambda t: op.apply(t, 2.0), [2.0, -4.0, 6.0]),
            (once, [20.0, -40.0, 60.0]),
            (once, [20.0, -40.0, 60.0]),  # (the single-level Functions made: reused)
            (twice, [20.0, 20.0, 20.0]),
            (torch.no_grad()(once), [20.0, -40.0, 60.0]),  # (another grad mode below)
            (torch.vmap(once), [20.0, -40.0, 60.0]),  # (torch's vmap rule: it binds)
        ]

    want = [f(x.detach()) for f, _ in cases(_TorchScale)]
    generated.clear()  # (torch's own route generates one per call)
    with monkeypatch.context() as patched:
        patched.setattr(private.inspect, "signature", refuse)
        got = [f(x.detach()) for f, _ in cases(_Scale)[:-1]]
    got.append(cases(_Scale)[-1][0](x.detach()))
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert [g.tolist() for g in got] == [v for _, v in cases(_Scale)]
    # `once`: one, at level 1, for both calls and both runs; `twice`: one at level 2, then two
    # at level 1 (below the innermost transform torch's own route runs: one per call); under
    # no_grad: one (another grad mode); vmap around grad: none (level 2, grad mode on: known)
    assert generated == [1, 2, 1, 1, 1]
    with pytest.raises(AssertionError, match="inspect.signature called"):
        monkeypatch.setattr(private.inspect, "signature", refuse)
        _TorchScale.apply(x, 2.0)  # (the module is torch's `inspect`: Function.apply binds)
