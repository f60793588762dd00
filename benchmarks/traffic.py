"""Memory traffic of one compiled training step on the GPU path's graph, without a GPU.

Standalone: `python benchmarks/traffic.py [--quick]`, after `pip install -e ".[bench]"`
(torchao). The package never imports it. Each variant compiles one step (`torch.compile` of the
forward plus a loss, plain-autograd backward) with `torch._scaled_mm` GEMMs (fp8fn
`backend="scaled_mm"`, torchao `emulate=False`; `torch._scaled_mm` runs on CPU), and counts
inductor's generated kernels and the bytes they read and write (`torch._inductor.metrics`,
inductor's per-kernel read/write sizes; the extern GEMMs, the same for all, apart). These are
counts, not times: deterministic, and the same graph a GPU would run.

Variants: torchao `Float8Linear` tensorwise (emulate=False), fp8fn CurrentScaling, fp8fn
DelayedScaling with its histories filled (a step and an `update` first, so the measured step is
a steady-state one). Models: one bf16 `Linear(512, 1024, bias=False)` at batch 256, and a bf16
4-layer MLP (512 wide, ReLUs, batch 256), each as a first layer (weights passed as plain
tensors, the input needs no gradient) and as a *middle* one (the module's own Parameters, the
input needs its gradient: the graph a real step compiles, where torch.compile's partitioner
treats Parameters as free to save). Targets (issue 28, first layer): delayed <= 0.75x
torchao's bytes, <= 0.85x fp8fn current's, and no more generated kernels than torchao; (issue
39, middle layer) delayed <= 0.60x torchao's bytes (the floor, x, W and dY each read once:
0.53x), no more kernels. `--quick`: the linear cases only.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # count what is compiled

import torch  # noqa: E402
from _common import print_table, ratio  # noqa: E402
from torch import nn  # noqa: E402
from torch._inductor import metrics  # noqa: E402

import fp8fn  # noqa: E402

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _linear_case():
    torch.manual_seed(0)
    model = nn.Linear(512, 1024, bias=False).to(torch.bfloat16)
    return model, torch.randn(256, 512, dtype=torch.bfloat16)


def _mlp_case():
    torch.manual_seed(0)
    layers = [nn.Linear(512, 512, bias=False)]
    for _ in range(3):
        layers += [nn.ReLU(), nn.Linear(512, 512, bias=False)]
    return nn.Sequential(*layers).to(torch.bfloat16), torch.randn(256, 512, dtype=torch.bfloat16)


def measure(step) -> tuple[int, int]:
    """`(generated kernels, kernel bytes)` of compiling and running `step()` once (forward and
    backward graphs), extern kernels (GEMMs) apart."""
    torch._dynamo.reset()
    metrics.reset()
    step()
    kernels = metrics.generated_kernel_count
    nbytes = sum(
        node.get_read_write_buffers_sizes()
        for node, _ in metrics.nodes_num_elem
        if not node.is_extern()
    )
    return kernels, nbytes


def _torchao_step(model, x):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = convert_to_float8_training(
        copy.deepcopy(model), config=Float8LinearConfig(emulate=False)
    )
    run = torch.compile(lambda x: _loss(model(x)))
    return lambda: run(x).backward()


def _fp8fn_step(model, x, recipe, middle=False):
    fn = fp8fn.transform(model, recipe)
    if middle:  # the module's own Parameters (the partitioner treats them as free to save)
        params = dict(model.named_parameters())
    else:
        params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    state = fn.init(x)
    if len(state):  # fill the histories: one eager step and its update
        observed = fp8fn.observe(state)
        _loss(fn.apply(params, observed, x)).backward()
        state = fp8fn.update(state, fp8fn.observations(observed))
    run = torch.compile(lambda p, s, x: _loss(fn.apply(p, s, x)))

    def step():
        observed = fp8fn.observe(state)
        run(params, observed, x).backward()
        return fp8fn.observations(observed)

    return step


CASES = {  # name: (model and input, middle: the module's Parameters and an input needing grad)
    "linear 512x1024": (_linear_case, False),
    "linear 512x1024, middle": (_linear_case, True),
    "MLP 4x512": (_mlp_case, False),
    "MLP 4x512, middle": (_mlp_case, True),
}


def variants(model, x, middle: bool = False) -> dict:
    """`{name: step}` of the variants on `model` and its input `x`; `middle`: the module's
    Parameters and an input that needs its gradient (a layer inside a network)."""
    if middle:
        x = x.requires_grad_()
    out = {}
    if HAS_TORCHAO:
        out["torchao tensorwise"] = _torchao_step(model, x)
    for name, recipe in (("current", fp8fn.CurrentScaling), ("delayed", fp8fn.DelayedScaling)):
        out[f"fp8fn {name}"] = _fp8fn_step(model, x, recipe(backend="scaled_mm"), middle)
    return out


def table(quick: bool) -> dict:
    """`{(model, variant): (kernels, bytes)}`, printed as a table with ratios."""
    cases = {k: v for k, v in CASES.items() if not quick or k.startswith("linear")}
    results = {}
    rows = []
    for cname, (make, middle) in cases.items():
        model, x = make()
        for vname, step in variants(model, x, middle).items():
            results[cname, vname] = measure(step)
        base = results.get((cname, "torchao tensorwise"))
        current = results[cname, "fp8fn current"]
        for vname in ("torchao tensorwise", "fp8fn current", "fp8fn delayed"):
            if (cname, vname) not in results:
                continue
            kernels, nbytes = results[cname, vname]
            rows.append(
                [
                    cname,
                    vname,
                    str(kernels),
                    f"{nbytes / 1e6:.2f}",
                    ratio(nbytes, base[1]) if base else "-",
                    ratio(nbytes, current[1]),
                ]
            )
    print_table(["model", "variant", "kernels", "MB", "/ torchao", "/ current"], rows, left=2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the linear cases only")
    args = parser.parse_args()
    torch._logging.set_logs(inductor_metrics=True)  # makes inductor count bytes per kernel
    table(args.quick)


if __name__ == "__main__":
    main()
