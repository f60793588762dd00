"""The private torch APIs fp8fn relies on, fenced in one module.

Each is a small function with a public meaning; `tests/test_torch_private.py` checks that the
torch in use still has them and that they behave as relied on, so that a torch upgrade that
changes one fails loudly there instead of somewhere deep in the op. Every one was verified on
torch 2.13.0. No other module of fp8fn touches a private torch name (`tests/test_torch_private.py`
scans the package's syntax trees for them); the torch error messages fp8fn matches are in
`_torch_errors.py`, beside this module.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types

import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
import torch.utils.checkpoint
import torch.utils.hooks
from torch._functorch import autograd_function as _autograd_function
from torch._functorch import pyfunctorch as _pyfunctorch
from torch._functorch import utils as _functorch_utils
from torch.utils import _pytree

# -- torch.utils._pytree ---------------------------------------------------------------------
# torch's own pytree, which torch.func, torch.compile and FSDP2 flatten with: `State` registers
# there (and with optree) so that all of them see its leaves. torch 2.13 has no public
# `torch.utils.pytree`. The functions themselves, not wrappers: dynamo knows them, and they
# are on every call's path.
tree_flatten = _pytree.tree_flatten  # (tree, is_leaf=None) -> (leaves, spec)
tree_unflatten = _pytree.tree_unflatten  # (leaves, spec) -> tree
tree_leaves = _pytree.tree_leaves  # (tree, is_leaf=None) -> leaves
tree_flatten_with_path = _pytree.tree_flatten_with_path  # (tree) -> ([(path, leaf)], spec)
keystr = _pytree.keystr  # (path) -> "['name']": a leaf's path as text
tree_map = _pytree.tree_map  # (fn, tree) -> tree of fn(leaf)
tree_map_only = _pytree.tree_map_only  # (type, fn, tree): fn on the leaves of that type only
register_pytree_node = _pytree.register_pytree_node  # (cls, flatten, unflatten, ...)
GetAttrKey = _pytree.GetAttrKey  # the key path entry `.name` of flatten_with_keys

_functorch = torch._C._functorch


# The innermost running torch.func transform's level, or None outside transforms. (The C
# function itself: a Python wrapper is a frame that torch.compile would make a graph of.)
functorch_level = _functorch.maybe_current_level


def traced_functorch_level() -> int | None:
    """`functorch_level()` as dynamo sees it: dynamo runs this while tracing and keeps the
    result as a constant (the bare C function returns an int inside a transform, a graph break
    that `fullgraph=True` reports as "returned non-Tensor", naming nothing)."""
    return _functorch.maybe_current_level()


# What `torch.compiler.assume_constant_result` sets; calling it would import dynamo, which
# `import fp8fn` must not.
traced_functorch_level._dynamo_marked_constant = True


def tracked_by_outer_differentiation(t: torch.Tensor) -> bool:
    """Whether a differentiation other than the one running now tracks `t`: plain autograd
    (`requires_grad`, with no torch.func transform running), or a torch.func level below the
    current one (grad of grad, or a plain-autograd graph under torch.func). With no transform
    running, the plain tensor under `t`'s wrappers: a torch.func transform's function that runs
    after it returned (`torch.func.vjp`'s, whose backward sees the forward's saved tensors in
    their dead wrappers, which still say `requires_grad`) is tracked only by plain autograd."""
    if _functorch.maybe_current_level() is None:
        return unwrapped(t).requires_grad
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
        if _functorch.is_gradtrackingtensor(t) or (
            not _functorch.is_functorch_wrapped_tensor(t) and t.requires_grad
        ):
            return True
    return False


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under torch.func's wrappers (grad tracking, batching); `t` if none."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def tensor_version(t: torch.Tensor) -> int:
    """The version counter of `t`: it grows with every in-place change of `t` or of a tensor
    sharing its counter (its views, `t.detach()`)."""
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (whose memory and version counter it shares), or None when
    `t` is not a view."""
    return t._base


