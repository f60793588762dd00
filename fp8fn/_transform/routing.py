"""Routing: the `TorchFunctionMode` that sends a forward pass's linear calls of the chosen
layers, known by the identity of their weight, to `fp8fn.linear` with their site's state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode

from .._core.checks import check_dtypes, check_operands
from .._core.recipes import DelayedScaling, NVFP4Scaling
from .._core.state import known_filled, site_name
from .._ops.gemm import resolve_backend
from .._ops.grouped import grouped_mm
from .._ops.linear import fp8_linear
from .._parallel.dtensor import gathered_for_split, sharded_linear, sharded_operands
from .._torch_errors import USE_CHECKPOINT_FN
from .._torch_private import (
    attention_forward,
    inside_torch_checkpoint,
    is_fake,
    module_parameters,
    never_compiled_alone,
    saved_tensor_hooks_active,
    unwrapped,
    view_base,
)
from .experts import (
    COPIES,
    DERIVING,
    GEMMS,
    GROUPED_MM,
    Derived,
    ExpertLayer,
    derive,
    expert_rows,
    read_gemm,
)
from .identity import ByIdentity

_SPLITS = (torch.Tensor.split, torch.Tensor.chunk)


_LINEAR_ARGS = ("input", "weight", "bias")  # F.linear(input, weight, bias=None)
_ADDMM_ARGS = ("input", "mat1", "mat2")  # torch.addmm(input, mat1, mat2, *, beta, alpha, out)


def _bind(args, kwargs, names, required, keywords=()) -> dict | None:
    """`{name: value}` of a call's arguments, each by position or by keyword, or None when the
    call does not fit (torch then raises its own error, or it is another overload)."""
    if len(args) > len(names) or kwargs.keys() - {*names, *keywords}:
        return None
    bound = dict(zip(names, args))
    if bound.keys() & kwargs.keys():
        return None
    bound.update(kwargs)
    return bound if all(n in bound for n in required) else None


def _operands(func, args, kwargs):
    """`(x, weight, bias, transposed, options)` of an `F.linear` call (`bias` None when not
    given), or of `torch.addmm(bias, x, weight)` (HF Conv1D; also as `bias.addmm(x, weight)`),
    each argument given by position or by keyword; `options` (`{name: shown value}`) the
    addmm keywords other than their defaults (`beta`, `alpha`, `out`), which fp8fn does not
    convert. None for a call of another form."""
    if func is F.linear:
        bound = _bind(args, kwargs, _LINEAR_ARGS, _LINEAR_ARGS[:2])
        if bound is None:
            return None
        return bound["input"], bound["weight"], bound.get("bias"), False, {}
    bound = _bind(args, kwargs, _ADDMM_ARGS, _ADDMM_ARGS, ("beta", "alpha", "out"))
    if bound is None:
        return None
    options = {k: repr(bound[k]) for k in ("beta", "alpha") if bound.get(k, 1) != 1}
    if bound.get("out") is not None:
        options["out"] = "a tensor"
    return bound["mat1"], bound["mat2"], bound["input"], True, options


def _aliases(a, b) -> bool:
    """Whether the plain tensors `a` and `b` are the same elements of the same memory (so the
    same values) though not the same tensor object. False while torch.compile traces, and for
    tensors without memory (meta, fake)."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a is not b
        and not torch.compiler.is_compiling()
        and unwrapped(a) is a
        and unwrapped(b) is b
        and a.device.type != "meta"
        and not (is_fake(a) or is_fake(b))
        and (a.device, a.dtype, a.shape, a.stride()) == (b.device, b.dtype, b.shape, b.stride())
        and a.data_ptr() == b.data_ptr()
    )


def _one_tensor_each(args: tuple) -> tuple:
    """`F.multi_head_attention_forward`'s positional `(query, key, value, ...)` with `key` made
    `query` and `value` made `key` where they alias it: torch projects `query is key` and `key
    is value` with fewer GEMMs of the packed `in_proj_weight` (one, or q and kv: sites
    `in_proj`, `#1`), and FSDP2 with gradients recorded hands each input of a wrapped module's
    forward over as a tensor of its own (a tensor given as key and value, not as query), so the
    attention would take another path (three GEMMs) than in `fn.init` (no gradients) and than
    one process."""
    if len(args) < 3:
        return args
    query, key, value = args[:3]
    if _aliases(query, key):
        key = query
    if _aliases(key, value):
        value = key
    return (query, key, value, *args[3:])


