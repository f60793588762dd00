"""`transform`: an nn.Module as a pure `(init, apply)` pair with explicit scaling state.

`apply` runs the user's own module as it is at the call (its buffers, dtype, device, training
flags and hooks) under `torch.func.functional_call` with the given parameters. A `Call` (one
per forward pass, a `TorchFunctionMode`, `routing.py`) routes the linear calls of the chosen
layers (`layers.py`), known by the identity of their weight, to `fp8fn.linear` with their site's
state. `transform` reads the module (its layers and recipes, parameter slots and ties, the
`checkpoint_fn` submodules, FSDP2's) and `apply` reads it again when its structure changed; during
`apply` the `checkpoint_fn` submodules get an instance `forward`, removed after the call (the full
list: docs/semantics.md, "What fp8fn touches outside the state").

This module is the facade: `apply` checks its arguments, then enters in one `with` the context
managers a call needs (torch's errors translated, `_torch_errors.py`; FSDP2's float8 weight
scales, `fsdp.py`; the module's lock, `swap.py`; the routing `Call`; the `checkpoint_fn`
recompute, `recompute.py`), then calls the module.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn

from .._core.checks import check_function
from .._core.error_origin import init_error
from .._core.experts import find_experts, find_gates
from .._core.keys import initial_key, seed_key
from .._core.observe import refuse_untrained_backward
from .._core.owners import held
from .._core.recipes import RECIPES, DelayedScaling, NVFP4Scaling
from .._core.state import (
    State,
    check_scales,
    check_state,
    claim,
    init_state,
    parse_site,
    site_name,
    warn_if_never_updated,
    warn_if_superseded,
)
from .._parallel.dtensor import gather_params, sharded_operands
from .._parallel.wrappers import ddp_parameter, refuse_ddp_inner_module, reshard_fsdp
from .._torch_errors import translated_errors
from .._torch_private import (
    constant_under_compile,
    innermost_function_mode,
    module_children,
    module_parameters,
    recomputing_in_torch_checkpoint,
    refuse_fullgraph_trace,
    tree_map,
)
from .checkpoint import refuse_compile
from .coverage import report_high_precision, summarize
from .expert_parallel import expert_parallel_in
from .expert_parallel import refuse_compile as refuse_expert_parallel_compile
from .experts import grouped_ops
from .fsdp import Fsdp2
from .layers import find_layers, is_linear_weight, recipe_for
from .recompute import recomputing
from .routing import Call
from .swap import Slots, exclusive, swapped_call


@constant_under_compile
def _reread_if_changed(transformed) -> bool:
    """`transformed._read_module()` when its module's structure changed since it last ran.

    Run as it is, in eager; while torch.compile traces `apply`, run at trace time only (its
    result a constant): a change that makes dynamo trace again (it guards on the submodules
    and parameters a forward reads) is re-read then.
    """
    if not _unchanged(transformed._structure):
        with exclusive(transformed.module):
            if not _unchanged(transformed._structure):
                transformed._read_module()
    return True


def _inside(name: str, path: str) -> bool:
    """Whether the tensor `name` belongs to the submodule at `path` ("" is the root)."""
    return not path or name.startswith(path + ".")


# The parameters of the user's choice functions: the recipe function, `filter_fn`, `checkpoint_fn`.
_CHOICE = ("name", "module")


def _structure(module, managed) -> list:
    """`[(submodule, its children, its parameters' (name, tensor))]`, by identity, less the
    slots FSDP2 manages (`managed`: `{(id(submodule), name)}`; FSDP2 swaps them at each
    forward): what `_read_module` read the module's layers, ties and slots from."""
    return [
        (
            m,
            tuple(module_children(m).values()),
            len(module_parameters(m)),
            tuple((a, p) for a, p in module_parameters(m).items() if (id(m), a) not in managed),
        )
        for m in module.modules()
    ]


