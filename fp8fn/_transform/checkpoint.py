"""`checkpoint`: recompute a pure function in the backward, under torch.func and autograd alike."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import nn

from .._torch_private import (
    autograd_leaves,
    differentiated,
    differentiated_by_transform,
    dynamo_imported,
    function_modes,
    functorch_level,
    tensor_version,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)
from .swap import Holder, module_tensors, swapped_call

_PASS_AS_ARGUMENTS = (
    "Pass it as an argument (`fp8fn.checkpoint(lambda w, x: x @ w, w, x)`, not "
    "`fp8fn.checkpoint(lambda x: x @ w, x)`), or pass a module itself as `f` "
    "(`fp8fn.checkpoint(block, x)`): its parameters are then arguments."
)


def _is_hf_cache(x) -> bool:
    """A HF transformers cache (`DynamicCache`, `EncoderDecoderCache`, and the models' own that
    do not derive from `Cache`, e.g. `ReformerDynamicCache`): a mutable object a layer updates
    in place. Duck-typed, so that transformers stays an optional dependency."""
    return any(
        c.__name__.endswith("Cache") and c.__module__.startswith("transformers")
        for c in type(x).__mro__
    )


def _refuse_cache(args, api: str, subject: str) -> None:
    """Raise if `args` carry a HF KV cache: the recompute would update it a second time."""
    leaves = tree_leaves(args, is_leaf=_is_hf_cache)  # kept whole if registered
    cache = next((x for x in leaves if _is_hf_cache(x)), None)
    if cache is not None:
        raise ValueError(
            f"fp8fn.{api}: expected no KV cache in the inputs of {subject}, got a "
            f"{type(cache).__name__}: the recompute in the backward would update it a second "
            "time (silently wrong gradients). Train without the cache: pass `use_cache=False` "
            "to the model, or set `model.config.use_cache = False` (HF transformers)."
        )


class _Checkpoint(torch.autograd.Function):
    """Runs `run(*tensors)` without saving activations; the backward re-runs it to differentiate.

    `run` maps a flat tuple of input tensors to a flat tuple of output tensors; `run.rng_state`
    is the RNG state to recompute with; `diff` the positions of the inputs to differentiate
    (the others, e.g. buffers, are constants). Only the inputs are saved.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(run, diff, *tensors):
        # An input returned as-is becomes a view: autograd cannot save an input it returns.
        return tuple(o.view_as(o) if any(o is t for t in tensors) else o for o in run(*tensors))

    @staticmethod
    def setup_context(ctx, inputs, output):
        run, diff, *tensors = inputs
        ctx.run, ctx.diff = run, diff
        ctx.mark_non_differentiable(*(t for t in output if not t.is_floating_point()))
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        tensors, diff = ctx.saved_tensors, ctx.diff
        grads = [None] * len(tensors)
        if not diff:
            return (None, None, *grads)
        # Plain autograd, no graph of the backward: the recompute is differentiated by plain
        # autograd too (torch.func's derivatives of some ops, e.g. `F.silu`'s, round differently
        # from autograd's: a torch.func recompute under `loss.backward()` changed the gradients
        # of a HF Mixtral's decoder layers), on detached inputs, and a tensor in it that
        # requires grad was read from outside `f`'s arguments (refused).
        plain = functorch_level() is None and not torch.is_grad_enabled()
        if plain:
            tensors = tuple(t.detach() for t in tensors)

        def run_diff(*diff_tensors):
            args = list(tensors)
            for i, t in zip(diff, diff_tensors):
                args[i] = t
            return tuple(ctx.run(*args))

        if plain:
            return (None, None, *_autograd_vjp(ctx, run_diff, tensors, diff, grad_outputs))

        def contracted(*diff_tensors):
            # sum(<output, cotangent>): its gradient is the vjp, bit for bit (the backward of
            # the sum and the product hands each output exactly its cotangent).
            total = torch.zeros((), dtype=torch.float32, device=tensors[diff[0]].device)
            for o, g in zip(run_diff(*diff_tensors), grad_outputs):
                if g is not None and o.is_floating_point():
                    total = total + (o * g).sum()
            return total

        # torch.func.grad, not vjp: the backward pass runs while the recompute's functorch
        # level is still active, so a checkpoint nested inside `f` can open its own level in
        # its backward (with vjp, whose vjp_fn runs after the level is gone, a nested
        # checkpoint under torch.func trips `level <= current_level INTERNAL ASSERT`).
        with _restored_rng(ctx.run.rng_state), torch.enable_grad():
            diff_grads = torch.func.grad(contracted, argnums=tuple(range(len(diff))))(
                *(tensors[i] for i in diff)
            )
        for i, g in zip(diff, diff_grads):
            grads[i] = g
        return (None, None, *grads)


