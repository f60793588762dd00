"""`transform`: an nn.Module as a pure `(init, apply)` pair with explicit scaling state.

`apply` runs the user's own module as it is at the call (its buffers, dtype, device, training
flags and hooks) under `torch.func.functional_call` with the given parameters. A `_Call` (one
per forward pass, a `TorchFunctionMode`) routes the linear calls of the chosen layers, known by
the identity of their weight, to `fp8fn.linear` with their site's state. `transform` keeps only
the layers' names and recipes, and nothing is left on the module after a call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .._core.checks import check_dtypes, check_operands, init_error
from .._core.recipes import RECIPES, CurrentScaling, DelayedScaling, NVFP4Scaling
from .._core.state import (
    State,
    check_scales,
    check_state,
    claim,
    init_state,
    parse_site,
    site_name,
    warn_if_never_updated,
    warn_if_superseded,
)
from .._ops.linear import fp8_linear
from .._ops.nvfp4 import initial_key, seed_key
from .._parallel.dtensor import explain_error as explain_sharded_error
from .._parallel.dtensor import gather_params, sharded_linear, sharded_operands
from .._parallel.fsdp_gather import (
    SCALES,
    Float8GatheredWeight,
    ScalesForCall,
    is_float8_gathered,
    weight_scales,
)
from .._parallel.wrappers import (
    ddp_parameter,
    is_fsdp_module,
    refuse_ddp_inner_module,
    reshard_fsdp,
)
from .._torch_private import (
    attention_forward,
    inside_torch_checkpoint,
    saved_tensor_hooks_active,
)
from .checkpoint import checkpoint_with_constants, refuse_compile

# What torch raises when the model's own torch.utils.checkpoint runs under torch.func.
_TORCH_CHECKPOINT_UNDER_FUNC = ("saved tensor hooks", "must override the setup_context")
# What torch raises when a module updates a buffer in place under torch.func.grad.
_TORCH_MUTATES_CAPTURED = "would mutate a captured Tensor"
# What torch raises when a model (an HF input hook) calls requires_grad_() under torch.func.
_TORCH_REQUIRES_GRAD_UNDER_FUNC = "call Tensor.requires_grad_() (or perhaps using"
_SPLITS = (torch.Tensor.split, torch.Tensor.chunk)
_USE_CHECKPOINT_FN = (
    "Turn the model's own checkpointing off (HF: `model.gradient_checkpointing_disable()`) and "
    "pass `checkpoint_fn=lambda name, module: ...` to fp8fn.transform."
)

# The `_Call` running in this thread, for the modules chosen by `checkpoint_fn`.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fp8fn_call", default=None)


@dataclasses.dataclass(frozen=True, eq=False)
class _Layer:
    """A layer that runs in float8: its module path, its parameters' names, its recipe."""

    path: str
    weight: str  # the weight's name in `module.named_parameters()` (the first name when tied)
    bias: str | None
    recipe: object
    transposed: bool  # HF Conv1D: weight stored `(in, out)`, called through torch.addmm
    module: nn.Module = dataclasses.field(repr=False)  # the module holding the weight
    attrs: tuple = ("weight", "bias")  # the weight's and the bias's names on `module`

    def held(self):
        """The weight the module holds now (FSDP2 swaps its shard and the unsharded weight)."""
        return self.module._parameters.get(self.attrs[0])

    def holds(self, weight) -> bool:
        """Whether `weight` is what the module holds now."""
        return self.held() is weight

    def own(self, tensors: dict):
        """`(weight, bias)` this layer runs with: from `tensors`, else the module's own."""
        weight = tensors.get(self.weight)
        if weight is None:
            weight = getattr(self.module, self.attrs[0])
        if self.bias is None:
            return weight, None
        bias = tensors.get(self.bias)
        return weight, getattr(self.module, self.attrs[1]) if bias is None else bias


