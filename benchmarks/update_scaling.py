"""Benchmark `fp8fn.update` (eager) on the packed state against a naive per-site Python loop.

Standalone: `python benchmarks/update_scaling.py [--repeats N] [--quick]`. The package never
imports it. `update` works on the packed `fp8fn.State` (two tensors for all sites), so its cost
should barely depend on the number of sites: the goal is that 4096 sites cost under 8x of 8
sites. The naive loop updates each role of each site with a few small kernels and a host sync,
as a per-site state would, and is checked to give bit-identical results.
"""

from __future__ import annotations

import argparse

import torch
from _common import median_times, print_table, ratio

import fp8fn

SIZES = (8, 64, 512, 4096)
QUICK_SIZES = (8, 64)
ROLES = ("input", "weight", "grad_output")
FP8_MAX = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}


def make_state(n_sites: int, recipe: fp8fn.DelayedScaling) -> tuple[fp8fn.State, fp8fn.State]:
    """A state after a few steps (non-empty histories) and a realistic observation of it."""
    gen = torch.Generator().manual_seed(n_sites)
    state = fp8fn.init_state(recipe, [f"blocks.{i}.fc" for i in range(n_sites)])
    history = torch.rand(state.amax_history.shape, generator=gen) * 10
    fp8_max = torch.tensor([FP8_MAX[r] for r in ROLES])
    state = state._replace(amax_history=history, scale=fp8_max / history.amax(-1))
    observed = torch.zeros_like(history)
    observed[..., 0] = torch.rand(history.shape[:-1], generator=gen) * 10
    return state, state._replace(amax_history=observed, scale=torch.zeros_like(state.scale))


def naive_update(state: fp8fn.State, obs: fp8fn.State) -> fp8fn.State:
    """The obvious implementation: a few small kernels and a host sync per role, per site."""
    histories, scales = [], []
    for site, site_state in state.items():
        observed = obs[site]
        for r, role in enumerate(ROLES):
            history, scale = site_state.amax_history[r], site_state.scale[r]
            a = observed.amax_history[r, 0]
            if a > 0 and torch.isfinite(a):
                history = torch.cat([a.reshape(1), history[:-1]])
                amax = history.max() if state.amax_compute == "max" else history[0]
                scale = fp8fn.compute_scale(amax, FP8_MAX[role], state.margin)
            histories.append(history)
            scales.append(scale)
    n, h = len(state), state.history_len
    return state._replace(
        amax_history=torch.stack(histories).view(n, 3, h), scale=torch.stack(scales).view(n, 3)
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--naive-repeats", type=int, default=5, help="the naive loop is slow")
    parser.add_argument("--history-len", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="8 and 64 sites, 3 repeats")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = 3 if args.quick else args.repeats
    naive_repeats = min(repeats, args.naive_repeats)
    torch.set_num_threads(1)
    recipe = fp8fn.DelayedScaling(history_len=args.history_len)
    cases = {n: make_state(n, recipe) for n in sizes}
    for n, (state, obs) in cases.items():  # warm up, and check the two agree exactly
        got, want = fp8fn.update(state, obs), naive_update(state, obs)
        assert torch.equal(got.amax_history, want.amax_history), n
        assert torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32)), n
    # Sizes interleaved, in a new order every round, so that drift and the after-effects of a
    # large case fall on all sizes alike; each call after an untimed one that warms caches for
    # its size.
    timing = {"warmup": 0, "shuffle": 0, "rewarm": True}
    update = median_times(
        {n: (lambda c=cases[n]: fp8fn.update(*c)) for n in sizes}, repeats, **timing
    )
    naive = median_times(
        {n: (lambda c=cases[n]: naive_update(*c)) for n in sizes}, naive_repeats, **timing
    )
    rows = []
    for n in sizes:
        u, v = update[n] * 1e3, naive[n] * 1e3
        base, naive_base = update[sizes[0]] * 1e3, naive[sizes[0]] * 1e3
        rows.append(
            [n, f"{u:.3f}", ratio(u, base), f"{v:.3f}", ratio(v, naive_base), ratio(v, u, 1)]
        )
    print_table(
        ["sites", "update ms", "x 8 sites", "naive ms", "naive x 8", "naive/update"],
        rows,
        title=f"fp8fn.update on the packed state, eager, 1 thread, "
        f"history_len={args.history_len}; median of {repeats} (naive loop: of {naive_repeats})",
    )
    largest = sizes[-1]
    growth = update[largest] / update[sizes[0]]
    verdict = "met" if growth < 8 else "MISSED"
    print(f"\ngoal: update of {largest} sites < 8x of {sizes[0]} sites: {growth:.2f}x  {verdict}")


if __name__ == "__main__":
    main()