def _refuse_outside_input(names) -> None:
    api, subject = names
    raise RuntimeError(
        f"fp8fn.{api}: expected {subject} to take every tensor it differentiates through as an "
        "argument, got its recompute reading one that requires grad from elsewhere (a module's "
        f"parameter, a global): its gradient would be lost. {_PASS_AS_ARGUMENTS}"
    )


def _autograd_vjp(ctx, run_diff, tensors, diff, grad_outputs) -> list:
    """`_Checkpoint.backward`'s gradients of the inputs by plain autograd on the recompute, as
    the same backward without recompute would take them, bit for bit: None where not
    differentiated or not reached (a parameter the loss does not reach keeps `.grad` None). A
    recompute reaching a leaf that requires grad other than its inputs is refused (its
    gradient would be lost)."""
    inputs = [tensors[i].detach().requires_grad_() for i in diff]
    with _restored_rng(ctx.run.rng_state), torch.enable_grad():
        outputs = run_diff(*inputs)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grad_outputs)
            if g is not None and o.is_floating_point() and o.requires_grad
        ]
        given = {id(t) for t in inputs}
        if any(id(leaf) not in given for leaf in autograd_leaves([o for o, _ in pairs])):
            _refuse_outside_input(ctx.run.names)
        diff_grads = torch.autograd.grad(
            [o for o, _ in pairs],
            inputs,
            [g for _, g in pairs],
            allow_unused=True,  # None for an input the recompute does not reach, as autograd
        )
    grads = [None] * len(tensors)
    for i, g in zip(diff, diff_grads):
        grads[i] = g
    return grads


@functools.cache
def _eager_checkpoint() -> type[_Checkpoint]:
    """`_Checkpoint` with its forward and backward never traced by torch.compile.

    Dynamo would otherwise trace the frames they call (falling back to eager for
    `checkpoint_with_constants` covers only its own frame): the forward's, which may then round
    differently from the eager recompute, and in the backward the `torch.func.grad` over the
    recompute, whose graph AOTAutograd differentiates once more (a double backward, which
    raises for ops that have none, e.g. SDPA on CPU). Made on first use, so that importing
    fp8fn does not import dynamo.
    """

    class _EagerCheckpoint(_Checkpoint):
        forward = staticmethod(torch.compiler.disable(_Checkpoint.forward))
        backward = staticmethod(torch.compiler.disable(_Checkpoint.backward))

    return _EagerCheckpoint


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state):
    cpu, cuda = state
    devices = range(len(cuda)) if cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        yield