def _is_hf_conv1d(module) -> bool:
    """HF transformers' `Conv1D` (GPT-2 family): a linear layer with its weight `(in, out)`.

    Duck-typed, so that transformers stays an optional dependency.
    """
    return any(
        c.__name__ == "Conv1D" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _linear_base(module):
    """The base class of a linear-like module fp8fn converts (nn.Linear, HF Conv1D), or None."""
    if isinstance(module, nn.Linear):
        return nn.Linear
    if _is_hf_conv1d(module):
        return next(c for c in type(module).__mro__ if c.__name__ == "Conv1D")
    return None


def _recipe_for(recipe, name, module):
    """The recipe of one layer: `recipe` itself, or `recipe(name, module)` when a function."""
    chosen = recipe if isinstance(recipe, RECIPES) else recipe(name, module)
    if chosen is not None and not isinstance(chosen, RECIPES):
        raise TypeError(
            f"fp8fn.transform: expected the recipe of layer {name!r} to be an fp8fn recipe "
            f"(e.g. fp8fn.DelayedScaling()) or None, got {type(chosen).__name__}."
        )
    return chosen


def _attention_layers(path: str, attention: nn.MultiheadAttention, names: dict):
    """`[(path, weight attr, bias attr)]` of an nn.MultiheadAttention's input projections: one
    packed `in_proj`, or `q_proj`, `k_proj`, `v_proj` (its `out_proj` is an nn.Linear)."""
    prefix = f"{path}." if path else ""
    if attention.in_proj_weight is not None:
        return [(f"{prefix}in_proj", "in_proj_weight", "in_proj_bias")]
    return [(f"{prefix}{r}_proj", f"{r}_proj_weight", "in_proj_bias") for r in "qkv"]


def _find_layers(module, recipe, filter_fn) -> list[_Layer]:
    """The linear layers that run in float8, in module order: nn.Linear (and subclasses that
    keep its forward), HF Conv1D, and nn.MultiheadAttention's projections (`<path>.in_proj`, or
    `q_proj`/`k_proj`/`v_proj`, and its `out_proj`). Warns when there are none."""
    names = {id(p): n for n, p in module.named_parameters()}  # tied: the first name
    layers = []

    def add(name, sub, attrs, transposed):
        if filter_fn is not None and not filter_fn(name, sub):
            return
        chosen = _recipe_for(recipe, name, sub)
        if chosen is None:
            return
        bias = getattr(sub, attrs[1])
        layers.append(
            _Layer(
                path=name,
                weight=names[id(getattr(sub, attrs[0]))],
                bias=None if not isinstance(bias, torch.Tensor) else names[id(bias)],
                recipe=chosen,
                transposed=transposed,
                module=sub,
                attrs=attrs,
            )
        )

    for name, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention):
            for path, weight, bias in _attention_layers(name, sub, names):
                add(path, sub, (weight, bias), False)
            continue
        base = _linear_base(sub)
        if base is None:
            continue
        refuse = None
        if type(sub).forward is not base.forward:
            refuse = f"a {type(sub).__name__}, a {base.__name__} subclass with its own forward"
        elif torch.nn.utils.parametrize.is_parametrized(sub, "weight"):
            refuse = "parametrized (torch.nn.utils.parametrize: its weight is made at each use)"
        if refuse and (filter_fn is None or filter_fn(name, sub)):
            raise TypeError(
                f"fp8fn.transform: layer {name!r} is {refuse}, which fp8fn cannot convert "
                "faithfully. Leave it in high precision with `filter_fn=lambda name, module: "
                f"name != {name!r}`."
            )
        add(name, sub, ("weight", "bias"), base is not nn.Linear)
    if not layers:
        warnings.warn(
            "fp8fn.transform: no layer was converted to float8, so the model runs entirely in "
            "high precision. fp8fn converts nn.Linear, HF Conv1D and nn.MultiheadAttention's "
            "projections, chosen by `filter_fn` and given a recipe.",
            stacklevel=3,
        )
    return layers


def _operands(func, args, kwargs):
    """`(x, weight, bias, transposed)` of an `F.linear` call or of a `torch.addmm(bias, x,
    weight)` (HF Conv1D) call; None for another use of addmm."""
    if func is F.linear:
        x, weight, *rest = args
        return x, weight, rest[0] if rest else kwargs.get("bias"), False
    if len(args) == 3 and not kwargs:
        bias, x, weight = args
        return x, weight, bias, True
    return None


class _Slots:
    """Where a module holds its tensors, for swapping them in safely.

    `torch.func.functional_call` with `tie_weights=True` swaps a submodule registered under two
    paths twice and restores it wrongly, leaving the module holding the call's tensors (torch
    2.13). So fp8fn swaps with `tie_weights=False` and ties by itself: each tensor is given once,
    under its first name, and copied to the other names that are other slots (another module
    sharing it, as tied weights); names of one slot seen through a shared submodule are dropped.
    """

    def __init__(self, module: nn.Module):
        self.first, self.others, seen, slots = {}, {}, {}, set()
        named = (
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        )
        for name, t in named:
            path, _, attr = name.rpartition(".")
            first = self.first[name] = seen.setdefault(id(t), name)
            slot = (id(module.get_submodule(path)), attr)
            if slot not in slots:
                slots.add(slot)
                if first != name:
                    self.others.setdefault(first, []).append(name)
        self.aliases = {n for n, f in self.first.items() if n != f}

    def expand(self, tensors: dict, api: str = "apply", prefix: str = "") -> dict:
        """`tensors` (`{name: tensor}`) for `functional_call(..., tie_weights=False)`, each name
        prefixed with `prefix`, in a new dict (`functional_call` writes back into its dict what
        the module holds at the end, e.g. FSDP2's unsharded root tensors). Raises when a tied
        tensor is given twice, as different tensors."""
        if not self.others and not (tensors.keys() & self.aliases) and not prefix:
            return dict(tensors)
        out = {}
        for name, t in tensors.items():
            first = self.first.get(name, name)
            if out.setdefault(prefix + first, t) is not t:
                raise ValueError(
                    f"fp8fn.{api}: `params` gives the tied tensor {first!r} twice, as {name!r} "
                    "too, with another tensor. Give each tied parameter once: "
                    "dict(model.named_parameters())."
                )
        for first, names in self.others.items():
            t = out.get(prefix + first)
            if t is not None:
                out.update((prefix + n, t) for n in names)
        return out


