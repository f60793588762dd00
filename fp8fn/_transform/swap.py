"""Tensor swapping: a module run with given tensors in place of its own, for one call.

`functional_call` puts the tensors into the module and takes them out after, so the module is
locked for the call (`exclusive`), and ties are handled here (`Slots`).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from .._core.owners import held, owner_of
from .._core.registries import MODULE_LOCKS
from .._torch_private import differentiated


class Slots:
    """Where a module holds its tensors, for swapping them in safely.

    `torch.func.functional_call` with `tie_weights=True` swaps a submodule registered under two
    paths twice and restores it wrongly, leaving the module holding the call's tensors (torch
    2.13). So fp8fn swaps with `tie_weights=False` and ties by itself: each tensor is given once,
    under its first name, and copied to the other names that are other slots (another module
    sharing it, as tied weights); names of one slot seen through a shared submodule are dropped.

    A tied weight of a converted layer (`own`: its slot's name) is given to that layer as a
    view of its own (`weight.view_as(weight)`: the same values, gradients flowing back to the
    one tensor), so that the identity of the weight a linear call gets tells which layer calls:
    each tied layer runs with its own site and recipe, and a layer left in high precision is
    not taken for the converted layer it shares a weight with.
    """

    def __init__(self, module: nn.Module, own=()):
        self.module = module
        self.first, self.others, seen, slots = {}, {}, {}, set()
        self.names = []  # one name per slot, in module order
        named = (
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        )
        for name, t in named:
            owner, attr = owner_of(module, name)
            first = self.first[name] = seen.setdefault(id(t), name)
            slot = (id(owner), attr)
            if slot not in slots:
                slots.add(slot)
                self.names.append(name)
                if first != name:
                    self.others.setdefault(first, []).append(name)
        self.aliases = {n for n, f in self.first.items() if n != f}
        self.parameters = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        tied = {*self.others, *(n for names in self.others.values() for n in names)}
        self.own = [n for n in own if n in tied]

    def expand(self, tensors: dict, api: str = "apply", prefix: str = "") -> dict:
        """`tensors` (`{name: tensor}`) for `functional_call(..., tie_weights=False)`, each name
        prefixed with `prefix`, in a new dict (`functional_call` writes back into its dict what
        the module holds at the end, e.g. FSDP2's unsharded root tensors), the `own` slots
        given their views. Raises when a tied tensor is given twice, as different tensors."""
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
        for name in self.own:
            t = out.get(prefix + name)
            t = held(self.module, self.first[name]) if t is None else t
            out[prefix + name] = t.view_as(t)
        return out

    def current(self) -> tuple[dict, dict, dict]:
        """What the module holds now: `(parameters, buffers, layout)`, each distinct tensor
        once, under the first slot holding it, and `layout` `{slot name: that name}`."""
        layout, tensors, seen = {}, {}, {}
        for name in self.names:
            t = held(self.module, name)
            if t is not None:
                layout[name] = first = seen.setdefault(id(t), name)
                tensors.setdefault(first, t)
        params = {n: t for n, t in tensors.items() if n in self.parameters}
        return params, {n: t for n, t in tensors.items() if n not in params}, layout


def swapped_call(module, slots: Slots | None, tensors: dict, args, kwargs, prefix=""):
    """`module(*args, **kwargs)` with `tensors` swapped in for the call (see `Slots`; `slots`
    None: `tensors` as `Slots.expand` made them, every slot's name given)."""
    if slots is not None:
        tensors = slots.expand(tensors, prefix=prefix)
    return torch.func.functional_call(
        module, tensors, args, kwargs, tie_weights=False, strict=False
    )


class Holder(nn.Module):
    """`call` (a module, or a bound method of one) as a module holding `module` under `m.`:
    `functional_call` on it swaps in the tensors of `module` without running `module`'s hooks a
    second time."""

    def __init__(self, module, call):
        super().__init__()
        self.m, self._call = module, (call,)  # in a tuple: a module call is not a submodule

    def forward(self, *args, **kwargs):
        return self._call[0](*args, **kwargs)


def module_tensors(module):
    """`module`'s tensors, for `swapped_call`: its `Slots`; the parameters and the buffers
    a differentiation tracks, `{first: t}`; the other buffers, `{first: t}` (constants). `first`
    is the first name of a tensor (tied tensors are one)."""
    slots, params, buffers = Slots(module), {}, {}
    named = [(n, t, True) for n, t in module.named_parameters()]
    named += [(n, t, False) for n, t in module.named_buffers()]
    for name, t, is_parameter in named:
        if slots.first[name] == name:
            (params if is_parameter or differentiated(t) else buffers)[name] = t
    return slots, params, buffers


_LOCKS_LOCK = threading.Lock()  # guards MODULE_LOCKS (`_core/registries.py`)


def _module_lock(module) -> threading.RLock:
    """One lock per module: `functional_call` swaps tensors into the module for a call, so
    calls with other tensors must not overlap (two transforms of one module share it)."""
    with _LOCKS_LOCK:
        lock = MODULE_LOCKS.get(module)
        if lock is None:
            lock = MODULE_LOCKS[module] = threading.RLock()
        return lock


def exclusive(module):
    """The module's lock (see `_module_lock`); nothing while compiling."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _module_lock(module)
