"""Routing: the `TorchFunctionMode` that sends a forward pass's linear calls of the chosen
layers, known by the identity of their weight, to `fp8fn.linear` with their site's state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._core.checks import check_dtypes, check_operands
from .._core.keys import site_id
from .._core.recipes import DelayedScaling, NVFP4Scaling
from .._core.state import known_filled, site_name
from .._ops.linear import fp8_linear
from .._parallel.dtensor import sharded_linear, sharded_operands
from .._torch_private import (
    attention_forward,
    inside_torch_checkpoint,
    never_compiled_alone,
    saved_tensor_hooks_active,
)
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
      counts: `{path: calls}` so far (a recompute starts from the forward's `counts`).
      recompute: whether this pass is a recompute of a `checkpoint_fn` module.
      index: `site_index(plan, state.sites)`, when the caller keeps it; else made here.

    Each layer of the plan finds its `Visit` (its calls so far, and the rows of `state` its
    sites take, split before the model runs) through its weight (`tracked.entries`), never by
    its path: a frame the model calls once per layer (a decoder layer or an MoE block that a
    graph break compiles apart) then traces the same code, with the same guards, for every
    layer, and compiles once (`identity.ByIdentity`).
    """

    def __init__(
        self, plan, tensors, state, held, stop_at=None, counts=None, recompute=False, index=None
    ):
        super().__init__()
        self.plan, self.state, self.held, self.stop_at = plan, state, held, stop_at
        self.recompute = recompute
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
        if state is not None and index is None:
            index = site_index(plan, state.sites)
        self.index = index
        self.visits = self._layer_visits(counts or {})  # {path: Visit}
        self.tracked = Tracked(plan, tensors, state is None, held, self.visits, recompute)
        self.torch_grouped = set()  # experts weights in torch._grouped_mm, while discovering
        self.torch_checkpointed = False  # a float8 GEMM ran in torch.utils.checkpoint (init)

    @never_compiled_alone  # (dynamo traces it inside the frames it compiles)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, tracked = kwargs or {}, self.tracked
        if self.passive:
            return func(*args, **kwargs)
        if (
            self.watching
            and not torch.compiler.is_compiling()  # (a frame compiled inside an eager call)
            and (not torch.is_grad_enabled() or saved_tensor_hooks_active())
        ):
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
                layer, visit = self._layer_of(weight, bias, transposed)
                derived = None if layer is not None or transposed else tracked.derived_of(weight)
                if derived is not None and isinstance(derived.expert, int) and weight.dim() == 2:
                    layer = derived.expert_layer()
                if layer is not None:
                    if options:
                        shown = ", ".join(f"{k}={v}" for k, v in options.items())
                        refuse_call(self._api(), layer, f"calls torch.addmm with {shown}")
                    if self.state is None:
                        self._count(layer)
                        self.torch_checkpointed |= inside_torch_checkpoint(None)
                        tracked.note(weight, None)
                        if derived is not None:
                            note_orientation(weight)
                        return func(*args, **kwargs)
                    weight = weight.t() if transposed else weight
                    return self._linear(layer, visit, x, weight, bias)
        if func in GEMMS or any(func is op for op in self.plan.grouped_ops):
            gemm = read_gemm(func, args, kwargs, tracked.derived_of, self.plan.grouped_ops)
            if gemm is not None:
                single = None if gemm.expert is None else gemm.derived.expert_layer()
                if self.state is None:
                    self._count(single) if single else self.count_experts(gemm.derived.entry)
                    self.torch_checkpointed |= inside_torch_checkpoint(None)
                    if func in GROUPED_MM:
                        self.torch_grouped.add(gemm.derived.entry.path)
                    tracked.note(gemm.derived.source, None)
                    note_orientation(gemm.weight)
                    return func(*args, **kwargs)
                if single:
                    return self._linear(single, None, gemm.x, gemm.weight, None)
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
        visits = [self._visit(p) for p in paths]
        k = max(v.k for v in visits)
        for v in visits:
            v.k = k + 1
        if self.state is None:
            self.sites.extend(site_name(p, k) for p in paths)
        return k

    def counts(self) -> dict:
        """`{path: calls}` so far, of the paths called."""
        return {p: v.k for p, v in self.visits.items() if v.k}

    def resume(self, counts: dict) -> None:
        """Count on from `counts` (`{path: calls}`: after a recompute, its own)."""
        for path, k in counts.items():
            self._visit(path).k = k

    def newest_rows(self):
        """`state.amax_history[..., 0]`, `(n_sites, 3)`, taken once per call."""
        if self._newest is None:
            self._newest = self.state.amax_history[..., 0]
        return self._newest

    def _split(self) -> tuple:
        """`(newest, stored, filled)`: `newest_rows()` and `state.scale` split into the sites'
        float32 `(3,)` rows (once per call: the backward gathers all sites in one stack), and
        `known_filled(state)`."""
        if self._rows is None:
            filled = known_filled(self.state)
            self._rows = (self.newest_rows().unbind(0), self.state.scale.unbind(0), filled)
        return self._rows

    def _layer_visits(self, counts: dict) -> dict:
        """`{path: Visit}`: one per layer of the plan with the rows of its sites (`()` while
        discovering, or for a layer without state), from the calls `counts` (`{path: k}`)."""
        visits = {p: Visit(k, None, f"apply: layer {p!r}") for p, k in counts.items()}
        if self.state is None:
            return visits
        for layer in self.plan.layers:
            at, api, site = self.index[layer.path]
            rows = tuple(self._row(i) for i in at)
            visits[layer.path] = Visit(counts.get(layer.path, 0), rows, api, site)
        return visits

    def _visit(self, path: str) -> Visit:
        """The `Visit` of `path` (made on its first call: an expert's matrix `path[e]`)."""
        visit = self.visits.get(path)
        if visit is None:
            visit = self.visits[path] = Visit(0, None, f"apply: layer {path!r}")
        return visit

    def _layer_of(self, weight, bias, transposed) -> tuple:
        """`(layer, its Visit)` when `weight` is a layer's weight, `(None, None)` for any other
        linear call. Layers sharing a weight are told apart by their bias."""
        matches = [e for e in self.tracked.given(weight) if e[0].transposed == transposed]
        if not matches:
            layer = self.plan.holder_of(weight, transposed, self.held)
            return layer, None if layer is None else self.visits.get(layer.path)
        layer, _, _, visit = next((e for e in matches if e[2] is bias), matches[0])
        return layer, visit

    def _count(self, layer) -> str:
        """The site name of this call of `layer`; counts the call."""
        visit = self._visit(layer.path)
        k, visit.k = visit.k, visit.k + 1
        name = site_name(layer.path, k)
        if self.state is None:
            self.sites.append(name)
        return name

    def _linear(self, layer, visit, x, weight, bias):
        """`fp8fn.linear` of this call of `layer` (`visit` its `Visit`, or None: an expert's
        matrix, whose sites are found by name)."""
        visit = self._visit(layer.path) if visit is None else visit
        k = visit.k
        visit.k = k + 1
        api = visit.api
        newest = stored = filled = None
        if isinstance(layer.recipe, DelayedScaling):
            if visit.rows is not None and k < len(visit.rows):
                newest, stored, filled = visit.rows[k]
            else:
                newest, stored, filled = self._site_rows(layer.path, k)
        check_operands(api, x, weight, bias)
        check_dtypes(api, x, weight, bias)  # the module's rules
        if sharded_operands(x, weight):  # functional FSDP, tensor parallel
            name = site_name(layer.path, k)
            return sharded_linear(self, layer, name, x, weight, bias, newest, stored)
        random = None
        if isinstance(layer.recipe, NVFP4Scaling):  # (by id where known: no name to guard on)
            if visit.site is None:
                site = site_name(layer.path, k)
            else:
                site = site_id(f"#{k}", visit.site) if k else visit.site
            random = (self.state.key, site)
        return fp8_linear(x, weight, bias, newest, stored, layer.recipe, random, filled, api)

    def _site_rows(self, path: str, k: int) -> tuple:
        """`(newest, stored, filled)` of the site `site_name(path, k)` (see `_split`)."""
        name = site_name(path, k)
        i = self.state._positions().get(name)
        if i is None:
            raise ValueError(
                f"fp8fn.apply: layer {path!r} was called more often than in `fn.init`: site "
                f"{name!r} is not in `state`. Call `fn.init` with inputs that call it as often."
            )
        return self._row(i)

    def _row(self, i: int) -> tuple:
        """`(newest, stored, filled)` of the site in row `i` (see `_split`)."""
        newest, stored, filled = self._split()
        return newest[i], stored[i], None if filled is None else filled[3 * i : 3 * i + 3]