def _functional_call(module, slots: _Slots, tensors: dict, args, kwargs, prefix=""):
    """`module(*args, **kwargs)` with `tensors` swapped in for the call (see `_Slots`)."""
    tensors = slots.expand(tensors, prefix=prefix)
    return torch.func.functional_call(
        module, tensors, args, kwargs, tie_weights=False, strict=False
    )


class _Call(TorchFunctionMode):
    """One forward pass of a `Transformed`: routes its layers' linear calls to fp8fn.

    Made per call, so one transform may run in several threads at once. It names each call of
    a layer (`path`, `path#1`, ...) and hands it its rows of `state`; while discovering
    (`state` None, for `fn.init`) it records the site names and runs the call as it is.

    Args:
      transformed: the `Transformed`.
      tensors: `{name: tensor}` as given to `apply`; a layer whose weight is not in it runs
        with the module's own (as in `functional_call`).
      state: the `State`, or None when discovering.
      counts: calls per layer path so far (a recompute starts from the forward's).
      recompute: whether this pass is a recompute of a `checkpoint_fn` module.
    """

    def __init__(self, transformed, tensors, state, counts=None, recompute=False):
        super().__init__()
        self.transformed, self.state, self.recompute = transformed, state, recompute
        self.counts = {} if counts is None else counts
        self.sites = []
        # Watch for the model's own torch.utils.checkpoint (see _refuse_torch_checkpoint).
        self.watching = (
            state is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        )
        self.passive = False
        self._rows = None
        # (layer, weight, bias): what each layer runs with
        self._entries = [(layer, *layer.own(tensors)) for layer in transformed._layers]
        self._by_weight = None  # {id(weight): entries}; None while compiling (see _layer_of)
        if not torch.compiler.is_compiling():
            self._by_weight = {}
            for entry in self._entries:
                self._by_weight.setdefault(id(entry[1]), []).append(entry)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.passive:  # a `checkpoint_fn` module's own pass is under way
            return func(*args, **kwargs)
        if self.watching and (not torch.is_grad_enabled() or saved_tensor_hooks_active()):
            self._refuse_torch_checkpoint()
        if func is F.multi_head_attention_forward:
            with self:  # its own linear calls come back here (see `attention_forward`)
                return attention_forward(*args, **kwargs)
        if func in _SPLITS:  # the packed in_proj weight, split into q, k, v
            return self._split(func, args, kwargs)
        if func is F.linear or func is torch.addmm:
            operands = _operands(func, args, kwargs)
            if operands is not None:
                x, weight, bias, transposed = operands
                layer = self._layer_of(weight, bias, transposed)
                if layer is not None:
                    if self.state is None:
                        self._count(layer)
                        return func(*args, **kwargs)
                    return self._linear(layer, x, weight.t() if transposed else weight, bias)
        if func is torch.Tensor.unflatten and torch.compiler.is_compiling():
            func = torch.unflatten  # (dynamo cannot trace the method's `super()` call from here)
        return func(*args, **kwargs)

    def _refuse_torch_checkpoint(self):
        """Raise if the model runs its own torch.utils.checkpoint (seen as gradients turned
        off, or saved-tensor hooks, inside a forward that records gradients): its recompute
        would run after `apply` has returned, with the module's own parameters and without
        fp8fn. (Only walks the frames in such a stretch: a part run under no_grad on purpose
        costs a few microseconds per op.)"""
        if inside_torch_checkpoint(_APPLY_CODE):
            raise RuntimeError(
                "fp8fn.apply: the model runs torch.utils.checkpoint, whose recompute in the "
                "backward would run outside fp8fn.apply: with the module's own parameters and "
                f"without fp8fn's casts, so silently wrong gradients. {_USE_CHECKPOINT_FN}"
            )

    def _split(self, func, args, kwargs):
        """`weight.split(...)` or `.chunk(...)`: the pieces of a layer's weight are that
        layer's weights too (nn.MultiheadAttention's packed in_proj, for cross-attention)."""
        pieces = func(*args, **kwargs)
        whole = args[0]
        layer = next(iter(self._given(whole)), (None,))[0]
        if layer is None and isinstance(whole, nn.Parameter):  # swapped in (FSDP2)
            layer = self.transformed._holder_of(whole, False)
        if layer is not None:
            for piece in pieces:
                entry = (layer, piece, None)
                self._entries.append(entry)
                if self._by_weight is not None:
                    self._by_weight[id(piece)] = [entry]
        return pieces

    def _given(self, weight) -> list:
        """The entries whose weight `weight` is (compiling: compared with `is`, since a dict
        keyed by `id` would make dynamo guard on the ids)."""
        if self._by_weight is None:
            return [e for e in self._entries if e[1] is weight]
        return self._by_weight.get(id(weight), [])

    def _layer_of(self, weight, bias, transposed):
        """The layer whose weight `weight` is, or None for any other linear call.

        Layers sharing a weight are told apart by their bias.
        """
        matches = [e for e in self._given(weight) if e[0].transposed == transposed]
        if not matches:
            return self.transformed._holder_of(weight, transposed)
        return next((e[0] for e in matches if e[2] is bias), matches[0][0])

    def _count(self, layer) -> str:
        """The site name of this call of `layer`; counts the call."""
        k = self.counts.get(layer.path, 0)
        self.counts[layer.path] = k + 1
        name = site_name(layer.path, k)
        self.sites.append(name)
        return name

    def _linear(self, layer, x, weight, bias):
        name = self._count(layer)
        newest = stored = None
        if isinstance(layer.recipe, DelayedScaling):
            i = self.state._positions().get(name)
            if i is None:
                raise ValueError(
                    f"fp8fn.apply: layer {layer.path!r} was called more often than in "
                    f"`fn.init`: site {name!r} is not in `state`. Call `fn.init` with inputs "
                    "that call it as often."
                )
            if self._rows is None:  # split once: the backward gathers all sites in one stack
                self._rows = (self.state.amax_history[..., 0].unbind(0), self.state.scale.unbind(0))
            newest, stored = self._rows[0][i], self._rows[1][i]
        check_operands(f"apply: layer {layer.path!r}", x, weight, bias)
        check_dtypes(f"apply: layer {layer.path!r}", x, weight, bias)  # the module's rules
        if sharded_operands(x, weight):  # functional FSDP, tensor parallel
            return sharded_linear(self, layer, name, x, weight, bias, newest, stored)
        random = (self.state.key, name) if isinstance(layer.recipe, NVFP4Scaling) else None
        return fp8_linear(x, weight, bias, newest, stored, layer.recipe, random=random)

    def checkpoint(self, module, path, forward, args, kwargs):
        """`forward(*args, **kwargs)` of the `checkpoint_fn` module `module`, recomputed in the
        backward with the tensors it has now, from this pass's call counts."""
        prefix = path + "." if path else ""
        params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
        start, end = dict(self.counts), {}
        shim, slots = _Shim(module, forward), self.transformed._block_slots[id(module)]

        def run(buffers, params, state, args, kwargs):
            tensors = {**buffers, **params}
            inner = _Call(
                self.transformed,
                {prefix + n: t for n, t in tensors.items()},
                state,
                dict(start),
                recompute=True,
            )
            with self.transformed._exclusive(), inner, _activated(inner):
                out = _functional_call(shim, slots, tensors, args, kwargs, prefix="m.")
            end.update(inner.counts)
            return out

        self.passive = True
        try:
            out = checkpoint_with_constants(
                run,
                (params, self.state, args, kwargs),
                buffers,
                api="apply",
                subject=f"module {path!r} (chosen by `checkpoint_fn`)",
            )
        finally:
            self.passive = False
        self.counts.update(end)
        return out


