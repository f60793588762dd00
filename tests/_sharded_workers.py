"""Scenarios that `tests/test_sharded.py` runs on gloo ranks (not a test module): sharded
parameters (DTensors) through `fn.apply`.

`main(rank, world_size, port, out_dir, names)` initializes the process group, runs the scenarios
`names` in order (the ranks must call the same collectives), and writes
`out_dir/rank{rank}.json`: `{scenario: "ok" | traceback}` plus `"_measured"` numbers.

The reference is one process on the global batch: the same module, the same transform, plain
params, computed on each rank without collectives. Every comparison is made exact where it can
be, as follows.

* **Warm states.** Both runs are warmed from the one process's observation of the first batch
  (`_warmed`). A data-parallel rank differentiates the mean over its own rows, so its output
  gradients are exactly W times the one process's (W, the data-parallel size, is a power of two);
  its state gets W times the grad_output amaxes, so its scales are exactly 1/W of the one
  process's and every float8 value it casts is the one process's, bit for bit. (Without this,
  each rank's gradient casts would saturate, or the comparison would be off by the factor.)
* **Observations.** After `fp8fn.all_reduce`, input and weight amaxes are bitwise the one
  process's, and grad_output amaxes bitwise W times them, wherever the observed tensor itself is
  computed bitwise equal. Tensor parallel's RowwiseParallel sums partial products over ranks
  (a split of the contraction): its output, and every gradient computed from it, differs from
  one process in the last bits. There the grad_output amaxes are checked to 1e-6 relative.
* **Outputs and gradients.** Functional FSDP's forward rows are bitwise the one process's rows.
  Gradients of the weights are sums over the batch, split over ranks and reduce-scattered (a
  different order of summation): checked to a relative tolerance, the measured value recorded.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import assert_bit_identical, bits
from _models import Tied, _seeded
from _spawn import (
    assert_on_every_rank,
    assert_state_same_on_all_ranks,
    run_scenarios,
    same_on_all_ranks,
)
from torch import nn

import fp8fn

RECIPE = fp8fn.DelayedScaling(history_len=4)
MEASURED: dict = {}
LR = 0.5


def _rel(a, b) -> float:
    a, b = _full(a).detach().double(), _full(b).detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _full(t):
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def _measure(key: str, value: float) -> float:
    MEASURED[key] = max(MEASURED.get(key, 0.0), value)
    return value


def _warmed(state: fp8fn.State, obs: fp8fn.State, dp: int) -> fp8fn.State:
    """`state` updated with one process's observation `obs`, as a rank of `dp` data-parallel
    ranks sees it: grad_output amaxes times `dp` (exact: a power of two)."""
    history = obs.amax_history.clone()
    history[:, 2] *= dp
    return fp8fn.update(state, obs._replace(amax_history=history))


def _check_obs(obs, ref_obs, dp: int, exact_grad_output: bool, key: str):
    """`obs` (all-reduced) against one process's: input and weight bitwise, grad_output
    `dp` x one process's (bitwise, or to 1e-6 after a Rowwise reduction)."""
    assert torch.equal(obs.amax_history[:, :2, 0], ref_obs.amax_history[:, :2, 0]), (
        obs.amax_history[:, :2, 0],
        ref_obs.amax_history[:, :2, 0],
    )
    mine, want = obs.amax_history[:, 2, 0], dp * ref_obs.amax_history[:, 2, 0]
    rel = ((mine - want).abs() / want).max().item()
    _measure(key, rel)
    if exact_grad_output:
        assert torch.equal(mine, want), (mine, want)
    else:
        assert rel < 1e-6, rel


class _Counting:
    """Counts the c10d collectives fp8fn calls (by replacing them on `torch.distributed`)."""

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_reduce")

    def __enter__(self):
        self.calls, self.saved = [], {n: getattr(dist, n) for n in self.NAMES}
        for name, original in self.saved.items():

            def counting(*args, _name=name, _original=original, **kwargs):
                t = args[1] if _name != "all_reduce" else args[0]  # the tensor sent
                self.calls.append((_name, t.dtype, t.numel() * t.element_size()))
                return _original(*args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


# --- functional FSDP ---------------------------------------------------------------------------


class FsdpNet(nn.Module):
    """Embedding -> fc1 -> GELU -> fc2 -> LayerNorm; sites `fc1`, `fc2`. Rows of fc2, its bias
    and the norm (30) split unevenly over 4 ranks (8, 8, 8, 6)."""

    def __init__(self, seed=3):
        super().__init__()
        with _seeded(seed):
            self.emb = nn.Embedding(24, 32)
            self.fc1, self.fc2, self.ln = nn.Linear(32, 64), nn.Linear(64, 30), nn.LayerNorm(30)

    def forward(self, idx):
        return self.ln(self.fc2(F.gelu(self.fc1(self.emb(idx)))))


def _fsdp_setup():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(0)
    idx, target = torch.randint(0, 24, (16, 3), generator=g), torch.randn(16, 3, 30, generator=g)
    n = 16 // world
    mine = slice(rank * n, (rank + 1) * n)
    model = FsdpNet()
    fn = fp8fn.transform(model, RECIPE)
    ref_params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in ref_params.items()}

    def loss(p, s):  # this rank's mean (FSDP averages the ranks' gradients)
        return (fn.apply(p, s, idx[mine]) - target[mine]).square().mean()

    def ref_loss(p, s):
        return (fn.apply(p, s, idx) - target).square().mean()

    return mesh, fn, params, ref_params, loss, ref_loss, (idx, mine)


