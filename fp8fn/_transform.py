"""`transform`: an nn.Module becomes a pure `(init, apply)` pair with explicit scaling state.

The module itself is never touched. The transform keeps a private structural copy of it in
which each chosen `nn.Linear` is an instance of a subclass whose forward calls `fp8fn.linear`
with its site's state, and each module chosen by `checkpoint_fn` one whose forward runs under
`fp8fn.checkpoint`. Parameters and tensors are shared, not copied. A `_Trace` per forward pass
names the call sites (`path`, `path#1`, ...) and hands out their state.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ._checkpoint import checkpoint_with_constants
from ._linear import check_operands, fp8_linear
from ._recipe import RECIPES, DelayedScaling
from ._state import State, check_state, claim, init_state

# What torch raises when the model's own torch.utils.checkpoint runs under torch.func.
_TORCH_CHECKPOINT_UNDER_FUNC = ("saved tensor hooks", "must override the setup_context")
# What torch raises when a module updates a buffer in place under torch.func.grad.
_TORCH_MUTATES_CAPTURED = "would mutate a captured Tensor"


def site_name(path: str, k: int) -> str:
    """The site of a layer's k-th call (from 0) in one forward: `path`, `path#1`, `path#2`, ...

    A `#` in the path itself is doubled, so that no layer's name can alias another's call.
    """
    base = path.replace("#", "##")
    return base if k == 0 else f"{base}#{k}"


def parse_site(name: str) -> tuple[str, int]:
    """`(path, k)` of a site name: the inverse of `site_name`."""
    head, sep, digits = name.rpartition("#")
    if sep and digits.isdigit() and (len(head) - len(head.rstrip("#"))) % 2 == 0:
        return head.replace("##", "#"), int(digits)
    return name.replace("##", "#"), 0


class _Trace:
    """One forward pass: the state it reads and how often each layer has been called.

    `state` is split into per-site rows once, when the first site asks, so the backward
    gathers the observations of all sites in one stack.
    """

    def __init__(self, recipes, state, counts=None, discover=False):
        self.recipes, self.state, self.discover = recipes, state, discover
        self.counts = {} if counts is None else counts
        self.sites = []  # names in call order (discovery only)
        self._rows = None

    def linear(self, path, x, weight, bias):
        k = self.counts.get(path, 0)
        self.counts[path] = k + 1
        name = site_name(path, k)
        if self.discover:
            self.sites.append(name)
            return F.linear(x, weight, bias)
        recipe = self.recipes[path]
        newest = stored = None
        if isinstance(recipe, DelayedScaling):
            i = self.state._positions().get(name)
            if i is None:
                raise ValueError(
                    f"fp8fn.apply: layer {path!r} was called more often than in `fn.init`: site "
                    f"{name!r} is not in `state`. Call `fn.init` with inputs that call it as often."
                )
            if self._rows is None:
                self._rows = (self.state.amax_history[..., 0].unbind(0), self.state.scale.unbind(0))
            newest, stored = self._rows[0][i], self._rows[1][i]
        check_operands("apply", x, weight, bias)
        return fp8_linear(x, weight, bias, newest, stored, recipe)


class _Holder:
    """The trace of the forward pass under way in one transform (None outside `apply`)."""

    def __init__(self):
        self.trace = None

    @contextlib.contextmanager
    def bind(self, trace):
        previous, self.trace = self.trace, trace
        try:
            yield trace
        finally:
            self.trace = previous


def _active_trace(module) -> _Trace:
    return _require_trace(module._fp8fn_holder, module._fp8fn_path)


def _refuse_outside_apply(holder: _Holder, path: str, module, args) -> None:
    """Forward pre-hook on the private copy's modules that own parameters or buffers."""
    _require_trace(holder, path)


def _require_trace(holder: _Holder, path: str) -> _Trace:
    """The trace under way; raises if a module of the private copy runs outside `apply`."""
    trace = holder.trace
    if trace is None:
        raise RuntimeError(
            f"fp8fn.apply: module {path!r} ran outside `fn.apply`. This happens "
            "when the model recomputes it with torch.utils.checkpoint in the backward, which "
            "would use the module's original parameters and lose the scaling state. Turn the "
            "model's own checkpointing off and pass `checkpoint_fn=lambda name, module: ...` "
            "to fp8fn.transform (or use fp8fn.checkpoint in functional code)."
        )
    return trace


def _linear_site_forward(self, input):
    """Forward of a converted nn.Linear: the fp8 primitive with this call site's state."""
    return _active_trace(self).linear(self._fp8fn_path, input, self.weight, self.bias)


def _conv1d_site_forward(self, input):
    """Forward of a converted HF `Conv1D` (weight `(in, out)`): the same, on `weight.T`."""
    return _active_trace(self).linear(self._fp8fn_path, input, self.weight.t(), self.bias)


