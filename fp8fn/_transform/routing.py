"""Routing: the `TorchFunctionMode` that sends a forward pass's linear calls of the chosen
layers, known by the identity of their weight, to `fp8fn.linear` with their site's state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._core.checks import check_dtypes, check_operands
from .._core.recipes import DelayedScaling, NVFP4Scaling
from .._core.state import known_filled, site_name
from .._ops.linear import fp8_linear
from .._parallel.dtensor import sharded_linear, sharded_operands
from .._torch_private import attention_forward, never_compiled_alone, saved_tensor_hooks_active
from .expert_calls import grouped, note_orientation
from .experts import COPIES, DERIVING, GEMMS, GROUPED_MM, read_gemm
from .forms import LINEARS, SPLITS, linear_operands, one_tensor_each, op_name
from .refusals import refuse_call, refuse_other_form, refuse_torch_checkpoint
from .tracking import Tracked


class Call(TorchFunctionMode):
    """One forward pass of a `Transformed`: routes its layers' linear calls to fp8fn.

    Made per call, so one transform may run in several threads at once. It names each call of
    a layer (`path`, `path#1`, ...) and hands it its rows of `state`; while discovering
    (`state` None, for `fn.init`) it records the site names and runs the call as it is.

    Experts weights (`experts.py`) are followed through the views and copies made of them
    (`tracking.py`), and their GEMMs go to the grouped float8 op with the rows of their experts'
    sites (`path[e]#k`: one row per expert, contiguous; `expert_calls.py`), or, one expert at a
    time, to `fp8fn.linear`. While discovering, it also notes which weights' GEMMs run in float8
    (`tracked.weights`: `{name: op or None}`, None for float8) for `fn.summary()`.

    Args:
      plan: the `Plan` of the `Transformed` (`plan.py`); the router reads nothing else of it.
      tensors: `{name: tensor}` as given to `apply`; a layer whose weight is not in it runs
        with the module's own (as in `functional_call`).
      state: the `State`, or None when discovering.
      held: the `Transformed`'s memo of the layers holding swapped-in weights (`holder_of`).
      stop_at: `Transformed.apply`'s code (the model's torch.utils.checkpoint is sought below).
      counts: calls per layer path so far (a recompute starts from the forward's).
      recompute: whether this pass is a recompute of a `checkpoint_fn` module.
    """

    def __init__(self, plan, tensors, state, held, stop_at=None, counts=None, recompute=False):
        super().__init__()
        self.plan, self.state, self.held, self.stop_at = plan, state, held, stop_at
        self.recompute = recompute
        self.counts = {} if counts is None else counts
        self.sites = []
        # Watch for the model's own torch.utils.checkpoint (`refuse_torch_checkpoint`).
        self.watching = (
            state is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        )
        self.passive = False  # a `checkpoint_fn` module's own pass is under way
        self._rows = self._newest = None
        # `[input, weight, grad_output]` bools a site, whether its histories are empty: read to
        # the host once per sharded forward (`_parallel.dtensor`), None until then
        self.unobserved = None
        self.tracked = Tracked(plan, tensors, state is None, held)  # (its `weights`, `touched`)
        self.torch_grouped = set()  # experts weights in torch._grouped_mm, while discovering

    @never_compiled_alone  # (dynamo traces it inside the frames it compiles)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, tracked = kwargs or {}, self.tracked
        if self.passive:
            return func(*args, **kwargs)
        if self.watching and (not torch.is_grad_enabled() or saved_tensor_hooks_active()):
            refuse_torch_checkpoint(self.stop_at)
        if func is F.multi_head_attention_forward:
            with self:  # its own linear calls come back here (see `attention_forward`)
                return attention_forward(*one_tensor_each(args), **kwargs)
        if func in SPLITS:  # the packed in_proj weight, split into q, k, v
            return tracked.split(func, args, kwargs)
        if func in COPIES and args and isinstance(args[0], torch.Tensor):
            return tracked.copy(func, args, kwargs)
        if func in DERIVING and args and tracked.derived_of(args[0]) is not None:
            return tracked.derive(func, args, kwargs)
        if any(func is f for f in LINEARS):
            operands = linear_operands(func, args, kwargs)
            if operands is None:  # another overload (addmm's out_dtype, its deprecated form)
                refuse_other_form(self._api(), func, args, kwargs, tracked.layer_given)
            else:
                x, weight, bias, transposed, options = operands
                layer = self._layer_of(weight, bias, transposed)
                derived = None if layer is not None or transposed else tracked.derived_of(weight)
                if derived is not None and isinstance(derived.expert, int) and weight.dim() == 2:
                    layer = derived.expert_layer()
                if layer is not None:
                    if options:
                        shown = ", ".join(f"{k}={v}" for k, v in options.items())
                        refuse_call(self._api(), layer, f"calls torch.addmm with {shown}")
                    if self.state is None:
                        self._count(layer)
                        tracked.note(weight, None)
                        if derived is not None:
                            note_orientation(weight)
                        return func(*args, **kwargs)
                    return self._linear(layer, x, weight.t() if transposed else weight, bias)
        if func in GEMMS or any(func is op for op in self.plan.grouped_ops):
            gemm = read_gemm(func, args, kwargs, tracked.derived_of, self.plan.grouped_ops)
            if gemm is not None:
                single = None if gemm.expert is None else gemm.derived.expert_layer()
                if self.state is None:
                    self._count(single) if single else self.count_experts(gemm.derived.entry)
                    if func in GROUPED_MM:
                        self.torch_grouped.add(gemm.derived.entry.path)
                    tracked.note(gemm.derived.source, None)
                    note_orientation(gemm.weight)
                    return func(*args, **kwargs)
                if single:
                    return self._linear(single, gemm.x, gemm.weight, None)
                return grouped(self, gemm)
            if self.state is None:
                for t in (*args, *kwargs.values()):
                    tracked.note(t, op_name(func))
        if func is torch.Tensor.unflatten and torch.compiler.is_compiling():
            func = torch.unflatten  # (dynamo cannot trace the method's `super()` call from here)
        return func(*args, **kwargs)

    def _api(self) -> str:
        return "init" if self.state is None else "apply"

    def count_experts(self, entry) -> int:
        """Counts a grouped call of all of `entry`'s experts; the k of its sites."""
        paths = [entry.expert(e) for e in range(entry.experts)]
        k = max(self.counts.get(p, 0) for p in paths)
        for p in paths:
            self.counts[p] = k + 1
            self.sites.append(site_name(p, k))
        return k

    def newest_rows(self):
        """`state.amax_history[..., 0]`, `(n_sites, 3)`, taken once per call."""
        if self._newest is None:
            self._newest = self.state.amax_history[..., 0]
        return self._newest

    def _layer_of(self, weight, bias, transposed):
        """The layer whose weight `weight` is, or None for any other linear call.

        Layers sharing a weight are told apart by their bias.
        """
        matches = [e for e in self.tracked.given(weight) if e[0].transposed == transposed]
        if not matches:
            return self.plan.holder_of(weight, transposed, self.held)
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
                self._rows = (self.newest_rows().unbind(0), self.state.scale.unbind(0), filled)
            newest, stored, filled = self._rows[0][i], self._rows[1][i], self._rows[2]
            filled = None if filled is None else filled[3 * i : 3 * i + 3]
        check_operands(api, x, weight, bias)
        check_dtypes(api, x, weight, bias)  # the module's rules
        if sharded_operands(x, weight):  # functional FSDP, tensor parallel
            return sharded_linear(self, layer, name, x, weight, bias, newest, stored)
        random = (self.state.key, name) if isinstance(layer.recipe, NVFP4Scaling) else None
        return fp8_linear(x, weight, bias, newest, stored, layer.recipe, random, filled, api)