class Call(TorchFunctionMode):
    """One forward pass of a `Transformed`: routes its layers' linear calls to fp8fn.

    Made per call, so one transform may run in several threads at once. It names each call of
    a layer (`path`, `path#1`, ...) and hands it its rows of `state`; while discovering
    (`state` None, for `fn.init`) it records the site names and runs the call as it is.

    Experts weights (`experts.py`) are followed through the views and copies made of them
    (`_derived`), and their GEMMs go to the grouped float8 op with the rows of their experts'
    sites (`path[e]#k`: one row per expert, contiguous), or, one expert at a time, to
    `fp8fn.linear`. While discovering, it also notes which weights' GEMMs run in float8
    (`weights`: `{name: op or None}`, None for float8) for `fn.summary()`.

    Args:
      transformed: the `Transformed`.
      tensors: `{name: tensor}` as given to `apply`; a layer whose weight is not in it runs
        with the module's own (as in `functional_call`).
      state: the `State`, or None when discovering.
      counts: calls per layer path so far (a recompute starts from the forward's).
      recompute: whether this pass is a recompute of a `checkpoint_fn` module.
    """

    def __init__(self, transformed, tensors, state, counts=None, recompute=False):
        super().__init__()
        self.transformed, self.state, self.recompute = transformed, state, recompute
        self.counts = {} if counts is None else counts
        self.sites = []
        # Watch for the model's own torch.utils.checkpoint (see _refuse_torch_checkpoint).
        self.watching = (
            state is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        )
        self.passive = False
        self._rows = self._newest = None
        # `[input, weight, grad_output]` bools a site, whether its histories are empty: read to
        # the host once per sharded forward (`_parallel.dtensor`), None until then
        self.unobserved = None
        self._derived = ByIdentity()  # {tensor: [Derived]}
        for entry in transformed._experts:
            weight = entry.own(tensors)
            self._track(weight, Derived(entry, weight))
        self.weights = {}
        self.torch_grouped = set()  # experts weights in torch._grouped_mm, while discovering
        self.touched = set()  # experts weights viewed, indexed or transposed in this call
        self._names = None
        if state is None:  # discovering: every weight that may reach a GEMM, by identity
            given = {**dict(transformed.module.named_parameters()), **tensors}
            self._names = {id(t): n for n, t in given.items() if is_lazy(t) or t.dim() >= 2}
        self._kept = []  # the copies `_names` knows by id
        # (layer, weight, bias): what each layer runs with
        self._entries = ByIdentity()  # {weight: [(layer, weight, bias)]}
        self._held_before = {}  # {id(layer): the weight it held before the call}, if sharded
        for layer in transformed._layers:
            weight, bias = layer.own(tensors)
            self._entries.add(weight, (layer, weight, bias))
            if not torch.compiler.is_compiling() and sharded_operands(weight):
                self._held_before[id(layer)] = layer.held()

    @never_compiled_alone  # (dynamo traces it inside the frames it compiles)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.passive:  # a `checkpoint_fn` module's own pass is under way
            return func(*args, **kwargs)
        if self.watching and (not torch.is_grad_enabled() or saved_tensor_hooks_active()):
            self._refuse_torch_checkpoint()
        if func is F.multi_head_attention_forward:
            with self:  # its own linear calls come back here (see `attention_forward`)
                return attention_forward(*_one_tensor_each(args), **kwargs)
        if func in _SPLITS:  # the packed in_proj weight, split into q, k, v
            return self._split(func, args, kwargs)
        if func in COPIES and args and isinstance(args[0], torch.Tensor):
            return self._copy(func, args, kwargs)
        if func in DERIVING and args and self._derived_of(args[0]) is not None:
            return self._derive(func, args, kwargs)
        if func is F.linear or func is torch.addmm or func is torch.Tensor.addmm:
            operands = _operands(func, args, kwargs)
            if operands is None:  # another overload (addmm's out_dtype, its deprecated form)
                self._refuse_other_form(func, args, kwargs)
            else:
                x, weight, bias, transposed, options = operands
                layer = self._layer_of(weight, bias, transposed)
                derived = None if layer is not None or transposed else self._derived_of(weight)
                if derived is not None and isinstance(derived.expert, int) and weight.dim() == 2:
                    layer = self._expert_layer(derived)
                if layer is not None:
                    if options:
                        shown = ", ".join(f"{k}={v}" for k, v in options.items())
                        self._refuse_call(layer, f"calls torch.addmm with {shown}")
                    if self.state is None:
                        self._count(layer)
                        self._note(weight, None)
                        if derived is not None:
                            _note_orientation(weight)
                        return func(*args, **kwargs)
                    return self._linear(layer, x, weight.t() if transposed else weight, bias)
        if func in GEMMS or any(func is op for op in self.transformed._grouped_ops):
            gemm = read_gemm(func, args, kwargs, self._derived_of, self.transformed._grouped_ops)
            if gemm is not None:
                single = None if gemm.expert is None else self._expert_layer(gemm.derived)
                if self.state is None:
                    self._count(single) if single else self._count_experts(gemm.derived.entry)
                    if func in GROUPED_MM:
                        self.torch_grouped.add(gemm.derived.entry.path)
                    self._note(gemm.derived.source, None)
                    _note_orientation(gemm.weight)
                    return func(*args, **kwargs)
                if single:
                    return self._linear(single, gemm.x, gemm.weight, None)
                return self._grouped(gemm)
            if self._names is not None:
                for t in (*args, *kwargs.values()):
                    self._note(t, f"torch.{func.__name__}" if func is not F.linear else "F.linear")
        if func is torch.Tensor.unflatten and torch.compiler.is_compiling():
            func = torch.unflatten  # (dynamo cannot trace the method's `super()` call from here)
        return func(*args, **kwargs)

    def _track(self, tensor, derived):
        self._derived.add(tensor, derived)

    def _derived_of(self, t) -> Derived | None:
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
        for entry in self.transformed._experts:
            if module_parameters(entry.module).get(entry.attr) is t:
                derived = Derived(entry, t)
                self._track(t, derived)
                return derived
        return None

    def _derive(self, func, args, kwargs):
        """Run a view, index or transpose of a tracked tensor, and track what it made."""
        result = func(*args, **kwargs)
        derived = derive(func, args, kwargs, self._derived_of(args[0]), result)
        if isinstance(derived, list):
            for piece, d in zip(result, derived):
                self._track(piece, d)
                self.touched.add(d.entry.path)
        elif derived is not None:
            self._track(result, derived)
            self.touched.add(derived.entry.path)
        return result

    def _copy(self, func, args, kwargs):
        """A copy of a tensor (`.to`, `.clone`, `.detach`, ...): a copy of a layer's weight is
        that layer's weight in the calls it reaches (the gradient flows back through the copy
        as autograd takes it), one of an experts weight (or of a tensor made from one) is
        followed like it, one of any other weight is noted under its name (`fn.summary()`)."""
        source, result = args[0], func(*args, **kwargs)
        if result is source or not isinstance(result, torch.Tensor):
            return result
        derived = self._derived_of(source)
        if derived is not None:
            copied = derived if derived.expert is not None else Derived(derived.entry, result)
            self._track(result, copied)
        for layer, _, bias in self._given(source):
            self._entries.add(result, (layer, result, bias))
        if self._names is not None:
            name = self._names.get(id(source))
            if name is None and view_base(source) is not None:
                name = self._names.get(id(view_base(source)))
            if name is not None:
                self._names[id(result)] = name
                self._kept.append(result)  # (alive for the call: its id stays its own)
        return result

    def _note(self, t, op):
        """While discovering: the weight `t` (or its source) runs a GEMM, in float8 when `op`
        is None, else in high precision through `op` (a float8 note is never overwritten)."""
        if self._names is None or not isinstance(t, torch.Tensor):
            return
        derived = self._derived_of(t)
        name = self._names.get(id(t)) if derived is None else derived.entry.path
        if name is None and view_base(t) is not None:
            name = self._names.get(id(view_base(t)))
        if name is not None and self.weights.get(name, "") is not None:
            self.weights[name] = op

    def _expert_layer(self, derived):
        """Expert `derived.expert` of its experts weight, as a layer of its own."""
        entry = derived.entry
        return ExpertLayer(entry.expert(derived.expert), entry.recipe)

    def _count_experts(self, entry) -> int:
        """Counts a grouped call of all of `entry`'s experts; the k of its sites."""
        paths = [entry.expert(e) for e in range(entry.experts)]
        k = max(self.counts.get(p, 0) for p in paths)
        for p in paths:
            self.counts[p] = k + 1
            self.sites.append(site_name(p, k))
        return k

    def _grouped(self, gemm):
        """A GEMM of all of an experts weight's experts, on the grouped float8 op."""
        entry = gemm.derived.entry
        k = self._count_experts(entry)
        newest = stored = None
        if isinstance(entry.recipe, DelayedScaling):
            first = expert_rows("apply", self.state._positions(), entry.path, entry.experts, k)
            newest = self._newest_rows()[first : first + entry.experts]
            stored = self.state.scale[first : first + entry.experts]
        x, weight = gemm.x, gemm.weight
        check_dtypes(f"apply: experts {entry.path!r}", x, weight[0], None)
        backend = resolve_backend(entry.recipe, x.device, "apply")
        margin = getattr(entry.recipe, "margin", 0)
        random = None  # NVFP4: expert e draws with the key folded with e, at the call's site
        if isinstance(entry.recipe, NVFP4Scaling):
            random = (self.state.key, site_name(entry.path, k))
        return gemm.finish(
            grouped_mm(
                x,
                weight,
                gemm.offs,
                newest,
                stored,
                margin,
                backend,
                recipe=entry.recipe,
                random=random,
                api=f"apply: experts {entry.path!r}",
            )
        )

    def expert_parallel_rows(self, module, attrs) -> list | None:
        """For fp8fn's expert-parallel forward (`expert_parallel.py`): this call of the experts
        weights `attrs` of `module`, counted as one grouped call of all their experts, as
        `[(recipe, newest, stored, filled)]` (`newest`, `stored`: float32 `(E, 3)` state rows
        under DelayedScaling, else None; None while discovering; `filled`: `State.filled` of
        those rows, `3 * E` bools expert-major, where `known_filled` knows them, else None); None
        when fp8fn does not run them.

        Raises:
          ValueError: `fp8fn.apply: ...` (`fp8fn.init: ...`) for a recipe other than
            DelayedScaling or CurrentScaling, or when only some of `attrs` are chosen.
        """
        entries = [
            next((e for e in self.transformed._experts if e.module is module and e.attr == a), None)
            for a in attrs
        ]
        if all(e is None for e in entries):
            return None
        known = next(e.path for e in entries if e is not None).rpartition(".")[0]
        names = [f"{known}.{a}" for a in attrs]
        kinds = {type(e.recipe).__name__ if e else None for e in entries}
        if None in kinds or not kinds <= {"DelayedScaling", "CurrentScaling"}:
            api = "init" if self.state is None else "apply"
            raise ValueError(
                f"fp8fn.{api}: expected the expert-parallel experts weights {names} to use "
                "DelayedScaling or CurrentScaling together (fp8fn.expert_parallel runs their "
                f"GEMMs on each rank's experts), got {sorted(map(str, kinds))}. Choose one of "
                "those for both weights, or None for both (high precision)."
            )
        out = []
        for entry in entries:
            k = self._count_experts(entry)
            if self.state is None:
                self.weights[entry.path] = None  # runs in float8 (`_note`)
                out.append((entry.recipe, None, None, None))
                continue
            newest = stored = filled = None
            if isinstance(entry.recipe, DelayedScaling):
                positions = self.state._positions()
                first = expert_rows("apply", positions, entry.path, entry.experts, k)
                newest = self._newest_rows()[first : first + entry.experts]
                stored = self.state.scale[first : first + entry.experts]
                known = known_filled(self.state)  # never the structure's word alone
                if known is not None:
                    filled = known[3 * first : 3 * (first + entry.experts)]
            out.append((entry.recipe, newest, stored, filled))
        return out

    def _newest_rows(self):
        """`state.amax_history[..., 0]`, `(n_sites, 3)`, taken once per call."""
        if self._newest is None:
            self._newest = self.state.amax_history[..., 0]
        return self._newest

    def _refuse_other_form(self, func, args, kwargs):
        """Raise if a layer's weight is among the tensors of a linear call of a form that
        `_operands` does not know: it would silently run in high precision."""
        for t in (*args, *kwargs.values()):
            layer = next(iter(self._given(t)), (None,))[0] if torch.is_tensor(t) else None
            if layer is not None:
                name = f"torch.{func.__name__}" if func is not F.linear else "F.linear"
                self._refuse_call(
                    layer, f"passes its weight to {name} in a form fp8fn does not convert"
                )

    def _refuse_call(self, layer, what: str):
        api = "init" if self.state is None else "apply"
        raise ValueError(
            f"fp8fn.{api}: layer {layer.path!r} {what} (fp8fn runs `x @ weight.T + bias`). "
            "Call it as `F.linear(x, weight, bias)` (HF Conv1D: `torch.addmm(bias, x, "
            "weight)`), or leave the layer in high precision with `filter_fn=lambda name, "
            f"module: name != {layer.path!r}`."
        )

    def _refuse_torch_checkpoint(self):
        """Raise if the model runs its own torch.utils.checkpoint (seen as gradients turned
        off, or saved-tensor hooks, inside a forward that records gradients): its recompute
        would run after `apply` has returned, with the module's own parameters and without
        fp8fn. (Only walks the frames in such a stretch: a part run under no_grad on purpose
        costs a few microseconds per op.)"""
        if inside_torch_checkpoint(type(self.transformed).apply.__code__):
            raise RuntimeError(
                "fp8fn.apply: the model runs torch.utils.checkpoint, whose recompute in the "
                "backward would run outside fp8fn.apply: with the module's own parameters and "
                f"without fp8fn's casts, so silently wrong gradients. {USE_CHECKPOINT_FN}"
            )

    def _split(self, func, args, kwargs):
        """`weight.split(...)` or `.chunk(...)`: the pieces of a layer's weight are that
        layer's weights too (nn.MultiheadAttention's packed in_proj, for cross-attention)."""
        whole = args[0]
        layer = next(iter(self._given(whole)), (None,))[0]
        if layer is None and isinstance(whole, nn.Parameter):  # swapped in (FSDP2)
            layer = self.transformed._holder_of(whole, False)
        if layer is not None and self._held_before:  # sharded operands (never compiled)
            held = self._held_before.get(id(layer))
            args = (gathered_for_split(whole, held), *args[1:])
        pieces = func(*args, **kwargs)
        if layer is not None:
            for piece in pieces:
                self._entries.add(piece, (layer, piece, None))
        return pieces

    def _given(self, weight) -> list:
        """The entries `(layer, weight, bias)` whose weight `weight` is."""
        return self._entries.values(weight)

    def _layer_of(self, weight, bias, transposed):
        """The layer whose weight `weight` is, or None for any other linear call.

        Layers sharing a weight are told apart by their bias.
        """
        matches = [e for e in self._given(weight) if e[0].transposed == transposed]
        if not matches:
            return self.transformed._holder_of(weight, transposed)
        return next((e[0] for e in matches if e[2] is bias), matches[0][0])

    def _count(self, layer) -> str:
        """The site name of this call of `layer`; counts the call."""
        k = self.counts.get(layer.path, 0)
        self.counts[layer.path] = k + 1
        name = site_name(layer.path, k)
        self.sites.append(name)
        return name

    def _linear(self, layer, x, weight, bias):
        name = self._count(layer)
        api = f"apply: layer {layer.path!r}"
        newest = stored = filled = None
        if isinstance(layer.recipe, DelayedScaling):
            i = self.state._positions().get(name)
            if i is None:
                raise ValueError(
                    f"fp8fn.apply: layer {layer.path!r} was called more often than in "
                    f"`fn.init`: site {name!r} is not in `state`. Call `fn.init` with inputs "
                    "that call it as often."
                )
            if self._rows is None:  # split once: the backward gathers all sites in one stack
                filled = known_filled(self.state)
                self._rows = (self._newest_rows().unbind(0), self.state.scale.unbind(0), filled)
            newest, stored, filled = self._rows[0][i], self._rows[1][i], self._rows[2]
            filled = None if filled is None else filled[3 * i : 3 * i + 3]
        check_operands(api, x, weight, bias)
        check_dtypes(api, x, weight, bias)  # the module's rules
        if sharded_operands(x, weight):  # functional FSDP, tensor parallel
            return sharded_linear(self, layer, name, x, weight, bias, newest, stored)
        random = (self.state.key, name) if isinstance(layer.recipe, NVFP4Scaling) else None
        return fp8_linear(x, weight, bias, newest, stored, layer.recipe, random, filled, api)


def _note_orientation(weight) -> None:
    """While discovering: an experts weight gathered in float8 under a finer recipe learns how
    its GEMMs read it, as `weight` (the GEMM's `(N, K)` or `(E, N, K)`) stands to it
    (`note_orientation`, duck-typed)."""
    note = getattr(type(weight), "note_orientation", None)
    if note is not None:
        note(weight)