def fsdp_step1_weight_cast_with_whole_amax(rank):
    """A weight whose history is empty is cast with the whole weight's amax (one all-reduce of
    a scalar in the op), not its shard's: the forward is then the one process's, bit for bit.
    With a known weight scale the forward has no all-reduce at all."""
    mesh, fn, params, ref_params, loss, ref_loss, (idx, mine) = _fsdp_setup()
    world = dist.get_world_size()
    cold = fn.init(idx[mine])
    # a fully cold step runs; the amaxes of tensors no cast touched are exact
    ref_obs = torch.func.grad(ref_loss, argnums=(0, 1))(ref_params, cold)[1]
    obs = fp8fn.all_reduce(torch.func.grad(loss, argnums=(0, 1))(params, cold)[1])
    assert torch.equal(obs.amax_history[:, 1, 0], ref_obs.amax_history[:, 1, 0])  # weights
    assert obs.amax_history[0, 0, 0] == ref_obs.amax_history[0, 0, 0]  # fc1's input

    def without_weight_history(s):
        history = s.amax_history.clone()
        history[:, 1] = 0.0
        return s._replace(amax_history=history)

    state = without_weight_history(_warmed(cold, ref_obs, world))
    ref_state = without_weight_history(fp8fn.update(cold, ref_obs))
    with _Counting() as counted:
        out = fn.apply(params, state, idx[mine])
    assert_bit_identical(out, fn.apply(ref_params, ref_state, idx)[mine])
    assert [c[:2] for c in counted.calls if c[0] == "all_reduce"] == [
        ("all_reduce", torch.float32)
    ] * 2  # one scalar per float8 weight
    # the test can fail: some rank's shard holds less than the whole weight's amax
    local = torch.stack([params[k].to_local().abs().max() for k in ("fc1.weight", "fc2.weight")])
    whole = torch.stack([ref_params[k].abs().max() for k in ("fc1.weight", "fc2.weight")])
    smaller = (local < whole).any().float()
    dist.all_reduce(smaller, op=dist.ReduceOp.MAX)
    assert smaller == 1.0
    with _Counting() as counted:
        fn.apply(params, _warmed(cold, ref_obs, world), idx[mine])
    assert not [c for c in counted.calls if c[0] == "all_reduce"]


def fsdp_functional_routes_and_steps(rank):
    """Shard(0) DTensor params on a plain module under torch.func.grad, fp8fn.value_and_grad and
    plain autograd: float8 weights all-gathered in float8 (uint8 on the wire, 1 byte per
    element), other params in float32; forward rows bitwise the one process's; gradients
    Shard(0) DTensors, bitwise equal across the three routes, equal to the global-batch gradient
    (the ranks' mean); observations as `_check_obs`; 3 SGD steps match one process."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, fn, params, ref_params, loss, ref_loss, (idx, mine) = _fsdp_setup()
    world = dist.get_world_size()
    cold = fn.init(idx[mine])
    ref_obs = torch.func.grad(ref_loss, argnums=(0, 1))(ref_params, cold)[1]
    state, ref_state = _warmed(cold, ref_obs, world), fp8fn.update(cold, ref_obs)

    # forward: rows bitwise; what goes over the wire
    with _Counting() as counted:
        out = fn.apply(params, state, idx[mine])
    assert_bit_identical(out, fn.apply(ref_params, ref_state, idx)[mine])
    sent = {}
    for name, dtype, nbytes in counted.calls:
        assert name == "all_gather_single", counted.calls  # no all-reduce with known scales
        sent[dtype] = sent.get(dtype, 0) + nbytes
    chunk = lambda rows: -(-rows // world)  # noqa: E731  (shards padded to equal rows)
    fp8_bytes = chunk(64) * 32 + chunk(30) * 64  # fc1.weight, fc2.weight: 1 byte per element
    fp32_elements = chunk(24) * 32 + chunk(64) + 3 * chunk(30)  # emb, biases, norm
    assert sent == {torch.uint8: fp8_bytes, torch.float32: 4 * fp32_elements}, sent
    MEASURED[f"fsdp_w{world}_forward_bytes_sent_per_rank"] = {str(k): v for k, v in sent.items()}

    # three gradient routes
    grads_func, obs_func = torch.func.grad(loss, argnums=(0, 1))(params, state)
    _, (grads_vg, obs_vg) = fp8fn.value_and_grad(loss, argnums=(0, 1))(params, state)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    observed = fp8fn.observe(state)
    loss(leaves, observed).backward()
    grads_ad, obs_ad = {k: v.grad for k, v in leaves.items()}, fp8fn.observations(observed)
    ref_grads, ref_obs1 = torch.func.grad(ref_loss, argnums=(0, 1))(ref_params, ref_state)
    for k, p in params.items():
        for grads in (grads_func, grads_vg, grads_ad):
            g = grads[k]
            assert isinstance(g, DTensor) and g.placements == (Shard(0),), (k, type(g))
            assert g.shape == p.shape and g.to_local().shape == p.to_local().shape
            assert torch.equal(g.to_local(), grads_func[k].to_local()), k
        # the mean over ranks of the ranks' gradients: the global batch's
        assert _measure(f"fsdp_w{world}_grad_rel_err", _rel(grads_func[k], ref_grads[k])) < 1e-6
    assert_bit_identical(obs_vg, obs_func)
    assert torch.equal(obs_ad.amax_history, obs_func.amax_history)
    obs = fp8fn.all_reduce(obs_func)
    _check_obs(obs, ref_obs1, world, True, f"fsdp_w{world}_obs_grad_output_rel")

    # 3 SGD steps under torch.func.grad, against one process
    p, rp = params, ref_params
    for _ in range(3):
        grads, obs = torch.func.grad(loss, argnums=(0, 1))(p, state)
        ref_grads, ref_obs = torch.func.grad(ref_loss, argnums=(0, 1))(rp, ref_state)
        state = fp8fn.update(state, fp8fn.all_reduce(obs))
        ref_state = fp8fn.update(ref_state, ref_obs)
        p = {k: v - LR * grads[k] for k, v in p.items()}
        rp = {k: v - LR * ref_grads[k] for k, v in rp.items()}
    assert_state_same_on_all_ranks(state)
    for k, v in p.items():
        assert isinstance(v, DTensor) and v.placements == (Shard(0),)
        assert _measure(f"fsdp_w{world}_params_rel_err_3_steps", _rel(v, rp[k])) < 1e-6, k
    torch.testing.assert_close(state.amax_history[:, :2], ref_state.amax_history[:, :2])
    torch.testing.assert_close(state.amax_history[:, 2], world * ref_state.amax_history[:, 2])


def fsdp_finer_recipe_layer_gathers_in_high_precision(rank):
    """A layer of a finer (stateless) recipe gets its weight gathered in high precision: the
    forward is the one process's, bit for bit."""
    mesh, _, params, ref_params, _, _, (idx, mine) = _fsdp_setup()
    model = FsdpNet()
    rowwise = fp8fn.RowwiseScaling()
    fn = fp8fn.transform(model, lambda name, m: rowwise if name == "fc2" else RECIPE)
    state = fn.init(idx)
    assert list(state) == ["fc1"]
    ref_obs = torch.func.grad(lambda p, s: fn.apply(p, s, idx).sum(), argnums=1)(ref_params, state)
    state = fp8fn.update(state, ref_obs)
    out = fn.apply(params, state, idx[mine])
    assert_bit_identical(out, fn.apply(ref_params, state, idx)[mine])


