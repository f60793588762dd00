"""`fp8fn.update(state, obs)` refuses a keyed state (a model with NVFP4 layers) passed as the
observation, whatever else about it looks like an observation (issue 38.10, class E): a
history zero past its newest entry, scales fp8fn has not seen (neither marked valid nor the
state's own), only the nonzero key tells it from an observation."""

import pytest
import torch
from _models import MLP

import fp8fn

NOT_AN_OBSERVATION = r"^fp8fn\.update: expected `obs` an observation .* and a key of 0\), got"


def _keyed_state():
    """A delayed state of 2 sites with a random key 5 (as `fn.init` gives a model that also has
    NVFP4 layers), and an observation-shaped history: `(state, history)`."""
    state = fp8fn.init_state(fp8fn.DelayedScaling(history_len=4), ["a", "b"])
    state = state._replace(key=torch.tensor(5.0, dtype=torch.float64))
    history = torch.zeros(2, 3, 4)
    history[..., 0] = torch.tensor([2.0, 0.5, 3e-4])
    return state, history


@pytest.mark.parametrize(
    "scale",
    [lambda s: torch.full_like(s, 3.0), lambda s: torch.zeros_like(s), lambda s: s.clone()],
    ids=["unseen-scales", "zero-scales", "copied-scales"],
)
def test_a_keyed_state_shaped_like_an_observation_is_refused(scale):
    state, history = _keyed_state()
    bad = state._replace(amax_history=history, scale=scale(state.scale))
    before = (state.amax_history.clone(), state.scale.clone(), state.key.clone())
    with pytest.raises(RuntimeError, match=NOT_AN_OBSERVATION):
        fp8fn.update(state, bad)
    for a, b in zip(before, (state.amax_history, state.scale, state.key)):
        assert torch.equal(a, b)  # nothing changed
    # The same values with the observation's key (0) are an observation.
    new = fp8fn.update(state, bad._replace(key=torch.zeros_like(state.key)))
    assert torch.equal(new.amax_history[..., 0], history[..., 0])
    assert new.key.item() == 6.0


def test_an_nvfp4_models_state_passed_as_its_observation_is_refused():
    """A real keyed state (`fn.init` of an NVFP4 model: no delayed site, so the key is all
    that differs) after one step, passed back as the observation, and rebuilt with fresh
    scales so no identity or mark tells it."""
    fn = fp8fn.transform(MLP((32, 48, 16), seed=0), fp8fn.NVFP4Scaling())
    x = torch.randn(4, 32)
    state = fn.init(x)
    state = fp8fn.update(state, fp8fn.observations(fp8fn.observe(state)))
    assert state.key.item() != 0
    rebuilt = state._replace(
        amax_history=state.amax_history.clone(), scale=torch.zeros_like(state.scale)
    )
    with pytest.raises(RuntimeError, match=NOT_AN_OBSERVATION):
        fp8fn.update(state, rebuilt)
