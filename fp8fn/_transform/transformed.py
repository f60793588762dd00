"""`transform`: an nn.Module as a pure `(init, apply)` pair with explicit scaling state.

The facade over a frozen `Plan` (`plan.py`: what `transform` reads from the module, read again
into a new plan when the module's structure changed). `apply` checks its arguments
(`arguments.py`), enters in one `with` the context managers a call needs (torch's errors
translated, `_torch_errors.py`; FSDP2's float8 weight scales, `fsdp.py`; the module's lock,
`swap.py`; the routing `Call`, `routing.py`, which sends the chosen layers' linear calls to
`fp8fn.linear`; the `checkpoint_fn` recompute, `recompute.py`), then calls the user's module
under `torch.func.functional_call` with the given parameters.
"""

from __future__ import annotations

import contextlib

import torch

from .._core.keys import seed_key
from .._core.state import State
from .._parallel.dtensor import gather_params, sharded_operands
from .._parallel.wrappers import refuse_ddp_inner_module
from .._torch_errors import translated_errors
from .._torch_private import constant_under_compile, innermost_function_mode
from .arguments import check_apply, check_sites, check_transform, claim_for_apply
from .checkpoint import refuse_compile
from .coverage import report_high_precision, summarize
from .discovery import discover
from .expert_parallel import refuse_compile as refuse_expert_parallel_compile
from .plan import initial_state, read_module
from .recompute import recomputing
from .refusals import refuse_compiled_torch_checkpoint, refuse_unrouted_grouped_mm
from .routing import Call, site_index
from .swap import exclusive, swapped_call


@constant_under_compile
def _reread_if_changed(transformed) -> bool:
    """`transformed`'s plan read again when it is no longer current (`Plan.current`).

    Run as it is, in eager; while torch.compile traces `apply`, run at trace time only (its
    result a constant): a change that makes dynamo trace again (it guards on the submodules
    and parameters a forward reads) is re-read then.
    """
    if not transformed.plan.current():
        with exclusive(transformed.module):
            if not transformed.plan.current():
                transformed._read(transformed.plan.confirmed)
    return True


class Transformed:
    """A module as a pair of pure functions: `init(*args)` -> state, `apply(params, state, *args)`.

    Made by `fp8fn.transform`; see there. `layers` lists the layers that run in fp8 (the
    experts weights once `init` has seen them used in a GEMM) and `recipes` their recipes;
    `checkpointed` the submodules recomputed in the backward; `summary()` what runs in float8
    and what does not.
    """

    def __init__(self, module, recipe, filter_fn=None, checkpoint_fn=None):
        check_transform(module, recipe, filter_fn, checkpoint_fn)
        refuse_ddp_inner_module(module)
        self.module = module
        self._choices = (recipe, filter_fn, checkpoint_fn)
        self._torch_grouped = frozenset()  # the experts weights `init` saw in torch._grouped_mm
        self._weights = None  # {weight name: None (float8) or the op}, from `init`
        self._reported = False  # the high-precision GEMMs were reported (once)
        self._torch_checkpointed = False  # `init` saw a float8 GEMM in torch.utils.checkpoint
        self._read(frozenset())

    def _read(self, confirmed: frozenset):
        """Read the module into a new `plan` (`read_module`), with the experts weights
        `confirmed` by `init`; the caches of the old plan go with it."""
        self.plan = plan = read_module(self.module, *self._choices, confirmed)
        # `fn.layers`, `fn.recipes`, `fn.checkpointed`: copies (the plan's own never change)
        self.layers, self.recipes = list(plan.recipes), dict(plan.recipes)
        self.checkpointed = list(plan.checkpointed)
        self._held = {}  # {id(weight): (weakref, layer)}: weights swapped into layers (FSDP2)
        self._known = None  # (the `state.sites` last checked by `apply`, their `site_index`)

    def _current_plan(self):
        """`plan`, read again first when the module's structure changed since it was read (a
        layer replaced, weights tied, fully_shard: since transform)."""
        _reread_if_changed(self)
        return self.plan

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
        return summarize(self.plan, self._weights)

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
        call = discover(self._current_plan(), args, kwargs, self._held)
        self._weights = call.tracked.weights
        plan = self.plan
        confirmed = {e.path for e in plan.experts if self._weights.get(e.path, "") is None}
        self._torch_grouped |= call.torch_grouped
        self._torch_checkpointed = call.torch_checkpointed
        if not confirmed <= plan.confirmed:
            self._read(plan.confirmed | confirmed)
        self.plan.fsdp.refuse_unused(self.plan.confirmed)
        if not self._reported:
            self._reported = report_high_precision(self.plan, self._weights)
        return initial_state(self.plan, call.sites, seed)

    def apply(self, params: dict, state: State, *args, **kwargs):
        """Run the module with `params`, in fp8 with the scales in `state`.

        Not pure in memory (docs/semantics.md, "What fp8fn touches outside the state"): it
        writes caches on this `Transformed` (the state's sites last checked, the layer holding
        each weight a module swapped in itself, the plan re-read when the module's structure
        changed); it marks `state.amax_history` as used when gradients are recorded for it (a
        second use is refused); an FSDP2 float8 weight keeps the scale of its forward
        all-gather; during the call the `checkpoint_fn` submodules have an instance `forward`.

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
        check_apply(self._current_plan(), params, state)
        tensors, call, kept = self._prepare(params, state)
        with (
            translated_errors(self.module, params),
            self.plan.fsdp.scales(state),
            exclusive(self.module),
            innermost_function_mode(call),
            call.tracked.marking(),
            recomputing(call, self.plan.checkpointed_modules),
            kept,
        ):
            out = swapped_call(self.module, None, tensors, args, kwargs)
            if self._torch_grouped:
                refuse_unrouted_grouped_mm(self.plan, call, self._torch_grouped)
            return out

    def _prepare(self, params: dict, state: State):
        """What `apply` makes before its `with`, once `check_apply` passed: `(tensors, call,
        kept)`, the tensors to swap in, the routing `Call`, and the context manager of the
        gathered buffers (`gather_params`). Raises what `apply` raises for `state`'s sites and
        for a state already used in the gradient being recorded."""
        plan, known = self.plan, self._known
        if known is None or state.sites is not known[0]:
            check_sites(plan, state)
            known = (state.sites, site_index(plan, state.sites))
            if not torch.compiler.is_compiling():  # no attribute write for dynamo to guard on
                self._known = known
        claim_for_apply(state)
        params = plan.fsdp.without_params(params)
        tensors, kept = params, contextlib.nullcontext()
        if params and sharded_operands(next(iter(params.values()))):  # the first tells
            tensors, kept = gather_params(plan, params, state)
        tensors = plan.slots.expand(tensors)
        call = Call(plan, tensors, state, self._held, type(self).apply.__code__, index=known[1])
        if self._torch_checkpointed:
            refuse_compiled_torch_checkpoint(plan.module)
        if plan.checkpointed_modules:
            refuse_compile()  # before the `with`: dynamo then runs this frame eagerly
        if plan.expert_parallel:
            refuse_expert_parallel_compile()
        return tensors, call, kept


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
