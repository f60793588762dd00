"""A table of values kept per tensor and found by the tensor's identity, that torch.compile
can trace without guarding on identities."""

from __future__ import annotations

import torch


class ByIdentity:
    """Values kept per tensor, for one forward pass (`routing.Call`); the tensors are kept
    alive with them, so an `id` stays its tensor's for the table's life.

    Eager, it finds a tensor's values by `id` (a dict: constant time per lookup). While dynamo
    traces, by comparing with `is` along a list: a lookup by `id` would make dynamo guard on
    the ids, and a step with new tensors (an optimizer's functional loop) would recompile. A
    table made or added to while dynamo traces is searched with `is` from then on, also
    eagerly: a call that torch.compile runs eagerly (a graph break it cannot resume) while
    compiling the frames it calls adds to it in both ways.
    """

    def __init__(self):
        self._items = []  # [(tensor, value)], in the order added
        self._ids = None if torch.compiler.is_compiling() else {}  # {id: [values]}

    def add(self, tensor: torch.Tensor, value) -> None:
        """Keep `value` for `tensor` (after any kept before)."""
        self._items.append((tensor, value))
        if self._ids is None:
            return
        if torch.compiler.is_compiling():
            self._ids = None  # (this item is not in it: searched with `is` from now on)
        else:
            self._ids.setdefault(id(tensor), []).append(value)

    def values(self, tensor) -> list:
        """The values kept for `tensor` (this very tensor), in the order added."""
        if self._ids is None or torch.compiler.is_compiling():
            return [v for t, v in self._items if t is tensor]
        return self._ids.get(id(tensor), [])