class _Shim(nn.Module):
    """`forward` of `module` (a bound method) as a module owning `module`'s tensors under `m.`:
    `functional_call` on it swaps them without running `module`'s hooks a second time."""

    def __init__(self, module, forward):
        super().__init__()
        self.m, self._forward = module, forward

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)


@contextlib.contextmanager
def _activated(call):
    token = _ACTIVE.set(call)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# Modules given a checkpointing `forward` while some `apply` runs: {id: [count, saved, module]}.
_INSTALLED: dict = {}
_INSTALL_LOCK = threading.Lock()
_MISSING = object()


def _checkpointing_forward(module, forward):
    """The `forward` a `checkpoint_fn` module has during `apply`: recomputed when the running
    `_Call` (of this thread) chose it, else the module's own (another thread's plain call)."""

    def checkpointing(*args, **kwargs):
        call = _ACTIVE.get()
        if call is None or call.state is None or call.recompute:
            return forward(*args, **kwargs)
        path = call.transformed._checkpointed_ids.get(id(module))
        if path is None:
            return forward(*args, **kwargs)
        return call.checkpoint(module, path, forward, args, kwargs)

    return checkpointing


@contextlib.contextmanager
def _checkpoint_forwards(modules):
    """Give `modules` their checkpointing `forward` (an instance attribute) while inside;
    shared between concurrent calls, and removed when the last one ends."""
    with _INSTALL_LOCK:
        for m in modules:
            entry = _INSTALLED.get(id(m))
            if entry is None:
                saved = m.__dict__.get("forward", _MISSING)
                forward = saved if saved is not _MISSING else type(m).forward.__get__(m)
                m.__dict__["forward"] = _checkpointing_forward(m, forward)
                _INSTALLED[id(m)] = [1, saved, m]
            else:
                entry[0] += 1
    try:
        yield
    finally:
        with _INSTALL_LOCK:
            for m in modules:
                entry = _INSTALLED[id(m)]
                entry[0] -= 1
                if entry[0] == 0:
                    del _INSTALLED[id(m)]
                    if entry[1] is _MISSING:
                        del m.__dict__["forward"]
                    else:
                        m.__dict__["forward"] = entry[1]


