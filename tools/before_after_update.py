"""`fp8fn.update` before and after a change, side by side in one process (1 thread, interleaved
rounds in a new order each round): 8, 64, 512 and 4096 sites, history_len 16, on two states:

* `rebuilt`: random histories put in with `_replace` (what `benchmarks/update_scaling.py` times:
  a state fp8fn did not make, so each call checks its history and reads which are filled);
* `updated`: the same state after one `update` (a training loop's state: made by `update`).

The "before" package is an older fp8fn imported as `fp8fn_base`, as for
`tools/before_after_overhead.py`:

    mkdir -p /tmp/base && git archive <commit> fp8fn | tar -x -C /tmp/base
    mv /tmp/base/fp8fn /tmp/base/fp8fn_base
    PYTHONPATH=$PWD:/tmp/base python tools/before_after_update.py [repeats]
"""

import sys

import fp8fn_base
import torch

import fp8fn

sys.path.insert(0, "benchmarks")
from _common import median_times  # noqa: E402

torch.set_num_threads(1)
REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
SIZES = (8, 64, 512, 4096)


def cases(fp, n: int) -> dict:
    """`{kind: call}`: `fp.update` of a rebuilt and of an updated state of `n` sites."""
    gen = torch.Generator().manual_seed(n)
    state = fp.init_state(fp.DelayedScaling(history_len=16), [f"l{i}" for i in range(n)])
    history = torch.rand(state.amax_history.shape, generator=gen) * 10
    state = state._replace(amax_history=history)
    seen = torch.zeros_like(history)
    seen[..., 0] = torch.rand(history.shape[:-1], generator=gen) * 10
    obs = state._replace(amax_history=seen, scale=torch.zeros_like(state.scale))
    updated = fp.update(fp.update(state, obs), obs)  # (past its first reads of `filled`)
    return {
        "rebuilt": lambda: fp.update(state, obs),
        "updated": lambda: fp.update(updated, obs),
    }


calls = {}
for name, fp in (("before", fp8fn_base), ("after", fp8fn)):
    for n in SIZES:
        for kind, call in cases(fp, n).items():
            calls[name, kind, n] = call
for kind in ("rebuilt", "updated"):  # the same bits before and after
    for n in SIZES:
        a, b = calls["before", kind, n](), calls["after", kind, n]()
        assert torch.equal(a.amax_history, b.amax_history), (kind, n)
        assert torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32)), (kind, n)
t = median_times(calls, REPEATS, warmup=3, shuffle=0, rewarm=True)
print(f"fp8fn.update, eager, 1 thread, history_len 16, median of {REPEATS} interleaved rounds")
print("state    sites  before ms  after ms  after/before  before x8  after x8")
for kind in ("rebuilt", "updated"):
    for n in SIZES:
        before, after = t["before", kind, n], t["after", kind, n]
        b8, a8 = t["before", kind, SIZES[0]], t["after", kind, SIZES[0]]
        print(
            f"{kind:8s} {n:5d} {before * 1e3:10.3f} {after * 1e3:9.3f} {after / before:12.2f}x "
            f"{before / b8:9.2f}x {after / a8:8.2f}x"
        )