def _autocast_state(tensors):
    """The autocast settings in effect for the devices of `tensors` and for the CPU."""
    devices = dict.fromkeys(["cpu", *(t.device.type for t in tensors)])
    settings = [
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in devices
        if torch.amp.is_autocast_available(d)
    ]
    return settings, torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def _restored_autocast(state):
    """Autocast as `_autocast_state` recorded it (on, with its dtype, or off), whatever is in
    effect now (the backward usually runs outside the forward's autocast)."""
    settings, cache = state
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in settings:
            stack.enter_context(
                torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield


def checkpoint(f, *args):
    """`f(*args)`, recomputed in the backward instead of saving its activations.

    Works under `torch.func.grad` / `vjp` / `grad_and_value` (where `torch.utils.checkpoint`
    raises) and under plain autograd. `f` must be a pure function of its arguments: everything
    it differentiates through — parameters and fp8fn scaling state included — must be passed in
    `args`, not read from a closure, since the recompute runs after the forward has returned.
    An `nn.Module` (or a bound method of one) may be `f`: its parameters and buffers at the call
    are then arguments too, and a `functools.partial`'s bound arguments are arguments. A tensor
    `f` closes over (or holds as a default) that a differentiation tracks is refused with an
    error, and so is, under plain autograd, a recompute that reads one from elsewhere. The
    recompute sees the forward's RNG state and autocast settings, so dropout masks and dtypes
    agree. Under fp8fn scaling, a recompute casts bit-identically to the forward and observes
    nothing twice. Inside a model that `fp8fn.apply` runs, choose the module with
    `checkpoint_fn` instead (there `fp8fn.checkpoint` is refused while recording gradients).

    Args:
      f: a function of pytrees of tensors (dicts, lists, tuples, NamedTuples; non-tensor
        leaves are passed through unchanged) returning a pytree of tensors (None leaves, as in
        HF layers' outputs, are returned as None), or an `nn.Module`.
      *args: its arguments.

    Returns:
      `f(*args)`.

    Raises:
      TypeError: when `f` is not callable, or returns something other than a pytree of
        tensors (None leaves allowed).
      ValueError: when `f` closes over a tensor being differentiated, or, recording
        gradients, `args` carry a HF KV cache (the recompute would update it again).
      RuntimeError: inside a model that `fp8fn.apply` runs, while recording gradients; when
        `f` modifies one of its inputs in place; when the recompute returns another structure,
        or (plain autograd) reads a tensor that requires grad from outside `args`; while dynamo
        traces it (without `fullgraph` that frame then runs eagerly).

    Example:
      >>> import torch, fp8fn
      >>> params, x = {"w": torch.randn(4, 4)}, torch.randn(2, 4)
      >>> f = lambda p, x: torch.tanh(x @ p["w"]).sum()
      >>> g = torch.func.grad(lambda p, x: fp8fn.checkpoint(f, p, x))(params, x)
      >>> torch.equal(g["w"], torch.func.grad(f)(params, x)["w"])
      True
    """
    if torch.is_grad_enabled() and any(
        type(m).__module__.partition(".")[0] == "fp8fn" for m in function_modes()
    ):
        raise RuntimeError(
            "fp8fn.checkpoint: expected to run outside fp8fn.apply, got a call inside the "
            "model it runs: the recompute in the backward would run outside fp8fn.apply, "
            "without its float8 casts (silently wrong gradients and observations). Checkpoint "
            "the module with `checkpoint_fn=lambda name, module: ...` in fp8fn.transform."
        )
    if not callable(f):
        raise TypeError(
            "fp8fn.checkpoint: expected `f` to be a function of the arguments that follow it, "
            f"got {type(f).__name__}. Call it as fp8fn.checkpoint(f, *args)."
        )
    call, bound, keywords = f, (), {}
    while isinstance(call, functools.partial):  # its bound arguments become arguments
        bound, keywords = (*call.args, *bound), {**call.keywords, **keywords}
        call = call.func
    module = call.__self__ if inspect.ismethod(call) else call
    if not isinstance(module, nn.Module):
        if torch.is_grad_enabled():
            _refuse_closed_over(call, (bound, keywords, args))
        return checkpoint_with_constants(
            lambda _, b, kw, a: call(*b, *a, **kw), (bound, keywords, args), ()
        )
    slots, params, buffers = module_tensors(module)
    holder = Holder(module, call)
    if torch.is_grad_enabled():
        _refuse_closed_over(call, (params, bound, keywords, args))

    def run(buffers, params, b, kw, a):
        return swapped_call(holder, slots, {**buffers, **params}, (*b, *a), kw, prefix="m.")

    return checkpoint_with_constants(run, (params, bound, keywords, args), buffers)


def _closed_over(f):
    """`(name, tensor, held_by_module)` for the tensors `f` reads besides its arguments: in its
    closure, its defaults, its `__self__`, inside dicts, lists, tuples, fp8fn States and
    modules there, and in the functions found there (followed, up to a bound)."""
    pending, seen = [("f", f)], set()
    while pending and len(seen) < 1000:
        name, value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield name, value, False
        elif isinstance(value, nn.Module):
            for n, t in (*value.named_parameters(), *value.named_buffers()):
                yield f"{name}.{n}", t, True
        elif isinstance(value, functools.partial):
            pending += [(name, value.func), (name, value.args), (name, value.keywords)]
        elif inspect.ismethod(value):
            pending += [(name, value.__func__), (name, value.__self__)]
        elif inspect.isfunction(value):
            code, cells = value.__code__, value.__closure__ or ()
            for var, cell in zip(code.co_freevars, cells):
                with contextlib.suppress(ValueError):  # an empty cell
                    pending.append((var, cell.cell_contents))
            pending += [(name, value.__defaults__ or ()), (name, value.__kwdefaults__ or {})]
        else:  # a container (a pytree node: dict, list, tuple, fp8fn.State, ...), or nothing
            leaves = tree_leaves(value)
            if leaves != [value]:
                pending += [(name, leaf) for leaf in leaves]


def _refuse_closed_over(f, args) -> None:
    """Raise if `f` reads a tensor a differentiation tracks from outside `args` (see `checkpoint`).

    A module's own parameters are refused when a torch.func transform tracks them (the module
    runs under `functional_call`), or, under plain autograd, when no argument requires grad; a
    recompute that reads them is refused in the backward (they may be unused: `f` may swap in
    its arguments with `functional_call`).
    """
    given = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    passed = {id(t) for t in given}
    plain = functorch_level() is None
    for name, t, held_by_module in _closed_over(f):
        if id(t) in passed:
            continue
        if held_by_module:
            tracked = differentiated_by_transform(t) or (
                plain and t.requires_grad and not any(differentiated(g) for g in given)
            )
        else:
            tracked = differentiated(t)
        if tracked:
            raise ValueError(
                "fp8fn.checkpoint: expected `f` to take every tensor it differentiates through "
                f"as an argument, got `{name}` (shape {tuple(t.shape)}) from outside them (its "
                "closure, a default, a bound object), which requires grad or is differentiated "
                "by torch.func: the recompute in the backward cannot differentiate it, so its "
                f"gradient would be lost. {_PASS_AS_ARGUMENTS}"
            )


def refuse_compile() -> None:
    """Raise while dynamo traces: without fullgraph the frame then runs eagerly (correct)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "fp8fn.checkpoint: torch.compile cannot trace a recompute in the backward. Leave "
            "fullgraph off (the checkpointed part then runs eagerly), or compile the model "
            "without checkpoint_fn."
        )


def checkpoint_with_constants(
    f, args: tuple, constants, api: str = "checkpoint", subject: str = "`f`"
):
    """`checkpoint(f, *args)` where `f` also reads `constants`, a pytree of tensors that are not
    differentiated: `f(constants, *args)`. The recompute gets fresh copies of their values at
    the forward (so in-place updates in it, e.g. batch-norm statistics, touch only the copies
    and happen once, in the forward). `api` and `subject` name the caller and `f` in errors.

    The recompute must see what the forward saw, and mutate nothing the forward already did:
    it runs with the forward's RNG state and autocast settings; recording gradients, a HF KV
    cache among `args` is refused (the recompute would update it again), and so is `f`
    modifying a tensor of `args` in place (the recompute would start from the modified value).
    """
    refuse_compile()
    if torch.is_grad_enabled():
        _refuse_cache(args, api, subject)
    const_leaves, const_spec = tree_flatten(constants)
    snapshot = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in const_leaves]
    leaves, in_spec = tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    out_spec = []
    recomputing = []

    def run(*tensors):
        it = iter(tensors)
        filled = [next(it) if t else x for x, t in zip(leaves, is_tensor)]
        consts = const_leaves
        if recomputing:  # fresh copies of the forward's values, made at the recompute's level
            consts = [t.clone() if isinstance(t, torch.Tensor) else t for t in snapshot]
        forward = not recomputing
        recomputing.append(True)
        versions = [tensor_version(t) for t in tensors] if forward else None
        with contextlib.nullcontext() if forward else _restored_autocast(autocast):
            outputs = f(tree_unflatten(consts, const_spec), *tree_unflatten(filled, in_spec))
        if forward and versions != [tensor_version(t) for t in tensors]:
            raise RuntimeError(
                f"fp8fn.{api}: expected {subject} to leave its inputs as they are, got one "
                "modified in place: the recompute in the backward would start from the modified "
                "value. Make the in-place op out of place (e.g. `x = x * 2`, not `x.mul_(2)`)."
            )
        out_leaves, spec = tree_flatten(outputs)
        present = [o is not None for o in out_leaves]  # None leaves are kept as they are
        if not any(present) or not all(
            isinstance(o, torch.Tensor) for o in out_leaves if o is not None
        ):
            raise TypeError(
                f"fp8fn.{api}: expected {subject} to return a pytree of tensors (None leaves "
                "allowed, at least one tensor), got leaves of types "
                f"{sorted({type(o).__name__ for o in out_leaves})}."
            )
        if out_spec and out_spec[0] != (spec, present):
            raise RuntimeError(
                f"fp8fn.{api}: expected {subject} to return the same structure when recomputed "
                f"in the backward, got {out_spec[0][0]} in the forward and {spec} then. Make it "
                "depend on its arguments only."
            )
        out_spec[:] = [(spec, present)]
        return [o for o in out_leaves if o is not None]

    tensors = [x for x, t in zip(leaves, is_tensor) if t]
    autocast = _autocast_state(tensors)
    diff = tuple(i for i, t in enumerate(tensors) if t.is_floating_point())
    run.rng_state, run.names = _rng_state(), (api, subject)
    # Without dynamo imported nothing is being compiled, and dynamo need not be imported.
    function = _eager_checkpoint() if dynamo_imported() else _Checkpoint
    outputs = iter(function.apply(run, diff, *tensors))
    spec, present = out_spec[0]
    return tree_unflatten([next(outputs) if p else None for p in present], spec)
