"""What fp8fn knows about the values of a tensor outside the state: one rule for every mark.

A mark records a fact about a tensor's values (e.g. "these scales are finite and > 0") with the
tensor's version counter then. It holds for the tensor itself, a view of it (which shares its
version counter) and, while the marked tensor lives (so its memory is not reused), any tensor of
the same memory (address, shape, strides, dtype, device): `t.detach()` copies
(`fp8fn.observe`'s and `fp8fn.value_and_grad`'s leaves) share memory and version counter. An
in-place change (`zero_()`, `fill_()`, `copy_()`) bumps the version: the fact is then unknown.
A tensor fp8fn did not make (a `tree_map` of a state, `tree_unflatten` of other leaves, a
loaded state) carries no mark. Marks are read outside torch.compile only (a compiled graph
checks the values themselves, in the graph).

The marks, each why it cannot be in the state (a fact about values that an in-place change or
a rebuilt state would outlive, as a pytree's static structure does):

* `VALID_SCALES`: scale tensors finite and > 0. Written by `init_state`, `update` and
  `check_scales` (after a host read); read by `check_scales` (no host read for a known one) and
  `update` (an observation's scales are never marked).
* `VALID_KEYS`: random keys holding integers in `[0, 2**52)`. Written by `fn.init`, `update`,
  `fold_in` and `check_key` (after a host read); read by `check_key`.
* `FILLED`: amax histories, with which of them hold an observation (`State.filled`'s tuple).
  Written by `update` (from the values it made); read by `known_filled`, which decides whether a
  role casts with its stored scale alone.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._torch_private import tensor_version, unwrapped, view_base


def _memory(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class Marks:
    """Facts about tensors' values, by identity and version, and by memory while the marked
    tensor lives (see the module's docstring)."""

    def __init__(self):
        self._by_tensor = WeakIdKeyDictionary()  # {tensor: (fact, version)}
        self._by_memory: dict[tuple, tuple] = {}  # {memory: (weakref, fact, version)}

    def mark(self, t: torch.Tensor, fact=True) -> torch.Tensor:
        """Record `fact` of the values of `t` (under torch.func's wrappers); returns `t`."""
        base = unwrapped(t)
        version, key = tensor_version(base), _memory(base)
        self._by_tensor[base] = (fact, version)
        if base.numel():  # (empty tensors share the address 0)
            by_memory = self._by_memory

            def forget(ref):
                if by_memory.get(key, (None,))[0] is ref:
                    del by_memory[key]

            by_memory[key] = (weakref.ref(base, forget), fact, version)
        return t

    def get(self, t: torch.Tensor):
        """The fact marked of `t`'s values (or of the tensor it views, or of one whose memory
        it shares), unchanged since; None when none is known."""
        base = unwrapped(t)
        for u in (base, view_base(base)):
            if u is not None:
                fact, version = self._by_tensor.get(u, (None, None))
                if fact is not None and version == tensor_version(u):
                    return fact
        if not base.numel():
            return None
        ref, fact, version = self._by_memory.get(_memory(base), (None, None, None))
        if ref is None or ref() is None or version != tensor_version(base):
            return None
        return fact


VALID_SCALES = Marks()
VALID_KEYS = Marks()
FILLED = Marks()
