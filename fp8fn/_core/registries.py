"""Everything fp8fn keeps outside the state, in one place: the marks, the registries and the
context variables (the two process-wide switches stay beside the code that rebinds them:
`_core/device.py`, `_kernels/triton_jit.py`; and the cache of torch.func's classes,
`SINGLE_LEVEL_FUNCTIONS`, beside the code that makes them in `_torch_private.py`, the layer
below this one). Each entry below says what it holds, who writes
it, who reads it, and why it cannot be in the state; docs/semantics.md has the same table and
`tests/test_registries.py` checks that no module defines one elsewhere.

None holds a number that the results depend on: each is a fact about values (a mark), about the
user's loop across calls (a warning), a cache, or a handle for a call that fp8fn does not make
itself (FSDP2's hooks, the module's own caller). Tensors, modules and groups are held weakly:
an entry leaves with them.

**Marks: one rule for every fact about a tensor's values.** A mark records a fact (e.g. "these
scales are finite and > 0") with the tensor's version counter then. It holds for the tensor
itself, a view of it (which shares its version counter) and, while the marked tensor lives (so
its memory is not reused), any tensor of the same memory (address, shape, strides, dtype,
device): `t.detach()` copies (`fp8fn.observe`'s and `fp8fn.value_and_grad`'s leaves) share
memory and version counter. An in-place change (`zero_()`, `fill_()`, `copy_()`, a write
through a view) bumps the version: the fact is then unknown and checked again. A tensor fp8fn
did not make (a `tree_map` of a state, `tree_unflatten` of other leaves, a loaded state)
carries no mark. Marks are read outside torch.compile only (a compiled graph checks the values
themselves, in the graph). A write that torch does not count (through `t.data`, `t.numpy()`
or the storage: autograd cannot see it either) is not seen; a scale of 0 or NaN written so
makes the output NaN, not a finite wrong number.
"""

from __future__ import annotations

import contextvars
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


# Each entry: what it holds; written by; read by; why not in the state.

# -- marks (facts about values, by identity and version) ------------------------------------------

# Scale tensors known finite and > 0. Written by `init_state`, `update`, `check_scales` (after
# a host read); read by `check_scales` (no host read for a known one) and `update` (an
# observation's scales are never marked). Not in the state: an in-place change or a rebuilt
# state would outlive it in the state's structure.
VALID_SCALES = Marks()
# Random keys known to hold integers in `[0, 2**52)`. Written by `fn.init`, `update`,
# `fold_in`, `check_key` (after a host read); read by `check_key`. Not in the state: the same.
VALID_KEYS = Marks()
# Amax histories, with which of them hold an observation (`State.filled`'s tuple) and how many
# updates read that from the values. Written by `update`; read by `known_filled`, which decides
# whether a role casts with its stored scale alone, and by `update` (a history it made holds
# finite amaxes >= 0: its check skipped). Not in the state: the same (`State.filled`, in the
# structure, is trusted only through this mark).
FILLED = Marks()

# -- the user's loop across calls (warnings and advice; by identity) ------------------------------

# History tensors of states that `update` made a newer state from: True once a newer state was
# used (`observe`, `apply`), False while none was. Written by `supersede` (`update`) and
# `warn_if_superseded`; read by `warn_if_superseded`. Not in the state: a fact of the loop (the
# state held is the old one, which `update` cannot change).
SUPERSEDED = WeakIdKeyDictionary()
# Each `update` result's history -> a weak reference to the history it came from. Written by
# `supersede`; read by `warn_if_superseded`. Not in the state: the same.
PREDECESSOR = WeakIdKeyDictionary()
# Histories made by `init_state` (no `update` has advanced them), with what the training step
# that first observed each saw: `{"seen": the first 64 values of the first parameter}`. Written
# by `init_state`, `warn_if_never_updated`; read by `warn_if_never_updated` (`apply`). Not in
# the state: a loop that drops `update` never returns the state to fp8fn.
NEVER_UPDATED = WeakIdKeyDictionary()
# The histories `fp8fn.observe` made: `{observed history: the history it copied}`. Written by
# `observe`; read by `claim` (the advice when one is reused), `refuse_untrained_backward`,
# `warn_if_never_updated`. Not in the state: `observe`'s copy is the user's state for one step;
# the entry tells it from the original.
OBSERVED = WeakIdKeyDictionary()

# -- caches and handles --------------------------------------------------------------------------

# `all_reduce`'s structure tags: (static, shape, device) -> (tag, the mismatch message), made
# once per structure and device, at most `MAX_ALL_REDUCE_TAGS` (cleared when full). Written and
# read by `all_reduce`. Not in the state: a cache of constants (copying the tag to a GPU at every
# call would wait for the device).
ALL_REDUCE_TAGS: dict = {}
MAX_ALL_REDUCE_TAGS = 64
# The process groups whose first `all_reduce` has run (weakly: a destroyed group leaves, and a
# new group at its address is not mistaken for it). Written and read by `all_reduce`. Not in the
# state: a fact of the group, shared by every state reduced on it (every rank of a group calls
# `all_reduce` on it equally often, so "first" is the same call on every rank).
ALL_REDUCE_STARTED: weakref.WeakSet = weakref.WeakSet()
# One lock per module (weakly). Written and read by `exclusive` (`apply`, `init`, the
# recompute). Not in the state: `functional_call` swaps tensors into the module for a call, and
# two transforms of one module share the module, not a state.
MODULE_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The `checkpoint_fn` modules given a `forward` while some `apply` runs: `{id: [count of the
# calls, the user's own forward or a sentinel, module]}`, during a call only. Written and read
# by `recomputing` (`apply`). Not in the state: a patch on the user's module, undone when the
# last concurrent call ends.
CHECKPOINT_FORWARDS: dict = {}

# -- context variables ----------------------------------------------------------------------------

# The running `apply`'s weight scales for FSDP2's all-gather (a `ScalesForCall`; None outside
# `apply`: FSDP2's backward re-gather). Set by `Fsdp2.scales` (`apply`); read by FSDP2's
# pre-forward all-gather hook (`Float8ShardWeight`). Not in the state: FSDP2 calls its hook, not
# fp8fn: the hook gets no argument from `apply`.
GATHER_SCALES: contextvars.ContextVar = contextvars.ContextVar("fp8fn_gather_scales", default=None)
# The running `Call` of this thread. Set by `recomputing` (`apply`); read by the patched
# `forward` of a `checkpoint_fn` module. Not in the state: the module's own caller calls
# `self.block(x)`, with no argument for it.
RUNNING_CALL: contextvars.ContextVar = contextvars.ContextVar("fp8fn_call", default=None)
