"""`fp8fn.optim.adamw`: AdamW as a pair of pure functions over a pytree of params, with
float32, bfloat16 or block-scaled float8 moments (docs/optim.md).

One step of one parameter `p` (float32 arithmetic; `t` the step count after this step):

    m = b1 * m_old + (1 - b1) * g
    v = b2 * v_old + (1 - b2) * g * g
    p = p - lr * ((m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps) + wd * p)

`sqrt` is float32's correctly rounded square root (computed in float64), so eager and compiled
steps agree bit for bit. The step uses this step's unrounded `m` and `v`; the state keeps them
rounded to the moments' format (float8: block-scaled e4m3, `_blocks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .._core.keys import advance_key, fold_key, initial_key
from .._numerics.nvfp4 import random_bits
from .._torch_private import (
    dtensor_local_or_none,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)
from ._blocks import MAX_EXPONENT, dequantize, n_blocks, quantize
from ._checks import check_grads, check_params, check_state
from ._layout import Layout, global_index, layout_of, local_of, shard_like
from ._state import MASTERS, MOMENT_FORMAT, MOMENTS, AdamWState, MomentConfig
from ._state import QuantizedMoment as QM


class PureOptimizer(NamedTuple):
    """A pair of pure functions (optax's shape, returning params rather than updates).

    Attributes:
      init: `init(params, seed=0) -> state`.
      update: `update(grads, state, params) -> (params, state)`; nothing passed in is changed.
    """

    init: Callable
    update: Callable


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """float32's correctly rounded square root (eager float32 `sqrt` on some CPUs is not;
    inductor's is: through float64 both give these bits)."""
    return x.double().sqrt().float()


def _zero_moment(p: torch.Tensor, layout: Layout, config: MomentConfig, quantized: bool):
    local = local_of(p)
    if quantized:
        data = torch.zeros(local.shape, dtype=torch.float8_e4m3fn, device=local.device)
        scale = torch.full(
            (n_blocks(layout.numel, config.block),), 2.0**MAX_EXPONENT, device=local.device
        )  # block_scale(0): the scale of an all-zero block
        return QM(shard_like(data, p), scale)
    dtype = torch.bfloat16 if config.moments == "bf16" else torch.float32
    return shard_like(torch.zeros(local.shape, dtype=dtype, device=local.device), p)


def _read(moment, layout: Layout, config: MomentConfig) -> torch.Tensor:
    """The moment as float32 (local shard)."""
    if isinstance(moment, QM):
        return dequantize(local_of(moment.data), moment.scale, layout, config.block)
    return local_of(moment).float()


def _write(x: torch.Tensor, old, p, layout: Layout, config: MomentConfig):
    """`x` (float32, local) in the format of `old`: a `QuantizedMoment`, or a tensor of `old`'s
    dtype."""
    if isinstance(old, QM):
        q, scale = quantize(x, layout, config.block, MOMENT_FORMAT)
        return QM(shard_like(q, p), scale)
    return shard_like(x.to(local_of(old).dtype), p)


def _round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """bfloat16 of the float32 `x` rounded stochastically: the low 16 bits of `bits` (int64 in
    `[0, 2**32)`, `x`'s shape) added to `x`'s low 16 bits, then truncated. Rounds up with
    probability (distance to the lower bfloat16) / (bfloat16 spacing); exact values stay."""
    raw = x.view(torch.int32).to(torch.int64) + (bits & 0xFFFF)
    return (raw & ~0xFFFF).to(torch.int32).view(torch.float32).to(torch.bfloat16)


def all_finite(g_leaves: list, b2: float) -> torch.Tensor:
    """bool `()`: every gradient element finite, its `(1 - b2) * g * g` too (the second
    moment's new term: a gradient beyond about 1.8e19 / sqrt(1 - b2) would make it inf), over
    every rank when a gradient is a DTensor (one all-reduce over the default group, which every
    rank of an SPMD step is in)."""
    bad = torch.stack(
        [(~torch.isfinite((1 - b2) * g * g)).any() for g in map(_float_local, g_leaves)]
    ).any()
    if any(dtensor_local_or_none(g) is not None for g in g_leaves):
        flag = bad.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = flag > 0
    return ~bad


def _float_local(g: torch.Tensor) -> torch.Tensor:
    return local_of(g).float()


def adamw(
    lr: float | torch.Tensor | Callable = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    moments: str = "fp32",
    block: int = 128,
    min_size: int = 4096,
    master: str | None = None,
    decay_mask: Callable[[torch.Tensor], bool] | None = None,
) -> PureOptimizer:
    """AdamW (decoupled weight decay, torch.optim.AdamW's formula) as `init` and `update`.

    Args:
      lr: the learning rate: a float, a 0-dim tensor, or a schedule `lr(count)` of the int64
        `()` count of steps taken before this one, returning a float or a 0-dim tensor.
      betas, eps, weight_decay: as in `torch.optim.AdamW`.
      moments: "fp32" (8 bytes per parameter), "bf16" (4), or "fp8": both moments in float8
        e4m3 with one float32 scale per `block` elements of the parameter's global flat index
        (2 + 8 / block bytes). Parameters of fewer than
        `min_size` elements keep float32 moments.
      block: elements per float8 scaling block (>= 1).
      min_size: the smallest parameter (global elements) with float8 moments (>= 1).
      master: None (each parameter updated in its own dtype, rounded to nearest) or "bf16-sr":
        bfloat16 params, the float32 update rounded stochastically with bits drawn from the
        state's key (folded with the parameter's position, advanced per step).
      decay_mask: `decay_mask(param) -> bool`, whether weight decay applies to a parameter;
        None: to all.

    Returns:
      A `PureOptimizer`: `state = init(params, seed=0)`, `params, state = update(grads,
      state, params)`. A step with a non-finite gradient anywhere (or one whose square
      overflows float32) is skipped: params and moments come back unchanged, `state.count`
      stays, `state.skipped` adds one.

    Example:
      >>> import torch, fp8fn
      >>> params = {"w": torch.ones(64, 64), "b": torch.zeros(64)}
      >>> opt = fp8fn.optim.adamw(1e-2, moments="fp8")
      >>> state = opt.init(params)
      >>> grads = {"w": torch.full((64, 64), 0.5), "b": torch.ones(64)}
      >>> params, state = opt.update(grads, state, params)
      >>> round(params["w"][0, 0].item(), 4), int(state.count)
      (0.9899, 1)
    """
    config = _check_config(lr, betas, eps, weight_decay, moments, block, min_size, master)
    b1, b2 = betas

    def quantized_of(leaves: list) -> list:
        return [config.moments == "fp8" and layout_of(p).numel >= config.min_size for p in leaves]

    def init(params, seed: int = 0) -> AdamWState:
        leaves, spec = tree_flatten(params)
        check_params("init", leaves, _names(params), config.master)
        device = local_of(leaves[0]).device
        layouts = [layout_of(p) for p in leaves]
        mu = [
            _zero_moment(p, lay, config, q)
            for p, lay, q in zip(leaves, layouts, quantized_of(leaves))
        ]
        nu = [
            _zero_moment(p, lay, config, q)
            for p, lay, q in zip(leaves, layouts, quantized_of(leaves))
        ]
        zero = torch.zeros((), dtype=torch.int64, device=device)
        key = initial_key(seed, device) if config.master == "bf16-sr" else None
        return AdamWState(
            zero, zero.clone(), tree_unflatten(mu, spec), tree_unflatten(nu, spec), config, key
        )

    def update(grads, state: AdamWState, params):
        leaves, spec = tree_flatten(params)
        names = _names(params)
        check_params("update", leaves, names, config.master)
        g_leaves = check_grads("update", grads, spec, leaves, names)
        quantized = quantized_of(leaves)
        mu, nu = check_state("update", state, config, spec, leaves, names, quantized)

        ok = all_finite(g_leaves, b2)
        count = state.count + 1
        c1 = (1.0 - b1 ** count.double()).float()
        c2 = (1.0 - b2 ** count.double()).float()
        rate = lr(state.count) if callable(lr) else lr
        new_p, new_mu, new_nu = [], [], []
        for i, (p, g, m_old, v_old) in enumerate(zip(leaves, g_leaves, mu, nu)):
            layout = layout_of(p)
            m = _read(m_old, layout, config)
            v = _read(v_old, layout, config)
            g32 = local_of(g).float()
            m = b1 * m + (1 - b1) * g32
            v = b2 * v + (1 - b2) * g32 * g32
            p_local = local_of(p)
            p32 = p_local.float()
            step = (m / c1) / (_sqrt(v / c2) + eps)
            decays = weight_decay != 0 and (decay_mask is None or decay_mask(p))
            if decays:
                step = step + weight_decay * p32
            p32 = p32 - rate * step
            if config.master == "bf16-sr":
                key = fold_key(state.key, i).to(torch.int64)
                index = None if not layout.sharded else global_index(layout, p32.device)
                bits = random_bits(key, 0, 0, p32.shape, index=index)
                out = _round_bf16_stochastic(p32, bits)
            else:
                out = p32.to(p_local.dtype)
            new_p.append(shard_like(torch.where(ok, out, p_local), p))
            new_mu.append(_select(ok, _write(m, m_old, p, layout, config), m_old))
            new_nu.append(_select(ok, _write(v, v_old, p, layout, config), v_old))

        new_state = AdamWState(
            torch.where(ok, count, state.count),
            torch.where(ok, state.skipped, state.skipped + 1),
            tree_unflatten(new_mu, spec),
            tree_unflatten(new_nu, spec),
            config,
            None if state.key is None else torch.where(ok, advance_key(state.key), state.key),
        )
        return tree_unflatten(new_p, spec), new_state

    return PureOptimizer(init, update)


def _select(ok: torch.Tensor, new, old):
    """`new` where `ok`, else `old` (tensors or `QuantizedMoment`s, DTensors by their shards;
    float8 bytes selected as uint8, which inductor can select)."""
    if isinstance(new, QM):
        data = torch.where(
            ok, local_of(new.data).view(torch.uint8), local_of(old.data).view(torch.uint8)
        )
        return QM(
            shard_like(data.view(local_of(old.data).dtype), old.data),
            torch.where(ok, new.scale, old.scale),
        )
    return shard_like(torch.where(ok, local_of(new), local_of(old)), old)


def _names(params) -> list[str]:
    """A readable path of each leaf of `params` (for error messages)."""
    return [keystr(path) or "the root" for path, _ in tree_flatten_with_path(params)[0]]


def _check_config(lr, betas, eps, weight_decay, moments, block, min_size, master) -> MomentConfig:
    """The `MomentConfig` of valid arguments, or an `fp8fn.optim.adamw` error."""

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (callable(lr) or isinstance(lr, torch.Tensor) or (number(lr) and lr >= 0)):
        raise TypeError(
            f"fp8fn.optim.adamw: expected `lr` to be a float >= 0, a 0-dim tensor or a schedule "
            f"`lr(count)`, got {lr!r}."
        )
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(number(b) and 0 <= b < 1 for b in betas)
    ):
        raise ValueError(
            f"fp8fn.optim.adamw: expected `betas` two floats in [0, 1), got {betas!r}."
        )
    if not (number(eps) and eps > 0):
        raise ValueError(f"fp8fn.optim.adamw: expected `eps` a float > 0, got {eps!r}.")
    if not (number(weight_decay) and weight_decay >= 0):
        raise ValueError(
            f"fp8fn.optim.adamw: expected `weight_decay` a float >= 0, got {weight_decay!r}."
        )
    if moments not in MOMENTS:
        raise ValueError(
            f"fp8fn.optim.adamw: expected `moments` one of {MOMENTS}, got {moments!r}."
        )
    for name, value in (("block", block), ("min_size", min_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fp8fn.optim.adamw: expected `{name}` an int >= 1, got {value!r}.")
    if master not in MASTERS:
        raise ValueError(f"fp8fn.optim.adamw: expected `master` one of {MASTERS}, got {master!r}.")
    return MomentConfig(moments, block, min_size, master)
