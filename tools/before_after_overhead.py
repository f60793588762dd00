"""Eager overhead before and after a change, side by side in one process (1 thread): ops per
linear (torch.func route, step 2), time per tiny site on both routes (filled state, interleaved
rounds, against torchao), and `update` on 8 and 512 sites.

The "before" package is an older fp8fn imported as `fp8fn_base` (fp8fn imports itself only
relatively, so a renamed copy imports beside it):

    mkdir -p /tmp/base && git archive <commit> fp8fn | tar -x -C /tmp/base
    mv /tmp/base/fp8fn /tmp/base/fp8fn_base
    PYTHONPATH=$PWD:/tmp/base python tools/before_after_overhead.py [layers] [repeats]
"""

import logging
import sys
import warnings

sys.path.insert(0, "benchmarks")
import fp8fn_base
import overhead
import torch
from _common import median_times

import fp8fn

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)
LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 64
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 15


def tiny(fp, layers):
    model = overhead._chain(layers)
    x = torch.randn(16, 16)
    g = torch.randn(16, 16) / 16
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    recipe = fp.DelayedScaling(backend="emulated")
    fn = fp.transform(model, recipe)
    holder = {}
    for route in ("autograd", "func"):  # filled state: one step and its update
        state = fp.observe(fn.init(x))
        fn.apply(params, state, x).backward(g)
        holder[route] = fp.update(fn.init(x), fp.observations(state))

    def autograd():
        state = fp.observe(holder["autograd"])
        fn.apply(params, state, x).backward(g)
        holder["autograd"] = fp.update(holder["autograd"], fp.observations(state))

    plain = {k: v.detach() for k, v in params.items()}
    grad = torch.func.grad(lambda p, s: (fn.apply(p, s, x) * g).sum(), argnums=(0, 1))

    def func():
        _, obs = grad(plain, holder["func"])
        holder["func"] = fp.update(holder["func"], obs)

    return autograd, func


def count_func(fp, m, k, n):
    recipe = fp.DelayedScaling(backend="emulated")
    gen = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(m, k, generator=gen),
        torch.randn(n, k, generator=gen) / k**0.5,
        torch.randn(n, generator=gen),
    )
    gout = torch.randn(m, n, generator=gen)
    state = fp.observe(fp.init_state(recipe, ["fc"]))
    fp.linear(
        x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), state["fc"], recipe
    ).backward(gout)
    state = fp.update(fp.init_state(recipe, ["fc"]), fp.observations(state))
    x, w, b = x.detach(), w.detach(), b.detach()

    def f(x, w, b, s):
        return fp.linear(x, w, b, s["fc"], recipe)

    with overhead.OpCounter() as fwd:
        _, vjp = torch.func.vjp(f, x, w, b, state)
    with overhead.OpCounter() as bwd:
        vjp(gout)
    return fwd.total + bwd.total


def updates(fp, sizes):
    recipe = fp.DelayedScaling(history_len=16)
    calls = {}
    for n in sizes:
        gen = torch.Generator().manual_seed(n)
        state = fp.init_state(recipe, [f"l{i}" for i in range(n)])
        history = torch.rand(state.amax_history.shape, generator=gen)
        state = state._replace(amax_history=history)
        seen = torch.zeros_like(history)
        seen[..., 0] = torch.rand(history.shape[:-1], generator=gen)
        obs = state._replace(amax_history=seen)
        calls[n] = lambda state=state, obs=obs: fp.update(state, obs)
    return calls


print("ops per linear, torch.func route, step 2 (forward + backward):")
for shape in ((64, 64, 64), (256, 256, 512)):
    before, after = count_func(fp8fn_base, *shape), count_func(fp8fn, *shape)
    print(f"  m,k,n={shape}: before {before}  after {after}")

fns = {}
for name, fp in (("before", fp8fn_base), ("after", fp8fn)):
    a, f = tiny(fp, LAYERS)
    fns[f"{name} autograd"], fns[f"{name} torch.func"] = a, f
ao = overhead._torchao_layer(16, 16, LAYERS)
ao.load_state_dict(overhead._chain(LAYERS).state_dict())
x, g = torch.randn(16, 16), torch.randn(16, 16) / 16
ao(x).backward(g)


def torchao():
    ao.zero_grad(set_to_none=True)
    ao(x).backward(g)


fns["torchao"] = torchao
t = median_times(fns, REPEATS, warmup=2, shuffle=0)
print(
    f"\ntiny sites: {LAYERS} chained 16x16 linears, fwd+bwd+update, filled state, 1 thread, "
    f"median of {REPEATS} interleaved rounds"
)
for k, v in t.items():
    print(
        f"  {k:20s} {v * 1e3:8.2f} ms  {v / LAYERS * 1e6:7.1f} us/site  "
        f"{v / t['torchao']:.2f}x torchao"
    )

sizes = (8, 512)
calls = {}
for name, fp in (("before", fp8fn_base), ("after", fp8fn)):
    for n, c in updates(fp, sizes).items():
        calls[f"{name} {n}"] = c
u = median_times(calls, 30, warmup=3, shuffle=0)
print("\nupdate, eager, history_len 16, median of 30 interleaved rounds")
for name in ("before", "after"):
    small, large = u[f"{name} 8"], u[f"{name} 512"]
    print(f"  {name}: 8 sites {small * 1e3:.3f} ms, 512 sites {large * 1e3:.3f} ms, ", end="")
    print(f"ratio {large / small:.2f}x")
