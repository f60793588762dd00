"""Record fp8fn's numbers on a small MLP, for every recipe and route, as SHA-256 digests.

Run from a checkout of fp8fn 0.3 (commit 509a66d) to make `tests/data/golden_v0_3.pt`:

    git worktree add /tmp/v03 509a66d
    cd /tmp/v03 && python /path/to/tools/golden_v0_3.py /path/to/tests/data/golden_v0_3.pt

`tests/test_scaling.py` recomputes the same records with today's code (`records()`) and
compares them bit for bit. Only public API (plus the fp8 cast, found under either layout) is
used, so the script runs on 0.3 and on later versions alike.
"""

from __future__ import annotations

import hashlib
import sys

import torch

import fp8fn

try:  # the layout since 0.4
    from fp8fn._numerics.fp8 import E4M3, E5M2, cast_to_fp8
except ImportError:  # 0.3
    from fp8fn._quantize import E4M3, E5M2, cast_to_fp8

RECIPES = {
    "delayed": lambda: fp8fn.DelayedScaling(history_len=4),
    "delayed_recent_margin": lambda: fp8fn.DelayedScaling(amax_compute="most_recent", margin=1),
    "current": fp8fn.CurrentScaling,
    "rowwise": fp8fn.RowwiseScaling,
    "rowwise_gw_hp": lambda: fp8fn.RowwiseScaling(hp_grad_weight=True),
    "mx": fp8fn.MXScaling,
    "blockwise": fp8fn.BlockwiseScaling,
    "nvfp4": fp8fn.NVFP4Scaling,
}


def digest(t: torch.Tensor) -> str:
    """The SHA-256 of `t`'s dtype, shape and bytes (hex)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False)
    ).to(dtype)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(24, 64, generator=g) * (1 + i) for i in range(2)]


def _step(fn, params, state, x, route: str):
    """`(out, param grads, obs)` of one step of the loss `out.square().mean()`."""
    if route == "func":

        def loss(p, s):
            out = fn.apply(p, s, x)
            return out.square().mean(), out

        (grads, obs), out = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(params, state)
        return out, grads, obs
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    observed = fp8fn.observe(state)
    out = fn.apply(leaves, observed, x)
    out.square().mean().backward()
    return out, {k: v.grad for k, v in leaves.items()}, fp8fn.observations(observed)


def records() -> dict[str, str]:
    """`{name: digest}` of outputs, parameter gradients, observations, updated states and fp8
    casts, for every recipe (delayed with empty and with filled histories), route (torch.func
    grad, plain autograd) and input dtype (float32; bfloat16 for the per-tensor recipes)."""
    out: dict[str, str] = {}
    xs = _batches()
    cases = [(name, make, torch.float32) for name, make in RECIPES.items()]
    cases += [(f"{name}_bf16", RECIPES[name], torch.bfloat16) for name in ("delayed", "current")]
    for rname, make, dtype in cases:
        for route in ("func", "autograd"):
            model = _model(dtype)
            fn = fp8fn.transform(model, make())
            params = {k: v.detach() for k, v in model.named_parameters()}
            state = fn.init(xs[0])
            for step, x in enumerate(xs):  # step 0: empty histories; step 1: filled
                x = x.to(dtype)
                tag = f"{rname}/{route}/{step}"
                y, grads, obs = _step(fn, params, state, x, route)
                out[f"{tag}/out"] = digest(y)
                for k, g in grads.items():
                    out[f"{tag}/grad/{k}"] = digest(g)
                if len(state):
                    out[f"{tag}/obs"] = digest(obs.amax_history)
                if len(state) or state.key is not None:
                    state = fp8fn.update(state, obs)
                    out[f"{tag}/history"] = digest(state.amax_history)
                    out[f"{tag}/scale"] = digest(state.scale)
                if state.key is not None:
                    out[f"{tag}/key"] = digest(state.key)
    # the per-tensor casts themselves: stored (delayed) and current scales, both formats
    x = xs[1].to(torch.bfloat16)
    for dtype, name in ((E4M3, "e4m3"), (E5M2, "e5m2")):
        fp8_max = torch.finfo(dtype).max
        for scale_name, scale in (
            ("current", fp8fn.compute_scale(x.abs().max().float(), fp8_max)),
            ("stored", torch.tensor(3.7)),
            ("margin1", fp8fn.compute_scale(torch.tensor(2.5), fp8_max, margin=1)),
        ):
            out[f"cast/{name}/{scale_name}"] = digest(cast_to_fp8(x, scale, dtype))
    return out


def main(path: str) -> None:
    rec = records()
    torch.save({"fp8fn": "0.3 (509a66d)", "torch": str(torch.__version__), "records": rec}, path)
    print(f"{len(rec)} records -> {path}")


if __name__ == "__main__":
    main(sys.argv[1])