def assert_in_graph(condition: torch.Tensor, message: str) -> None:
    """Raise `RuntimeError(message)` where the bool `()` tensor `condition` is False, without a
    host read: on CPU at once, on CUDA as a device-side assert; torch.compile keeps it in the
    graph."""
    torch._assert_async(condition, message)


_FUNCTION_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]  # autograd's C entry
# torch.func's single-level autograd.Function of an fp8fn Function at a grad transform's level
# and grad mode: `{(cls, level, grad mode): class}`, at most a few (levels of nesting x two
# modes x fp8fn's Functions). Written and read by `apply_function` (torch makes a new class per
# call). Not in the state: a cache of classes that depend on nothing else. (Here, not in
# `_core/registries.py`: this module is the layer below `_core`.)
SINGLE_LEVEL_FUNCTIONS: dict = {}


def apply_function(cls, *args):
    """`cls.apply(*args)`, for an autograd.Function `cls` with `setup_context` whose `forward`
    takes exactly `args`, positionally: without the per-call work `Function.apply` and
    torch.func add around autograd's C entry (~30% of a small linear under torch.func).

    * Outside torch.func's transforms: the C entry on `args` with dead functorch wrappers
      unwrapped, without the `inspect.signature(forward).bind(...)` that `Function.apply` runs
      on every call (to fill defaults and keywords, of which there are none here).
    * Under `torch.func.grad`/`vjp` (the innermost transform a Grad one): what torch.func's
      `custom_function_call` does there (`custom_function_call_grad`: unwrap dead wrappers,
      apply a single-level Function that unwraps, runs `cls` one level down and wraps), with
      that single-level Function generated once per `(cls, level, grad mode)`, the only things
      it depends on, instead of a new class on every call. One level down, torch's own route
      runs (`custom_function_call`), and, below every transform, `cls.apply`: this function
      again (`Function`), without the binding.
    * Under other transforms (vmap, jvp): `custom_function_call`.
    * Under torch.compile: `cls.apply` itself (what dynamo traces).
    """
    if torch.compiler.is_compiling():
        return cls.apply(*args)
    if not torch._C._are_functorch_transforms_active():
        return _FUNCTION_BASE_APPLY.__get__(None, cls)(*_functorch_utils.unwrap_dead_wrappers(args))
    interpreter = _pyfunctorch.retrieve_current_functorch_interpreter()
    if interpreter.key() != _functorch.TransformType.Grad:
        return _autograd_function.custom_function_call(cls, *args)
    key = (cls, interpreter.level(), interpreter.prev_grad_mode())
    generated = SINGLE_LEVEL_FUNCTIONS.get(key)
    if generated is None:
        generated = _autograd_function.generate_single_level_function(interpreter, cls)
        SINGLE_LEVEL_FUNCTIONS[key] = generated
    args = [_functorch.unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args]
    with _autograd_function.enable_single_level_autograd_function():
        return _FUNCTION_BASE_APPLY.__get__(None, generated)(*args)


class Function(torch.autograd.Function):
    """An autograd.Function whose `apply` is `apply_function`: `forward` takes its arguments
    positionally (no keywords, no defaults), with `setup_context`. dynamo traces `apply` as
    torch's own (its autograd.Function support takes over `cls.apply`)."""

    @classmethod
    def apply(cls, *args):
        return apply_function(cls, *args)


def tracked_below(t: torch.Tensor) -> bool:
    """Whether a differentiation below the current transform level tracks `t`."""
    return _functorch.is_gradtrackingtensor(t) or t.requires_grad


def differentiated(t: torch.Tensor) -> bool:
    """Whether a differentiation tracks `t`: a running torch.func transform, at any level, or
    plain autograd (`requires_grad` of the tensor under the transforms' wrappers)."""
    return differentiated_by_transform(t) or unwrapped(t).requires_grad


def differentiated_by_transform(t: torch.Tensor) -> bool:
    """Whether a running torch.func transform (at any level) tracks `t`, plain autograd aside."""
    while _functorch.is_functorch_wrapped_tensor(t):
        if t.requires_grad:  # a wrapper's requires_grad: tracked at the wrapper's level
            return True
        t = _functorch.get_unwrapped(t)
    return False