def _is_hf_conv1d(module) -> bool:
    """HF transformers' `Conv1D` (GPT-2 family): a linear layer with its weight `(in, out)`.

    Duck-typed, so that transformers stays an optional dependency.
    """
    cls = type(module)
    return any(
        c.__name__ == "Conv1D" and c.__module__.startswith("transformers") for c in cls.__mro__
    )


def _linear_kind(module):
    """`(base class, fp8 forward)` of a linear-like module fp8fn converts, or None."""
    if isinstance(module, nn.Linear):
        return nn.Linear, _linear_site_forward
    if _is_hf_conv1d(module):
        base = next(c for c in type(module).__mro__ if c.__name__ == "Conv1D")
        return base, _conv1d_site_forward
    return None


def _checkpointed_forward(self, *args, **kwargs):
    """Forward of a module chosen by `checkpoint_fn`: recomputed in the backward."""
    trace = _active_trace(self)
    holder, original = self._fp8fn_holder, super(type(self), self).forward.__func__
    if trace.discover:
        return original(self, *args, **kwargs)
    params = dict(self.named_parameters(remove_duplicate=False))
    buffers = dict(self.named_buffers(remove_duplicate=False))
    start, end = dict(trace.counts), {}

    def run(buffers, params, state, args, kwargs):
        inner = _Trace(trace.recipes, state, dict(start))
        with holder.bind(inner), _reparametrize_module(self, {**buffers, **params}):
            out = original(self, *args, **kwargs)
        end.update(inner.counts)
        return out

    out = checkpoint_with_constants(run, (params, trace.state, args, kwargs), buffers)
    trace.counts = end
    return out


@functools.cache
def _subclass(cls, forward, prefix):
    return type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})


def _copy_module(module: nn.Module, memo: dict) -> nn.Module:
    """A shallow structural copy: own child/parameter/buffer dicts, shared tensors.

    (Not `copy.copy`: parametrized modules refuse to be pickled, and so to be copied by it.)
    """
    new = object.__new__(type(module))
    new.__dict__ = dict(module.__dict__)
    new._parameters = copy.copy(module._parameters)
    new._buffers = copy.copy(module._buffers)
    new._modules = copy.copy(module._modules)
    memo[id(module)] = new
    for name, child in module._modules.items():
        if child is not None:
            new._modules[name] = memo[id(child)] if id(child) in memo else _copy_module(child, memo)
    return new


def _all_sites_filter(name, module):
    return True


