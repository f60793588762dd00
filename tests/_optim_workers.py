"""Scenarios that `tests/test_optim_slow.py` runs on gloo ranks (not a test module):
`fp8fn.optim.adamw` on DTensor parameters against the same update on plain tensors.

`main(rank, world_size, port, out_dir, names)` runs the scenarios `names` in order and writes
`out_dir/rank{rank}.json`. Every rank computes the plain reference itself (no collective), then
the sharded run; each rank compares its own shard of every result (params, float8 bytes)
with the same slice of the reference, and the block scales (a plain tensor on every rank) with
the reference's, bit for bit. The shapes are chosen so that shard cuts fall inside blocks.
"""

from __future__ import annotations

import torch
from _helpers import bits
from _spawn import run_scenarios
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fp8fn
from fp8fn._torch_private import dtensor_local_offset

WORLD = 2
SHAPES = {"w": (37, 53), "e": (130, 70), "b": (53,)}  # rows of 53 and 70: cuts inside blocks
STEPS = 3
MEASURED: dict = {}
WORKDIR = ""  # the spawn's directory (checkpoints), set by `main`


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}


def _grads(step: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: (torch.randn(s, generator=gen) * 0.01).to(dtype) for k, s in SHAPES.items()}


def _run(opt, params, shard, bad_step=None):
    """`STEPS` updates of `params` placed by `shard` (identity for plain); at `bad_step`, a NaN
    in the gradient of rank 0's first element of `w`."""
    params = {k: shard(k, p) for k, p in params.items()}
    state = opt.init(params, seed=5)
    for step in range(STEPS):
        grads = _grads(step, next(iter(params.values())).dtype)
        if step == bad_step:
            grads["w"][0, 0] = float("nan")
        grads = {k: shard(k, g) for k, g in grads.items()}
        params, state = opt.update(grads, state, params)
    return params, state


def _local_slice(ref: torch.Tensor, d) -> torch.Tensor:
    """The slice of the plain `ref` that this rank's shard of the DTensor `d` holds."""
    shape, offset = dtensor_local_offset(d)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return ref[index]


def _check(plain, sharded) -> None:
    leaves_p = torch.utils._pytree.tree_leaves(plain)
    leaves_s = torch.utils._pytree.tree_leaves(sharded)
    assert len(leaves_p) == len(leaves_s)
    for ref, got in zip(leaves_p, leaves_s):
        if type(got).__name__ == "DTensor":
            ref = _local_slice(ref, got)
            got = got.to_local()
        assert ref.dtype == got.dtype and ref.shape == got.shape, (ref.shape, got.shape)
        assert torch.equal(bits(ref), bits(got))


def _placed(mesh, placements):
    return lambda name, t: distribute_tensor(
        t, mesh, [p if t.dim() > 1 or p == Shard(0) else Shard(0) for p in placements]
    )


def _compare(placements_of_mesh, moments="fp8", master=None, bad_step=None):
    dtype = torch.bfloat16 if master else torch.float32
    opt = fp8fn.optim.adamw(1e-2, moments=moments, block=128, min_size=64, master=master)
    plain = _run(opt, _params(dtype), lambda name, t: t, bad_step)
    for shape, placements in placements_of_mesh:
        mesh = init_device_mesh("cpu", shape)
        sharded = _run(opt, _params(dtype), _placed(mesh, placements), bad_step)
        _check(plain, sharded)
    return plain


def shard0_1d(rank):
    """FSDP2's layout: Shard(0) on a 1-D mesh of 2 (a row cut inside blocks)."""
    _compare([((WORLD,), [Shard(0)])])


def meshes_2d(rank):
    """2-D meshes (2, 1) and (1, 2), placements (Shard(0), Shard(1)): rows cut on the first,
    columns on the second (the local elements are runs of the flat index, not one range)."""
    _compare([((WORLD, 1), [Shard(0), Shard(1)]), ((1, WORLD), [Shard(0), Shard(1)])])


def fully_shard_params(rank):
    """Parameters of a module sharded by FSDP2's `fully_shard`, updated functionally."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(53, 130)
    with torch.no_grad():
        model.weight.copy_(torch.randn(130, 53, generator=torch.Generator().manual_seed(1)))
        model.bias.zero_()
    plain_params = {k: p.detach().clone() for k, p in model.named_parameters()}
    fully_shard(model)
    sharded_params = {k: p.detach() for k, p in model.named_parameters()}
    assert all(type(p).__name__ == "DTensor" for p in sharded_params.values())
    opt = fp8fn.optim.adamw(1e-2, moments="fp8", min_size=64)
    gen = torch.Generator().manual_seed(2)
    grads = [{k: torch.randn(p.shape, generator=gen) for k, p in plain_params.items()}]
    plain = opt.update(grads[0], opt.init(plain_params), plain_params)
    mesh = next(iter(sharded_params.values())).device_mesh
    g = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in grads[0].items()}
    sharded = opt.update(g, opt.init(sharded_params), sharded_params)
    _check(plain, sharded)


def bf16_sr_master(rank):
    """bfloat16 params with stochastic rounding: the bits drawn per global element index."""
    _compare([((WORLD,), [Shard(0)]), ((1, WORLD), [Shard(0), Shard(1)])], master="bf16-sr")


def fp32_and_bf16_moments(rank):
    for moments in ("fp32", "bf16"):
        _compare([((WORLD,), [Shard(0)])], moments=moments)


def non_finite_on_one_rank_skips_on_all(rank):
    """A NaN in rank 0's shard only: every rank skips that step, as the plain run does."""
    plain = _compare([((WORLD,), [Shard(0)])], bad_step=1)
    assert int(plain[1].skipped) == 1 and int(plain[1].count) == STEPS - 1