_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _module_lock(module) -> threading.RLock:
    """One lock per module: `functional_call` swaps tensors into the module for a call, so
    calls with other tensors must not overlap (two transforms of one module share it)."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.RLock()
        return lock


class Transformed:
    """A module as a pair of pure functions: `init(*args)` -> state, `apply(params, state, *args)`.

    Made by `fp8fn.transform`; see there. `layers` lists the layers that run in fp8 and
    `recipes` their recipes; `checkpointed` the submodules recomputed in the backward.
    """

    def __init__(self, module, recipe, filter_fn=None, checkpoint_fn=None):
        if not isinstance(module, nn.Module):
            raise TypeError(
                "fp8fn.transform: expected `module` to be an nn.Module, "
                f"got {type(module).__name__}."
            )
        if isinstance(recipe, type) and issubclass(recipe, RECIPES):
            raise TypeError(
                f"fp8fn.transform: expected `recipe` to be a recipe instance, got the class "
                f"{recipe.__name__}. Pass an instance: fp8fn.{recipe.__name__}()."
            )
        if not (isinstance(recipe, RECIPES) or callable(recipe)):
            raise TypeError(
                "fp8fn.transform: expected `recipe` to be an fp8fn recipe (e.g. "
                "fp8fn.DelayedScaling()) or a function (name, module) -> recipe or None, "
                f"got {type(recipe).__name__}."
            )
        refuse_ddp_inner_module(module)
        self.module = module
        self._ddp_param = ddp_parameter(module)  # (name, parameter) of a DDP model, else None
        self._layers = _find_layers(module, recipe, filter_fn)
        self.recipes = {layer.path: layer.recipe for layer in self._layers}
        self.layers = list(self.recipes)
        self._delayed = self._delayed_recipe()
        self._stateful = [p for p, r in self.recipes.items() if isinstance(r, DelayedScaling)]
        self._slots = _Slots(module)
        self._held = {}  # {id(weight): (weakref, layer)}: weights swapped into layers (FSDP2)
        self.checkpointed = self._checkpoint_modules(checkpoint_fn)
        self._checkpointed_ids = {id(module.get_submodule(p)): p for p in self.checkpointed}
        self._checkpointed_modules = [module.get_submodule(p) for p in self.checkpointed]
        self._block_slots = {id(m): _Slots(m) for m in self._checkpointed_modules}
        self._known_sites = None  # the `state.sites` last checked by `apply`
        self._fsdp_slots = self._fsdp_managed()  # {name: (module, attr, shard)} under FSDP2
        self._gathered = self._float8_gathered_layers()  # float8_all_gather's, under FSDP2

    def _fsdp_managed(self) -> dict:
        """`{name: (submodule, attribute, sharded parameter)}` of the parameters FSDP2 manages.

        FSDP2's hooks put each module's unsharded parameters on it for its forward and its
        sharded ones back after, so `apply` must leave these slots to FSDP2 (a swap by
        `functional_call` would be undone on its exit, leaving the module holding shards
        while FSDP2 counts it unsharded). Empty without FSDP2.
        """
        if not any(is_fsdp_module(m) for m in self.module.modules()):
            return {}
        reshard_fsdp(self.module)  # all shards in place (a forward may have left the root not)
        managed = {}
        for prefix, sub in self.module.named_modules():
            if not is_fsdp_module(sub):
                continue
            for name, p in sub.named_parameters():
                if sharded_operands(p):
                    full = f"{prefix}.{name}" if prefix else name
                    path, _, attr = full.rpartition(".")
                    managed.setdefault(full, (self.module.get_submodule(path), attr, p))
        return managed

    def _without_fsdp_params(self, params: dict) -> dict:
        """`params` without the FSDP2-managed parameters, which must be the model's own."""
        for name, (module, attr, shard) in self._fsdp_slots.items():
            given = params.get(name)
            if given is not None and given is not shard and given is not module._parameters[attr]:
                raise ValueError(
                    f"fp8fn.apply: expected `params[{name!r}]` to be the model's own parameter, "
                    f"which FSDP2 shards and gathers, got another tensor "
                    f"({type(given).__name__}). Pass `dict(model.named_parameters())`: under "
                    "FSDP2 the module's parameters are the ones that train."
                )
        return {k: v for k, v in params.items() if k not in self._fsdp_slots}

    def _float8_gathered_layers(self) -> list[_Layer]:
        """The layers whose weights FSDP2 all-gathers in float8 (`fp8fn.float8_all_gather`);
        raises unless each runs in float8 with a per-tensor recipe and is sharded."""
        gathered = [m for m in self._layers if is_float8_gathered(m.held())]
        layer_weights = {id(m.held()) for m in gathered}
        for name, p in self.module.named_parameters():
            if is_float8_gathered(p) and id(p) not in layer_weights:
                raise ValueError(
                    f"fp8fn.transform: parameter {name!r} is all-gathered in float8 "
                    "(fp8fn.float8_all_gather), but its layer does not run in float8 under this "
                    "transform (left out by `filter_fn` or its recipe). Give float8_all_gather "
                    "the same `filter_fn` as fp8fn.transform."
                )
        for m in gathered:
            if not isinstance(m.recipe, (DelayedScaling, CurrentScaling)):
                raise ValueError(
                    f"fp8fn.transform: expected layer {m.path!r}, whose weight is all-gathered in "
                    "float8 (fp8fn.float8_all_gather), to use DelayedScaling or CurrentScaling, "
                    f"got {type(m.recipe).__name__}. Leave it out of float8_all_gather."
                )
            weight = m.held()
            if not (sharded_operands(weight) or isinstance(weight, Float8GatheredWeight)):
                raise ValueError(
                    f"fp8fn.transform: expected the float8_all_gather weight of layer {m.path!r} "
                    "to be sharded by FSDP2, got an unsharded weight. Call fully_shard after "
                    "fp8fn.float8_all_gather and before fp8fn.transform."
                )
        return gathered

    def _weight_scales(self, state) -> ScalesForCall:
        """The weight scales of this call's float8 all-gathers (`_parallel/fsdp_gather.py`)."""
        if any(not sharded_operands(m.held()) for m in self._gathered):
            # A weight still gathered from an earlier forward without backward (FSDP2 keeps the
            # root unsharded) holds that call's scale: reshard, so it is gathered again.
            reshard_fsdp(self.module)
        positions = state._positions()
        entries = [
            (
                m.module,
                positions[site_name(m.path, 0)] if isinstance(m.recipe, DelayedScaling) else None,
                getattr(m.recipe, "margin", 0),
            )
            for m in self._gathered
        ]
        return ScalesForCall(weight_scales(entries, state))

    def _delayed_recipe(self) -> DelayedScaling | None:
        """The one DelayedScaling config of the stateful layers (they share one packed state)."""
        delayed = {r for r in self.recipes.values() if isinstance(r, DelayedScaling)}
        configs = {(r.history_len, r.amax_compute, r.margin) for r in delayed}
        if len(configs) > 1:
            raise ValueError(
                "fp8fn.transform: all DelayedScaling layers of one model share one packed state, "
                "so they need the same history_len, amax_compute and margin; got "
                f"{sorted(configs)}."
            )
        return min(delayed, key=repr) if delayed else None

    def _checkpoint_modules(self, checkpoint_fn) -> list[str]:
        """The submodules `checkpoint_fn` chooses (the outermost choice wins)."""
        chosen = []
        if checkpoint_fn is None:
            return chosen
        for name, sub in self.module.named_modules():
            if checkpoint_fn(name, sub) and not any(
                p == "" or name.startswith(p + ".") for p in chosen
            ):
                chosen.append(name)
        return chosen

    def _holder_of(self, weight, transposed):
        """The layer that holds `weight` now, though `apply` was not given it: a module that
        swaps in its own tensors for its forward (FSDP2's unsharded weights). None if none."""
        if not isinstance(weight, torch.Tensor):
            return None
        held = self._held.get(id(weight))
        if held is not None and held[0]() is weight and held[1].holds(weight):
            layer = held[1]
        else:
            layer = next((m for m in self._layers if m.holds(weight)), None)
            if layer is None:
                return None
            if not torch.compiler.is_compiling():
                self._held[id(weight)] = (weakref.ref(weight), layer)
        return layer if layer.transposed == transposed else None

    def _exclusive(self):
        """The module's lock (see `_module_lock`); nothing while compiling."""
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return _module_lock(self.module)

    def init(self, *args, seed: int = 0, **kwargs) -> State:
        """Find every fp8 call site and return the initial scaling state.

        The model runs once, on the meta device when it can (no real activations are
        computed), else for real without autograd and with the global RNG left as it was. A
        model with sharded (DTensor) parameters, as under FSDP2, always runs for real (FSDP2
        all-gathers, so every rank calls `init`), and its FSDP2 modules are resharded after.
        Sites are the stateful (DelayedScaling) layers' calls, in the order of the module tree
        (`fn.layers`), each layer's calls in turn: `path`, then `path#k` for its k-th further
        call. A layer the example did not call (a branch not taken) has its `path` site too. So
        the order depends on the model, not on the example batch: ranks that run `init` on
        different batches agree (`fp8fn.all_reduce` pairs sites by position).

        Args:
          *args, **kwargs: example inputs of the module.
          seed: (keyword only) the seed of the random key (`state.key`) of models with
            `NVFP4Scaling` layers: their stochastic rounding and Hadamard signs. The same seed
            gives the same key, so every rank and a fresh `init` draw the same bits.

        Returns:
          An `fp8fn.State` on the device of the first stateful (or NVFP4) layer's weight; it
          has no sites when no layer uses DelayedScaling, and a key (float64 `()`) when some
          layer uses NVFP4Scaling (else `state.key` is None).
        """
        seed_key(seed)  # checks the seed before the model runs
        calls = {}
        for name in self._discover(args, kwargs):
            path, k = parse_site(name)
            calls[path] = max(calls.get(path, 0), k + 1)
        recipe = self._delayed or DelayedScaling(history_len=1)
        names = [site_name(p, k) for p in self._stateful for k in range(max(calls.get(p, 0), 1))]
        stateful = set(self._stateful)
        first = next((m for m in self._layers if m.path in stateful), None)
        nvfp4 = [m for m in self._layers if isinstance(m.recipe, NVFP4Scaling)]
        first = first or next(iter(nvfp4), None)
        device = None if first is None else first.own({})[0].device
        state = init_state(recipe, names, device)
        return state._replace(key=initial_key(seed, device)) if nvfp4 else state

    def _discover(self, args, kwargs) -> list[str]:
        """The site names of one forward pass on the example inputs, in call order."""
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        memo = {}

        def to_meta(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) not in memo:  # tied tensors stay tied
                memo[id(t)] = torch.empty_like(t, device="meta")
            return memo[id(t)]

        with torch.random.fork_rng(devices=[]):  # discovery must not consume the RNG
            # Sharded (DTensor) parameters: FSDP2's lazy init would adopt meta tensors as its
            # shards, so such a model runs for real (FSDP2 all-gathers: every rank calls init).
            if not any(sharded_operands(t) for t in tensors.values()):
                try:
                    meta = {k: to_meta(v) for k, v in tensors.items()}
                    return self._run_discovery(meta, pytree.tree_map(to_meta, (args, kwargs)))
                except Exception:  # data-dependent control flow, or an op without a meta kernel
                    pass
            try:
                sites = self._run_discovery({}, (args, kwargs))
            except Exception as e:
                if str(e).startswith("fp8fn."):
                    raise  # fp8fn's own error names the mistake and its fix
                raise init_error(e) from e
        if any(p is not tensors[n] for n, p in self.module.named_parameters()):
            reshard_fsdp(self.module)  # FSDP2 keeps the root unsharded after a forward
        return sites

    def _run_discovery(self, tensors, args_kwargs) -> list[str]:
        args, kwargs = args_kwargs
        call = _Call(self, tensors, None)
        token = SCALES.set(ScalesForCall(None)) if self._gathered else None
        try:
            with torch.no_grad(), self._exclusive(), call:
                _functional_call(self.module, self._slots, tensors, args, kwargs)
        finally:
            if token is not None:
                SCALES.reset(token)
        return call.sites

    def apply(self, params: dict, state: State, *args, **kwargs):
        """Run the module with `params`, in fp8 with the scales in `state`. Pure.

        The module runs as it is now: its buffers, dtype, device, training flags and hooks.

        Sharded parameters (DTensors; `_parallel/dtensor.py`): functional FSDP gives `params`
        as `distribute_tensor(p, mesh, [Shard(0)])` for a plain module (torch.func or plain
        autograd; float8 weights are all-gathered in float8, the others in high precision;
        gradients come back sharded, averaged over the ranks); a tensor-parallel module
        (`parallelize_module`, optionally inside FSDP2) takes `dict(model.named_parameters())`
        under plain autograd. Every rank must hold the same `state` (`fp8fn.all_reduce`).

        Args:
          params: `{name: tensor}` keyed like `module.named_parameters()`; it may also give
            buffers (keyed like `module.named_buffers()`). A name it leaves out is the module's
            own tensor, as in `torch.func.functional_call` (e.g. a frozen base model). Whether
            they are DTensors is read from the first entry. Under FSDP2 (`fully_shard`), the
            parameters it manages must be the module's own (`dict(model.named_parameters())`):
            FSDP2's hooks gather and reshard them.
          state: the `fp8fn.State` from `init` (or `update`).
          *args, **kwargs: the module's inputs.

        Returns:
          The module's output. The gradient with respect to `state` is the observation for
          `fp8fn.update`.

        Raises:
          RuntimeError: when `state` already took part in another `apply` of the gradient being
            recorded: autograd would sum the two calls' observations, fp8fn combines by max.
        """
        self._check(params, state)
        claim(state.amax_history, "apply", "state")
        if not self._fsdp_slots and is_fsdp_module(self.module):  # fully_shard after transform
            self._fsdp_slots = self._fsdp_managed()
        if self._fsdp_slots:
            params = self._without_fsdp_params(params)
        tensors = params
        if params and sharded_operands(next(iter(params.values()))):  # the first tells
            tensors = gather_params(self, params)
        call = _Call(self, tensors, state)
        token = SCALES.set(self._weight_scales(state)) if self._gathered else None
        try:
            if self._checkpointed_modules:
                refuse_compile()
                with self._exclusive(), call, _activated(call):
                    with _checkpoint_forwards(self._checkpointed_modules):
                        return _functional_call(self.module, self._slots, tensors, args, kwargs)
            with self._exclusive(), call:
                return _functional_call(self.module, self._slots, tensors, args, kwargs)
        except TypeError as e:
            bad = {n: type(v).__name__ for n, v in params.items() if not torch.is_tensor(v)}
            if bad:
                raise TypeError(f"fp8fn.apply: expected tensors in `params`, got {bad}.") from e
            raise
        except RuntimeError as e:
            sharded = explain_sharded_error(e, self.module)
            if sharded is not None:
                raise sharded from e
            message = str(e)
            if any(m in message for m in _TORCH_CHECKPOINT_UNDER_FUNC):
                raise RuntimeError(
                    "fp8fn.apply: the model calls torch.utils.checkpoint, which does not work "
                    f"under torch.func transforms. {_USE_CHECKPOINT_FN}"
                ) from e
            if _TORCH_REQUIRES_GRAD_UNDER_FUNC in message:
                raise RuntimeError(
                    "fp8fn.apply: the model calls requires_grad_() under a torch.func transform, "
                    "which torch refuses. HF models do it in the input hook of their own "
                    "gradient checkpointing: remove both with `model.gradient_checkpointing_"
                    "disable()` and `model.disable_input_require_grads()`, and pass "
                    "`checkpoint_fn=lambda name, module: ...` to fp8fn.transform."
                ) from e
            if _TORCH_MUTATES_CAPTURED in message:
                raise RuntimeError(
                    "fp8fn.apply: the model updates a buffer in place (e.g. batch-norm running "
                    "statistics), which torch.func transforms refuse for tensors from outside "
                    "them. Differentiate with plain autograd (fp8fn.value_and_grad, or "
                    "fp8fn.observe and loss.backward()), or put the module in eval mode."
                ) from e
            raise
        finally:
            if token is not None:
                SCALES.reset(token)

    def _check(self, params, state):
        if not isinstance(params, dict):
            raise TypeError(
                f"fp8fn.apply: expected `params` to be a dict of tensors keyed like "
                f"module.named_parameters(), got {type(params).__name__}."
            )
        if not params.keys() <= self._slots.first.keys():
            raise ValueError(
                "fp8fn.apply: `params` must be keyed like module.named_parameters() (or "
                f"named_buffers()); unexpected {sorted(params.keys() - self._slots.first.keys())}. "
                "If the model changed after fp8fn.transform, transform it again."
            )
        check_state("apply", state)
        check_scales("apply", state.scale)
        warn_if_superseded("apply", state)
        warn_if_never_updated("apply", state, params)
        if self._ddp_param is not None and torch.is_grad_enabled():
            name, own = self._ddp_param
            if params.get(name, own) is not own:
                raise ValueError(
                    "fp8fn.apply: a DistributedDataParallel model averages gradients only in "
                    "loss.backward() into its own parameters, and these are other tensors "
                    "(torch.func.grad, fp8fn.value_and_grad): gradients would silently differ "
                    "across ranks. Use plain autograd with `dict(ddp.named_parameters())` "
                    "(fp8fn.observe, loss.backward()), or transform the model without DDP and "
                    "all-reduce the gradients yourself."
                )
        if state.key is None and any(isinstance(r, NVFP4Scaling) for r in self.recipes.values()):
            raise ValueError(
                "fp8fn.apply: expected `state` with a random key (`state.key`) for the model's "
                "NVFP4Scaling layers, got a state without one. Make it with fn.init(..., seed=...) "
                "of this transform."
            )
        recipe = self._delayed
        if recipe is not None and (
            state.history_len != recipe.history_len
            or (state.amax_compute, state.margin) != (recipe.amax_compute, recipe.margin)
        ):
            raise ValueError(
                f"fp8fn.apply: `state` was made for another recipe: {state!r} with history_len "
                f"{state.history_len}, but the model's layers use {recipe}. Make it with fn.init."
            )
        if state.sites is not self._known_sites:
            missing = [p for p in self._stateful if site_name(p, 0) not in state]
            stateful = set(self._stateful)
            extra = [n for n in state.sites if parse_site(n)[0] not in stateful]
            if missing or extra:
                raise ValueError(
                    "fp8fn.apply: `state` does not belong to this model: "
                    f"missing sites {missing}, unknown sites {extra}. Make it with fn.init."
                )
            if not torch.compiler.is_compiling():  # no attribute write for dynamo to guard on
                self._known_sites = state.sites