def _recipe_for(recipe, name, module):
    """The recipe of one layer: `recipe` itself, or `recipe(name, module)` when a function."""
    chosen = recipe if isinstance(recipe, RECIPES) else recipe(name, module)
    if chosen is not None and not isinstance(chosen, RECIPES):
        raise TypeError(
            f"fp8fn.transform: expected the recipe of layer {name!r} to be an fp8fn recipe "
            f"(e.g. fp8fn.DelayedScaling()) or None, got {type(chosen).__name__}."
        )
    return chosen


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
        if not (isinstance(recipe, RECIPES) or callable(recipe)):
            raise TypeError(
                "fp8fn.transform: expected `recipe` to be an fp8fn recipe (e.g. "
                "fp8fn.DelayedScaling()) or a function (name, module) -> recipe or None, "
                f"got {type(recipe).__name__}."
            )
        self.module = module
        self._holder = _Holder()
        memo = {}
        self._copy = _copy_module(module, memo)
        self._pairs = [(m, memo[id(m)]) for m in module.modules()]  # (original, copy)
        self._param_names = [n for n, _ in module.named_parameters()]  # tied: first name only
        self._aliases = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        self._buffers = dict(module.named_buffers(remove_duplicate=False))
        self.recipes = self._convert_layers(memo, recipe, filter_fn or _all_sites_filter)
        self.layers = list(self.recipes)
        self._delayed = self._delayed_recipe()
        self._refuse_outside_recompute(memo)
        self.checkpointed = self._checkpoint_modules(checkpoint_fn)
        self._known_sites = None  # the `state.sites` last checked by `apply`

    def _convert_layers(self, memo, recipe, filter_fn) -> dict:
        """Give the copies of the chosen linear layers the fp8 forward; {path: recipe}.

        Warns when no layer is converted, naming the linear-like modules left in high
        precision.
        """
        recipes, left = {}, []
        inside_attention = {
            id(m)
            for a in self.module.modules()
            if isinstance(a, nn.MultiheadAttention)
            for m in a.modules()
        }
        for name, original in self.module.named_modules():
            kind = _linear_kind(original)
            if isinstance(original, nn.MultiheadAttention) or (
                kind is not None and id(original) in inside_attention
            ):
                left.append(f"{name or '<root>'} ({type(original).__name__})")
                continue
            if kind is None or not filter_fn(name, original):
                continue
            chosen = _recipe_for(recipe, name, original)
            if chosen is None:
                continue
            base, forward = kind
            if type(original).forward is not base.forward:
                raise TypeError(
                    f"fp8fn.transform: layer {name!r} is a {type(original).__name__}, a "
                    f"{base.__name__} subclass with its own forward, which fp8fn cannot convert "
                    "faithfully. Leave it in high precision with `filter_fn=lambda name, "
                    f"module: name != {name!r}`."
                )
            target = memo[id(original)]
            target.__class__ = _subclass(type(original), forward, "Fp8")
            target._fp8fn_path, target._fp8fn_holder = name, self._holder
            recipes[name] = chosen
        if not recipes:
            warnings.warn(
                "fp8fn.transform: no layer was converted to float8, so the model runs entirely "
                "in high precision. fp8fn converts nn.Linear and HF Conv1D layers chosen by "
                "`filter_fn` and given a recipe"
                + (f"; these stay in high precision: {left}." if left else "."),
                stacklevel=3,
            )
        elif left:
            warnings.warn(
                f"fp8fn.transform: these linear-like modules stay in high precision: {left} "
                "(nn.MultiheadAttention calls its projections' weights directly). Write "
                "attention with nn.Linear projections to run them in float8.",
                stacklevel=3,
            )
        return recipes

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

    def _refuse_outside_recompute(self, memo) -> None:
        """Make the copy's other tensor-owning modules refuse to run outside `apply`.

        A recompute by the model's own torch.utils.checkpoint runs after `apply` has returned,
        with the module's original tensors. (The hook dict is the copy's own, so the user's
        module is untouched.)
        """
        for name, original in self.module.named_modules():
            target = memo[id(original)]
            if (target._parameters or target._buffers) and not hasattr(target, "_fp8fn_path"):
                target._forward_pre_hooks = copy.copy(target._forward_pre_hooks)
                target.register_forward_pre_hook(
                    functools.partial(_refuse_outside_apply, self._holder, name)
                )

    def _checkpoint_modules(self, checkpoint_fn) -> list[str]:
        """Give the copies of the chosen submodules (outermost wins) a recomputed forward."""
        chosen = []
        for name, original in self.module.named_modules():
            if checkpoint_fn is None or not checkpoint_fn(name, original):
                continue
            if not any(p == "" or name.startswith(p + ".") for p in chosen):
                chosen.append(name)
        for name in chosen:
            target = self._copy.get_submodule(name)
            target.__class__ = _subclass(type(target), _checkpointed_forward, "Checkpointed")
            target._fp8fn_path, target._fp8fn_holder = name, self._holder
        return chosen

    def init(self, *args, **kwargs) -> State:
        """Find every fp8 call site and return the initial scaling state.

        The model runs once, on the meta device when it can (no real activations are
        computed), else for real without autograd and with the global RNG left as it was.
        Sites are the stateful (DelayedScaling) layers' calls in call order (`path`, and
        `path#k` for a layer's k-th further call), then those layers the example did not call
        (a branch not taken).

        Returns:
          An `fp8fn.State` on the device of the first stateful layer's weight; it has no
          sites when no layer uses DelayedScaling.
        """
        trace = self._discover(args, kwargs)
        recipe = self._delayed or DelayedScaling(history_len=1)
        stateful = self._stateful_layers()
        names = [n for n in trace.sites if parse_site(n)[0] in stateful]
        names = list(dict.fromkeys(names + [site_name(p, 0) for p in stateful]))
        device = self.module.get_submodule(stateful[0]).weight.device if stateful else None
        return init_state(recipe, names, device)

    def _discover(self, args, kwargs) -> _Trace:
        named = {**dict(self.module.named_parameters(remove_duplicate=False)), **self._buffers}

        def to_meta(t):
            return torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t

        with torch.random.fork_rng(devices=[]):  # discovery must not consume the RNG
            try:
                return self._run_discovery(
                    {k: to_meta(v) for k, v in named.items()},
                    pytree.tree_map(to_meta, (args, kwargs)),
                )
            except Exception:  # data-dependent control flow, or an op without a meta kernel
                pass
            try:
                return self._run_discovery(named, (args, kwargs))
            except Exception as e:
                raise type(e)(
                    f"fp8fn.init: the model raised on the example inputs ({type(e).__name__}: "
                    f"{e}). Call fn.init with inputs the model accepts."
                ) from e

    def _run_discovery(self, named, args_kwargs) -> _Trace:
        args, kwargs = args_kwargs
        self._sync_training_flags()
        trace = _Trace(self.recipes, None, discover=True)
        with torch.no_grad(), self._holder.bind(trace):
            torch.func.functional_call(self._copy, named, args, kwargs, strict=False)
        return trace

    def apply(self, params: dict, state: State, *args, **kwargs):
        """Run the module with `params`, in fp8 with the scales in `state`. Pure.

        Args:
          params: `{name: tensor}` keyed like `module.named_parameters()`; it may also give
            buffers (keyed like `module.named_buffers()`), which otherwise come from the module.
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
        self._sync_training_flags()
        named = {**self._buffers, **params}
        try:
            with self._holder.bind(_Trace(self.recipes, state)):
                return torch.func.functional_call(self._copy, named, args, kwargs, strict=False)
        except RuntimeError as e:
            message = str(e)
            if any(m in message for m in _TORCH_CHECKPOINT_UNDER_FUNC):
                raise RuntimeError(
                    "fp8fn.apply: the model calls torch.utils.checkpoint, which does not work "
                    "under torch.func transforms. Turn the model's own checkpointing off and "
                    "pass `checkpoint_fn=lambda name, module: ...` to fp8fn.transform."
                ) from e
            if any(getattr(m, "gradient_checkpointing", False) for m in self.module.modules()):
                raise RuntimeError(
                    "fp8fn.apply: the model's own gradient checkpointing is on (e.g. HF "
                    "`gradient_checkpointing_enable()`); torch.utils.checkpoint does not work "
                    "under torch.func transforms, and would recompute outside fp8fn.apply. Turn "
                    "it off (`model.gradient_checkpointing_disable()`) and pass "
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

    def _sync_training_flags(self):
        """Follow `module.train()` / `.eval()` made after the transform (dropout, batch norm)."""
        for original, copied in self._pairs:
            if copied.training != original.training:
                copied.training = original.training

    def _stateful_layers(self) -> list[str]:
        return [p for p, r in self.recipes.items() if isinstance(r, DelayedScaling)]

    def _check(self, params, state):
        if not isinstance(params, dict):
            raise TypeError(
                f"fp8fn.apply: expected `params` to be a dict of tensors keyed like "
                f"module.named_parameters(), got {type(params).__name__}."
            )
        missing = [n for n in self._param_names if n not in params]
        extra = [n for n in params if n not in self._buffers and n not in self._aliases]
        if missing or extra:
            raise ValueError(
                "fp8fn.apply: `params` must be keyed like module.named_parameters(); "
                f"missing {missing}, unexpected {extra}."
            )
        bad = {n: type(v).__name__ for n, v in params.items() if not isinstance(v, torch.Tensor)}
        if bad:
            raise TypeError(f"fp8fn.apply: expected `params` to hold tensors, got {bad}.")
        sharded = [n for n, v in params.items() if type(v).__name__ == "DTensor"]
        if sharded:
            raise ValueError(
                f"fp8fn.apply: expected whole parameters, got sharded DTensors {sharded[:3]}... "
                "(FSDP2 unshards lazily, inside each module's forward, which fp8fn.apply does "
                "not run). Call `.unshard()` on every FSDPModule before the step, then pass "
                "`dict(model.named_parameters())`."
            )
        check_state("apply", state)
        recipe = self._delayed
        if recipe is not None and (
            state.history_len != recipe.history_len
            or (state.amax_compute, state.margin) != (recipe.amax_compute, recipe.margin)
        ):
            raise ValueError(
                f"fp8fn.apply: `state` was made for another recipe: {state!r} with history_len "
                f"{state.history_len}, but the model's layers use {recipe}. Make it with fn.init."
            )
        if state.sites != self._known_sites:
            stateful = self._stateful_layers()
            missing = [p for p in stateful if site_name(p, 0) not in state]
            extra = [n for n in state.sites if parse_site(n)[0] not in stateful]
            if missing or extra:
                raise ValueError(
                    "fp8fn.apply: `state` does not belong to this model: "
                    f"missing sites {missing}, unknown sites {extra}. Make it with fn.init."
                )
            if not torch.compiler.is_compiling():  # no attribute write for dynamo to guard on
                self._known_sites = state.sites


def transform(module, recipe, filter_fn=None, checkpoint_fn=None) -> Transformed:
    """Turn `module` into pure `init` / `apply` functions that run its nn.Linear layers in fp8.

    The module is never modified (no swapped children, hooks or attributes).

    Args:
      module: any nn.Module.
      recipe: an fp8fn recipe for every layer (e.g. `fp8fn.DelayedScaling()`), or a function
        `(name, layer) -> recipe | None` choosing one per layer (None: high precision). The
        DelayedScaling layers share one packed state, so they need one static config.
      filter_fn: `(name, submodule) -> bool`, choosing the nn.Linear layers (subclasses
        included) that run in fp8; default: all.
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
