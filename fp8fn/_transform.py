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

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ._checkpoint import checkpoint
from ._linear import checked_linear
from ._recipe import CurrentScaling, DelayedScaling
from ._state import init_site_state

# What torch raises when the model's own torch.utils.checkpoint runs under torch.func.
_TORCH_CHECKPOINT_UNDER_FUNC = ("saved tensor hooks", "must override the setup_context")


class _Trace:
    """One forward pass: the state it reads and how often each layer has been called."""

    def __init__(self, recipe, state, counts=None, discover=False):
        self.recipe, self.state, self.discover = recipe, state, discover
        self.counts = {} if counts is None else counts
        self.sites = []  # names in call order (discovery only)

    def site_name(self, path: str) -> str:
        k = self.counts.get(path, 0)
        self.counts[path] = k + 1
        return path if k == 0 else f"{path}#{k}"

    def linear(self, path, x, weight, bias):
        name = self.site_name(path)
        if self.discover:
            self.sites.append(name)
            return F.linear(x, weight, bias)
        if name not in self.state and isinstance(self.recipe, DelayedScaling):
            raise ValueError(
                f"fp8fn.apply: layer {path!r} was called more often than in `fn.init`: site "
                f"{name!r} is not in `state`. Call `fn.init` with inputs that call it as often."
            )
        site_state = self.state.get(name)
        return checked_linear(x, weight, bias, site_state, self.recipe, "apply", f"state[{name!r}]")


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


def _site_forward(self, input):
    """Forward of a converted nn.Linear: the fp8 primitive with this call site's state."""
    return _active_trace(self).linear(self._fp8fn_path, input, self.weight, self.bias)


def _checkpointed_forward(self, *args, **kwargs):
    """Forward of a module chosen by `checkpoint_fn`: recomputed in the backward."""
    trace = _active_trace(self)
    holder, original = self._fp8fn_holder, super(type(self), self).forward.__func__
    if trace.discover:
        return original(self, *args, **kwargs)
    named = {
        **dict(self.named_parameters(remove_duplicate=False)),
        **dict(self.named_buffers(remove_duplicate=False)),
    }
    start, end = dict(trace.counts), {}

    def run(tensors, state, args, kwargs):
        inner = _Trace(trace.recipe, state, dict(start))
        with holder.bind(inner), _reparametrize_module(self, tensors):
            out = original(self, *args, **kwargs)
        end.update(inner.counts)
        return out

    out = checkpoint(run, named, trace.state, args, kwargs)
    trace.counts = end
    return out


@functools.cache
def _subclass(cls, forward, prefix):
    return type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})


def _copy_module(module: nn.Module, memo: dict) -> nn.Module:
    """A shallow structural copy: own child/parameter/buffer dicts, shared tensors."""
    new = copy.copy(module)
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


