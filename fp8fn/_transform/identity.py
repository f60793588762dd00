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
    """Values kept per tensor for one forward pass (`routing.Call`), found by the tensor itself.

    Each tensor carries its values in an attribute (`attr`), set when a value is kept and
    cleared by `clear` when the call ends, so none outlives it: the tensors given to the call
    (the weights, before the model runs) and those the call makes from them (views, copies, an
    expert's matrix `W[e]`, as many as the experts a step hits). dynamo guards on the attribute
    of a tensor a frame receives (absent, or the values it holds), never on an id, nor on which
    tensor of a list it is, nor on how many tensors were kept before: a frame that the model
    calls once per layer (a decoder layer or an MoE block that a graph break compiles apart) or
    once per expert (GPT-OSS's `_apply_gate`) finds its layer's values through the weight it
    receives, with the same guards for every layer, and compiles once for all of them. A lookup
    by `id`, or by `is` along a list, made such frames guard on the weight's identity: a compile
    per layer (and per expert), up to dynamo's recompile limit.

    Args:
      attr: the attribute name of the marks: one per table and transform, so that a tensor
        marked by one transform's call is never read as another's.
    """

    def __init__(self, attr: str):
        self.attr = attr
        self._marked = None  # (tensor, (tensor, ... None)): the marked tensors, newest first
        self._hidden = []  # [(tensor, values)]: `hide`'s, restored by `clear`

    def keep(self, tensor: torch.Tensor, value) -> None:
        """Keep `value` for `tensor` (after any kept before)."""
        setattr(tensor, self.attr, (*(getattr(tensor, self.attr, None) or ()), value))
        self._marked = (tensor, self._marked)

    def hide(self, tensor: torch.Tensor) -> None:
        """Hide the values an enclosing call kept for `tensor` (a `checkpoint_fn` recompute
        runs inside the forward pass), until `clear`. Eager only (a recompute never compiles);
        before any `keep` of this table."""
        values = tensor.__dict__.pop(self.attr, None)
        if values:
            self._hidden.append((tensor, values))

    def values(self, tensor) -> tuple:
        """The values kept for `tensor` (this very tensor), in the order kept."""
        return getattr(tensor, self.attr, None) or ()

    @never_compiled_alone  # (a frame of its own would guard on how many it clears)
    def clear(self) -> None:
        """Clear the marks kept so far (the call ends), and restore those hidden: removed
        eagerly, so that no attribute stays on a tensor given to the call; set to None while
        dynamo traces (it cannot trace `delattr`)."""
        compiling = torch.compiler.is_compiling()
        while self._marked is not None:
            tensor, self._marked = self._marked
            if compiling:
                setattr(tensor, self.attr, None)
            else:
                tensor.__dict__.pop(self.attr, None)
        for tensor, values in self._hidden:
            setattr(tensor, self.attr, values)
        self._hidden = []
