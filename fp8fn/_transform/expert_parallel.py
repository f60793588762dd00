"""`fp8fn.expert_parallel`: the experts of a model sharded over the ranks of a process group
(expert parallelism), their forward run as dispatch -> this rank's experts -> combine.

What it changes on the model (docs/semantics.md, "What fp8fn touches outside the state"):
each experts weight (and bias) becomes a DTensor `Shard(0)` parameter on the mesh (rank r
holds experts `r * El ... (r+1) * El - 1`; DCP saves and loads them), and the experts module
gets an instance `forward` (`_ExpertParallelForward`). Under `fn.apply` with DelayedScaling
or CurrentScaling for the experts weights, that forward runs the float8 grouped GEMMs fused
with the all-to-alls (`fp8fn/_parallel/expert_gemm.py`: with DelayedScaling the tokens
travel as e4m3 cast by the sender with the destination expert's input scale, the output
gradients as e5m2 with its grad_output scale; with `float8_wire="all"` the GEMM outputs too,
as e4m3 with a scale per row); otherwise (plain use, `fn.init`, a recipe of None) it runs the
module's own forward on the rows each rank received, in high precision.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .._core.checks import no_autocast
from .._core.experts import find_experts
from .._ops.gemm import resolve_backend
from .._parallel.dtensor import local_shard
from .._parallel.expert_exchange import plan_exchange, send_rows
from .._parallel.expert_gemm import dispatch_grouped_mm, grouped_mm_combine
from .._torch_private import (
    as_dtensor,
    experts_gate,
    fsdp_gradient_divisions,
    function_modes,
    module_parameters,
    refuse_fullgraph_trace,
)
from .expert_calls import expert_parallel_rows
from .routing import Call

_NO_COMPILE = (
    "fp8fn.expert_parallel: expected an eager forward of expert-parallel experts, got "
    "torch.compile: the all-to-all's splits are read on the host. Leave fullgraph off (fn.apply "
    "then runs eagerly), or run eagerly."
)
_FORGOTTEN_DIVIDE_FACTOR = (
    "fp8fn.expert_parallel: expected the FSDP2 parameter group holding {path!r}'s weights to "
    "divide their gradients by the whole world (`set_gradient_divide_factor`), got FSDP2's "
    "default, a division by its data-parallel size {dp} alone: each expert's gradient already "
    "sums the tokens of its {ep} expert-parallel ranks (the all-to-all brought them), so it "
    "would come out {ep} times too large. After `fully_shard(experts, mesh=mesh['dp'])` call "
    "`experts.set_gradient_divide_factor(float(dp * ep))` (and "
    "`experts.set_force_sum_reduction_for_comms(True)` on gloo), or set the factor your loss "
    'needs (docs/moe.md, "With data parallelism").'
)
_CONTRACT = (
    "transformers 5.x's experts interface: `forward(hidden_states, top_k_index, "
    "top_k_weights)`, attributes `has_gate`, `has_bias`, `is_transposed`, `act_fn`, weights "
    "`gate_up_proj` (or `up_proj`) and `down_proj`"
)


def _running_call():
    """The `Call` of the `fn.apply` (or `fn.init`) running this forward, or None."""
    return next(
        (m for m in reversed(function_modes()) if isinstance(m, Call) and not m.passive), None
    )


class _ExpertParallelForward:
    """The `forward` of an expert-parallel experts module (an instance attribute).

    `(hidden_states (T, D), top_k_index int64 (T, k), top_k_weights (T, k)) -> (T, D)`: the
    (token, k) rows, sorted by expert (stable), go to their experts' ranks; each rank runs its
    experts on the rows it received; the results come back and are weighted and summed over k
    as transformers' `batched_mm` experts do (`(y * w).view(T, k, D).sum(1)`).
    """

    def __init__(self, module, group, attrs, biases, float8_wire, root, path):
        self.module, self.group, self.attrs, self.biases = module, group, attrs, biases
        self.float8_wire = float8_wire
        self.root, self.path = weakref.ref(root), path
        self.divisions_checked = set()  # the weights' parameter objects (ids) checked

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if torch.compiler.is_compiling():  # (a compiled model call, outside `apply`)
            refuse_fullgraph_trace(_NO_COMPILE)
            raise RuntimeError(_NO_COMPILE)
        self._check_gradient_division()
        m = self.module
        experts = getattr(m, self.attrs[0]).shape[0]
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        x = hidden_states.repeat_interleave(k, dim=0)[order]
        call = _running_call()
        rows = None if call is None else expert_parallel_rows(call, m, self.attrs)
        if rows is None or call.state is None:
            ex = plan_exchange(ids[order], experts, self.group)
            y = self._high_precision(x, ex, top_k_weights.dtype)
        else:
            known, unknown = self._wires(rows, experts)
            ex = plan_exchange(ids[order], experts, self.group, unknown)
            y = self._float8(x, ex, rows, _wires_read(known, ex.flags, experts))
        y = y[torch.argsort(order)]
        out = (y * top_k_weights.reshape(-1, 1)).view(tokens, k, -1).sum(1)
        return out.to(hidden_states.dtype)

    def _check_gradient_division(self) -> None:
        """Raise `_FORGOTTEN_DIVIDE_FACTOR` if an FSDP2 parameter group inside the model holds
        these experts weights over a data-parallel mesh of more than one rank and divides by
        its default (`set_gradient_divide_factor` not called), with more than one expert-
        parallel rank. Checked once per set of parameter objects (`fully_shard` replaces
        them, so a model sharded after a first step is checked again)."""
        key = tuple(id(getattr(self.module, a)) for a in self.attrs + self.biases)
        root, ep = self.root(), self.group.size()
        if key in self.divisions_checked or root is None or ep == 1:
            return
        for factor, dp in fsdp_gradient_divisions(root, self.module, self.attrs + self.biases):
            if factor is None and dp > 1:
                raise ValueError(_FORGOTTEN_DIVIDE_FACTOR.format(path=self.path, dp=dp, ep=ep))
        self.divisions_checked.add(key)

    def _wires(self, rows, experts: int) -> tuple:
        """`(known, unknown)`: for the input role of the first weight and the grad_output role
        of the second, the experts whose rows travel in float8 (E bools), or None where the
        state does not know which histories are filled (`State.filled`); `unknown`: a bool
        tensor of those histories' `newest > 0`, read on the host with the counts, or None."""
        known, unknown = [], []
        for (_, newest, _, filled), role in zip(rows, (0, 2)):
            if not self.float8_wire or newest is None or role == 2 and self.biases:
                known.append((False,) * experts)  # (CurrentScaling; a bias: `_float8`)
            elif filled is not None:
                known.append(filled[role::3])
            else:
                known.append(None)
                unknown.append(newest[:, role] > 0)
        return known, (torch.cat(unknown) if unknown else None)

    def _float8(self, x, ex, rows, wires):
        m = self.module
        weights = [local_shard(getattr(m, a)) for a in self.attrs]
        if m.is_transposed:  # stored (E, K, N): the op takes (E, N, K)
            weights = [w.transpose(-2, -1) for w in weights]
        # biases (E, N), each added to its expert's rows after the GEMM, as transformers does;
        # the second one's gradient sums the output gradients in high precision: with biases
        # those rows stay off the combine backward's float8 wire (`_wires`)
        biases = [local_shard(getattr(m, b)) for b in self.biases] or [None, None]
        (recipe, newest_1, stored_1, _), (_, newest_2, stored_2, _) = rows
        backend = resolve_backend(recipe, x.device)
        margin = getattr(recipe, "margin", 0)
        wire_x, wire_g = wires
        scaled = self.float8_wire == "all"
        device = x.device.type
        if torch.is_autocast_enabled(device):  # as the grouped op: x in the autocast dtype,
            x = x.to(torch.get_autocast_dtype(device))  # the GEMMs not autocast again
        with no_autocast(x):
            h = dispatch_grouped_mm(
                x, weights[0], newest_1, stored_1, ex, margin, backend, wire_x, scaled
            )
            if biases[0] is not None:  # (as transformers' `out.add_(bias[ids])`)
                h = (h + biases[0][ex.ids]).to(h.dtype)
        h = experts_gate(m, h) if m.has_gate else m.act_fn(h)
        with no_autocast(h):
            return grouped_mm_combine(
                h, weights[1], newest_2, stored_2, ex, margin, backend, wire_g, scaled, biases[1]
            )

    def _high_precision(self, x, ex, weight_dtype):
        """The module's own forward on this rank's rows, with its local experts."""
        m = self.module
        x = send_rows(x, ex)
        params = module_parameters(m)
        held = {a: params[a] for a in self.attrs + self.biases}
        held_experts = m.num_experts
        try:
            for a in held:
                params[a] = local_shard(held[a])
            m.num_experts = ex.local
            ones = x.new_ones(x.shape[0], 1, dtype=weight_dtype)
            y = type(m).forward(m, x, ex.ids[:, None], ones)
        finally:
            params.update(held)
            m.num_experts = held_experts
        return send_rows(y, ex, back=True)