class Transformed:
    """A module as a pair of pure functions: `init(*args)` -> state, `apply(params, state, *args)`.

    Made by `fp8fn.transform`; see there.
    """

    def __init__(self, module, recipe, filter_fn=None, checkpoint_fn=None):
        if not isinstance(module, nn.Module):
            raise TypeError(
                "fp8fn.transform: expected `module` to be an nn.Module, "
                f"got {type(module).__name__}."
            )
        if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
            raise TypeError(
                "fp8fn.transform: expected `recipe` to be fp8fn.DelayedScaling or "
                f"fp8fn.CurrentScaling, got {type(recipe).__name__}."
            )
        self.module, self.recipe = module, recipe
        self._holder = _Holder()
        memo = {}
        self._copy = _copy_module(module, memo)
        self._pairs = [(m, memo[id(m)]) for m in module.modules()]  # (original, copy)
        self._param_names = [n for n, _ in module.named_parameters()]  # tied: first name only
        self._aliases = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        self._buffers = dict(module.named_buffers(remove_duplicate=False))
        self.layers = self._convert_layers(memo, filter_fn or _all_sites_filter)
        self._refuse_outside_recompute(memo)
        self.checkpointed = self._checkpoint_modules(checkpoint_fn)

    def _convert_layers(self, memo, filter_fn) -> list[str]:
        """Give the copies of the chosen nn.Linear layers the fp8 forward; their paths."""
        layers = []
        for name, original in self.module.named_modules():
            if not (isinstance(original, nn.Linear) and filter_fn(name, original)):
                continue
            if type(original).forward is not nn.Linear.forward:
                raise TypeError(
                    f"fp8fn.transform: layer {name!r} is a {type(original).__name__}, an "
                    "nn.Linear subclass with its own forward, which fp8fn cannot convert "
                    "faithfully. Leave it in high precision with `filter_fn=lambda name, "
                    f"module: name != {name!r}`."
                )
            target = memo[id(original)]
            target.__class__ = _subclass(type(original), _site_forward, "Fp8")
            target._fp8fn_path, target._fp8fn_holder = name, self._holder
            layers.append(name)
        return layers

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

    def init(self, *args, **kwargs) -> dict:
        """Find every fp8 call site and return the initial scaling state.

        The model runs once, on the meta device when it can (no real activations are
        computed), else for real without autograd. Sites are the converted layers in call
        order (`path`, and `path#k` for a layer's k-th further call), then the converted
        layers the example did not call (a branch not taken).

        Returns:
          `{site: fp8fn.SiteState}` for `DelayedScaling` (on the device of each layer's
          weight); `{}` for the stateless `CurrentScaling`.
        """
        trace = self._discover(args, kwargs)
        if not isinstance(self.recipe, DelayedScaling):
            return {}
        names = list(dict.fromkeys(trace.sites + self.layers))
        weights = {layer: self.module.get_submodule(layer).weight for layer in self.layers}
        return {
            name: init_site_state(self.recipe, weights[name.split("#")[0]].device) for name in names
        }

    def _discover(self, args, kwargs) -> _Trace:
        named = {**dict(self.module.named_parameters(remove_duplicate=False)), **self._buffers}

        def to_meta(t):
            return torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t

        try:
            return self._run_discovery(
                {k: to_meta(v) for k, v in named.items()},
                pytree.tree_map(to_meta, (args, kwargs)),
            )
        except Exception:  # data-dependent control flow, or an op without a meta kernel
            return self._run_discovery(named, (args, kwargs))

    def _run_discovery(self, named, args_kwargs) -> _Trace:
        args, kwargs = args_kwargs
        self._sync_training_flags()
        trace = _Trace(self.recipe, None, discover=True)
        with torch.no_grad(), self._holder.bind(trace):
            torch.func.functional_call(self._copy, named, args, kwargs, strict=False)
        return trace

    def apply(self, params: dict, state: dict, *args, **kwargs):
        """Run the module with `params`, in fp8 with the scales in `state`. Pure.

        Args:
          params: `{name: tensor}` keyed like `module.named_parameters()`; it may also give
            buffers (keyed like `module.named_buffers()`), which otherwise come from the module.
          state: the scaling state from `init` (or `update`).
          *args, **kwargs: the module's inputs.

        Returns:
          The module's output. The gradient with respect to `state` is the observation tree
          for `fp8fn.update`.
        """
        self._check(params, state)
        self._sync_training_flags()
        named = {**self._buffers, **params}
        try:
            with self._holder.bind(_Trace(self.recipe, state)):
                return torch.func.functional_call(self._copy, named, args, kwargs, strict=False)
        except RuntimeError as e:
            message = str(e)
            if any(m in message for m in _TORCH_CHECKPOINT_UNDER_FUNC):
                raise RuntimeError(
                    "fp8fn.apply: the model calls torch.utils.checkpoint, which does not work "
                    "under torch.func transforms. Turn the model's own checkpointing off and "
                    "pass `checkpoint_fn=lambda name, module: ...` to fp8fn.transform."
                ) from e
            raise

    def _sync_training_flags(self):
        """Follow `module.train()` / `.eval()` made after the transform (dropout, batch norm)."""
        for original, copied in self._pairs:
            if copied.training != original.training:
                copied.training = original.training

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
        if not isinstance(state, dict):
            raise TypeError(
                f"fp8fn.apply: expected `state` to be the dict made by fn.init, "
                f"got {type(state).__name__}."
            )
        stateful = isinstance(self.recipe, DelayedScaling)
        missing = [n for n in self.layers if stateful and n not in state]
        extra = [n for n in state if n.split("#")[0] not in self.layers]
        if missing or extra:
            raise ValueError(
                "fp8fn.apply: `state` does not belong to this model: "
                f"missing sites {missing}, unknown sites {extra}. Make it with fn.init."
            )


def transform(module, recipe, filter_fn=None, checkpoint_fn=None) -> Transformed:
    """Turn `module` into pure `init` / `apply` functions that run its nn.Linear layers in fp8.

    The module is never modified (no swapped children, hooks or attributes).

    Args:
      module: any nn.Module.
      recipe: `fp8fn.DelayedScaling()` or `fp8fn.CurrentScaling()`.
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
