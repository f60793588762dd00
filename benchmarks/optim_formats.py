"""The float8 moment formats of `fp8fn.optim`, measured on the demo's gradient stream.

Standalone: `python benchmarks/optim_formats.py [--steps 200 --seed 0] [--quick]` (`--quick`:
20 steps). The package never
imports it. It trains the demo's GPT (`fp8fn.demo`, default size, float32, the demo's AdamW
settings: betas (0.9, 0.95), lr 3e-3 with warmup and cosine, clip 1.0) with float32 moments,
records the gradients of every parameter with >= 4096 elements, then replays that fixed stream
through AdamW moments kept in each candidate format:

    m_t = Q_m(b1 * m_{t-1} + (1 - b1) * g_t)      v_t = Q_v(b2 * v_{t-1} + (1 - b2) * g_t**2)

(`Q` rounds to the format and back; the step uses the unrounded new moments, as
`fp8fn.optim` does), beside exact float32 moments. Reported, as SQNR in dB (20 log10 of
|ref| / |ref - x|, over all recorded parameters together):

* `m`, `v`: the stored moment after the last step (errors accumulated over the stream);
* `update`: the AdamW direction `m_hat / (sqrt(v_hat) + eps)` of the last step, and its mean
  over the steps after the first 10 (`update mean`);
* `bytes`: bytes per parameter of that moment (1 byte + the block's scales).

A candidate names the format, the transform before the cast (`sqrt`: `v` kept as its root;
`coat`: COAT's dynamic range expansion `sign(x) |x|**k` with `k` per block, arXiv 2410.19313,
`k = log(format range) / log(block range)` capped at 4; `coat1`: the same with `k <= 1`, a
compression only),
the scale (`pow2`: a power of two, `exact`: `fp8_max / amax`) and the block size.
"""

from __future__ import annotations

import argparse
import math

import torch
from _common import print_table

from fp8fn.optim._blocks import FORMATS, fp8_max

B1, B2, EPS = 0.9, 0.95, 1e-8