def fsdp_tied_weights(rank):
    """Tied weights (two layers sharing one; a head tied to the embedding) are gathered in high
    precision and cast by the layers as plain weights: forward rows bitwise the one process's,
    gradients (summed over the ties, then reduce-scattered) as its."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    idx = torch.randint(0, 16, (8, 3), generator=torch.Generator().manual_seed(2))
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
    model = Tied(16, 32, seed=4)
    fn = fp8fn.transform(model, RECIPE)
    ref_params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in ref_params.items()}
    cold = fn.init(idx)
    ref_loss = lambda p, s: fn.apply(p, s, idx).square().mean()  # noqa: E731
    loss = lambda p, s: fn.apply(p, s, idx[mine]).square().mean()  # noqa: E731
    ref_obs = torch.func.grad(ref_loss, argnums=(0, 1))(ref_params, cold)[1]
    state, ref_state = _warmed(cold, ref_obs, world), fp8fn.update(cold, ref_obs)
    assert_bit_identical(
        fn.apply(params, state, idx[mine]), fn.apply(ref_params, ref_state, idx)[mine]
    )
    grads, obs = torch.func.grad(loss, argnums=(0, 1))(params, state)
    ref_grads, ref_obs = torch.func.grad(ref_loss, argnums=(0, 1))(ref_params, ref_state)
    for k, g in grads.items():
        assert _measure("fsdp_tied_grad_rel_err", _rel(g, ref_grads[k])) < 1e-6, k
    _check_obs(fp8fn.all_reduce(obs), ref_obs, world, True, "fsdp_tied_obs")


def torch_private_dtensor_helpers(rank):
    """The fenced DTensor internals (`fp8fn/_torch_private.py`) behave as relied on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp8fn import _torch_private as private

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = torch.arange(12.0).reshape(6, 2)
    d = distribute_tensor(whole, mesh, [Shard(0)])
    assert private.dtensor_local(d) is d._local_tensor and torch.equal(
        d.to_local(), d._local_tensor
    )
    spec = private.dtensor_spec(d)
    assert spec.placements == (Shard(0),) and spec.shape == (6, 2) and spec.mesh == mesh
    made = private.new_dtensor_spec(mesh, [Shard(0)], (6, 2), torch.float32)
    assert made == spec  # placements, global shape, stride, dtype
    again = private.make_dtensor(d.to_local() * 2, made)
    assert type(again) is type(d) and torch.equal(again.full_tensor(), whole * 2)
    assert not again.requires_grad


class BnNet(nn.Module):
    """fc (8 -> 6) -> BatchNorm1d(6); site `fc`."""

    def __init__(self):
        super().__init__()
        with _seeded(5):
            self.fc, self.bn = nn.Linear(8, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.fc(x))