def _unchanged(structure) -> bool:
    """Whether every submodule of `structure` (from `_structure`) still holds the same children
    and parameters (compared by identity: a few microseconds per submodule)."""
    for m, children, n_params, params in structure:
        now = module_children(m)
        if len(now) != len(children) or any(a is not b for a, b in zip(now.values(), children)):
            return False
        now = module_parameters(m)
        if len(now) != n_params or any(now.get(a) is not p for a, p in params):
            return False
    return True


class Transformed:
    """A module as a pair of pure functions: `init(*args)` -> state, `apply(params, state, *args)`.

    Made by `fp8fn.transform`; see there. `layers` lists the layers that run in fp8 (the
    experts weights once `init` has seen them used in a GEMM) and `recipes` their recipes;
    `checkpointed` the submodules recomputed in the backward; `summary()` what runs in float8
    and what does not.
    """

    def __init__(self, module, recipe, filter_fn=None, checkpoint_fn=None):
        if not isinstance(module, nn.Module):
            raise TypeError(
                "fp8fn.transform: expected `module` to be an nn.Module, "
                f"got {type(module).__name__}."
            )
        if isinstance(recipe, type) and issubclass(recipe, RECIPES):
            raise TypeError(
                f"fp8fn.transform: expected `recipe` to be a recipe instance, got the class "
                f"{recipe.__name__}. Pass an instance: fp8fn.{recipe.__name__}()."
            )
        if not (isinstance(recipe, RECIPES) or callable(recipe)):
            raise TypeError(
                "fp8fn.transform: expected `recipe` to be an fp8fn recipe (e.g. "
                "fp8fn.DelayedScaling()) or a function (name, module) -> recipe or None, "
                f"got {type(recipe).__name__}."
            )
        if not isinstance(recipe, RECIPES):
            check_function("transform", "recipe", recipe, _CHOICE, "recipe or None")
        for arg, f in (("filter_fn", filter_fn), ("checkpoint_fn", checkpoint_fn)):
            if f is not None:
                check_function("transform", arg, f, _CHOICE, "bool")
        refuse_ddp_inner_module(module)
        self.module = module
        self._choices = (recipe, filter_fn, checkpoint_fn)
        self._confirmed = set()  # the experts weights `init` saw in a GEMM
        self._torch_grouped = set()  # those among them `init` saw in torch._grouped_mm
        self._weights = None  # {weight name: None (float8) or the op}, from `init`
        self._reported = False  # the high-precision GEMMs were reported (once)
        self._read_module()

    def _read_module(self):
        """Read what `apply` needs from the module: its layers and their recipes, its slots and
        ties, the submodules `checkpoint_fn` chooses, FSDP2's. Done by `transform`, and again
        by `apply` when the module's structure changed since (`_structure`: a submodule
        replaced, a parameter reassigned or tied), so that a transform made before such a
        change runs as one made after it."""
        module, (recipe, filter_fn, checkpoint_fn) = self.module, self._choices
        self._ddp_param = ddp_parameter(module)  # (name, parameter) of a DDP model, else None
        self._experts = find_experts(module, self._chosen)
        self._expert_parallel = expert_parallel_in(self._experts)  # (fp8fn.expert_parallel)
        self._grouped_ops = grouped_ops()  # the grouped GEMM ops (transformers' custom one)
        # routers and gates next to the experts: high precision, unless a recipe function
        # chooses for them
        self._gates = find_gates(module, self._experts) if isinstance(recipe, RECIPES) else set()
        self._layers = find_layers(
            module, recipe, filter_fn, warn=not self._experts, gates=self._gates
        )
        self.recipes = {layer.path: layer.recipe for layer in self._layers}
        self.recipes.update({e.path: e.recipe for e in self._experts if e.path in self._confirmed})
        self.layers = list(self.recipes)
        self._delayed = self._delayed_recipe()
        self._stateful = [m.path for m in self._layers if isinstance(m.recipe, DelayedScaling)]
        self._stateful_experts = {  # `path[e]` of the delayed experts weights
            e.expert(i): e
            for e in self._experts
            if isinstance(e.recipe, DelayedScaling)
            for i in range(e.experts)
        }
        self._fsdp = Fsdp2(module, self._layers, self._experts)  # slots, float8 all-gathers
        own = [m.slot for m in self._layers if m.slot not in self._fsdp.managed]
        self._slots = Slots(module, own)
        self._refuse_fsdp_ties()
        self._held = {}  # {id(weight): (weakref, layer)}: weights swapped into layers (FSDP2)
        self.checkpointed = self._checkpoint_modules(checkpoint_fn)
        self._checkpointed_ids = {id(module.get_submodule(p)): p for p in self.checkpointed}
        self._checkpointed_modules = [module.get_submodule(p) for p in self.checkpointed]
        self._block_slots = {
            id(m): Slots(m, [n[len(p) + 1 :] if p else n for n in own if _inside(n, p)])
            for p, m in zip(self.checkpointed, self._checkpointed_modules)
        }
        self._known_sites = None  # the `state.sites` last checked by `apply`
        managed = {(id(m), attr) for m, attr, _ in self._fsdp.managed.values()}
        self._structure = _structure(module, managed)

    def _reread_if_changed(self):
        """`_read_module` again when the module's structure changed since it last ran."""
        _reread_if_changed(self)

    def _refuse_fsdp_ties(self):
        """Raise when layers sharing one FSDP2-managed weight get different choices (one left
        in high precision, or another recipe): FSDP2 swaps the one unsharded weight into each,
        so fp8fn cannot give each layer its own view of it, and would run them all as one."""
        choice = {m.slot: m.recipe for m in self._layers}
        for first, names in self._slots.others.items():
            group = [n for n in (first, *names) if is_linear_weight(self.module, n)]
            if len(group) < 2 or not any(n in self._fsdp.managed for n in group):
                continue
            if len({repr(choice.get(n)) for n in group}) > 1:
                chosen = ", ".join(f"{n!r}: {choice.get(n)}" for n in group)
                raise ValueError(
                    "fp8fn.transform: expected the layers sharing one FSDP2-managed weight to "
                    f"have one recipe, got {chosen}. Under FSDP2 they run as one layer: give "
                    "them the same choice in `filter_fn` and the recipe function, or untie the "
                    "weights."
                )

    def _chosen(self, name, owner):
        """The recipe `filter_fn` and the recipe (function) give the weight `name` of `owner`
        (for a linear layer: its path and itself), or None for high precision."""
        recipe, filter_fn, _ = self._choices
        if filter_fn is not None and not filter_fn(name, owner):
            return None
        return recipe_for(recipe, name, owner)

    def summary(self) -> str:
        """What runs in float8 and what does not, as a table of the model's matmul weights
        (every weight of 2 or more dims a GEMM used during `init`, and every layer chosen),
        each with its share of their elements. Made by `init`.

        Raises:
          RuntimeError: before `init`.
        """
        if self._weights is None:
            raise RuntimeError(
                "fp8fn.Transformed.summary: expected `fn.init(...)` first, got none: init runs "
                "the model once and sees which weights reach a GEMM."
            )
        return summarize(self, self._weights)

    def _delayed_recipe(self) -> DelayedScaling | None:
        """The one DelayedScaling config of the stateful layers (they share one packed state)."""
        delayed = {r for r in self.recipes.values() if isinstance(r, DelayedScaling)}
        delayed |= {e.recipe for e in self._experts if isinstance(e.recipe, DelayedScaling)}
        configs = {(r.history_len, r.amax_compute, r.margin) for r in delayed}
        if len(configs) > 1:
            raise ValueError(
                "fp8fn.transform: all DelayedScaling layers of one model share one packed state, "
                "so they need the same history_len, amax_compute and margin; got "
                f"{sorted(configs)}."
            )
        return min(delayed, key=repr) if delayed else None

    def _checkpoint_modules(self, checkpoint_fn) -> list[str]:
        """The submodules `checkpoint_fn` chooses (the outermost choice wins)."""
        chosen = []
        if checkpoint_fn is None:
            return chosen
        for name, sub in self.module.named_modules():
            if checkpoint_fn(name, sub) and not any(
                p == "" or name.startswith(p + ".") for p in chosen
            ):
                chosen.append(name)
        return chosen

    def _holder_of(self, weight, transposed):
        """The layer that holds `weight` now, though `apply` was not given it: a module that
        swaps in its own tensors for its forward (FSDP2's unsharded weights). None if none."""
        if not isinstance(weight, torch.Tensor):
            return None
        # (compiling: no lookup by `id`, on which dynamo would guard: a recompile per step of
        # new weights; the layers are compared with `is`)
        known = None if torch.compiler.is_compiling() else self._held.get(id(weight))
        if known is not None and known[0]() is weight and known[1].holds(weight):
            layer = known[1]
        else:
            layer = next((m for m in self._layers if m.holds(weight)), None)
            if layer is None:
                return None
            if not torch.compiler.is_compiling():
                self._held[id(weight)] = (weakref.ref(weight), layer)
        return layer if layer.transposed == transposed else None

    def init(self, *args, seed: int = 0, **kwargs) -> State:
        """Find every fp8 call site and return the initial scaling state.

        The model runs once, on the meta device when it can (no real activations are
        computed), else for real without autograd and with the CPU random generator left as it
        was (only the CPU generator is forked: a model that draws random numbers on an
        accelerator while it runs for real advances that device's generator). A
        model with sharded (DTensor) parameters, as under FSDP2, always runs for real (FSDP2
        all-gathers, so every rank calls `init`), and its FSDP2 modules are resharded after.
        Sites are the stateful (DelayedScaling) layers' calls, in the order of the module tree
        (`fn.layers`), each layer's calls in turn: `path`, then `path#k` for its k-th further
        call. A layer the example did not call (a branch not taken) has its `path` site too.
        After them, each experts weight (a 3-D weight the example used in a GEMM) of E experts
        has E sites per call, `path[0]` ... `path[E-1]`, then `path[0]#1` ...; the example also
        tells which weights' GEMMs run in float8 (`summary()`), and those that stay in high
        precision without `filter_fn` or a recipe of None choosing so are warned about once. So
        the order depends on the model, not on the example batch: ranks that run `init` on
        different batches agree (`fp8fn.all_reduce` pairs sites by position).

        Args:
          *args, **kwargs: example inputs of the module.
          seed: (keyword only) the seed of the random key (`state.key`) of models with
            `NVFP4Scaling` layers: their stochastic rounding and Hadamard signs. The same seed
            gives the same key, so every rank and a fresh `init` draw the same bits.

        Returns:
          An `fp8fn.State` on the device of the first stateful (or NVFP4) layer's weight; it
          has no sites when no layer uses DelayedScaling, and a key (float64 `()`) when some
          layer uses NVFP4Scaling (else `state.key` is None).
        """
        seed_key(seed)  # checks the seed before the model runs
        self._reread_if_changed()
        call = self._discover(args, kwargs)
        calls = {}
        for name in call.sites:
            path, k = parse_site(name)
            calls[path] = max(calls.get(path, 0), k + 1)
        self._weights = call.weights
        confirmed = {e.path for e in self._experts if call.weights.get(e.path, "") is None}
        self._torch_grouped |= call.torch_grouped
        if not confirmed <= self._confirmed:
            self._confirmed |= confirmed
            self._read_module()
        self._fsdp.refuse_unused(self._confirmed)
        if not self._reported:
            self._reported = report_high_precision(self, call.weights)
        recipe = self._delayed or DelayedScaling(history_len=1)
        names = [site_name(p, k) for p in self._stateful for k in range(max(calls.get(p, 0), 1))]
        experts = [
            e
            for e in self._experts
            if isinstance(e.recipe, DelayedScaling) and e.path in self._confirmed
        ]
        for entry in experts:  # each call: one row per expert, contiguous
            paths = [entry.expert(e) for e in range(entry.experts)]
            calls_made = max(1, *(calls.get(p, 0) for p in paths))
            names += [site_name(p, k) for k in range(calls_made) for p in paths]
        stateful = set(self._stateful)
        first = next((m for m in self._layers if m.path in stateful), None)
        nvfp4 = [m for m in self._layers if isinstance(m.recipe, NVFP4Scaling)]
        nvfp4_experts = [
            e
            for e in self._experts
            if isinstance(e.recipe, NVFP4Scaling) and e.path in self._confirmed
        ]
        first = first or next(iter(nvfp4), None)
        device = None if first is None else first.own({})[0].device
        if first is None and (experts or nvfp4_experts):
            device = (experts or nvfp4_experts)[0].own({}).device
        state = init_state(recipe, names, device)
        return state._replace(key=initial_key(seed, device)) if nvfp4 or nvfp4_experts else state

    def _discover(self, args, kwargs) -> Call:
        """The `Call` of one forward pass on the example inputs (its `sites`, in call order,
        and its `weights`)."""
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        memo = {}

        def to_meta(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) not in memo:  # tied tensors stay tied
                memo[id(t)] = torch.empty_like(t, device="meta")
            return memo[id(t)]

        with torch.random.fork_rng(devices=[]):  # discovery must not consume the RNG
            # Sharded (DTensor) parameters: FSDP2's lazy init would adopt meta tensors as its
            # shards, so such a model runs for real (FSDP2 all-gathers: every rank calls init).
            if not any(sharded_operands(t) for t in tensors.values()):
                try:
                    meta = {k: to_meta(v) for k, v in tensors.items()}
                    return self._run_discovery(meta, tree_map(to_meta, (args, kwargs)))
                except Exception:  # data-dependent control flow, or an op without a meta kernel
                    pass
            try:
                call = self._run_discovery({}, (args, kwargs))
            except Exception as e:
                if str(e).startswith("fp8fn."):  # fp8fn refuses a call of the model's
                    raise
                raise init_error(e) from e
        if any(p is not tensors[n] for n, p in self.module.named_parameters()):
            reshard_fsdp(self.module)  # FSDP2 keeps the root unsharded after a forward
        return call

    def _run_discovery(self, tensors, args_kwargs) -> Call:
        args, kwargs = args_kwargs
        tensors = self._slots.expand(tensors, "init")
        call = Call(self, tensors, None)
        with torch.no_grad(), self._fsdp.scales(None), exclusive(self.module), call:
            swapped_call(self.module, None, tensors, args, kwargs)
        return call

    def apply(self, params: dict, state: State, *args, **kwargs):
        """Run the module with `params`, in fp8 with the scales in `state`.

        Not pure in memory (docs/semantics.md, "What fp8fn touches outside the state"): it
        writes caches on this `Transformed` (the state's sites last checked, the layer holding
        each weight a module swapped in itself, the module re-read when its structure changed);
        it marks `state.amax_history` as used when gradients are recorded for it (a second use
        is refused); an FSDP2 float8 weight keeps the scale of its forward all-gather; and
        during the call the `checkpoint_fn` submodules have an instance `forward` (removed when
        the call ends).

        The module runs as it is now: its buffers, dtype, device, training flags and hooks.

        Sharded parameters (DTensors; `_parallel/dtensor.py`): functional FSDP gives `params`
        as `distribute_tensor(p, mesh, [Shard(0)])` for a plain module (torch.func or plain
        autograd; float8 weights are all-gathered in float8, the others in high precision;
        gradients come back sharded, averaged over the ranks); a tensor-parallel module
        (`parallelize_module`, optionally inside FSDP2) takes `dict(model.named_parameters())`
        under plain autograd. Every rank must hold the same `state` (`fp8fn.all_reduce`).

        Args:
          params: `{name: tensor}` keyed like `module.named_parameters()`; it may also give
            buffers (keyed like `module.named_buffers()`). A name it leaves out is the module's
            own tensor, as in `torch.func.functional_call` (e.g. a frozen base model). Whether
            they are DTensors is read from the first entry. Under FSDP2 (`fully_shard`), the
            parameters it manages must be the module's own (`dict(model.named_parameters())`):
            FSDP2's hooks gather and reshard them.
          state: the `fp8fn.State` from `init` (or `update`).
          *args, **kwargs: the module's inputs.

        Returns:
          The module's output. The gradient with respect to `state` is the observation for
          `fp8fn.update`.

        Raises:
          RuntimeError: when `state` already took part in another `apply` of the gradient being
            recorded: autograd would sum the two calls' observations, fp8fn combines by max.
        """
        self._reread_if_changed()  # a layer replaced, weights tied, fully_shard: since transform
        self._check(params, state)
        try:
            claim(state.amax_history, "apply", "state")
        except RuntimeError:
            # torch.utils.checkpoint around apply: its recompute reruns the forward whose
            # observations are recorded (bit for bit), and observes nothing a second time.
            if not recomputing_in_torch_checkpoint():
                raise
        params = self._fsdp.without_params(params)
        tensors, kept = params, contextlib.nullcontext()
        if params and sharded_operands(next(iter(params.values()))):  # the first tells
            tensors, kept = gather_params(self, params, state)
        tensors = self._slots.expand(tensors)
        call = Call(self, tensors, state)
        if self._checkpointed_modules:
            refuse_compile()  # before the `with`: dynamo then runs this frame eagerly
        if self._expert_parallel:
            refuse_expert_parallel_compile()

        with (
            translated_errors(self.module, params),
            self._fsdp.scales(state),
            exclusive(self.module),
            innermost_function_mode(call),
            recomputing(call, self._checkpointed_modules),
            kept,
        ):
            out = swapped_call(self.module, None, tensors, args, kwargs)
            if self._torch_grouped:
                self._refuse_unrouted_grouped_mm(call)
            return out

    def _refuse_unrouted_grouped_mm(self, call):
        """Raise when this forward used an experts weight that `init` saw in `torch._grouped_mm`
        (or `F.grouped_mm`) but no GEMM of it reached fp8fn: under torch.compile, dynamo (torch
        2.13) does not hand that call to a `TorchFunctionMode`, so it ran in high precision.
        (transformers' grouped_mm experts, compiled, call their own custom op, which dynamo
        hands over.) Under fullgraph the user sees this error at trace time; without it, when
        the frame runs."""
        watched = call.touched & self._torch_grouped & self._confirmed
        names = sorted(
            e.path
            for e in self._experts
            if e.path in watched and not any(call.counts.get(e.expert(i)) for i in range(e.experts))
        )
        if names:
            message = (
                f"fp8fn.apply: expected the GEMMs of experts weights {names} routed to fp8fn, "
                "as in fn.init, got none: under torch.compile, dynamo does not hand "
                "torch._grouped_mm (F.grouped_mm) to fp8fn, so they ran in high precision. "
                "Call the experts as torch.bmm or a loop of F.linear(x, weight[e]), or run "
                "apply uncompiled."
            )
            if torch.compiler.is_compiling():
                refuse_fullgraph_trace(message)
            raise RuntimeError(message)

    def _check(self, params, state):
        if not isinstance(params, dict):
            raise TypeError(
                f"fp8fn.apply: expected `params` to be a dict of tensors keyed like "
                f"module.named_parameters(), got {type(params).__name__}."
            )
        if not params.keys() <= self._slots.first.keys():
            raise ValueError(
                "fp8fn.apply: `params` must be keyed like module.named_parameters() (or "
                f"named_buffers()); unexpected {sorted(params.keys() - self._slots.first.keys())}. "
                "Key them as the model is now (apply re-reads parameters and submodules "
                "changed after fp8fn.transform; a buffer registered after it needs a new "
                "fp8fn.transform)."
            )
        check_state("apply", state)
        check_scales("apply", state.scale)
        warn_if_superseded("apply", state)
        warn_if_never_updated("apply", state, params)
        refuse_untrained_backward(params, functools.partial(held, self.module), state)
        if self._ddp_param is not None and torch.is_grad_enabled():
            name, own = self._ddp_param
            if params.get(name, own) is not own:
                raise ValueError(
                    "fp8fn.apply: a DistributedDataParallel model averages gradients only in "
                    "loss.backward() into its own parameters, and these are other tensors "
                    "(torch.func.grad, fp8fn.value_and_grad): gradients would silently differ "
                    "across ranks. Use plain autograd with `dict(ddp.named_parameters())` "
                    "(fp8fn.observe, loss.backward()), or transform the model without DDP and "
                    "all-reduce the gradients yourself."
                )
        if state.key is None and any(isinstance(r, NVFP4Scaling) for r in self.recipes.values()):
            raise ValueError(
                "fp8fn.apply: expected `state` with a random key (`state.key`) for the model's "
                "NVFP4Scaling layers, got a state without one. Make it with fn.init(..., seed=...) "
                "of this transform."
            )
        recipe = self._delayed
        if recipe is not None and (
            state.history_len != recipe.history_len
            or (state.amax_compute, state.margin) != (recipe.amax_compute, recipe.margin)
        ):
            raise ValueError(
                f"fp8fn.apply: `state` was made for another recipe: {state!r} with history_len "
                f"{state.history_len}, but the model's layers use {recipe}. Make it with fn.init."
            )
        if state.sites is not self._known_sites:
            missing = [p for p in self._stateful if site_name(p, 0) not in state] + [
                e.expert(0)
                for e in self._experts
                if e.path in self._confirmed
                and isinstance(e.recipe, DelayedScaling)
                and e.expert(0) not in state
            ]
            stateful = set(self._stateful)
            known = stateful | self._stateful_experts.keys()
            extra = [n for n in state.sites if parse_site(n)[0] not in known]
            if missing or extra:
                raise ValueError(
                    "fp8fn.apply: `state` does not belong to this model: "
                    f"missing sites {missing}, unknown sites {extra}. Make it with fn.init."
                )
            if not torch.compiler.is_compiling():  # no attribute write for dynamo to guard on
                self._known_sites = state.sites