def record_stream(steps: int, seed: int) -> list[dict]:
    """The clipped gradients of the demo's float32 run, per step, of its large parameters."""
    import fp8fn
    from fp8fn.demo import GPT, Corpus, batches, learning_rate

    corpus = Corpus.load()
    torch.manual_seed(seed)
    model = GPT(len(corpus.chars), 64, 128, 2, 4)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    warmup = max(1, steps // 20)
    opt = fp8fn.optim.adamw(
        lambda count: learning_rate(int(count), steps, 3e-3, warmup),
        betas=(B1, B2),
        eps=EPS,
        weight_decay=0.1,
        decay_mask=lambda p: p.dim() >= 2,
    )
    state = opt.init(params)

    def loss_fn(params, x, y):
        return torch.func.functional_call(model, params, (x, y))

    grad = torch.func.grad(loss_fn)
    stream = []
    for x, y in batches(corpus.train, steps, 32, 64, seed):
        grads, _ = fp8fn.optim.clip_by_global_norm(grad(params, x, y), 1.0)
        stream.append({k: g for k, g in grads.items() if g.numel() >= 4096})
        params, state = opt.update(grads, state, params)
    return stream


def _scale(amax: torch.Tensor, fmt: str, kind: str) -> torch.Tensor:
    top = fp8_max(fmt)
    if kind == "exact":
        return (top / amax.double().clamp(min=1e-30)).float()
    k = torch.floor(torch.log2(top / amax.double().clamp(min=1e-30))).clamp(max=126)
    return torch.exp2(k).float()


def round_trip(x: torch.Tensor, fmt: str, transform: str, scale: str, block: int) -> torch.Tensor:
    """`x` (float32) through the candidate format and back, blocks of the flat index."""
    n = x.numel()
    flat = torch.nn.functional.pad(x.flatten(), (0, -n % block)).view(-1, block)
    sign, mag = flat.sign(), flat.abs()
    if transform == "sqrt":
        mag = mag.double().sqrt().float()
    if transform in ("coat", "coat1"):  # |x|**k fills the format's range (min subnormal to max)
        nonzero = torch.where(mag > 0, mag, torch.inf)
        lo, hi = nonzero.amin(1, keepdim=True), mag.amax(1, keepdim=True)
        fmt_range = math.log(fp8_max(fmt) / 2.0 ** (-9 if fmt == "e4m3" else -16))
        ratio = torch.log(hi / lo).clamp(min=1e-6)
        k = (fmt_range / ratio).clamp(max=4.0 if transform == "coat" else 1.0)
        k = torch.where(torch.isfinite(k), k, 1.0)
        mag = mag.double().pow(k).float()
    s = _scale(mag.amax(1, keepdim=True), fmt, scale)
    out = (mag * s).clamp(max=fp8_max(fmt)).to(FORMATS[fmt][0]).float() / s
    if transform == "sqrt":
        out = out * out
    if transform in ("coat", "coat1"):
        out = out.double().pow(1.0 / k).float()
    return (sign * out).flatten()[:n].view(x.shape)


def sqnr(ref: list, x: list) -> float:
    num = sum(float(r.double().square().sum()) for r in ref)
    den = sum(float((r.double() - y.double()).square().sum()) for r, y in zip(ref, x))
    return 10 * math.log10(num / den) if den else math.inf


def replay(stream, m_fmt=None, v_fmt=None) -> dict:
    """SQNRs of one candidate (None: that moment exact) over the recorded stream."""
    names = list(stream[0])
    m = {k: torch.zeros_like(g) for k, g in stream[0].items()}
    v = {k: torch.zeros_like(g) for k, g in stream[0].items()}
    mq, vq = dict(m), dict(v)
    ups = []
    for t, grads in enumerate(stream, 1):
        c1, c2 = 1 - B1**t, 1 - B2**t
        u_ref, u_q = [], []
        for k in names:
            g = grads[k]
            m[k] = B1 * m[k] + (1 - B1) * g
            v[k] = B2 * v[k] + (1 - B2) * g * g
            mn = B1 * mq[k] + (1 - B1) * g
            vn = B2 * vq[k] + (1 - B2) * g * g
            u_ref.append((m[k] / c1) / ((v[k] / c2).sqrt() + EPS))
            u_q.append((mn / c1) / ((vn / c2).sqrt() + EPS))
            mq[k] = mn if m_fmt is None else round_trip(mn, *m_fmt)
            vq[k] = vn if v_fmt is None else round_trip(vn, *v_fmt)
        if t > 10:
            ups.append(sqnr(u_ref, u_q))
    return {
        "m": sqnr([m[k] for k in names], [mq[k] for k in names]),
        "v": sqnr([v[k] for k in names], [vq[k] for k in names]),
        "update": ups[-1],
        "update mean": sum(ups) / len(ups),
    }


CANDIDATES_M = [
    ("e4m3", "none", "pow2", 128),
    ("e4m3", "none", "exact", 128),
    ("e5m2", "none", "pow2", 128),
    ("e4m3", "coat", "exact", 128),
    ("e4m3", "coat1", "exact", 128),
    ("e4m3", "none", "pow2", 32),
    ("e4m3", "none", "pow2", 256),
]
CANDIDATES_V = [
    ("e4m3", "none", "pow2", 128),
    ("e4m3", "none", "exact", 128),
    ("e4m3", "coat1", "exact", 128),
    ("e5m2", "none", "pow2", 128),
    ("e4m3", "sqrt", "pow2", 128),
    ("e4m3", "sqrt", "exact", 128),
    ("e5m2", "sqrt", "pow2", 128),
    ("e4m3", "coat", "exact", 128),
    ("e4m3", "sqrt", "pow2", 32),
    ("e4m3", "sqrt", "pow2", 256),
]


def bytes_per_param(candidate) -> float:
    fmt, transform, _, block = candidate
    return 1 + (8 if transform.startswith("coat") else 4) / block


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/optim_formats.py")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 20
    torch.set_num_threads(1)
    stream = record_stream(args.steps, args.seed)
    n = sum(g.numel() for g in stream[0].values())
    print(f"{args.steps} steps of the demo's gradients, {len(stream[0])} tensors, {n:,} elements")
    rows = [("m", c, replay(stream, m_fmt=c)) for c in CANDIDATES_M]
    rows += [("v", c, replay(stream, v_fmt=c)) for c in CANDIDATES_V]
    chosen = ("e4m3", "none", "exact", 128)
    rows += [("m+v", chosen, replay(stream, chosen, chosen))]
    print_table(
        ("moment", "format transform scale block", "bytes", "m dB", "v dB", "update dB",
         "update mean dB"),
        [
            (which, " ".join(map(str, c)), f"{bytes_per_param(c) * (1 + (which == 'm+v')):.3f}",
             *(f"{r[k]:.1f}" for k in ("m", "v", "update", "update mean")))
            for which, c, r in rows
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
