"""The weights one forward pass follows by identity, for its `Call` (`routing.py`): each chosen
layer's weight and the copies and pieces made of it, each experts weight and the views, copies
and indexings made of it (`experts.Derived`), and, while discovering, every weight that may
reach a GEMM, under its name."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._parallel.dtensor import gathered_for_split, sharded_operands
from .._torch_private import module_parameters, view_base
from .experts import Derived, derive
from .identity import ByIdentity, markable


class Tracked:
    """What a forward pass knows by identity (made per call, with its `Call`).

    Args:
      plan: the `Plan`.
      tensors: `{name: tensor}` given to the call (as in `functional_call`).
      discovering: whether the call is `fn.init`'s (then every weight is noted by name).
      held: the `Transformed`'s memo of the layers holding swapped-in weights (`holder_of`).
      visits: `{layer path: visit}`, the `Call`'s (`routing.Visit`); empty while discovering.
      nested: whether the call runs inside another of the same transform (a `checkpoint_fn`
        recompute in the forward pass), whose marks on the weights it hides while it runs.

    Attributes:
      entries: `{weight: [(layer, weight, bias, visit)]}` by identity: what each layer runs
        with (copies and pieces added), and its `visits` entry (None while discovering).
      weights: while discovering, `{name: op or None}`: which weights' GEMMs run in float8
        (None) or in high precision through `op`, for `fn.summary()`.
      touched: the experts weights viewed, indexed or transposed in this call.
    """

    def __init__(self, plan, tensors, discovering: bool, held: dict, visits: dict, nested: bool):
        self.plan, self.held, self.visits = plan, held, visits
        serial = id(plan)  # (the marks' names: one transform's never read as another's)
        self._derived = ByIdentity(f"_fp8fn_derived_{serial}")  # {tensor: [Derived]}
        self.entries = ByIdentity(f"_fp8fn_entries_{serial}")
        experts = [(entry, entry.own(tensors)) for entry in plan.experts]
        layers = [(layer, *layer.own(tensors)) for layer in plan.layers]
        if nested:  # (the enclosing call's marks on these weights: hidden until the end)
            for _, weight in experts:
                self._derived.hide(weight)
            for _, weight, _ in layers:
                self.entries.hide(weight)
        for entry, weight in experts:
            self._derived.keep(weight, Derived(entry, weight))
        self.weights, self.touched = {}, set()
        self._names = None
        if discovering:  # every weight that may reach a GEMM, by identity
            given = {**dict(plan.module.named_parameters()), **tensors}
            self._names = {id(t): n for n, t in given.items() if is_lazy(t) or t.dim() >= 2}
        self._kept = []  # the copies `_names` knows by id
        self._held_before = {}  # {id(layer): the weight it held before the call}, if sharded
        for layer, weight, bias in layers:
            self.entries.keep(weight, (layer, weight, bias, visits.get(layer.path)))
            if not torch.compiler.is_compiling() and sharded_operands(weight):
                self._held_before[id(layer)] = layer.held()

    @contextlib.contextmanager
    def marking(self):
        """The call's span: the marks it leaves on the tensors it is given and makes
        (`ByIdentity`) are cleared when it ends."""
        try:
            yield
        finally:
            self._derived.clear()
            self.entries.clear()

    def derived_of(self, t) -> Derived | None:
        """The `Derived` of an experts weight or a tensor made from one, else None."""
        hits = self._derived.values(t) if isinstance(t, torch.Tensor) else []
        hit = hits[-1] if hits else None
        if hit is None and isinstance(t, nn.Parameter):
            hit = self._swapped_in(t)
        return hit

    def _swapped_in(self, t) -> Derived | None:
        """The `Derived` of `t` when an experts module holds it now though `apply` was not
        given it (FSDP2's unsharded weight, swapped in for the forward); tracked from then on.
        """
        for entry in self.plan.experts:
            if module_parameters(entry.module).get(entry.attr) is t:
                derived = Derived(entry, t)
                self._derived.keep(t, derived)
                return derived
        return None

    def derive(self, func, args, kwargs):
        """Run a view, index or transpose of a tracked tensor, and track what it made."""
        result = func(*args, **kwargs)
        derived = derive(func, args, kwargs, self.derived_of(args[0]), result)
        if isinstance(derived, list):
            result = markable(result)
            for piece, d in zip(result, derived):
                self._derived.keep(piece, d)
                self.touched.add(d.entry.path)
        elif derived is not None:
            self._derived.keep(result, derived)
            self.touched.add(derived.entry.path)
        return result

    def copy(self, func, args, kwargs):
        """A copy of a tensor (`.to`, `.clone`, `.detach`, ...): a copy of a layer's weight is
        that layer's weight in the calls it reaches (the gradient flows back through the copy
        as autograd takes it), one of an experts weight (or of a tensor made from one) is
        followed like it, one of any other weight is noted under its name (`fn.summary()`)."""
        source, result = args[0], func(*args, **kwargs)
        if result is source or not isinstance(result, torch.Tensor):
            return result
        derived = self.derived_of(source)
        if derived is not None:
            copied = derived if derived.expert is not None else Derived(derived.entry, result)
            self._derived.keep(result, copied)
        for layer, _, bias, visit in self.given(source):
            self.entries.keep(result, (layer, result, bias, visit))
        if self._names is not None:
            name = self._names.get(id(source))
            if name is None and view_base(source) is not None:
                name = self._names.get(id(view_base(source)))
            if name is not None:
                self._names[id(result)] = name
                self._kept.append(result)  # (alive for the call: its id stays its own)
        return result

    def note(self, t, op):
        """While discovering: the weight `t` (or its source) runs a GEMM, in float8 when `op`
        is None, else in high precision through `op` (a float8 note is never overwritten)."""
        if self._names is None or not isinstance(t, torch.Tensor):
            return
        derived = self.derived_of(t)
        name = self._names.get(id(t)) if derived is None else derived.entry.path
        if name is None and view_base(t) is not None:
            name = self._names.get(id(view_base(t)))
        if name is not None and self.weights.get(name, "") is not None:
            self.weights[name] = op

    def split(self, func, args, kwargs):
        """`weight.split(...)` or `.chunk(...)`: the pieces of a layer's weight are that
        layer's weights too (nn.MultiheadAttention's packed in_proj, for cross-attention)."""
        whole = args[0]
        layer, _, _, visit = next(iter(self.given(whole)), (None,) * 4)
        if layer is None and isinstance(whole, nn.Parameter):  # swapped in (FSDP2)
            layer = self.plan.holder_of(whole, False, self.held)
            visit = None if layer is None else self.visits.get(layer.path)
        if layer is not None and self._held_before:  # sharded operands (never compiled)
            held = self._held_before.get(id(layer))
            args = (gathered_for_split(whole, held), *args[1:])
        pieces = func(*args, **kwargs)
        if layer is not None:
            pieces = markable(pieces)
            for piece in pieces:
                self.entries.keep(piece, (layer, piece, None, visit))
        return pieces

    def given(self, weight) -> list:
        """The entries `(layer, weight, bias, visit)` whose weight `weight` is."""
        return self.entries.values(weight)

    def layer_given(self, weight):
        """The first layer whose weight `weight` is, else None."""
        return next(iter(self.given(weight)), (None,))[0]
