"""Benchmark `fp8fn.update` (eager) against a naive per-site Python loop.

Standalone: `python benchmarks/update_scaling.py [--repeats N]`. The package never imports it.
The goal (issue 2): 1024 sites cost under 8x of 8 sites, because `update` is batched.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import fp8fn

SIZES = (8, 16, 64, 256, 1024)
FP8_MAX = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}


def make_state(n_sites: int, recipe: fp8fn.DelayedScaling) -> dict:
    """A state after a few steps (non-empty histories) and realistic observations."""
    gen = torch.Generator().manual_seed(n_sites)
    state, obs = {}, {}
    for i in range(n_sites):
        roles, role_obs = [], []
        for _ in fp8fn.SiteState._fields:
            s = fp8fn.init_site_state(recipe).input
            history = torch.rand(recipe.history_len, generator=gen) * 10
            roles.append(s._replace(amax_history=history, scale=448.0 / history.max()))
            o = torch.zeros(recipe.history_len)
            o[0] = torch.rand((), generator=gen) * 10
            zero = torch.zeros(())
            role_obs.append(fp8fn.ScaleState(o, zero, zero, zero))
        state[f"blocks.{i}.fc"] = fp8fn.SiteState(*roles)
        obs[f"blocks.{i}.fc"] = fp8fn.SiteState(*role_obs)
    return state, obs


def naive_update(state: dict, obs: dict) -> dict:
    """The obvious implementation: a few small kernels per tensor role, per site."""
    new = {}
    for site, site_state in state.items():
        roles = []
        for role, s, o in zip(fp8fn.SiteState._fields, site_state, obs[site]):
            a = o.amax_history[0]
            if not (a > 0 and torch.isfinite(a)):
                roles.append(s)
                continue
            history = torch.cat([a.reshape(1), s.amax_history[:-1]])
            window = int(s.amax_window)
            amax = history[:window].max()
            scale = fp8fn.compute_scale(amax, FP8_MAX[role], s.margin)
            roles.append(s._replace(amax_history=history, scale=scale))
        new[site] = fp8fn.SiteState(*roles)
    return new


def time_once(fn, *args) -> float:
    """Milliseconds of one call, after an untimed call that warms caches for this size."""
    fn(*args)
    start = time.perf_counter()
    out = fn(*args)
    elapsed = (time.perf_counter() - start) * 1e3
    del out  # freeing the result is not part of the call
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--history-len", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    random.seed(0)
    recipe = fp8fn.DelayedScaling(history_len=args.history_len)
    cases = {n: make_state(n, recipe) for n in SIZES}
    for n, (state, obs) in cases.items():  # warm up, and check the two agree exactly
        got, want = fp8fn.update(state, obs), naive_update(state, obs)
        leaves = torch.utils._pytree.tree_leaves
        assert all(torch.equal(a, b) for a, b in zip(leaves(got), leaves(want))), n
    times = {n: {"update": [], "naive": []} for n in SIZES}
    order = list(SIZES)
    for _ in range(args.repeats):  # interleave sizes, in a new order each time, so that drift
        random.shuffle(order)  # and the after-effects of a large case fall on all sizes alike
        for n in order:
            state, obs = cases[n]
            times[n]["update"].append(time_once(fp8fn.update, state, obs))
            times[n]["naive"].append(time_once(naive_update, state, obs))
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    base, naive_base = med[SIZES[0]]["update"], med[SIZES[0]]["naive"]
    print(f"fp8fn.update, eager, history_len={args.history_len}, median of {args.repeats}")
    print(f"{'sites':>6} {'update ms':>10} {'ratio':>7} {'naive ms':>10} {'naive ratio':>12}")
    for n in SIZES:
        u, v = med[n]["update"], med[n]["naive"]
        print(f"{n:>6} {u:>10.3f} {u / base:>7.2f} {v:>10.3f} {v / naive_base:>12.2f}")


if __name__ == "__main__":
    main()