def fsdp_edges(rank):
    """Functional FSDP's edges, each run or refused with fp8fn's error: batch-norm buffers
    given as Shard(0) DTensors are read in eval mode (output bitwise that of plain buffers) and
    refused when train mode would change them (only a gathered copy would change); a state of
    DTensors; vmap over a stacked state, and over the inputs only."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, fn, params, _, _, _, (idx, mine) = _fsdp_setup()
    model = BnNet()
    bn_fn = fp8fn.transform(model, RECIPE)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    own = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    sharded = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in own.items() if v.dim()}
    state = bn_fn.init(x)
    model.eval()
    assert_bit_identical(bn_fn.apply(sharded, state, x), bn_fn.apply(own, state, x))
    model.train()
    before = sharded["bn.running_mean"].full_tensor()
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected the buffers given as DTensors"):
        bn_fn.apply(sharded, state, x)
    assert torch.equal(sharded["bn.running_mean"].full_tensor(), before)
    model.eval()

    state = fn.init(idx[mine])
    replicated = state._replace(
        amax_history=distribute_tensor(state.amax_history, mesh, [Replicate()]),
        scale=distribute_tensor(state.scale, mesh, [Replicate()]),
    )
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected the state's tensors to be pl"):
        fn.apply(params, replicated, idx[mine])
    stacked = torch.utils._pytree.tree_map(lambda t: torch.stack([t, t]), state)
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected an unbatched state for DTen"):
        torch.vmap(lambda s: fn.apply(params, s, idx[mine]))(stacked)
    with pytest.raises(ValueError, match=r"^fp8fn\.apply: expected no vmap over a model with s"):
        torch.vmap(lambda i: fn.apply(params, state, i))(idx[mine].unsqueeze(1))


def fsdp_checkpoint_fn_and_higher_order(rank):
    """A `checkpoint_fn` layer recomputed in the backward gathers its float8 weight again:
    gradients and observations bitwise those without recompute. A gradient of a gradient is
    refused with fp8fn's errors: the op's, or the sharded gather's."""
    _, fn, params, _, loss, _, (idx, mine) = _fsdp_setup()
    state = fn.init(idx)
    recomputed = fp8fn.transform(FsdpNet(), RECIPE, checkpoint_fn=lambda name, m: name == "fc2")

    def loss_recomputed(p, s):
        return (recomputed.apply(p, s, idx[mine]) - 1.0).square().mean()

    def loss_plain(p, s):
        return (fn.apply(p, s, idx[mine]) - 1.0).square().mean()

    grads, obs = torch.func.grad(loss_recomputed, argnums=(0, 1))(params, state)
    want, want_obs = torch.func.grad(loss_plain, argnums=(0, 1))(params, state)
    for k, g in grads.items():
        assert torch.equal(g.to_local(), want[k].to_local()), k
    assert_bit_identical(obs, want_obs)

    def grad_of_grad(name):
        inner = lambda p: torch.func.grad(loss, argnums=0)(p, state)[name].sum()  # noqa: E731
        return torch.func.grad(inner)(params)

    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: layer 'fc1': higher-order deriv"):
        grad_of_grad("fc1.weight")  # through the float8 op
    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: higher-order derivatives over sha"):
        grad_of_grad("ln.weight")  # through the high-precision gather only