_APPLY_CODE = Transformed.apply.__code__


def transform(module, recipe, filter_fn=None, checkpoint_fn=None) -> Transformed:
    """Turn `module` into pure `init` / `apply` functions that run its linear layers in fp8.

    The module is never modified: `apply` runs it as it is at each call (buffers, dtype,
    device, training flags and hooks included), with the given parameters swapped in and its
    chosen layers' linear calls routed to fp8fn for that call only.

    Args:
      module: any nn.Module.
      recipe: an fp8fn recipe for every layer (e.g. `fp8fn.DelayedScaling()`), or a function
        `(name, layer) -> recipe | None` choosing one per layer (None: high precision). The
        DelayedScaling layers share one packed state, so they need one static config.
      filter_fn: `(name, submodule) -> bool`, choosing the linear layers (`nn.Linear` and its
        subclasses that keep its forward, HF `Conv1D`) that run in fp8; default: all.
      checkpoint_fn: `(name, submodule) -> bool`, choosing submodules whose forward is
        recomputed in the backward (outermost choice wins), under torch.func and plain
        autograd alike; default: none.

    Returns:
      A `Transformed` with `init(*args, **kwargs) -> state` and
      `apply(params, state, *args, **kwargs) -> output`.

    Example:
      >>> import torch, fp8fn
      >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
      ...                             torch.nn.Linear(64, 8))
      >>> fn = fp8fn.transform(model, fp8fn.DelayedScaling())
      >>> x = torch.randn(16, 32)
      >>> state = fn.init(x)
      >>> list(state)
      ['0', '2']
      >>> params = dict(model.named_parameters())
      >>> loss = lambda p, s, x: fn.apply(p, s, x).square().mean()
      >>> grads, obs = torch.func.grad(loss, argnums=(0, 1))(params, state, x)
      >>> state = fp8fn.update(state, obs)
      >>> bool(state["0"].input.amax_history[0] == x.abs().max())
      True
    """
    return Transformed(module, recipe, filter_fn, checkpoint_fn)