def transform(module, recipe, filter_fn=None, checkpoint_fn=None) -> Transformed:
    """Turn `module` into pure `init` / `apply` functions that run its linear layers in fp8.

    `apply` runs the module as it is at each call (buffers, dtype, device, training flags and
    hooks included), with the given parameters swapped in and its chosen layers' linear calls
    routed to fp8fn for that call only. The module is modified during a call only: the
    submodules chosen by `checkpoint_fn` get an instance `forward` (the recompute), removed
    (or the user's own restored) when the call ends.

    Args:
      module: any nn.Module.
      recipe: an fp8fn recipe for every layer (e.g. `fp8fn.DelayedScaling()`), or a function
        `(name, layer) -> recipe | None` choosing one per layer (None: high precision). The
        DelayedScaling layers share one packed state, so they need one static config.
      filter_fn: `(name, submodule) -> bool`, choosing the linear layers (`nn.Linear` and its
        subclasses that keep its forward, HF `Conv1D`) that run in fp8; default: all. It (and
        a recipe function) is also asked about each 3-D parameter, with the parameter's name
        and the module holding it: an experts weight (`(E, N, K)`, transformers'
        `...experts.gate_up_proj`) whose GEMMs run per expert in fp8 once `init` sees one
        (docs/moe.md), with any recipe (per expert or per group).
      checkpoint_fn: `(name, submodule) -> bool`, choosing submodules whose forward is
        recomputed in the backward (outermost choice wins), under torch.func and plain
        autograd alike; default: none.

    Returns:
      A `Transformed` with `init(*args, **kwargs) -> state` and
      `apply(params, state, *args, **kwargs) -> output`.

    Example:
      >>> import torch, fp8fn
      >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
      ...                             torch.nn.Linear(64, 8))
      >>> fn = fp8fn.transform(model, fp8fn.DelayedScaling())
      >>> x = torch.randn(16, 32)
      >>> state = fn.init(x)
      >>> list(state)
      ['0', '2']
      >>> params = dict(model.named_parameters())
      >>> loss = lambda p, s, x: fn.apply(p, s, x).square().mean()
      >>> grads, obs = torch.func.grad(loss, argnums=(0, 1))(params, state, x)
      >>> state = fp8fn.update(state, obs)
      >>> bool(state["0"].input.amax_history[0] == x.abs().max())
      True
    """
    return Transformed(module, recipe, filter_fn, checkpoint_fn)