def function_modes() -> list:
    """The `TorchFunctionMode`s in effect, outermost first."""
    return torch.overrides._get_current_function_mode_stack()


@contextlib.contextmanager
def innermost_function_mode(mode):
    """Enter the TorchFunctionMode `mode` below those already in effect (the user's own): they
    see each call first and pass it on to `mode`. As `with mode:` while torch.compile traces.
    """
    if torch.compiler.is_compiling() or not torch.overrides._is_torch_function_mode_enabled():
        with mode:
            yield
        return
    outer = [torch.overrides._pop_mode() for _ in function_modes()]  # innermost first
    try:
        with mode:
            for m in reversed(outer):
                torch.overrides._push_mode(m)
            try:
                yield
            finally:
                for _ in outer:
                    torch.overrides._pop_mode()
    finally:
        for m in reversed(outer):
            torch.overrides._push_mode(m)


def never_compiled_alone(fn):
    """Have torch.compile never compile `fn`, nor what it calls, when `fn` is called from code
    that runs eagerly (dynamo still traces `fn` where a frame it compiles calls it); returns
    `fn`.

    For a `TorchFunctionMode`'s `__torch_function__`: where a compiled function falls back to
    running eagerly (a graph break dynamo cannot resume, e.g. inside a context manager), dynamo
    would compile each call the mode receives from eager code as a frame of its own, (torch
    2.13) with guards that do not tell one tensor property getter from another
    (`Tensor.shape.__get__`, `Tensor.device.__get__`: a frame compiled for `x.shape` answers
    `x.device` with a shape), and the frames it calls once per call site (each a compile, up to
    dynamo's recompile limit). Sets the code's frame strategy (as `torch._dynamo.skip` does,
    and for the frames it calls) without importing dynamo.
    """
    frames = torch._C._dynamo.eval_frame
    skip = frames._FrameAction.SKIP
    frames.set_code_exec_strategy(fn.__code__, frames._FrameExecStrategy(skip, skip))
    return fn


def saved_tensor_hooks_active() -> bool:
    """Whether `torch.autograd.graph.saved_tensors_hooks` are in effect (e.g. the non-reentrant
    `torch.utils.checkpoint`, or offloading to CPU)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def under_compile(module) -> bool:
    """Whether torch.compile runs this code (tracing it, or running it eagerly between the
    graphs of a compiled function, whose callees it compiles), or compiled a submodule of
    `module` on its own (`nn.Module.compile`)."""
    if torch.compiler.is_compiling():
        return True
    if torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


_TORCH_CHECKPOINT = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__


def inside_torch_checkpoint(stop_at) -> bool:
    """Whether the caller runs inside `torch.utils.checkpoint.checkpoint`, below the frame of
    the code object `stop_at` (frames above it are the caller's caller's business).

    Cheap when it cannot be: the reentrant checkpoint runs its function with gradients off, the
    non-reentrant one under saved-tensor hooks; only then are the frames walked.
    """
    if torch.is_grad_enabled() and not saved_tensor_hooks_active():
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not stop_at:
        if frame.f_code is _TORCH_CHECKPOINT:
            return True
        frame = frame.f_back
    return False


def constant_under_compile(fn):
    """`torch.compiler.assume_constant_result(fn)` without importing dynamo (which that call
    does, and `import fp8fn` must not): dynamo runs `fn` once at trace time and takes its
    result as a constant. The mark is the attribute that decorator sets."""
    fn._dynamo_marked_constant = True
    return fn


class TraceRefused(RuntimeError, AssertionError):
    """A `RuntimeError` that fp8fn raises while dynamo traces with `fullgraph=True`.

    Dynamo (torch 2.13, `convert_frame`) re-raises an `AssertionError` raised during tracing as
    it is, where it wraps a `RuntimeError` in its `InternalTorchDynamoError`; being both, this
    error reaches the user as fp8fn's own, with dynamo's "from user code" trace appended.
    """


@constant_under_compile
def refuse_fullgraph_trace(message: str) -> bool:
    """Under `torch.compile(..., fullgraph=True)` (or `torch._dynamo.error_on_graph_break`),
    raise `TraceRefused(message)`; else return False.

    Call it only while compiling: dynamo runs it at trace time (a constant function), so the
    error is raised by dynamo's own frame instead of traced (a traced `raise` under fullgraph
    becomes dynamo's `Unsupported: Observed exception`, with the error only as its cause).
    Without fullgraph the caller's traced `raise` breaks the graph and that frame runs eagerly.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx.one_graph or getattr(tx, "error_on_graph_break", False):
        raise TraceRefused(message)
    return False