def expert_parallel_in(experts) -> bool:
    """Whether any of `experts` (`Experts`) is held by an expert-parallel module."""
    return any(isinstance(vars(e.module).get("forward"), _ExpertParallelForward) for e in experts)


def refuse_compile() -> None:
    """While dynamo traces `apply` of a model with expert-parallel experts: raise (under
    fullgraph fp8fn's error, at trace time)."""
    if torch.compiler.is_compiling():
        refuse_fullgraph_trace(_NO_COMPILE)
        raise RuntimeError(_NO_COMPILE)


def _wires_read(known: list, flags: list | None, experts: int) -> tuple:
    """`known` (`_ExpertParallelForward._wires`) with each None replaced by the next E of the
    host-read `flags`."""
    flags = iter(flags or ())
    return tuple(
        tuple(w) if w is not None else tuple(next(flags) for _ in range(experts)) for w in known
    )


def _experts_modules(model) -> list:
    """`[(path, module, attrs, biases)]`: the modules holding experts weights (3-D floating
    parameters, as `transform` finds them), each checked against `_CONTRACT`; `biases`: the
    names of their `(E, N)` biases (`has_bias`: GPT-OSS), or `()`."""
    owners = {}
    for entry in find_experts(model, lambda name, owner: True):
        path = entry.path.rpartition(".")[0]
        owners.setdefault(id(entry.module), (path, entry.module, []))[2].append(entry.attr)
    found = []
    for path, module, held in owners.values():
        gate = getattr(module, "has_gate", None)
        attrs = ("gate_up_proj" if gate else "up_proj", "down_proj")
        if gate is None or not set(attrs) <= set(held) or not hasattr(module, "num_experts"):
            raise ValueError(
                f"fp8fn.expert_parallel: expected experts modules with {_CONTRACT}, got "
                f"{path!r} ({type(module).__name__}) holding 3-D weights {held}: its "
                "forward's arguments are its own (fp8fn's user experts forms; Llama 4's "
                "experts, which take every token for every expert, already weighted), so which "
                "rows go to which expert's rank is not known. Such experts run in float8 "
                "through fp8fn.transform without expert parallelism."
            )
        if getattr(module, "has_post_expert_norm", False):
            raise ValueError(
                f"fp8fn.expert_parallel: expected experts without a post-expert norm, got "
                f"{path!r} ({type(module).__name__}) with one: not supported yet."
            )
        biases = tuple(f"{a}_bias" for a in attrs) if getattr(module, "has_bias", False) else ()
        found.append((path, module, attrs, biases))
    return found


