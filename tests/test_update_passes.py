"""`fp8fn.update`'s element work: a fixed number of passes over the state's size whatever the
number of sites (one read of the observation, one write of the new histories, one reduction for
the window's max; the history's own check only for a history `update` did not make), and the
same bits as a per-row Python model on many rows, leading dims and non-contiguous histories."""

import math

import pytest
import torch
from _helpers import FP8_MAX, ROLES, bits, expected_scale
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fp8fn

# Observed amaxes: pushed (> 0 and finite, down to the smallest subnormal and up to float32's
# max) and not (0, -0, negative, inf, NaN).
OBSERVED = [3.0, 0.0, 1e-45, -0.0, 3e38, -2.0, 7.25, math.inf, 0.5, -math.inf, math.nan, 448.0]
# The eager roll writes through `out=` views: on a GPU too, where there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class BigPasses(TorchDispatchMode):
    """The names of the non-view ATen ops that read or write a tensor of at least `size`
    elements, in order (allocations, which read nothing, left out)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.names = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        touched = inputs + [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if inputs and not func.is_view and max(t.numel() for t in touched) >= self.size:
            self.names.append(func.overloadpacket.__name__)
        return out


def _case(n_sites: int, recipe=fp8fn.DelayedScaling(history_len=16), lead=(), seed: int = 0):
    """A state of `recipe` with random histories (amaxes >= 0, some 0 and -0) and scales, not
    made by `update`, and an observation of it drawing every site's roles from `OBSERVED`."""
    gen = torch.Generator().manual_seed(seed)
    state = fp8fn.init_state(recipe, [f"blocks.{i}.fc" for i in range(n_sites)])
    shape = (*lead, n_sites, 3, recipe.history_len)
    history = torch.rand(shape, generator=gen) * 100
    history[torch.rand(shape, generator=gen) < 0.2] = 0.0
    history[torch.rand(shape, generator=gen) < 0.1] = -0.0
    pick = torch.randint(len(OBSERVED), shape[:-1], generator=gen)
    observed = torch.zeros(shape)
    observed[..., 0] = torch.tensor(OBSERVED)[pick]
    scale = torch.rand(shape[:-1], generator=gen) + 0.5
    state = state._replace(amax_history=history, scale=scale)
    return state, state._replace(amax_history=observed, scale=torch.zeros_like(scale))


def _model(state: fp8fn.State, obs: fp8fn.State) -> tuple[torch.Tensor, torch.Tensor]:
    """The new histories and scales, row by row in Python floats (float64)."""
    histories, scales = state.amax_history.tolist(), state.scale.flatten().tolist()
    rows = list(_rows(histories))
    fp8_max = [FP8_MAX[r] for r in ROLES]
    new_rows, new_scales = [], []
    for i, (row, a) in enumerate(zip(rows, obs.amax_history[..., 0].flatten().tolist())):
        if a > 0 and math.isfinite(a):
            row = [a, *row[:-1]]
            used = max(row) if state.amax_compute == "max" else row[0]
            new_scales.append(expected_scale(used, fp8_max[i % 3], state.margin))
        else:
            new_scales.append(torch.tensor(scales[i]))
        new_rows.append(row)
    shape = state.amax_history.shape
    return torch.tensor(new_rows).view(shape), torch.stack(new_scales).view(shape[:-1])


def _rows(nested):
    if nested and isinstance(nested[0], list):
        for part in nested:
            yield from _rows(part)
    else:
        yield nested


@pytest.mark.parametrize("history_len", [1, 2, 16])
@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
@pytest.mark.parametrize("layout", ["contiguous", "leading dims", "non-contiguous"])
@pytest.mark.parametrize("device", DEVICES)
def test_update_of_many_rows_matches_the_row_model(history_len, amax_compute, layout, device):
    lead = (2,) if layout == "leading dims" else ()
    recipe = fp8fn.DelayedScaling(history_len=history_len, amax_compute=amax_compute, margin=1)
    state, obs = _case(40, recipe, lead, seed=history_len)
    if layout == "non-contiguous":  # the same values, every other site's rows of a buffer
        n, _, h = state.amax_history.shape
        history = torch.full((n, 2, 3, h), math.nan)[:, 0]
        history.copy_(state.amax_history)
        assert not history.is_contiguous()
        state = state._replace(amax_history=history)
    want_history, want_scale = _model(state, obs)
    state, obs = state.to(device), obs.to(device)
    new = fp8fn.update(state, obs)
    assert torch.equal(bits(new.amax_history.cpu()), bits(want_history))
    assert torch.equal(bits(new.scale.cpu()), bits(want_scale))
    again = fp8fn.update(new, obs)  # from a history update made (its check skipped)
    want_history, want_scale = _model(new, obs)
    assert torch.equal(bits(again.amax_history.cpu()), bits(want_history))
    assert torch.equal(bits(again.scale.cpu()), bits(want_scale))


@pytest.mark.parametrize("made_by_update", [True, False])
def test_update_makes_a_fixed_number_of_passes_over_the_state(made_by_update):
    """One read of the observation (its older entries: a sum of magnitudes), one write of the new
    histories, one reduction for the window's max; the check of the history itself (one
    reduction) only for a history `update` did not make. The same at 8 and 512 sites."""
    passes = []
    for n in (8, 512):
        state, obs = _case(n)
        if made_by_update:
            state = fp8fn.update(state, obs)
        size = state.amax_history.numel() * 15 // 16  # the observation's older entries
        with BigPasses(size) as seen:
            fp8fn.update(state, obs)
        passes.append(seen.names)
    check = [] if made_by_update else ["aminmax"]
    assert passes == [["abs", "sum", *check, "index_select", "amax"]] * 2


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, -math.inf])
@pytest.mark.parametrize("entry", [0, 15])
def test_update_refuses_a_history_it_did_not_make_holding_a_non_amax(value, entry):
    """A rebuilt state (never marked) with NaN, inf or a negative entry, the newest or the
    oldest: refused in the graph, the state unchanged."""
    state, obs = _case(4)
    state.amax_history[2, 1, entry] = value
    before = bits(state.amax_history).clone()
    with pytest.raises(RuntimeError, match=r"^fp8fn\.update: expected `state\.amax_history`"):
        fp8fn.update(state, obs)
    assert torch.equal(bits(state.amax_history), before)


@pytest.mark.parametrize("value", [1e-45, -1e-45, 3.0, -3.0, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("opposite", [False, True])
def test_update_refuses_an_observation_with_any_older_entry_not_zero(value, opposite):
    """The smallest subnormal of either sign, NaN and inf among the older entries, alone or
    beside its opposite (a sum would cancel them): a state, not an observation. (-0 is zero:
    accepted, as 0.)"""
    state, obs = _case(4)
    obs.amax_history[3, 2, 7] = value
    if opposite:
        obs.amax_history[0, 0, 1] = -value
    with pytest.raises(RuntimeError, match=r"^fp8fn\.update: expected `obs` an observation"):
        fp8fn.update(state, obs)
    obs.amax_history[3, 2, 7] = obs.amax_history[0, 0, 1] = -0.0
    assert torch.equal(bits(fp8fn.update(state, obs).amax_history), bits(_model(state, obs)[0]))
