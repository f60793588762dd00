"""A table of values kept per tensor and found by the tensor's identity, that torch.compile
can trace without guarding on identities, nor on how many tensors a call has made."""

from __future__ import annotations

import torch

from .._torch_private import never_compiled_alone


def markable(pieces: tuple) -> tuple:
    """The pieces of a multi-output op (`split`, `chunk`, `unbind`) as tensors `mark` can
    mark: while dynamo traces, each as a view of itself (dynamo refuses `setattr` on an
    output of a multi-output op, and accepts it on a single-output view); eagerly, as they are.
    Same values, same views of the same base."""
    if not torch.compiler.is_compiling():
        return pieces
    return tuple(piece.view_as(piece) for piece in pieces)


class ByIdentity:
    """Values kept per tensor, for one forward pass (`routing.Call`), of two kinds.

    * Tensors given to the call (`keep`: the weights, a fixed number per call). They are kept
      alive with their values, so an `id` stays its tensor's for the table's life. Eager, one
      is found by `id` (a dict: constant time per lookup); while dynamo traces, by comparing
      with `is` along a list: a lookup by `id` would make dynamo guard on the ids, and a step
      with new tensors (an optimizer's functional loop) would recompile. A table made or added
      to while dynamo traces is searched with `is` from then on, also eagerly: a call that
      torch.compile runs eagerly (a graph break it cannot resume) while compiling the frames it
      calls adds to it in both ways.
    * Tensors the call makes from those (`mark`: views, copies, an expert's matrix `W[e]`, as
      many as the experts a step hits). Each carries its values in an attribute (`attr`),
      cleared (set to None) by `clear` when the call ends, so none outlives it. dynamo guards on
      the attribute of a tensor that a frame receives (absent, or the values it holds), never
      on an id, nor on how many tensors were marked before: kept in the list, they made a frame
      that transformers' eager experts loop calls once per expert (GPT-OSS's `_apply_gate`)
      guard on the list's length, and recompile at every expert up to dynamo's limit.

    Args:
      attr: the attribute name of the marks: one per table and transform, so that a tensor
        made by one transform's call is never read as another's.
    """

    def __init__(self, attr: str):
        self.attr = attr
        self._items = []  # [(tensor, value)], in the order kept
        self._ids = None if torch.compiler.is_compiling() else {}  # {id: [values]}
        self._marked = None  # (tensor, (tensor, ... None)): the marked tensors, newest first

    def keep(self, tensor: torch.Tensor, value) -> None:
        """Keep `value` for `tensor`, a tensor given to the call (after any kept before)."""
        self._items.append((tensor, value))
        if self._ids is None:
            return
        if torch.compiler.is_compiling():
            self._ids = None  # (this item is not in it: searched with `is` from now on)
        else:
            self._ids.setdefault(id(tensor), []).append(value)

    def mark(self, tensor: torch.Tensor, value) -> None:
        """Keep `value` for `tensor`, a tensor the call made (after any kept before)."""
        setattr(tensor, self.attr, (*(getattr(tensor, self.attr, None) or ()), value))
        self._marked = (tensor, self._marked)

    def values(self, tensor) -> list:
        """The values kept for `tensor` (this very tensor), in the order added."""
        marked = getattr(tensor, self.attr, None)
        if marked:
            return list(marked)
        if self._ids is None or torch.compiler.is_compiling():
            return [v for t, v in self._items if t is tensor]
        return self._ids.get(id(tensor), [])

    @never_compiled_alone  # (a frame of its own would guard on how many it clears)
    def clear(self) -> None:
        """Clear the marks of the tensors marked so far (the call ends)."""
        while self._marked is not None:
            tensor, self._marked = self._marked
            setattr(tensor, self.attr, None)
