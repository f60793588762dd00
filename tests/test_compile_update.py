import math

import torch
from _helpers import assert_bit_identical, site_obs

import fp8fn


def test_update_compiled_fullgraph_bit_identical_to_eager():
    torch._dynamo.reset()
    compiled = torch.compile(fp8fn.update, fullgraph=True)
    recipes = {
        "fc1": fp8fn.DelayedScaling(history_len=4),
        "fc2": fp8fn.DelayedScaling(history_len=4, amax_compute="most_recent", margin=1),
        "fc3": fp8fn.DelayedScaling(history_len=2, margin=3),
    }
    eager = {site: fp8fn.init_site_state(r) for site, r in recipes.items()}
    steps = [
        (3.0, 5.0, 7.0),
        (0.5, math.nan, 0.0),
        (2.5, math.inf, 1e-30),
        (6.0, 1e-3, 3e4),
    ]
    state = eager
    for amaxes in steps:
        obs = {site: site_obs(len(s.input.amax_history), *amaxes) for site, s in eager.items()}
        obs["fc3"] = obs["fc3"]._replace(weight=None)
        eager = fp8fn.update(eager, obs)
        state = compiled(state, obs)
        assert_bit_identical(state, eager)
    assert eager["fc1"].input.amax_history.tolist() == [6.0, 2.5, 0.5, 3.0]