def fsdp_errors(rank):
    """Clear errors: a DTensor param that is not Shard(0) for a plain module; a `params` dict
    whose first entry is plain but other entries DTensors (torch's 'got mixed' error)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh, fn, params, ref_params, _, _, (idx, mine) = _fsdp_setup()
    state = fn.init(idx[mine])
    replicated = {
        **params,
        "ln.weight": distribute_tensor(ref_params["ln.weight"], mesh, [Replicate()]),
    }
    with pytest.raises(
        ValueError, match=r"^fp8fn\.apply: expected `params\['ln\.weight'\]` sharded as `Shard"
    ):
        fn.apply(replicated, state, idx[mine])
    mixed = {**ref_params, "ln.weight": params["ln.weight"]}
    with pytest.raises(
        RuntimeError, match=r"^fp8fn\.apply: expected the model's DTensors to meet only DTensors"
    ):
        fn.apply(mixed, state, idx[mine])


# --- tensor parallel ---------------------------------------------------------------------------


class TPNet(nn.Module):
    """`net`: Linear(32, 64) -> GELU -> Linear(64, 32), then LayerNorm(32); sites `net.0`,
    `net.2`. Input `(batch, seq, 32)`."""

    def __init__(self, seed=5):
        super().__init__()
        with _seeded(seed):
            self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.net(x))


def _tp_data(batch=4, seq=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, seq, 32, generator=g) * 3, torch.randn(batch, seq, 32, generator=g)


def _ref_step(ref_fn, ref_params, ref_state, x, t):
    loss = lambda p, s: (ref_fn.apply(p, s, x) - t).square().mean()  # noqa: E731
    return torch.func.grad(loss, argnums=(0, 1))(ref_params, ref_state)


def _record_linear_outputs(model, paths):
    """What each layer's F.linear returned (before the parallel style's output hook)."""
    seen = {}
    for path in paths:
        model.get_submodule(path).register_forward_hook(
            lambda m, a, out, path=path: seen.__setitem__(
                path, (type(out).__name__, tuple(getattr(out, "placements", ())))
            ),
            prepend=True,
        )
    return seen


def tp_colwise_rowwise(rank):
    """parallelize_module with ColwiseParallel / RowwiseParallel, then transform. The op takes
    the DTensors, returns Shard(-1) (Colwise) and Partial (Rowwise) DTensors; plain autograd
    and fp8fn.value_and_grad give the same gradients, placed like the params; a cold step casts
    the sharded roles with the whole tensors' amaxes (observations as one process's); torch.func
    is refused with a clear error; 3 torch.optim steps match one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    x, t = _tp_data()
    ref = TPNet()
    model = copy.deepcopy(ref)
    seen = _record_linear_outputs(model, ["net.0", "net.2"])
    parallelize_module(model, mesh, {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()})
    fn, ref_fn = fp8fn.transform(model, RECIPE), fp8fn.transform(ref, RECIPE)
    cold, ref_cold = fn.init(x), ref_fn.init(x)
    assert list(cold) == list(ref_cold) == ["net.0", "net.2"]
    ref_params = dict(ref.named_parameters())

    def loss(p, s):
        return (fn.apply(p, s, x) - t).square().mean()

    # a cold step: Rowwise input, weights and Colwise grad_output cast with whole amaxes
    observed = fp8fn.observe(cold)
    loss(dict(model.named_parameters()), observed).backward()
    model.zero_grad()
    ref_obs = _ref_step(ref_fn, ref_params, ref_cold, x, t)[1]
    _check_obs(fp8fn.all_reduce(fp8fn.observations(observed)), ref_obs, 1, False, "tp_cold_obs")

    state = ref_state = fp8fn.update(cold, ref_obs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        observed = fp8fn.observe(state)
        out = fn.apply(dict(model.named_parameters()), observed, x)
        value = (out - t).square().mean()
        value.backward()
        ref_grads, ref_obs = _ref_step(ref_fn, ref_params, ref_state, x, t)
        obs = fp8fn.all_reduce(fp8fn.observations(observed))
        if step == 0:
            assert seen == {
                "net.0": ("DTensor", (Shard(2),)),
                "net.2": ("DTensor", (Partial(),)),
            }, seen
            assert type(out) is torch.Tensor  # the styles' hooks made it local
            _measure("tp_output_rel_err", _rel(out, ref_fn.apply(ref_params, ref_state, x)))
            assert MEASURED["tp_output_rel_err"] < 1e-6
            want = {
                "net.0.weight": (Shard(0),),
                "net.0.bias": (Shard(0),),
                "net.2.weight": (Shard(1),),
                "net.2.bias": (Replicate(),),
            }
            grads = {k: p.grad for k, p in model.named_parameters()}
            for k, g in grads.items():
                assert tuple(getattr(g, "placements", ())) == want.get(k, ()), k
                _measure("tp_grad_rel_err", _rel(g, ref_grads[k]))
                MEASURED.setdefault("tp_grad_bitwise", []).append(
                    (k, torch.equal(_full(g), ref_grads[k]))
                )
            assert MEASURED["tp_grad_rel_err"] < 1e-6
            # fp8fn.value_and_grad: the same gradients and observations
            params = dict(model.named_parameters())
            _, (grads_vg, obs_vg) = fp8fn.value_and_grad(loss, argnums=(0, 1))(params, state)
            for k, g in grads.items():
                assert torch.equal(_full(grads_vg[k]), _full(g)), k
            assert_bit_identical(fp8fn.all_reduce(obs_vg), obs)
            _check_obs(obs, ref_obs, 1, False, "tp_obs_grad_output_rel")
            MEASURED["tp_obs_grad_output_bitwise"] = torch.equal(
                obs.amax_history[:, 2, 0], ref_obs.amax_history[:, 2, 0]
            )
        opt.step()
        opt.zero_grad()
        ref_params = {k: v - LR * ref_grads[k] for k, v in ref_params.items()}
        state, ref_state = fp8fn.update(state, obs), fp8fn.update(ref_state, ref_obs)
    assert same_on_all_ranks(state.amax_history)
    for k, p in model.named_parameters():
        assert _measure("tp_params_rel_err_3_steps", _rel(p, ref_params[k])) < 1e-6, k

    # torch.func inside torch's parallel styles: refused with fp8fn's error
    with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: expected plain autograd for a tens"):
        torch.func.grad(loss, argnums=(0, 1))(dict(model.named_parameters()), state)
    # a DTensor input with a plain weight (the next layer not parallelized)
    half = copy.deepcopy(ref)
    parallelize_module(half, mesh, {"net.0": ColwiseParallel(use_local_output=False)})
    with pytest.raises(
        ValueError, match=r"^fp8fn\.apply: layer 'net\.2': expected a tensor-parallel call as"
    ):
        fp8fn.transform(half, RECIPE).apply(dict(half.named_parameters()), state, x)
    # a finer recipe does not take DTensor operands
    rowwise_fn = fp8fn.transform(model, fp8fn.RowwiseScaling())
    with pytest.raises(ValueError, match=r"fp8fn\.apply: layer 'net\.0': expected a per-tensor"):
        rowwise_fn.apply(dict(model.named_parameters()), rowwise_fn.init(x), x)


def tp_checkpoint_fn(rank):
    """`checkpoint_fn` on a tensor-parallel model (a TP layer, the pair of them, the root):
    plain autograd and fp8fn.value_and_grad give gradients (DTensors placed as without it) and
    observations bitwise those without recompute; torch.func stays refused with fp8fn's
    error. (The recompute runs under plain autograd: torch's parallel styles' Functions lack
    setup_context.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    x, t = _tp_data()
    model = TPNet()
    parallelize_module(model, mesh, {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()})
    plain = fp8fn.transform(model, RECIPE)
    state = plain.init(x)

    def grads_and_obs(fn, by_value_and_grad):
        params = dict(model.named_parameters())

        def loss(p, s):
            return (fn.apply(p, s, x) - t).square().mean()

        if by_value_and_grad:
            _, (grads, obs) = fp8fn.value_and_grad(loss, argnums=(0, 1))(params, state)
            return grads, obs
        observed = fp8fn.observe(state)
        loss(params, observed).backward()
        grads = {k: p.grad for k, p in params.items()}
        model.zero_grad()
        return grads, fp8fn.observations(observed)

    for by_value_and_grad in (False, True):
        want, want_obs = grads_and_obs(plain, by_value_and_grad)
        for chosen in ("net.0", "net", ""):
            fn = fp8fn.transform(model, RECIPE, checkpoint_fn=lambda n, m, c=chosen: n == c)
            grads, obs = grads_and_obs(fn, by_value_and_grad)
            for k, g in grads.items():
                assert type(g) is type(want[k]), (chosen, k)
                assert getattr(g, "placements", None) == getattr(want[k], "placements", None)
                assert torch.equal(_full(g), _full(want[k])), (chosen, by_value_and_grad, k)
            assert_bit_identical(obs, want_obs)
            loss = lambda p, s: (fn.apply(p, s, x) - t).square().mean()  # noqa: E731
            with pytest.raises(RuntimeError, match=r"^fp8fn\.apply: expected plain autograd for"):
                torch.func.grad(loss, argnums=(0, 1))(dict(model.named_parameters()), state)

    # the recompute of DTensor inputs by plain autograd still refuses a tensor read from outside
    from torch.distributed.tensor import Shard, distribute_tensor

    outside = types.SimpleNamespace(w=torch.ones(2, 2, requires_grad=True))
    d = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]).requires_grad_()
    out = fp8fn.checkpoint(lambda d: d.to_local() * outside.w, d)
    with pytest.raises(RuntimeError, match=r"^fp8fn\.checkpoint: expected `f` to take every t"):
        out.sum().backward()


def tp_sequence_parallel(rank):
    """SequenceParallel around the TP pair (tokens sharded along the sequence): the op is
    unchanged; outputs, weight gradients and observations as one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x, t = _tp_data()
    seq = x.shape[1] // world
    mine = slice(rank * seq, (rank + 1) * seq)
    ref = TPNet()
    model = copy.deepcopy(ref)
    plan = {
        "net.0": ColwiseParallel(input_layouts=Shard(1)),
        "net.2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(use_local_output=True),
    }
    parallelize_module(model, mesh, plan)
    fn, ref_fn = fp8fn.transform(model, RECIPE), fp8fn.transform(ref, RECIPE)
    ref_params = dict(ref.named_parameters())
    ref_cold = ref_fn.init(x)
    ref_obs = _ref_step(ref_fn, ref_params, ref_cold, x, t)[1]
    state = fp8fn.update(ref_cold, ref_obs)
    observed = fp8fn.observe(state)
    out = fn.apply(dict(model.named_parameters()), observed, x[:, mine])
    ((out - t[:, mine]).square().sum() / t.numel()).backward()  # this rank's share of the mean
    ref_grads, ref_obs = _ref_step(ref_fn, ref_params, state, x, t)
    _measure("sp_output_rel_err", _rel(out, ref_fn.apply(ref_params, state, x)[:, mine]))
    assert MEASURED["sp_output_rel_err"] < 1e-6
    for k, p in model.named_parameters():
        # the norm's gradients are Partial DTensors: full_tensor() sums them
        assert _measure("sp_grad_rel_err", _rel(p.grad, ref_grads[k])) < 1e-6, k
    _check_obs(fp8fn.all_reduce(fp8fn.observations(observed)), ref_obs, 1, False, "sp_obs")


def current_scaling_sharded(rank):
    """CurrentScaling (stateless) on DTensor operands: every cast takes the amax of the whole
    logical tensor. Functional FSDP: the weight's (one all-reduce per weight per forward), the
    rank's own rows for the input: the forward is one process's on those rows, bit for bit.
    Tensor parallel: outputs and gradients as one process's on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    current = fp8fn.CurrentScaling()
    _, _, params, ref_params, _, _, (idx, mine) = _fsdp_setup()
    fn = fp8fn.transform(FsdpNet(), current)
    state = fn.init(idx)
    with _Counting() as counted:
        out = fn.apply(params, state, idx[mine])
    assert_bit_identical(out, fn.apply(ref_params, state, idx[mine]))
    assert [c[0] for c in counted.calls].count("all_reduce") == 2

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    x, t = _tp_data()
    ref = TPNet()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()})
    fn, ref_fn = fp8fn.transform(model, current), fp8fn.transform(ref, current)
    state = fn.init(x)
    out = fn.apply(dict(model.named_parameters()), state, x)
    (out - t).square().mean().backward()
    ref_params = dict(ref.named_parameters())
    ref_out = ref_fn.apply(ref_params, state, x)
    ref_grads = _ref_step(ref_fn, ref_params, state, x, t)[0]
    assert _measure("tp_current_output_rel_err", _rel(out, ref_out)) < 1e-6
    for k, p in model.named_parameters():
        assert _measure("tp_current_grad_rel_err", _rel(p.grad, ref_grads[k])) < 1e-6, k


def probe_subnormal(t: torch.Tensor, fp8_max: float = 448.0, ulp: float = 2.0**-9) -> None:
    """Make `t[0, 1]` (in place) a value whose float8 bits differ between scaling from `t`'s amax
    with margin 0 and with margin 1: 3 subnormal ulps at `fp8_max / amax`, 1.5 (rounded to 2)
    at half that scale. A margin other than the recipe's then changes the result for sure.
    (`ulp`: 2**-9 for e4m3, 2**-16 for e5m2.)"""
    with torch.no_grad():
        t[0, 1] = 3 * ulp * t.abs().max() / fp8_max


def _mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def sharded_margin_bias_and_rows(rank):
    """The sharded routes against the plain one on the same process, bitwise, on inputs whose
    float8 bits depend on the margin (DelayedScaling(margin=1), a cold state: every role cast
    from its amax): functional FSDP's output and input gradient, and a weight of 1 row (more
    ranks than rows) with its gradient the mean of the ranks'; a ColwiseParallel layer's output
    and gradients (each rank's shards hold the whole tensors' amaxes). In float32, bfloat16 and
    under bfloat16 autocast, each bias gradient is the float32 sum of the output gradient's rows
    in the bias's dtype (then the mean over the ranks, for functional FSDP), computed here
    without fp8fn."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    recipe = fp8fn.DelayedScaling(history_len=4, margin=1)
    g = torch.Generator().manual_seed(10 + rank)
    cases = ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True))
    for dtype, autocast in cases:  # (autocast: bf16 operands and output gradient, fp32 params)
        g_dtype = torch.bfloat16 if autocast else dtype
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for rows in (8, 1):  # functional FSDP; a weight of 1 row
                with _seeded(6):
                    layer = nn.Linear(16, rows).to(dtype)
                probe_subnormal(layer.weight.data)
                x = torch.randn(32, 16, generator=g).to(dtype)
                c = torch.randn(32, rows, generator=g).to(dtype)
                x[0, 0] = 4.0
                probe_subnormal(x)
                if rows > 1:
                    probe_subnormal(c, 57344.0, 2.0**-16)
                fn = fp8fn.transform(layer, recipe)
                cold = fn.init(x)
                own = {k: v.detach().clone() for k, v in layer.named_parameters()}
                sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in own.items()}

                def loss(p, x):
                    return (fn.apply(p, cold, x) * c).sum()

                assert_bit_identical(fn.apply(sharded, cold, x), fn.apply(own, cold, x))
                grads, gx = torch.func.grad(loss, argnums=(0, 1))(sharded, x)
                want, want_gx = torch.func.grad(loss, argnums=(0, 1))(own, x)
                assert torch.equal(gx, want_gx), (dtype, rows)
                for k, grad in grads.items():
                    assert torch.equal(grad.full_tensor(), _mean_over_ranks(want[k])), (dtype, k)
                bias = _mean_over_ranks(c.to(g_dtype).float().sum(0).to(dtype))
                assert torch.equal(grads["bias"].full_tensor(), bias), (dtype, rows)

            # tensor parallel: ColwiseParallel, each rank's shards holding the whole amaxes
            with _seeded(7):
                layer = nn.Linear(16, 8).to(dtype)
            with torch.no_grad():
                layer.weight[:: 8 // world, 0] = 3.0  # the weight's amax in every rank's rows
            probe_subnormal(layer.weight.data)
            same = torch.Generator().manual_seed(20)  # the same on every rank: Replicate
            x, c = torch.randn(32, 16, generator=same).to(dtype), torch.randn(32, 8, generator=same)
            x[0, 0] = 4.0
            probe_subnormal(x)
            c = c.to(dtype)
            c[0, :] = 8.0  # the output gradient's amax in every rank's columns
            probe_subnormal(c, 57344.0, 2.0**-16)
            columns = slice(rank * 8 // world, (rank + 1) * 8 // world)
            local = {
                k: v.detach()[columns].clone().requires_grad_() for k, v in layer.named_parameters()
            }
            parallelize_module(layer, mesh, ColwiseParallel(use_local_output=False))
            fn = fp8fn.transform(layer, recipe)
            cold = fn.init(x)
            observed = fp8fn.observe(cold)
            xs = x.clone().requires_grad_()
            out = fn.apply(dict(layer.named_parameters()), observed, xs)
            (out.to_local() * c[:, columns]).sum().backward()
            site = fp8fn.observe(cold)
            xp = x.clone().requires_grad_()
            want = fp8fn.linear(xp, local["weight"], local["bias"], site[""], recipe)
            (want * c[:, columns]).sum().backward()
            assert torch.equal(out.to_local(), want), dtype
            summed = xp.grad.clone()
            dist.all_reduce(summed)  # the ranks' partial sums (Colwise: Partial, then Replicate)
            assert torch.equal(xs.grad, summed), dtype
            for k, p in layer.named_parameters():
                assert torch.equal(p.grad.to_local(), local[k].grad), (dtype, k)
            bias = c[:, columns].to(g_dtype).float().sum(0).to(dtype)
            assert torch.equal(layer.bias.grad.to_local(), bias), dtype
            assert_bit_identical(fp8fn.observations(observed), fp8fn.observations(site))


class RowHeadNet(nn.Module):
    """fc1 (16 -> 8) -> GELU -> head (8 -> 1); sites `fc1`, `head`. The head's weight and bias
    hold 1 row: on 2 ranks, rank 1 holds none of either. The head's weight starts at zero (a
    zero-initialized output layer), so its history fills one step after the others."""

    def __init__(self):
        super().__init__()
        with _seeded(8):
            self.fc1, self.head = nn.Linear(16, 8), nn.Linear(8, 1)
        with torch.no_grad():
            self.head.weight.zero_()

    def forward(self, x):
        return self.head(F.gelu(self.fc1(x)))


def fsdp_rank_without_rows_steps(rank):
    """Functional FSDP where the last rank holds no rows of a weight (a 1-row head on 2 ranks),
    over 5 steps with `fp8fn.update` and SGD between them (DelayedScaling(history_len=4,
    margin=2)), bit for bit against the plain params on the same process and data (the
    observations all-reduced as data parallel does, the gradients the mean over the ranks):
    outputs, input gradients, weight and bias gradients, params, observations and states after
    each update. Step 1 is cold; the zero head weight observes 0 and keeps its history empty,
    so at step 2 only it is cast with the whole weight's amax (one all-reduce in the steps, 2
    at step 1, none from step 3: every weight cast with its stored scale). Each rank's own
    weight observation is its shard's amax, exactly 0 on the rank without rows. The checks of a
    rank's own values are agreed over the ranks before any raises (`assert_on_every_rank`), so
    that a slip fails every rank by an assertion, none by a collective's timeout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert dist.get_world_size() == 2  # (the gradients' mean over 2 ranks is exact)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, lr = RowHeadNet(), 0.1
    probe_subnormal(model.fc1.weight.data)
    fn = fp8fn.transform(model, fp8fn.DelayedScaling(history_len=4, margin=2))
    g = torch.Generator().manual_seed(30 + rank)  # each rank its own rows
    x, c = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    x[0, 0] = 4.0
    probe_subnormal(x)
    ref_params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in ref_params.items()}
    assert [params[k].to_local().shape[0] for k in ("head.weight", "head.bias")] == [1 - rank] * 2
    state = ref_state = fn.init(x)

    def loss(p, s, x):
        return (fn.apply(p, s, x) * c).sum()

    site_of = {k: state._positions()[k.split(".")[0]] for k in ("fc1.weight", "head.weight")}
    reduces = []
    for step in range(5):
        with _Counting() as counted:
            out = fn.apply(params, state, x)
            grads, obs, gx = torch.func.grad(loss, argnums=(0, 1, 2))(params, state, x)
        reduces.append([call[0] for call in counted.calls].count("all_reduce"))
        ref_grads, ref_obs, ref_gx = torch.func.grad(loss, argnums=(0, 1, 2))(
            ref_params, ref_state, x
        )
        # this rank's own (checked on all ranks at once): output and input gradient as the plain
        # run's; observations of inputs and output gradients as its, of weights the shard's
        # amax (0 for no rows)
        mine, want = obs.amax_history[..., 0], ref_obs.amax_history[..., 0]
        checks = {
            "output": torch.equal(bits(out), bits(fn.apply(ref_params, ref_state, x))),
            "input gradient": torch.equal(bits(gx), bits(ref_gx)),
            "input, grad_output observations": torch.equal(mine[:, 0::2], want[:, 0::2]),
        }
        for k, i in site_of.items():
            local = params[k].to_local()
            shard_amax = local.abs().max() if local.numel() else torch.tensor(0.0)
            checks[f"{k} observation"] = torch.equal(mine[i, 1], shard_amax)
        assert_on_every_rank({f"step {step + 1}: {what}": v for what, v in checks.items()})
        for k, grad in grads.items():  # the same on every rank
            assert torch.equal(grad.full_tensor(), _mean_over_ranks(ref_grads[k])), (step, k)
        obs, ref_obs = fp8fn.all_reduce(obs), fp8fn.all_reduce(ref_obs)
        assert_bit_identical(obs, ref_obs)
        state, ref_state = fp8fn.update(state, obs), fp8fn.update(ref_state, ref_obs)
        assert_bit_identical(state, ref_state)
        if step == 0:  # empty after step 1: the head's weight, fc1's output gradient
            empty = (state.amax_history[..., 0] == 0).nonzero().tolist()
            assert empty == sorted([[site_of["head.weight"], 1], [site_of["fc1.weight"], 2]])
        params = {k: v - lr * grads[k] for k, v in params.items()}
        ref_params = {k: v - lr * _mean_over_ranks(ref_grads[k]) for k, v in ref_params.items()}
        for k, v in params.items():
            assert torch.equal(v.full_tensor(), ref_params[k]), (step, k)
    # one all-reduce of a scalar per weight cast from its whole amax, in each of a step's two
    # forwards (the call, the one under grad): none once every history is filled
    assert reduces == [4, 2, 0, 0, 0], reduces
    assert (state.amax_history[:, :, 0] > 0).all()
    assert (state.amax_history[site_of["head.weight"], 1] > 0).all()  # 4 entries: steps 2-5
    assert_state_same_on_all_ranks(state)


# --- 2-D: TP inside, FSDP2 over the data-parallel mesh dim -------------------------------------


def two_d_tp_and_fsdp2(rank):
    """Mesh (dp=2, tp=2): parallelize_module on "tp", then fully_shard per layer and the root on
    "dp" (torchtitan's order). Plain autograd and torch.optim; FSDP2's hooks swap in the
    unsharded TP weights, which fp8fn finds as the ones its layers hold. 3 steps match one
    process; states equal on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].size()
    x, t = _tp_data(batch=8)
    rows = x.shape[0] // dp
    mine = slice(mesh["dp"].get_local_rank() * rows, (mesh["dp"].get_local_rank() + 1) * rows)
    ref = TPNet()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()})
    for m in (model.net[0], model.net[2], model.norm, model):
        fully_shard(m, mesh=mesh["dp"])
    fn, ref_fn = fp8fn.transform(model, RECIPE), fp8fn.transform(ref, RECIPE)
    ref_params = dict(ref.named_parameters())
    ref_cold = ref_fn.init(x)
    ref_obs = _ref_step(ref_fn, ref_params, ref_cold, x, t)[1]
    state, ref_state = _warmed(ref_cold, ref_obs, dp), fp8fn.update(ref_cold, ref_obs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        observed = fp8fn.observe(state)
        out = fn.apply(dict(model.named_parameters()), observed, x[mine])
        (out - t[mine]).square().mean().backward()  # this rank's mean: FSDP2 averages over dp
        obs = fp8fn.all_reduce(fp8fn.observations(observed))  # over dp x tp: the world
        ref_grads, ref_obs = _ref_step(ref_fn, ref_params, ref_state, x, t)
        if step == 0:
            _check_obs(obs, ref_obs, dp, False, "2d_obs_grad_output_rel")
            for k, p in model.named_parameters():
                assert _measure("2d_grad_rel_err", _rel(p.grad, ref_grads[k])) < 1e-6, k
        opt.step()
        opt.zero_grad()
        ref_params = {k: v - LR * ref_grads[k] for k, v in ref_params.items()}
        state, ref_state = fp8fn.update(state, obs), fp8fn.update(ref_state, ref_obs)
    assert_state_same_on_all_ranks(state)
    for k, p in model.named_parameters():
        assert _measure("2d_params_rel_err_3_steps", _rel(p, ref_params[k])) < 1e-6, k


SCENARIOS = {
    f.__name__: f
    for f in (
        fsdp_step1_weight_cast_with_whole_amax,
        fsdp_functional_routes_and_steps,
        fsdp_finer_recipe_layer_gathers_in_high_precision,
        fsdp_errors,
        fsdp_edges,
        fsdp_checkpoint_fn_and_higher_order,
        fsdp_tied_weights,
        torch_private_dtensor_helpers,
        tp_colwise_rowwise,
        tp_checkpoint_fn,
        tp_sequence_parallel,
        current_scaling_sharded,
        sharded_margin_bias_and_rows,
        fsdp_rank_without_rows_steps,
        two_d_tp_and_fsdp2,
    )
}


def main(rank: int, world_size: int, port: int, out_dir: str, names: list) -> None:
    scenarios = [SCENARIOS[name] for name in names]
    run_scenarios(rank, world_size, port, out_dir, scenarios, MEASURED, group_timeout_s=60)
