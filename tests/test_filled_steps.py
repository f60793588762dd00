"""Histories that fill at different steps (issue 38.10, class B): roles, sites and ensemble
members that observe nothing at first. Each step of a training loop must give the same bits as
the same loop where "filled" is unknown (every step's state rebuilt on a clone of its history,
so fp8fn knows nothing of its values and reads them), and where what fp8fn knew is stale (the
values copied in place into a state whose histories were all filled): the filled fast path
(cast with the stored scale alone) may only be taken where the history is really filled.
"""

import pytest
import torch
from _helpers import CountHostReads, CountOps, assert_bit_identical

import fp8fn

DELAYED_MARGIN_2 = fp8fn.DelayedScaling(history_len=4, margin=2, backend="emulated")
STEPS = 4


def _grad_fn(fn):
    """`(params, state, x) -> ((grads, obs), loss)`, the loss `mean((fn(x) - 1)**2)` (a zero
    output still has a gradient)."""
    loss = lambda p, s, x: (fn.apply(p, s, x) - 1.0).square().mean()  # noqa: E731
    return torch.func.grad_and_value(loss, argnums=(0, 1))


def _forget(state):
    """The same values, without what fp8fn knows of them (filled, valid scales)."""
    return state._replace(amax_history=state.amax_history.clone())


def _copied_into_warm(init):
    """A rebuild that keeps a stale fact: `state -> warm` with `state`'s values copied in place
    into `warm`, a state of `init`'s structure whose histories were all filled (its structure
    and its tensors' marks say so, until the copy changes them)."""
    newest = torch.zeros_like(init.amax_history)
    newest[..., 0] = 1.0
    warm = fp8fn.update(
        init, init._replace(amax_history=newest, scale=torch.zeros_like(init.scale))
    )
    assert all(warm.filled)

    def copied_into_warm(state):
        warm.amax_history.copy_(state.amax_history)
        warm.scale.copy_(state.scale)
        return warm

    return copied_into_warm


def _train(step_fn, params, state, x, rebuild):
    """`STEPS` steps of `step_fn(params, rebuild(state), x) -> ((grads, obs), loss)`, SGD lr
    0.5 and `fp8fn.update(state, obs)`: per step `(loss, grads, obs, new state's tensors, which
    of its histories are filled, as a tuple of bools per role, read from the values)`."""
    trace = []
    for _ in range(STEPS):
        (grads, obs), loss = step_fn(params, rebuild(state), x)
        params = {k: p - 0.5 * grads[k] for k, p in params.items()}
        state = fp8fn.update(state, obs)
        filled = tuple((state.amax_history[..., 0] > 0).flatten().tolist())
        trace.append((loss, grads, obs, state.amax_history, state.scale, filled))
    return trace


def _assert_same_steps(fn, params, x, step_fn=None, init=None):
    """The loop with `filled` known, unknown (`_forget`) and stale (`_copied_into_warm`), bit
    for bit at each step; returns which histories are filled after each step."""
    step_fn = step_fn or _grad_fn(fn)
    init = init if init is not None else fn.init(x)
    known = _train(step_fn, params, init, x, lambda s: s)
    for rebuild in (_forget, _copied_into_warm(init)):
        for step, (a, b) in enumerate(zip(known, _train(step_fn, params, init, x, rebuild))):
            try:
                assert_bit_identical(a, b)
            except AssertionError as e:
                raise AssertionError(f"step {step}, {rebuild.__name__}") from e
    return [a[5] for a in known]


def _mlp(zero, seed=0):
    """Linear 16->32 -> GELU -> Linear 32->32 -> GELU -> Linear 32->8, no biases, the layers
    in `zero` zero-initialized."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32, bias=False),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32, bias=False),
        torch.nn.GELU(),
        torch.nn.Linear(32, 8, bias=False),
    )
    with torch.no_grad():
        for i in zero:
            model[i].weight.zero_()
    fn = fp8fn.transform(model, DELAYED_MARGIN_2)
    x = torch.randn(6, 16) * torch.logspace(-3, 1, 6)[:, None]
    return fn, {k: v.detach() for k, v in model.named_parameters()}, x


def _fills_late(filled):
    assert not all(filled[0]) and all(filled[-1]), filled


@pytest.mark.parametrize(
    "zero",
    [[0], [2], [4]],
    ids=["first", "middle", "last"],
)
def test_zero_initialized_layers_fill_later(zero):
    """A zero-initialized weight observes 0 at step 1, and so do the layer downstream of it (its
    input) and the layers upstream (their grad_output); they fill once SGD has moved it."""
    fn, params, x = _mlp(zero)
    _fills_late(_assert_same_steps(fn, params, x))


class _Skip(torch.nn.Module):
    """fc1 -> (fc2 unless `skip`) -> fc3; `skip` is read at each forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(16, 16, bias=False) for _ in range(3))
        self.skip = False

    def forward(self, x):
        h = self.fc1(x)
        return self.fc3(h if self.skip else torch.relu(self.fc2(h)))


