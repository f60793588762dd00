"""The plan: what `fp8fn.transform` reads from the module, as one frozen value.

`read_module(module, recipe, filter_fn, checkpoint_fn)` reads the module's layers and their
recipes, its parameter slots and ties, its experts weights and the routers and gates next to
them, the submodules `checkpoint_fn` chooses and the slots FSDP2 manages, into a `Plan`. A
`Transformed` holds one, and reads the module again into a new `Plan` when its structure changed
(`Plan.current`) or `fn.init` confirmed experts weights (`confirmed`); nothing changes a `Plan`.
The per-forward router (`routing.Call`) reads only the plan and its call's arguments.
"""

from __future__ import annotations

import dataclasses
import types
import weakref

import torch
from torch import nn

from .._core.experts import find_experts, find_gates
from .._core.keys import initial_key
from .._core.recipes import RECIPES, DelayedScaling, NVFP4Scaling
from .._core.state import State, init_state, parse_site, site_name
from .._parallel.wrappers import ddp_parameter, is_fsdp_module
from .._torch_private import module_children, module_parameters
from .expert_parallel import expert_parallel_in
from .experts import grouped_ops
from .fsdp import Fsdp2
from .layers import find_layers, is_linear_weight, recipe_for
from .swap import Slots


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What a `Transformed` knows of its module, read by `read_module`; never changed."""

    module: nn.Module = dataclasses.field(repr=False)  # the user's module, run live
    choices: tuple  # (recipe or recipe function, filter_fn, checkpoint_fn), as given
    confirmed: frozenset  # the experts weights' paths `fn.init` saw in a GEMM
    layers: tuple  # the `layers._Layer`s that run in float8, in module order
    experts: tuple  # the `Experts` candidates (3-D weights given a recipe)
    gates: frozenset  # the routers' and gates' paths next to the experts (high precision)
    recipes: types.MappingProxyType  # {path: recipe}: the layers', then the confirmed experts'
    delayed: DelayedScaling | None  # the one DelayedScaling config of the stateful sites
    stateful: tuple  # the paths of the DelayedScaling layers
    known_paths: frozenset  # those and the delayed experts' `path[e]`: a state's site paths
    needs_key: bool  # whether a recipe is NVFP4Scaling (the state carries a random key)
    ddp_param: tuple | None  # (name, parameter) of a DistributedDataParallel model, else None
    expert_parallel: bool  # whether an experts module runs under fp8fn.expert_parallel
    grouped_ops: tuple  # the grouped GEMM ops (`experts.grouped_ops()`)
    fsdp: Fsdp2  # FSDP2's managed slots and float8 all-gathers
    slots: Slots  # the module's slots and ties
    checkpointed: tuple  # the paths `checkpoint_fn` chose (the outermost wins)
    checkpointed_modules: tuple  # those submodules
    checkpointed_ids: types.MappingProxyType  # {id(submodule): its path}
    block_slots: types.MappingProxyType  # {id(submodule): its `Slots`}
    structure: tuple  # what the plan was read from (`_structure`), for `unchanged`

    def chosen(self, name, owner):
        """The recipe `filter_fn` and the recipe (function) give the weight `name` of `owner`
        (for a linear layer: its path and itself), or None for high precision."""
        return _chosen(self.choices, name, owner)

    def current(self) -> bool:
        """Whether the plan is the module's: `unchanged`, and not missing FSDP2's slots
        (`fully_shard` applied to the module after `transform`)."""
        return self.unchanged() and (bool(self.fsdp.managed) or not is_fsdp_module(self.module))

    def unchanged(self) -> bool:
        """Whether every submodule still holds the children and parameters the plan was read
        from (compared by identity: a few microseconds per submodule)."""
        for m, children, n_params, params in self.structure:
            now = module_children(m)
            if len(now) != len(children) or any(a is not b for a, b in zip(now.values(), children)):
                return False
            now = module_parameters(m)
            if len(now) != n_params or any(now.get(a) is not p for a, p in params):
                return False
        return True

    def holder_of(self, weight, transposed: bool, memo: dict):
        """The layer that holds `weight` now, though the call was not given it: a module
        that swaps in its own tensors for its forward (FSDP2's unsharded weights); None if none, or
        if that layer is not called `transposed` (HF Conv1D). `memo` (`{id(weight): (weakref,
        layer)}`, kept by the `Transformed` with its plan) remembers the answers."""
        if not isinstance(weight, torch.Tensor):
            return None
        # (compiling: no lookup by `id`, on which dynamo would guard: a recompile per step of
        # new weights; the layers are compared with `is`)
        known = None if torch.compiler.is_compiling() else memo.get(id(weight))
        if known is not None and known[0]() is weight and known[1].holds(weight):
            layer = known[1]
        else:
            layer = next((m for m in self.layers if m.holds(weight)), None)
            if layer is None:
                return None
            if not torch.compiler.is_compiling():
                memo[id(weight)] = (weakref.ref(weight), layer)
        return layer if layer.transposed == transposed else None


def _chosen(choices, name, owner):
    recipe, filter_fn, _ = choices
    if filter_fn is not None and not filter_fn(name, owner):
        return None
    return recipe_for(recipe, name, owner)


def read_module(module, recipe, filter_fn, checkpoint_fn, confirmed=frozenset()) -> Plan:
    """Read the `Plan` of `module` under these choices (`fp8fn.transform`'s arguments), with
    the experts weights `confirmed` (their paths) seen in a GEMM by `fn.init`.

    It reads the module and changes nothing in it, but for FSDP2's modules, resharded first
    (every shard in place, `Fsdp2`); it calls `filter_fn`, the recipe function and
    `checkpoint_fn`, and warns when no layer runs in float8 (`find_layers`).

    Raises what `fp8fn.transform` raises for the module's layers and recipes (a recipe function
    returning another type, two DelayedScaling configs, FSDP2-tied layers with two choices, a
    float8 all-gather of a layer that does not run in float8)."""
    choices = (recipe, filter_fn, checkpoint_fn)
    ddp_param = ddp_parameter(module)
    experts = tuple(find_experts(module, lambda name, owner: _chosen(choices, name, owner)))
    # routers and gates next to the experts: high precision, unless a recipe function chooses
    expert_parallel = expert_parallel_in(experts)
    gates = frozenset(find_gates(module, experts) if isinstance(recipe, RECIPES) else ())
    layers = tuple(find_layers(module, recipe, filter_fn, warn=not experts, gates=gates))
    recipes = {layer.path: layer.recipe for layer in layers}
    recipes.update({e.path: e.recipe for e in experts if e.path in confirmed})
    delayed = _delayed_recipe(recipes, experts)
    stateful = tuple(m.path for m in layers if isinstance(m.recipe, DelayedScaling))
    delayed_experts = [e for e in experts if isinstance(e.recipe, DelayedScaling)]
    fsdp = Fsdp2(module, layers, experts)
    own = [m.slot for m in layers if m.slot not in fsdp.managed]
    slots = Slots(module, own)
    _refuse_fsdp_ties(module, layers, slots, fsdp)
    checkpointed = _checkpoint_modules(module, checkpoint_fn)
    modules = tuple(module.get_submodule(p) for p in checkpointed)
    managed = {(id(m), attr) for m, attr, _ in fsdp.managed.values()}
    return Plan(
        module=module,
        choices=choices,
        confirmed=frozenset(confirmed),
        layers=layers,
        experts=experts,
        gates=gates,
        recipes=types.MappingProxyType(recipes),
        delayed=delayed,
        stateful=stateful,
        known_paths=frozenset(stateful)
        | {e.expert(i) for e in delayed_experts for i in range(e.experts)},
        needs_key=any(isinstance(r, NVFP4Scaling) for r in recipes.values()),
        ddp_param=ddp_param,
        expert_parallel=expert_parallel,
        grouped_ops=grouped_ops(),  # (transformers' custom op appears when it loads)
        fsdp=fsdp,
        slots=slots,
        checkpointed=tuple(checkpointed),
        checkpointed_modules=modules,
        checkpointed_ids=types.MappingProxyType({id(m): p for p, m in zip(checkpointed, modules)}),
        block_slots=types.MappingProxyType(
            {
                id(m): Slots(m, [n[len(p) + 1 :] if p else n for n in own if _inside(n, p)])
                for p, m in zip(checkpointed, modules)
            }
        ),
        structure=_structure(module, managed),
    )


def _inside(name: str, path: str) -> bool:
    """Whether the tensor `name` belongs to the submodule at `path` ("" is the root)."""
    return not path or name.startswith(path + ".")


def _structure(module, managed) -> tuple:
    """`((submodule, its children, its number of parameters, its parameters' (name, tensor)),)`
    by identity, less the slots FSDP2 manages (`managed`: `{(id(submodule), name)}`; FSDP2 swaps
    them at each forward): what `read_module` read the module's layers, ties and slots from."""
    return tuple(
        (
            m,
            tuple(module_children(m).values()),
            len(module_parameters(m)),
            tuple((a, p) for a, p in module_parameters(m).items() if (id(m), a) not in managed),
        )
        for m in module.modules()
    )


def _refuse_fsdp_ties(module, layers, slots, fsdp):
    """Raise when layers sharing one FSDP2-managed weight get different choices (one left
    in high precision, or another recipe): FSDP2 swaps the one unsharded weight into each,
    so fp8fn cannot give each layer its own view of it, and would run them all as one."""
    choice = {m.slot: m.recipe for m in layers}
    for first, names in slots.others.items():
        group = [n for n in (first, *names) if is_linear_weight(module, n)]
        if len(group) < 2 or not any(n in fsdp.managed for n in group):
            continue
        if len({repr(choice.get(n)) for n in group}) > 1:
            chosen = ", ".join(f"{n!r}: {choice.get(n)}" for n in group)
            raise ValueError(
                "fp8fn.transform: expected the layers sharing one FSDP2-managed weight to "
                f"have one recipe, got {chosen}. Under FSDP2 they run as one layer: give "
                "them the same choice in `filter_fn` and the recipe function, or untie the "
                "weights."
            )


def _delayed_recipe(recipes, experts) -> DelayedScaling | None:
    """The one DelayedScaling config of the stateful layers (they share one packed state)."""
    delayed = {r for r in recipes.values() if isinstance(r, DelayedScaling)}
    delayed |= {e.recipe for e in experts if isinstance(e.recipe, DelayedScaling)}
    configs = {(r.history_len, r.amax_compute, r.margin) for r in delayed}
    if len(configs) > 1:
        raise ValueError(
            "fp8fn.transform: all DelayedScaling layers of one model share one packed state, "
            "so they need the same history_len, amax_compute and margin; got "
            f"{sorted(configs)}."
        )
    return min(delayed, key=repr) if delayed else None


def _checkpoint_modules(module, checkpoint_fn) -> list[str]:
    """The submodules `checkpoint_fn` chooses (the outermost choice wins)."""
    chosen = []
    if checkpoint_fn is None:
        return chosen
    for name, sub in module.named_modules():
        if checkpoint_fn(name, sub) and not any(
            p == "" or name.startswith(p + ".") for p in chosen
        ):
            chosen.append(name)
    return chosen


def initial_state(plan: Plan, sites: list, seed: int) -> State:
    """The state `fn.init` returns for `plan`, whose example forward called `sites` (names, in
    call order): see `Transformed.init`."""
    calls = {}
    for name in sites:
        path, k = parse_site(name)
        calls[path] = max(calls.get(path, 0), k + 1)
    recipe = plan.delayed or DelayedScaling(history_len=1)
    names = [site_name(p, k) for p in plan.stateful for k in range(max(calls.get(p, 0), 1))]
    confirmed = [e for e in plan.experts if e.path in plan.confirmed]
    experts = [e for e in confirmed if isinstance(e.recipe, DelayedScaling)]
    for entry in experts:  # each call: one row per expert, contiguous
        paths = [entry.expert(e) for e in range(entry.experts)]
        calls_made = max(1, *(calls.get(p, 0) for p in paths))
        names += [site_name(p, k) for k in range(calls_made) for p in paths]
    stateful = set(plan.stateful)
    first = next((m for m in plan.layers if m.path in stateful), None)
    nvfp4 = [m for m in plan.layers if isinstance(m.recipe, NVFP4Scaling)]
    nvfp4_experts = [e for e in confirmed if isinstance(e.recipe, NVFP4Scaling)]
    first = first or next(iter(nvfp4), None)
    device = None if first is None else first.own({})[0].device
    if first is None and (experts or nvfp4_experts):
        device = (experts or nvfp4_experts)[0].own({}).device
    state = init_state(recipe, names, device)
    return state._replace(key=initial_key(seed, device)) if nvfp4 or nvfp4_experts else state