def _dcp_model(seed: int):
    """Two linear layers (53 -> 130 -> 7) of `seed`'s weights, sharded by FSDP2 over the
    ranks, with `fp8fn.optim.AdamW` (float8 moments)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(53, 130), torch.nn.Linear(130, 7))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = fp8fn.optim.AdamW(model.parameters(), lr=1e-2, moments="fp8", min_size=64)
    return model, opt


def _dcp_step(model, opt, step: int) -> None:
    """One optimizer step on fixed gradients (the same global tensors on every world size, so
    that the optimizer alone decides the bits)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
    opt.step()
    opt.zero_grad()


def _dcp_dicts(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def dcp_save(rank):
    """2 steps under FSDP2, `torch.distributed.checkpoint.save`, then the uninterrupted 3rd
    step's full params kept for `dcp_resume` (in other processes, on another world size)."""
    import os

    import torch.distributed.checkpoint as dcp

    model, opt = _dcp_model(seed=1)
    for step in range(2):
        _dcp_step(model, opt, step)
    assert opt.state[next(model.parameters())]["exp_avg"].to_local().dtype == torch.float8_e4m3fn
    dcp.save(_dcp_dicts(model, opt), checkpoint_id=os.path.join(WORKDIR, "ckpt"))
    _dcp_step(model, opt, 2)
    truth = {k: p.full_tensor() for k, p in model.named_parameters()}
    if rank == 0:
        torch.save(truth, os.path.join(WORKDIR, "truth.pt"))


def dcp_resume(rank):
    """On another world size: a model of other weights loads the checkpoint and takes the 3rd
    step; its params equal the uninterrupted run's bit for bit."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = _dcp_model(seed=7)
    loaded = _dcp_dicts(model, opt)
    dcp.load(loaded, checkpoint_id=os.path.join(WORKDIR, "ckpt"))
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    state = opt.state[next(model.parameters())]
    assert state["exp_avg"].to_local().dtype == torch.float8_e4m3fn and int(state["step"]) == 2
    _dcp_step(model, opt, 2)
    truth = torch.load(os.path.join(WORKDIR, "truth.pt"))
    for name, p in model.named_parameters():
        assert torch.equal(bits(p.full_tensor()), bits(truth[name])), name


def dtensor_state_on_plain_params_is_refused(rank):
    """A state made for DTensor params, given plain params: an fp8fn.optim error, nothing run."""
    import pytest

    mesh = init_device_mesh("cpu", (WORLD,))
    opt = fp8fn.optim.adamw(1e-2, moments="fp8", min_size=64)
    sharded = {k: distribute_tensor(p, mesh, [Shard(0)]) for k, p in _params().items()}
    state = opt.init(sharded)
    with pytest.raises(
        TypeError, match=r"fp8fn\.optim\.update: expected `state.mu` at \['w'\] to be"
    ):
        opt.update(_grads(0), state, _params())


def clip_by_global_norm_of_dtensors(rank):
    """The global norm of sharded gradients is the whole tensors' (the shards' partial norms
    reduced), so every rank scales by the plain factor (to float32 rounding: another order of
    summation)."""
    mesh = init_device_mesh("cpu", (1, WORLD))
    grads = _grads(0)
    plain, plain_norm = fp8fn.optim.clip_by_global_norm(grads, 0.05)
    sharded = {k: _placed(mesh, [Shard(0), Shard(1)])(k, g) for k, g in grads.items()}
    clipped, norm = fp8fn.optim.clip_by_global_norm(sharded, 0.05)
    torch.testing.assert_close(norm, plain_norm, rtol=1e-6, atol=0)
    for k, g in clipped.items():
        torch.testing.assert_close(g.to_local(), _local_slice(plain[k], g), rtol=1e-6, atol=0)


SCENARIOS = [
    shard0_1d,
    meshes_2d,
    fully_shard_params,
    bf16_sr_master,
    fp32_and_bf16_moments,
    non_finite_on_one_rank_skips_on_all,
    dtensor_state_on_plain_params_is_refused,
    clip_by_global_norm_of_dtensors,
]


def main(rank: int, world_size: int, port: int, out_dir: str, names: list) -> None:
    global WORKDIR
    WORKDIR = out_dir
    chosen = [s for s in [*SCENARIOS, dcp_save, dcp_resume] if s.__name__ in names]
    run_scenarios(rank, world_size, port, out_dir, chosen, MEASURED, group_timeout_s=60)