def _group_of(mesh, mesh_dim):
    """The process group of `mesh` (1-D) or of its dim `mesh_dim`, and that 1-D mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "fp8fn.expert_parallel: expected `mesh` to be a torch.distributed DeviceMesh, got "
            f"{type(mesh).__name__}. Make one with init_device_mesh('cpu', (world,))."
        )
    if mesh_dim is None and mesh.ndim != 1:
        raise ValueError(
            f"fp8fn.expert_parallel: expected a 1-D mesh or `mesh_dim`, got a {mesh.ndim}-D mesh "
            f"{mesh.mesh_dim_names}. Name the expert-parallel dim: mesh_dim='ep'."
        )
    sub = mesh if mesh_dim is None else mesh[mesh_dim]
    return sub, sub.get_group()


def expert_parallel(model: nn.Module, mesh, *, mesh_dim=None, float8_wire: bool | str = True):
    """Shard `model`'s experts over the ranks of `mesh` (expert parallelism), in place.

    Each experts module (transformers 5.x's experts interface: `gate_up_proj` or `up_proj`,
    `down_proj`, `forward(hidden_states, top_k_index, top_k_weights)`) has its experts weights
    replaced by DTensor `Shard(0)` parameters (rank r holds experts `r * E/world ...`: each
    rank's slice of the weight it holds now, which must be the same on every rank; DCP saves
    and loads them) and runs as dispatch -> this rank's experts -> combine, two
    `all_to_all_single` each way plus one of the row counts per call (read on the host: one
    read per call). Under `fn.apply` of a `fp8fn.transform` of the model with DelayedScaling
    for the experts, the tokens of each expert whose input history holds an amax are sent as
    e4m3 bytes cast by the sender with that expert's input scale, and the output gradients as
    e5m2 with its grad_output scale (`float8_wire`); the GEMMs take the bytes as they are; an
    expert whose history is still empty gets its rows in high precision (a second all-to-all
    while some experts are filled and others not). Every rank must hold the same state
    (`fp8fn.all_reduce` the observations over every rank: the expert-parallel group and any
    data-parallel one). With FSDP2 over a data-parallel dim, shard each experts module over
    it with `set_gradient_divide_factor(world)` (docs/moe.md, "With data parallelism"): a
    forward of the experts raises while an FSDP2 group inside `model` holds them over more
    than one data-parallel rank with FSDP2's default division.

    Args:
      model: an nn.Module holding experts modules.
      mesh: a `DeviceMesh`; 1-D, or give `mesh_dim`.
      mesh_dim: the name of the expert-parallel dim of a multi-dim `mesh`.
      float8_wire: True: dispatch forward and combine backward in float8 under DelayedScaling,
        with the state's scales (the GEMMs' bits unchanged). False: the rows travel in the
        activation dtype, and the receiver casts them (the same bits, twice the bytes at
        bfloat16). "all": as True, and combine forward and dispatch backward (the GEMM outputs
        `y` and `grad_x`, under DelayedScaling or CurrentScaling) as e4m3 with a power-of-two
        scale per row, sent as one byte with it (K + 1 bytes a row): not bit-identical to one
        process; the error is measured in docs/moe.md.

    Returns:
      `model`, changed in place.

    Raises:
      ValueError: `float8_wire` not True, False or "all"; no experts module; one outside the
        experts interface (Llama 4's, fp8fn's user forms) or with a post-expert norm; a
        number of experts that the mesh's size does not divide; experts weights already
        DTensors (sharded by something else). Nothing is changed then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fp8fn.expert_parallel: expected `model` to be an nn.Module, got "
            f"{type(model).__name__}."
        )
    if not (float8_wire is True or float8_wire is False or float8_wire == "all"):
        raise ValueError(
            f'fp8fn.expert_parallel: expected `float8_wire` True, False or "all", got '
            f"{float8_wire!r}."
        )
    sub, group = _group_of(mesh, mesh_dim)
    world = sub.size()
    found = _experts_modules(model)
    if not found:
        raise ValueError(
            f"fp8fn.expert_parallel: expected a model with experts modules, got "
            f"{type(model).__name__} with no 3-D floating parameter."
        )
    for path, module, attrs, biases in found:
        for a in attrs + biases:
            p = getattr(module, a)
            if as_dtensor(p) is not None:
                raise ValueError(
                    f"fp8fn.expert_parallel: expected plain experts weights, got "
                    f"'{path}.{a}' already a DTensor {tuple(p.placements)} (sharded by "
                    "fully_shard, a tensor-parallel plan or expert_parallel). Call "
                    "expert_parallel first, on the plain model."
                )
            if p.shape[0] % world:
                raise ValueError(
                    f"fp8fn.expert_parallel: expected the mesh's size to divide the number of "
                    f"experts, got {p.shape[0]} experts in '{path}.{a}' over {world} ranks."
                )
    from torch.distributed.tensor import DTensor, Shard

    rank = sub.get_local_rank()
    for path, module, attrs, biases in found:
        for a in attrs + biases:
            p = getattr(module, a)
            local = p.shape[0] // world
            shard = p.detach()[rank * local : (rank + 1) * local].clone()
            d = DTensor.from_local(shard, sub, [Shard(0)], run_check=False)
            setattr(module, a, nn.Parameter(d, requires_grad=p.requires_grad))
        module.forward = _ExpertParallelForward(
            module, group, attrs, biases, float8_wire, model, path
        )
    return model