def test_a_middle_site_that_does_not_run_at_step_1():
    model = _Skip()
    fn = fp8fn.transform(model, DELAYED_MARGIN_2)
    x = torch.randn(5, 16)
    params = {k: v.detach() for k, v in model.named_parameters()}
    init = fn.init(x)
    grad = _grad_fn(fn)

    def step_fn(params, state, x, calls=[0]):
        model.skip = calls[0] % STEPS == 0  # step 1 of each run skips fc2
        calls[0] += 1
        return grad(params, state, x)

    filled = _assert_same_steps(fn, params, x, step_fn, init)
    assert filled[0] == (True,) * 3 + (False,) * 3 + (True,) * 3
    assert all(filled[1])


def test_a_site_that_never_runs_costs_update_two_host_reads_in_all():
    """fc2 never runs (its histories stay empty): `update` reads which histories are filled in
    its first 2 calls only (warm-up), then leaves the empty ones to the graph: 0 reads per step,
    and the steps still match the loop that reads them every time (`_forget`)."""
    model = _Skip()
    fn = fp8fn.transform(model, DELAYED_MARGIN_2)
    x = torch.randn(5, 16)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fn.init(x)
    model.skip = True
    grad = _grad_fn(fn)
    reads = []
    for _ in range(STEPS):
        (_, obs), _ = grad(params, state, x)
        with CountHostReads() as c:
            state = fp8fn.update(state, obs)
        reads.append(len(c.reads))
    assert reads == [1, 1, 0, 0]
    assert not state.amax_history[1].any()
    _assert_same_steps(fn, params, x, grad)


def test_stacked_members_that_fill_at_different_steps():
    """Two members under vmap (`fp8fn.stack_states`): member 0 with a zero-initialized middle
    layer, member 1 without; the stacked histories fill at different steps per member."""
    fn, p0, x = _mlp(zero=[2], seed=0)
    _, p1, _ = _mlp(zero=[], seed=1)
    params = {k: torch.stack([p0[k], p1[k]]) for k in p0}
    init = fp8fn.stack_states([fn.init(x), fn.init(x)])
    step = _grad_fn(fn)
    ensemble = torch.func.vmap(step, in_dims=(0, 0, None))
    _fills_late(_assert_same_steps(fn, params, x, ensemble, init))
    # the members' histories differ in what they filled after step 1
    (_, obs), _ = ensemble(params, init, x)
    seen = obs.amax_history[..., 0] > 0
    assert not torch.equal(seen[0], seen[1])


def _linear_step(route):
    """`(params, state, x) -> ((grads, obs), loss)` of three chained `fp8fn.linear` calls (sites
    a, b, c; GELUs between), on torch.func (`grad_and_value`) or plain autograd (`observe`,
    `backward`)."""

    def loss(params, state, x):
        h = torch.nn.functional.gelu(
            fp8fn.linear(x, params["a"], None, state["a"], DELAYED_MARGIN_2)
        )
        h = torch.nn.functional.gelu(
            fp8fn.linear(h, params["b"], None, state["b"], DELAYED_MARGIN_2)
        )
        return (
            (fp8fn.linear(h, params["c"], None, state["c"], DELAYED_MARGIN_2) - 1.0).square().mean()
        )

    if route == "func":
        return torch.func.grad_and_value(loss, argnums=(0, 1))

    def step(params, state, x):
        leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
        observed = fp8fn.observe(state)
        value = loss(leaves, observed, x)
        value.backward()
        return (
            {k: p.grad for k, p in leaves.items()},
            fp8fn.observations(observed),
        ), value.detach()

    return step


@pytest.mark.parametrize("route", ["func", "autograd"])
def test_functional_linear_knows_its_sites_filled_from_updates_mark(route):
    """`fp8fn.linear` on `state[site]` of a state `update` made casts a role with the stored
    scale alone where `update` marked its history filled (no current scale chosen in the graph),
    bit for bit the loop where that is unknown or stale, also while the roles of the sites
    around a zero-initialized middle weight fill late."""
    fn, params, x = _mlp([2])
    params = dict(zip("abc", params.values()))
    init = fp8fn.init_state(DELAYED_MARGIN_2, list("abc"))
    step = _linear_step(route)
    _fills_late(_assert_same_steps(fn, params, x, step, init))
    _, params, x = _mlp([])  # every history filled by step 1's observations
    params = dict(zip("abc", params.values()))
    with CountOps() as ops:
        (_, obs), _ = step(params, init, x)
    assert ops.ops["aten.gt"] == 6  # step 1: stored or current scale, chosen in the graph
    state = fp8fn.update(init, obs)
    assert all(state.filled)
    with CountOps() as ops:
        step(params, state, x)
    assert ops.ops["aten.gt"] == 0  # the stored scales alone
    with CountOps() as ops:  # the same values, unknown
        step(params, state._replace(amax_history=state.amax_history.clone()), x)
    assert ops.ops["aten.gt"] == 6
