"""`checkpoint_fn`: the chosen modules' forwards, recomputed in the backward inside `apply`.

While an `apply` runs, each chosen module has an instance `forward` (installed by
`_checkpoint_forwards`, removed after) that checkpoints its pass when the `Call` of this thread
(`RUNNING_CALL`) chose it.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .._core.registries import CHECKPOINT_FORWARDS, RUNNING_CALL
from .checkpoint import checkpoint_with_constants
from .routing import Call
from .swap import Holder, exclusive, swapped_call


@contextlib.contextmanager
def recomputing(call, modules):
    """Inside, `modules` (the `checkpoint_fn` choice) are recomputed in the backward of the
    forward pass that the `Call` `call` runs; nothing when there are none."""
    if not modules:
        yield
        return
    with _activated(call), _checkpoint_forwards(modules):
        yield


@contextlib.contextmanager
def _activated(call):
    token = RUNNING_CALL.set(call)
    try:
        yield
    finally:
        RUNNING_CALL.reset(token)


_INSTALL_LOCK = threading.Lock()  # guards CHECKPOINT_FORWARDS (`_core/registries.py`)
_MISSING = object()


def _checkpointing_forward(module, forward):
    """The `forward` a `checkpoint_fn` module has during `apply`: recomputed when the running
    `Call` (of this thread) chose it, else the module's own (another thread's plain call)."""

    def checkpointing(*args, **kwargs):
        call = RUNNING_CALL.get()
        # Without gradients (evaluation, `fn.init`) there is no backward to recompute in.
        if call is None or call.state is None or call.recompute or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        path = call.plan.checkpointed_ids.get(id(module))
        if path is None:
            return forward(*args, **kwargs)
        return recomputed(call, module, path, forward, args, kwargs)

    return checkpointing


@contextlib.contextmanager
def _checkpoint_forwards(modules):
    """Give `modules` their checkpointing `forward` (an instance attribute) while inside;
    shared between concurrent calls, and removed when the last one ends."""
    with _INSTALL_LOCK:
        for m in modules:
            entry = CHECKPOINT_FORWARDS.get(id(m))
            if entry is None:
                saved = m.__dict__.get("forward", _MISSING)
                forward = saved if saved is not _MISSING else type(m).forward.__get__(m)
                m.__dict__["forward"] = _checkpointing_forward(m, forward)
                CHECKPOINT_FORWARDS[id(m)] = [1, saved, m]
            else:
                entry[0] += 1
    try:
        yield
    finally:
        with _INSTALL_LOCK:
            for m in modules:
                entry = CHECKPOINT_FORWARDS[id(m)]
                entry[0] -= 1
                if entry[0] == 0:
                    del CHECKPOINT_FORWARDS[id(m)]
                    if entry[1] is _MISSING:
                        del m.__dict__["forward"]
                    else:
                        m.__dict__["forward"] = entry[1]


def recomputed(call, module, path, forward, args, kwargs):
    """`forward(*args, **kwargs)` of the `checkpoint_fn` module `module`, run by the `Call`
    `call`, recomputed in the backward with the tensors it holds now (each tied layer's own
    view included), from `call`'s counts."""
    prefix = path + "." if path else ""
    params, buffers, layout = call.plan.block_slots[id(module)].current()
    start, end = call.counts(), {}
    holder = Holder(module, forward)

    def run(buffers, params, state, args, kwargs):
        given = {**buffers, **params}
        tensors = {name: given[first] for name, first in layout.items()}
        inner = Call(
            call.plan,
            {prefix + n: t for n, t in tensors.items()},
            state,
            call.held,
            call.stop_at,
            dict(start),
            recompute=True,
            index=call.index,
        )
        with exclusive(call.plan.module), inner, inner.tracked.marking(), _activated(inner):
            held = {"m." + n: t for n, t in tensors.items()}
            out = swapped_call(holder, None, held, args, kwargs)
        end.update(inner.counts())
        return out

    call.passive = True
    try:
        out = checkpoint_with_constants(
            run,
            (params, call.state, args, kwargs),
            buffers,
            api="apply",
            subject=f"module {path!r} (chosen by `checkpoint_fn`)",
        )
    finally:
        call.passive = False
    call.resume(end)
    return out