class Visit:
    """A layer's calls in one forward pass (`Call`).

    Attributes:
      k: its calls so far: the next call's site is `site_name(path, k)`.
      rows: for a layer of the plan, `(newest, stored, filled)` of each of its sites in
        `state`, in call order (`Call._split`); `()` for a layer without state; None for an
        expert's matrix (its rows found by name).
      api: what errors name the call: `apply: layer 'path'` (never read but to raise: a
        frame compiled for one layer's calls guards on what it reads).
      site: for an NVFP4 layer of the plan, `keys.site_id` of its first site, an int64 `()`
        tensor (its random draws'; a later call's: `site_id("#k", site)`), else None.
    """

    def __init__(self, k: int, rows: tuple | None, api: str, site=None):
        self.k, self.rows, self.api, self.site = k, rows, api, site


def site_index(plan, sites: tuple) -> dict:
    """`{path: (rows, api, site)}` for each layer of `plan`: the rows its sites hold among
    `sites` (a `State`'s), in call order, the name errors give its calls, and for an NVFP4
    layer its first site's `keys.site_id` (an int64 `()` tensor on the CPU; else None)."""
    at = {s: i for i, s in enumerate(sites)}
    index = {}
    for layer in plan.layers:
        rows, k = [], 0
        while (i := at.get(site_name(layer.path, k))) is not None:
            rows.append(i)
            k += 1
        site = None
        if isinstance(layer.recipe, NVFP4Scaling):
            site = torch.tensor(site_id(site_name(layer.path, 0)), dtype=torch.int64)
        index[layer.path] = (tuple(rows), f"apply: layer {layer.path!r}", site)
    return index
