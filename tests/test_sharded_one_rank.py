"""The sharded placements (`_parallel/`) on a one-rank gloo mesh, in the quick tier: functional
FSDP (`Shard(0)` params, `_parallel/dtensor.py`'s gather and float8 all-gather), tensor
parallelism (`parallelize_module`), FSDP2 with `fp8fn.float8_all_gather`
(`_parallel/fsdp_gather.py`) and `fp8fn.all_reduce` run their whole code paths with their
collectives over one rank, and give the unsharded model's bits. `test_sharded.py`,
`test_fsdp.py` and `test_distributed.py` run them on several ranks (slow tier)."""

import copy

import torch
import torch.distributed as dist
from _helpers import DELAYED, assert_bit_identical, gelu_mlp, loss_of, params_of, stepped
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fp8fn


def test_functional_fsdp_on_one_rank_gives_the_unsharded_bits(one_rank_mesh, monkeypatch):
    model = gelu_mlp()
    fn = fp8fn.transform(model, DELAYED)
    x = torch.randn(8, 16)
    plain = params_of(model)
    state = stepped(fn, plain, fn.init(x), x)  # scales known: weights gathered in float8
    sharded = {k: distribute_tensor(v, one_rank_mesh, [Shard(0)]) for k, v in plain.items()}
    sent, gather = {}, dist.all_gather_single

    def counted(out, send, **kwargs):
        sent[send.dtype] = sent.get(send.dtype, 0) + send.numel() * send.element_size()
        return gather(out, send, **kwargs)

    monkeypatch.setattr(dist, "all_gather_single", counted)
    assert_bit_identical(fn.apply(sharded, state, x), fn.apply(plain, state, x))
    # the weights in float8 (1 byte per element), the biases in float32
    assert sent == {torch.uint8: 32 * 16 + 32 * 32 + 8 * 32, torch.float32: 4 * (32 + 32 + 8)}
    grads, obs = torch.func.grad(loss_of(fn), argnums=(0, 1))(sharded, state, x)
    want, want_obs = torch.func.grad(loss_of(fn), argnums=(0, 1))(plain, state, x)
    assert_bit_identical(obs, want_obs)
    for k, g in grads.items():
        assert isinstance(g, DTensor) and g.placements == (Shard(0),), k
        assert torch.equal(g.to_local(), want[k]), k


def test_tensor_parallel_on_one_rank_gives_the_unsharded_bits(one_rank_mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ref = gelu_mlp()
    model = copy.deepcopy(ref)
    parallelize_module(model, one_rank_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fn, ref_fn = fp8fn.transform(model, DELAYED), fp8fn.transform(ref, DELAYED)
    x = torch.randn(8, 16)
    state = stepped(ref_fn, params_of(ref), ref_fn.init(x), x)
    observed = fp8fn.observe(state)
    out = fn.apply(dict(model.named_parameters()), observed, x)
    out.square().mean().backward()
    want_out = ref_fn.apply(params_of(ref), state, x)
    want, want_obs = torch.func.grad(loss_of(ref_fn), argnums=(0, 1))(params_of(ref), state, x)
    assert_bit_identical(out, want_out)
    assert_bit_identical(fp8fn.all_reduce(fp8fn.observations(observed)), want_obs)
    for k, p in model.named_parameters():
        sharded = k.startswith(("0.", "2."))  # the parallelized layers; "4" is left as it is
        assert isinstance(p.grad, DTensor) == sharded, k
        assert torch.equal(p.grad.full_tensor() if sharded else p.grad, want[k]), k


def test_fsdp2_float8_all_gather_on_one_rank_gives_the_unsharded_bits(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard

    ref = gelu_mlp()
    model = copy.deepcopy(ref)
    fp8fn.float8_all_gather(model)
    fully_shard(model, mesh=one_rank_mesh)
    fn, ref_fn = fp8fn.transform(model, DELAYED), fp8fn.transform(ref, DELAYED)
    assert [g.path for g in fn.plan.fsdp.gathered] == ["0", "2", "4"]  # gathered in float8
    x = torch.randn(8, 16)
    state = stepped(ref_fn, params_of(ref), ref_fn.init(x), x)
    assert list(fn.init(x)) == list(state)
    observed = fp8fn.observe(state)
    out = fn.apply(dict(model.named_parameters()), observed, x)
    out.square().mean().backward()
    want, want_obs = torch.func.grad(loss_of(ref_fn), argnums=(0, 1))(params_of(ref), state, x)
    assert_bit_identical(out, ref_fn.apply(params_of(ref), state, x))
    assert_bit_identical(fp8fn.observations(observed), want_obs)
    for k, p in model.named_parameters():
        assert torch.equal(p.grad.full_tensor(), want[k]), k


def test_all_reduce_on_one_rank_gives_the_observations_back(one_rank_mesh):
    state = fp8fn.init_state(DELAYED, ["a", "b"])
    obs = state._replace(amax_history=torch.rand(2, 3, 4), scale=torch.zeros(2, 3))
    assert_bit_identical(fp8fn.all_reduce(obs, one_rank_mesh.get_group()), obs)
