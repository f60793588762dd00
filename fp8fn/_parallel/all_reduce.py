"""Observations across ranks: `all_reduce`, the max of every observed amax in one collective.

The packed state makes this one `torch.distributed.all_reduce(op=MAX)` whatever the number of
sites: the observation's two tensors, and a 4-float tag of their structure (sites, config,
shapes), are copied into one flat buffer, reduced, and viewed back.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .._core.registries import ALL_REDUCE_STARTED, ALL_REDUCE_TAGS, MAX_ALL_REDUCE_TAGS
from .._core.state import State, check_state
from .._core.update import observed_only
from .._torch_private import assert_in_graph, process_group_devices


def _check_group(group):
    """The process group to reduce over (the world for None), or a clear error."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fp8fn.all_reduce: expected an initialized torch.distributed process group, got "
            "none. Call `torch.distributed.init_process_group(backend)` first (torchrun sets "
            "the environment it reads), or skip `all_reduce` in a single process."
        )
    if group is None:
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"fp8fn.all_reduce: expected a `group` that contains this rank, got one that does "
            f"not contain rank {dist.get_rank()}. Every rank of a group calls `all_reduce` with "
            "it; the other ranks skip it (or reduce over their own group)."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "fp8fn.all_reduce: expected `group` to be None (the world) or a "
            f"torch.distributed.ProcessGroup (e.g. from dist.new_group), got "
            f"{type(group).__name__}."
        )
    return group


def _check_device(device: torch.device, group) -> None:
    """Refuse a tensor on a device the group's backend has no collective for.

    (torch says only `No backend type associated with device type cpu`.) gloo reduces CPU and
    CUDA tensors; NCCL only CUDA ones.
    """
    supported = process_group_devices(group)
    if supported is None or device.type in {d.type for d in supported}:
        return
    names = sorted({d.type for d in supported})
    raise ValueError(
        f"fp8fn.all_reduce: expected `obs` on a device that the backend of `group` "
        f"({dist.get_backend(group)}) reduces ({', '.join(names)}), got {device}. Move the "
        f"observation there (`obs = obs.to(device)`), or reduce over a group of a backend for "
        f"{device.type} (gloo: cpu and cuda; nccl: cuda)."
    )


def _structure_tag(key, device: torch.device) -> torch.Tensor:
    """A hash of `key` as two 24-bit integers (exact in float32), each next to its negation:
    after a MAX over the ranks the tag is unchanged exactly when every rank sent the same one
    (max(a) = a and max(-a) = -a mean min(a) = max(a)). float32 `(4,)` on `device`."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=6).digest()
    a, b = int.from_bytes(digest[:3], "little"), int.from_bytes(digest[3:], "little")
    return torch.tensor([a, -a, b, -b], dtype=torch.float32, device=device)


def _structure(obs: State, device: torch.device) -> tuple[torch.Tensor, str]:
    """`obs`'s structure tag on `device` and the message for ranks that disagree with it."""
    key = (obs.static, tuple(obs.amax_history.shape))
    found = ALL_REDUCE_TAGS.get((*key, device))
    if found is None:
        if len(ALL_REDUCE_TAGS) >= MAX_ALL_REDUCE_TAGS:
            ALL_REDUCE_TAGS.clear()
        message = (
            "fp8fn.all_reduce: expected observations of the same structure on every rank of "
            f"`group` (sites, in order, history_len, amax_compute, margin); this rank has "
            f"{obs!r}, another differs. Build the state the same way on every rank (fn.init of "
            "one transform; a layer called a different number of times has other sites)."
        )
        found = ALL_REDUCE_TAGS[(*key, device)] = (_structure_tag(key, device), message)
    return found


def all_reduce(obs: State, group=None) -> State:
    """The max of every observed amax over the ranks of `group`, in one collective for all sites.

    An amax that is inf or NaN counts as "not observed" (0) before the reduce, as in
    `fp8fn.merge`, so a rank that saw nothing leaves another rank's observation intact, and 0
    stays "not observed" unless some rank observed something. `obs.scale` (the gradient with
    respect to the scales, zeros on fp8fn's routes) is reduced by max in the same collective, so
    the result is `fp8fn.merge` of the ranks' observations. `obs` is not modified (the
    structure's tag and the groups already started are kept outside the state:
    `_core/registries.py`). Every rank of `group` must call it, with observations of the same
    structure (the same model and `fn.init`): a 4-float tag of the structure rides in the
    collective and is compared in the graph after it (no host read, so no device sync in a
    step), so ranks that disagree all raise instead of mixing sites. The first call on a group
    reduces the tag alone before (one more tiny collective, read on the host), so that
    observations of other sizes raise too instead of aborting the collective.

    Merge microbatches first (`fp8fn.merge`), then reduce over the ranks, then `fp8fn.update`:
    every rank then holds the same state, bit for bit.

    Args:
      obs: an `fp8fn.State` of observations: `amax_history` float32
        `(..., n_sites, 3, history_len)` (the amaxes seen in `[..., 0]`), `scale` float32
        `(..., n_sites, 3)`; on CPU or CUDA for gloo, on CUDA for NCCL.
      group: a `torch.distributed.ProcessGroup` holding this rank, or None for the world. It
        must span every rank that sees different data or a different shard of the weights
        (data parallel x tensor parallel); never pipeline stages, whose sites differ.

    Returns:
      A new `State` of `obs`'s structure, shapes and device: the elementwise max over the ranks.

    Raises:
      RuntimeError: when torch.distributed is not initialized, or when the ranks'
        observations differ in structure at a reduce after the group's first (the in-graph
        check: on CPU raised at once; on CUDA a device-side assert, which ends the process).
      ValueError: when `group` does not hold this rank, its backend cannot reduce tensors
        on `obs`'s device, or the ranks' observations differ in structure at the group's first
        reduce.

    Example (on every rank, after `torch.distributed.init_process_group`)::

      state = fp8fn.observe(state)
      loss = loss_fn(fn.apply(params, state, x))
      loss.backward()
      obs = fp8fn.all_reduce(fp8fn.observations(state))  # one all_reduce(MAX) for all sites
      state = fp8fn.update(state, obs)                     # identical on all ranks
    """
    check_state("all_reduce", obs, "obs", batch_dims=None)
    group = _check_group(group)
    history, scale = obs.amax_history, obs.scale
    _check_device(history.device, group)
    n, m = history.numel(), scale.numel()
    tag, mismatch = _structure(obs, history.device)
    if group not in ALL_REDUCE_STARTED:
        # The first reduce on a group checks the tag alone, on the host: buffers of other sizes
        # (another number of sites, history_len) would abort the collective itself.
        reduced = tag.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(reduced, tag):
            raise ValueError(mismatch)
        ALL_REDUCE_STARTED.add(group)
    with torch.no_grad():
        pieces = [observed_only(history).flatten(), scale.detach().flatten()]
        packed = torch.cat([*pieces, tag])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        # Same-sized structures that differ (site order, margin) pair sites wrongly: checked
        # in the graph, no host read (on CUDA a device-side assert, on CPU raised at once).
        assert_in_graph((packed[n + m :] == tag).all(), mismatch)
    return obs._replace(
        amax_history=packed[:n].view(history.shape), scale=packed[n : n + m].view(scale.shape)
    )
