"""Per-site overhead of fp8fn: ops dispatched per linear, time per tiny site, `update` scaling.

Standalone: `python benchmarks/overhead.py [--repeats N] [--quick]`. The package never imports
it; torchao (`pip install -e ".[bench]"`) is optional. Three tables, measured in one run:

1. **Ops dispatched per linear forward + backward**, counted with a `TorchDispatchMode` (every
   ATen op that reaches the dispatcher: kernels, views and metadata ops alike). The layer is a
   middle layer (input, weight and bias all require grad), at step 2 (after one `update`, so the
   delayed scales are in use). Rows: float32 `F.linear`; torchao 0.18 `Float8Linear`
   (tensorwise, emulate=True); fp8fn `DelayedScaling` eager on the torch.func route
   (`torch.func.vjp`) and on the plain autograd route (`fp8fn.observe`, `backward()`), for the
   backends "emulated" and "scaled_mm" (`torch._scaled_mm` runs on CPU as a slow reference
   kernel, fine at these shapes). fp8fn's forward includes `state[site]` (its rows of the
   packed state).
2. **Time per tiny site**: 128 chained 16x16 linear layers, forward + backward (median), where
   per-op overhead dominates: float32, torchao, fp8fn on both routes; ratios to torchao.
3. **`fp8fn.update`** for 8, 64, 512 and 4096 sites, as a ratio to 8 sites.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import logging
import warnings

import torch
import torch.nn.functional as F
from _common import median_times, print_table, ratio
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8fn

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
SHAPE = (64, 64)  # (batch, features) of the layer whose ops are counted


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _operands(seed=0):
    gen = torch.Generator().manual_seed(seed)
    m, k = SHAPE
    x = torch.randn(m, k, generator=gen).requires_grad_()
    w = (torch.randn(k, k, generator=gen) / k**0.5).requires_grad_()
    b = torch.randn(k, generator=gen).requires_grad_()
    g = torch.randn(m, k, generator=gen)
    return x, w, b, g


# ------------------------------------------------------------------ ops per linear, each route


def _count_float32():
    x, w, b, g = _operands()
    with OpCounter() as fwd:
        out = F.linear(x, w, b)
    with OpCounter() as bwd:
        out.backward(g)
    return fwd.total, bwd.total


def _torchao_layer(in_features, out_features, n_layers=1):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(*(nn.Linear(in_features, out_features) for _ in range(n_layers)))
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    return convert_to_float8_training(model, config=config)


def _count_torchao():
    x, w, b, g = _operands()
    layer = _torchao_layer(*SHAPE[::-1])
    with torch.no_grad():
        layer[0].weight.copy_(w)
        layer[0].bias.copy_(b)
    layer(x).backward(g)  # step 1
    with OpCounter() as fwd:
        out = layer(x)
    with OpCounter() as bwd:
        out.backward(g)
    return fwd.total, bwd.total


def _stepped_state(recipe):
    """The state of site "fc" after one observed step: delayed scales in use."""
    x, w, b, g = _operands(1)
    state = fp8fn.observe(fp8fn.init_state(recipe, ["fc"]))
    fp8fn.linear(x, w, b, state["fc"], recipe).backward(g)
    return fp8fn.update(state, fp8fn.observations(state))


def _count_fp8fn_autograd(backend):
    recipe = fp8fn.DelayedScaling(backend=backend)
    x, w, b, g = _operands()
    state = fp8fn.observe(_stepped_state(recipe))
    with OpCounter() as fwd:
        out = fp8fn.linear(x, w, b, state["fc"], recipe)
    with OpCounter() as bwd:
        out.backward(g)
    assert fp8fn.observations(state)["fc"].grad_output.amax_history[0] == g.abs().max()
    return fwd.total, bwd.total


def _count_fp8fn_func(backend):
    recipe = fp8fn.DelayedScaling(backend=backend)
    x, w, b, g = (t.detach() for t in _operands())
    state = _stepped_state(recipe)

    def f(x, w, b, state):
        return fp8fn.linear(x, w, b, state["fc"], recipe)

    with OpCounter() as fwd:
        _, vjp_fn = torch.func.vjp(f, x, w, b, state)
    with OpCounter() as bwd:
        *_, obs = vjp_fn(g)
    assert obs["fc"].grad_output.amax_history[0] == g.abs().max()
    return fwd.total, bwd.total


def count_ops() -> dict:
    rows = {"float32 F.linear": _count_float32()}
    if HAS_TORCHAO:
        rows["torchao Float8Linear (emulate)"] = _count_torchao()
    for backend in ("emulated", "scaled_mm"):
        rows[f"fp8fn torch.func, {backend}"] = _count_fp8fn_func(backend)
        rows[f"fp8fn autograd, {backend}"] = _count_fp8fn_autograd(backend)
    return rows


# ------------------------------------------------------------------ time per tiny site


def _chain(n_layers, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(n_layers)))


def time_tiny_sites(n_layers, repeats, warmup=3) -> dict:
    model = _chain(n_layers)
    x = torch.randn(16, 16)
    g = torch.randn(16, 16) / 16
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    recipe = fp8fn.DelayedScaling(backend="emulated")
    fn = fp8fn.transform(model, recipe)
    holder = {"autograd": fn.init(x), "func": fn.init(x)}

    def float32():
        torch.func.functional_call(model, params, (x,)).backward(g)

    def fp8fn_autograd():
        state = fp8fn.observe(holder["autograd"])
        fn.apply(params, state, x).backward(g)
        holder["autograd"] = fp8fn.update(holder["autograd"], fp8fn.observations(state))

    plain = {k: v.detach() for k, v in params.items()}

    def loss(p, s):
        return (fn.apply(p, s, x) * g).sum()

    grad = torch.func.grad(loss, argnums=(0, 1))

    def fp8fn_func():
        _, obs = grad(plain, holder["func"])
        holder["func"] = fp8fn.update(holder["func"], obs)

    variants = {
        "float32": float32,
        "fp8fn autograd": fp8fn_autograd,
        "fp8fn torch.func": fp8fn_func,
    }
    if HAS_TORCHAO:
        ao = _torchao_layer(16, 16, n_layers)
        ao.load_state_dict(model.state_dict())

        def torchao():
            ao.zero_grad(set_to_none=True)
            ao(x).backward(g)

        variants["torchao"] = torchao
    return median_times(variants, repeats, warmup=warmup)


# ------------------------------------------------------------------ update scaling


def time_update(sizes, repeats) -> dict:
    recipe = fp8fn.DelayedScaling(history_len=16)
    calls = {}
    for n in sizes:
        gen = torch.Generator().manual_seed(n)
        state = fp8fn.init_state(recipe, [f"l{i}" for i in range(n)])
        history = torch.rand(state.amax_history.shape, generator=gen)
        state = state._replace(amax_history=history)
        seen = torch.zeros_like(history)
        seen[..., 0] = torch.rand(history.shape[:-1], generator=gen)  # an observation
        obs = state._replace(amax_history=seen)
        calls[n] = lambda state=state, obs=obs: fp8fn.update(state, obs)
    return median_times(calls, repeats)


# ------------------------------------------------------------------ main


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=128, help="tiny layers chained")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="16 layers, 3 repeats, 8/64 sites")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.layers = 3, 16
    sizes = (8, 64) if args.quick else (8, 64, 512, 4096)
    torch.set_num_threads(args.threads)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    ops = count_ops()
    tiny = time_tiny_sites(args.layers, args.repeats)
    update = time_update(sizes, max(args.repeats, 5))

    base = ops["float32 F.linear"]
    ao = ops.get("torchao Float8Linear (emulate)")
    print(
        f"1. ops dispatched per linear forward + backward: middle layer {SHAPE}, x, weight and "
        "bias require grad, step 2"
    )
    header = ["route", "forward", "backward", "total", "x float32", "x torchao"]
    rows = [
        [name, f, b, f + b, ratio(f + b, sum(base)), ratio(f + b, sum(ao)) if ao else "-"]
        for name, (f, b) in ops.items()
    ]
    print_table(header, rows)

    print(
        f"\n2. time per tiny site: {args.layers} chained 16x16 linears, forward + backward, "
        f"median of {args.repeats}, {args.threads} thread(s)"
    )
    ref = tiny.get("torchao")
    rows = [
        [
            name,
            f"{t * 1e3:.2f}",
            f"{t / args.layers * 1e6:.1f}",
            ratio(t, tiny["float32"]),
            ratio(t, ref) if ref else "-",
        ]
        for name, t in tiny.items()
    ]
    print_table(["route", "step ms", "us/site", "x float32", "x torchao"], rows)

    print("\n3. fp8fn.update on the packed state, eager, history_len 16")
    rows = [[n, f"{t * 1e3:.3f}", ratio(t, update[sizes[0]])] for n, t in update.items()]
    print_table(["sites", "ms", "x 8 sites"], rows)


if __name__ == "__main__":
    main()
