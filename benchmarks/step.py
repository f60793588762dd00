"""One training step (forward + backward + scaling update) of an MLP and a small transformer.

Standalone: `python benchmarks/step.py [--repeats N] [--threads T] [--quick]`, after
`pip install -e ".[bench]"` (torchao). The package never imports it. Variants, run
alternately in one process (warmup, then the median of N repeats of each): plain float32 and
bfloat16; fp8fn DelayedScaling and CurrentScaling, eager and `torch.compile(fn.apply)` with
plain autograd (`fp8fn.observe` / `fp8fn.observations`); fp8fn DelayedScaling on the torch.func
route, eager (`torch.func.grad_and_value`) and compiled (`torch.compile(fp8fn.value_and_grad)`);
torchao `Float8Linear` (emulate=True, tensorwise dynamic scaling), eager and compiled. Goals
(issue 5): fp8fn eager <= 0.8x torchao eager; compiled fp8fn <= 1.3x compiled float32.
`--quick` runs a tiny MLP, two warmups and two repeats (a smoke run, numbers meaningless).
The transformer is the demo's character-level GPT (`fp8fn.demo.GPT`).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging

import torch
import torch.nn.functional as F
from _common import median_times, print_table, ratio
from torch import nn

import fp8fn
from fp8fn.demo import GPT

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _mlp(width, n_layers=4):
    """`n_layers` `width x width` linear layers with ReLUs between them."""
    layers = [nn.Linear(width, width)]
    for _ in range(n_layers - 1):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers)


def _mlp_case(quick, width, batch=256):
    width, batch = (32, 16) if quick else (width, batch)
    model = _mlp(width)
    x, y = torch.randn(batch, width), torch.randint(0, width, (batch,))
    return model, (x, y), F.cross_entropy


def _gpt_case(quick):
    d, seq, batch = (64, 32, 2) if quick else (256, 128, 8)
    vocab = 256
    model = GPT(vocab, seq, d_model=d, n_layers=2, n_heads=4)
    x, y = (torch.randint(0, vocab, (batch, seq)) for _ in range(2))
    return model, (x, y), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())


def _plain_step(model, compile_):
    run = torch.compile(model) if compile_ else model

    def step(x, y, loss_fn):
        model.zero_grad(set_to_none=True)
        loss_fn(run(x), y).backward()

    return step


def _fp8fn_step(model, recipe, compile_, x):
    fn = fp8fn.transform(model, recipe)
    apply = torch.compile(fn.apply, fullgraph=True) if compile_ else fn.apply
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    holder = {"state": fn.init(x)}

    def step(x, y, loss_fn):
        for p in params.values():
            p.grad = None
        stateful = isinstance(recipe, fp8fn.DelayedScaling)
        state = fp8fn.observe(holder["state"]) if stateful else holder["state"]
        loss_fn(apply(params, state, x), y).backward()
        if stateful:
            holder["state"] = fp8fn.update(holder["state"], fp8fn.observations(state))

    return step


def _fp8fn_func_step(model, recipe, compile_, x):
    """The torch.func route: grads and observations as a return value, no `.grad` anywhere."""
    fn = fp8fn.transform(model, recipe)
    params = {k: v.detach() for k, v in model.named_parameters()}
    holder = {"state": fn.init(x), "params": params}

    def make(loss_fn):
        def loss(params, state, x, y):
            return loss_fn(fn.apply(params, state, x), y)

        if compile_:
            return torch.compile(fp8fn.value_and_grad(loss, argnums=(0, 1)))
        grad_and_value = torch.func.grad_and_value(loss, argnums=(0, 1))
        return lambda *args: grad_and_value(*args)[::-1]

    def step(x, y, loss_fn):
        if "value_and_grad" not in holder:
            holder["value_and_grad"] = make(loss_fn)
        _, (grads, obs) = holder["value_and_grad"](holder["params"], holder["state"], x, y)
        holder["state"] = fp8fn.update(holder["state"], obs)

    return step


def _torchao_step(model, compile_):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = convert_to_float8_training(
        copy.deepcopy(model), config=Float8LinearConfig(emulate=True)
    )
    return _plain_step(model, compile_)


def variants(model, x):
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    delayed, current = fp8fn.DelayedScaling(history_len=16), fp8fn.CurrentScaling()
    found = {
        "float32 eager": (_plain_step(model, False), False),
        "float32 compiled": (_plain_step(copy.deepcopy(model), True), False),
        "bfloat16 eager": (_plain_step(bf16, False), True),
        "fp8fn delayed eager": (_fp8fn_step(model, delayed, False, x), False),
        "fp8fn current eager": (_fp8fn_step(model, current, False, x), False),
        "fp8fn delayed compiled": (_fp8fn_step(model, delayed, True, x), False),
        "fp8fn current compiled": (_fp8fn_step(model, current, True, x), False),
        "fp8fn func eager": (_fp8fn_func_step(model, delayed, False, x), False),
        "fp8fn func compiled": (_fp8fn_func_step(model, delayed, True, x), False),
    }
    if HAS_TORCHAO:
        found["torchao eager"] = (_torchao_step(model, False), False)
        found["torchao compiled"] = (_torchao_step(model, True), False)
    return found


def measure(case, repeats, warmup):
    model, (x, y), loss_fn = case
    steps = variants(model, x)
    x_bf16 = x.to(torch.bfloat16) if x.is_floating_point() else x

    def call(step, bf16):
        return lambda: step(x_bf16 if bf16 else x, y, loss_fn)

    fns = {name: call(step, bf16) for name, (step, bf16) in steps.items()}
    return median_times(fns, repeats, warmup=warmup)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--mlp-width", type=int, default=1024, help="the 4-layer MLP's width")
    parser.add_argument("--mlp-batch", type=int, default=256, help="the MLP's batch (rows)")
    parser.add_argument("--mlp-only", action="store_true", help="skip the transformer")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 2, 2
    torch.set_num_threads(args.threads)
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cases = {"MLP": _mlp_case(args.quick, args.mlp_width, args.mlp_batch)}
    if not (args.quick or args.mlp_only):  # --quick: the MLP only (compiling the GPT takes minutes)
        cases["transformer"] = _gpt_case(args.quick)
    results = {name: measure(case, args.repeats, args.warmup) for name, case in cases.items()}
    names = list(next(iter(results.values())))
    print_table(
        ["variant", *results],
        [[name, *(f"{r[name] * 1e3:.2f}" for r in results.values())] for name in names],
        title=f"median step time (ms) of {args.repeats} repeats, {args.threads} threads",
    )
    ratios = [  # (numerator, denominator, goal)
        ("fp8fn delayed eager", "torchao eager", "goal <= 0.8"),
        ("fp8fn current eager", "torchao eager", "goal <= 0.8"),
        ("fp8fn delayed compiled", "float32 compiled", "<= 1.3"),
        ("fp8fn current compiled", "float32 compiled", "<= 1.3"),
        ("fp8fn delayed compiled", "torchao compiled", ""),
        ("fp8fn func compiled", "fp8fn func eager", ""),
        ("fp8fn func compiled", "fp8fn delayed compiled", ""),
        ("fp8fn func eager", "fp8fn delayed eager", ""),
        ("fp8fn func compiled", "torchao compiled", "<= 1.0"),
        ("fp8fn func compiled", "float32 compiled", "<= 1.3"),
        ("fp8fn delayed eager", "float32 eager", ""),
        ("torchao eager", "float32 eager", ""),
        ("bfloat16 eager", "float32 eager", ""),
    ]
    print()
    print_table(
        ["ratio", *results],
        [
            [
                f"{a} / {b}" + (f" ({goal})" if goal else ""),
                *(ratio(r[a], r[b]) for r in results.values()),
            ]
            for a, b, goal in ratios
            if a in names and b in names
        ],
    )


if __name__ == "__main__":
    main()