def recomputing_in_torch_checkpoint() -> bool:
    """Whether the caller runs in the recompute of a non-reentrant `torch.utils.checkpoint`:
    the backward unpacking a saved tensor reruns the checkpointed function (from the
    checkpoint's `unpack_hook`). Walks every frame: for an error path. False while
    torch.compile traces (dynamo cannot read frames)."""
    if torch.compiler.is_compiling():
        return False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "unpack_hook" and code.co_filename == _TORCH_CHECKPOINT.co_filename:
            return True
        frame = frame.f_back
    return False


_BACKWARD_HOOKS_FILE = inspect.getsourcefile(torch.utils.hooks.BackwardHook)


def raised_by_backward_hook(error: BaseException) -> bool:
    """Whether `error` was raised while torch set up a module's full backward hook
    (`register_full_backward_hook` or `_pre_hook`: `torch.utils.hooks.BackwardHook`, an
    autograd.Function without setup_context, which torch.func refuses). False while
    torch.compile traces (dynamo cannot read tracebacks)."""
    if torch.compiler.is_compiling():
        return False
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _BACKWARD_HOOKS_FILE:
            return True
        tb = tb.tb_next
    return False


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a FakeTensor (shape and dtype only: torch.compile traces with them)."""
    return torch._subclasses.fake_tensor.is_fake(t)


def dynamo_imported() -> bool:
    """Whether torch.compile's dynamo has been imported (nothing can be compiling before), read
    without importing it."""
    return "torch._dynamo" in sys.modules


def autograd_leaves(outputs) -> list:
    """The leaf tensors that the autograd graph of the tensors `outputs` accumulates gradients
    into (walking `grad_fn.next_functions`; a leaf is an `AccumulateGrad` node's `variable`)."""
    stack = [o.grad_fn for o in outputs]
    seen, leaves = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad
            leaves.append(node.variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


# -- nn.Module internals -----------------------------------------------------------------------
# A module's own (not its submodules') parameters, buffers and children live in three dicts;
# fp8fn reads them to know a layer's weight by identity without `getattr` (which would run
# `__getattr__` overrides and parametrizations).


def module_parameters(module: torch.nn.Module) -> dict:
    """`module`'s own parameters, `{name: Parameter or None}`: the live dict, not a copy."""
    return module._parameters


def module_buffers(module: torch.nn.Module) -> dict:
    """`module`'s own buffers, `{name: Tensor or None}`: the live dict, not a copy."""
    return module._buffers


def module_children(module: torch.nn.Module) -> dict:
    """`module`'s direct submodules, `{name: Module or None}`: the live dict, not a copy."""
    return module._modules


def children_in_attributes(attributes: dict):
    """The children dict (`module_children`) held in a module's instance attributes dict
    `attributes` (its `__dict__`), or None if `attributes` holds none."""
    return attributes.get("_modules")


def has_backward_hooks(module: torch.nn.Module) -> bool:
    """Whether `module` has a full backward hook or backward pre-hook of its own
    (`register_full_backward_hook`, `register_full_backward_pre_hook`)."""
    return bool(module._backward_hooks or module._backward_pre_hooks)


# -- FSDP2's gradient reduction (`fp8fn/_transform/expert_parallel.py`) -------------------------


def fsdp_gradient_divisions(root: torch.nn.Module, module: torch.nn.Module, names) -> list:
    """`[(gradient_divide_factor, data-parallel size)]` of the FSDP2 parameter groups, among
    `fully_shard`ed modules inside `root`, that hold the parameters `names` of `module`: the
    factor `set_gradient_divide_factor` set (None when unset: FSDP2 then divides by the
    data-parallel size, its shard mesh's size times its replicate mesh's)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for m in root.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            held = any(
                p._module_info.module is module and p._module_info.param_name in names
                for p in group.fsdp_params
            )
            if held:
                info = group.mesh_info
                size = getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1)
                found.append((group.gradient_divide_factor, size))
    return found


# -- tensor subclasses (`fp8fn/_parallel/fsdp_gather.py`) ----------------------------------------

# What a wrapper subclass sets as its `__torch_function__` to see every op in its
# `__torch_dispatch__` only (torch compares it by identity: the C function itself).
disabled_torch_function = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(cls, like: torch.Tensor, dtype=None, **kwargs) -> torch.Tensor:
    """A new instance of the tensor subclass `cls` with no storage of its own, of `like`'s size
    and strides and device, and `dtype` (default `like`'s); `kwargs` as
    `Tensor._make_wrapper_subclass` takes them (`storage_offset`, `requires_grad`)."""
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.size(),
        strides=like.stride(),
        dtype=like.dtype if dtype is None else dtype,
        device=like.device,
        **kwargs,
    )


def op_mutates(op) -> bool:
    """Whether the aten operator overload `op` (as `__torch_dispatch__` receives it) changes
    one of its arguments in place (its schema marks an argument written)."""
    return op._schema.is_mutable


def aten_copy_ops() -> tuple:
    """The underscored aten operators that copy a tensor, as `__torch_dispatch__` receives them:
    `.to(...)`/`.cpu()`/`.cuda()` (`_to_copy`) and `pin_memory()` (`_pin_memory`)."""
    aten = torch.ops.aten
    return aten._to_copy.default, aten._pin_memory.default


def private_grouped_mm():
    """`torch._grouped_mm` (the grouped GEMM HF's `grouped_mm` experts call: `(input, mat2,
    offs=None, bias=None, out_dtype=None)`), or None on a torch without it."""
    return getattr(torch, "_grouped_mm", None)


def scaled_grouped_mm_available() -> bool:
    """Whether this torch has `torch._scaled_grouped_mm` (float8 grouped GEMM, CUDA)."""
    return hasattr(torch, "_scaled_grouped_mm")


def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """`torch._scaled_grouped_mm` of the float8 `a` `(T, K)` and `b` `(E, K, N)` with row scales
    `scale_a` float32 `(T,)` and column scales `scale_b` float32 `(E, N)`, groups of rows ending
    at `offs` (int32 `(E,)`)."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


def is_convolution(module: torch.nn.Module) -> bool:
    """Whether `module` is one of torch's convolutions (`nn.Conv1d/2d/3d` and their transposed
    forms: `nn.modules.conv._ConvNd`)."""
    return isinstance(module, torch.nn.modules.conv._ConvNd)


def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    """`torch._scaled_mm` (tensorwise or row-wise scales): the op torchao calls. (`F.scaled_mm`,
    public from torch 2.10, dispatches to `_scaled_mm_v2`, whose CPU kernel rounds differently on
    CPUs with AVX512-FP16/AMX: up to 2.9e-6 apart at 32x64x48 in float32.)"""
    return torch._scaled_mm(
        a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )


def _attention_forward():
    """`F.multi_head_attention_forward` without its `__torch_function__` dispatch.

    nn.MultiheadAttention calls it with its projections' weights; a TorchFunctionMode sees that
    one call, and nothing inside it. Running this copy with the mode entered again lets the
    mode see its `linear` calls (the copy reads `has_torch_function` from its own globals).
    Made once, at import: torch.compile then traces a plain function.
    """
    f = F.multi_head_attention_forward
    namespace = {**f.__globals__, "has_torch_function": lambda *args: False}
    copy = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
    copy.__kwdefaults__ = f.__kwdefaults__
    return copy


attention_forward = _attention_forward()


# -- DTensor internals (sharded parameters, `fp8fn/_parallel/dtensor.py`) ---------------------
# Inside an autograd.Function's `forward` torch.func has unwrapped its inputs, and there fp8fn
# reads a DTensor's local shard and builds DTensors of given placements without a collective.
# The public `to_local` / `from_local` are autograd.Functions without `setup_context`, which
# torch.func refuses; these are what they do underneath.


def as_dtensor(t):
    """The DTensor that `t` is (under torch.func's wrappers), or None for any other value.

    A dict lookup while `torch.distributed.tensor` has not been imported: no DTensor exists then.
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, torch.Tensor):
        return None
    t = unwrapped(t)
    return t if isinstance(t, module.DTensor) else None


def dtensor_local(d: torch.Tensor) -> torch.Tensor:
    """The local shard of the DTensor `d` (not a differentiable view: no autograd node)."""
    return d._local_tensor


def dtensor_local_or_none(t):
    """The local shard of `t` if it is a DTensor, else None (without importing
    `torch.distributed.tensor`)."""
    return getattr(t, "_local_tensor", None)


def process_group_devices(group) -> list[torch.device] | None:
    """The device types that `group`'s backends have collectives for, or None where the group
    does not say (e.g. a fake group)."""
    return getattr(group, "_device_types", None)


def dtensor_spec(d: torch.Tensor):
    """The `DTensorSpec` of the DTensor `d`: its mesh, placements and global shape."""
    return d._spec


def new_dtensor_spec(mesh, placements, shape, dtype):
    """A `DTensorSpec` for a contiguous tensor of global `shape` and `dtype` placed on `mesh`."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, dtype))


def make_dtensor(local: torch.Tensor, spec) -> torch.Tensor:
    """A DTensor of `spec` whose local shard is `local` (no collective, no check)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


# -- the CUDA contract of the float8 GEMMs, checked on CPU (fp8fn.testing) ---------------------
# A dispatch mode sees every aten call below autograd and torch.func; torch's meta kernels of the
# float8 GEMMs apply the CUDA rules to tensors on the meta device (`device_hint` says cuda).
DispatchMode = torch.utils._python_dispatch.TorchDispatchMode


def scaled_gemm_ops() -> dict:
    """`{name: aten overload}` of torch's float8 GEMMs, as `__torch_dispatch__` receives them:
    `_scaled_mm` (`torch._scaled_mm`), `_scaled_mm_v2` (`F.scaled_mm`) and
    `_scaled_grouped_mm` (`torch._scaled_grouped_mm`)."""
    aten = torch.ops.aten
    return {
        "_scaled_mm": aten._scaled_mm.default,
        "_scaled_mm_v2": aten._scaled_mm_v2.default,
        "_scaled_grouped_mm": aten._scaled_grouped_mm.default,
    }


def grouped_gemm_op():
    """The aten overload of `torch._grouped_mm` (bfloat16 grouped GEMM), as
    `__torch_dispatch__` receives it."""
    return torch.ops.aten._grouped_mm.default


def bind_op_arguments(op, args: tuple, kwargs: dict) -> dict:
    """`{argument name: value}` of an aten overload's call, defaults filled from its schema."""
    bound = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        else:
            bound[a.name] = a.default_value if a.has_default_value() else None
    return bound


def outside_fake_mode():
    """A context in which tensors are made for real, even inside a FakeTensorMode (so that a
    meta tensor made there is a plain meta tensor, to which torch applies its CUDA rules)."""
    return torch._subclasses.fake_tensor.unset_fake_temporarily()


def experts_gate(module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """transformers 5.x experts' gating of the up projection's output `h` `(rows, 2I)` ->
    `(rows, I)` (`act_fn(gate) * up`, or the model's own layout): the interface's
    `_apply_gate` hook, an underscored method of transformers (not torch), fenced here too."""
    return module._apply_gate(h)


def dtensor_local_offset(d: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(local_shape, global_offset)` of this rank's shard of the DTensor `d`: where its local
    tensor sits in the global tensor (`fp8fn.optim`'s blocks are on the global flat index)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spec = d._spec
    return compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
