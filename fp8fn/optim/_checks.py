"""The checks of `fp8fn.optim`'s inputs: each raises an `fp8fn.optim.` error naming what was
expected and what came, before anything is computed."""

from __future__ import annotations

import torch

from .._torch_private import dtensor_local_or_none, tree_flatten
from ._state import AdamWState, QuantizedMoment

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_dtensor(t) -> bool:
    return dtensor_local_or_none(t) is not None


def _kind(t) -> str:
    return "a DTensor" if _is_dtensor(t) else "a plain tensor"


def check_params(api: str, leaves: list, names: list, master: str | None) -> None:
    """Every leaf a float32/bfloat16/float16 tensor (bfloat16 with `master="bf16-sr"`)."""
    if not leaves:
        raise ValueError(
            f"fp8fn.optim.{api}: expected `params` with at least one tensor, got none."
        )
    for name, p in zip(names, leaves):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"fp8fn.optim.{api}: expected every leaf of `params` to be a tensor, got "
                f"{type(p).__name__} at {name}."
            )
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(
                f"fp8fn.optim.{api}: expected floating-point params (float32, bfloat16 or "
                f"float16), got {p.dtype} at {name}. Integer, complex and float8 tensors are not "
                "trained by AdamW: leave them out of `params`."
            )
        if master == "bf16-sr" and p.dtype != torch.bfloat16:
            raise TypeError(
                f"fp8fn.optim.{api}: expected bfloat16 params with master='bf16-sr', got "
                f"{p.dtype} at {name}. Cast them with `{{k: p.bfloat16() for k, p in "
                "params.items()}`, or use master=None."
            )


def check_grads(api: str, grads, spec, leaves: list, names: list) -> list:
    """The leaves of `grads`, which must have the params' structure, shapes and kind."""
    g_leaves, g_spec = tree_flatten(grads)
    if g_spec != spec:
        raise ValueError(
            f"fp8fn.optim.{api}: expected `grads` with the structure of `params` ({spec}), got "
            f"{g_spec}. Pass the gradients of exactly the params being updated."
        )
    for name, g, p in zip(names, g_leaves, leaves):
        if (
            not isinstance(g, torch.Tensor)
            or g.shape != p.shape
            or _is_dtensor(g) != _is_dtensor(p)
        ):
            got = (
                f"{_kind(g)} of shape {tuple(g.shape)}"
                if isinstance(g, torch.Tensor)
                else (type(g).__name__)
            )
            raise ValueError(
                f"fp8fn.optim.{api}: expected the gradient at {name} to be {_kind(p)} of shape "
                f"{tuple(p.shape)} (the parameter's), got {got}."
            )
        if not g.is_floating_point() or g.is_complex():
            raise TypeError(
                f"fp8fn.optim.{api}: expected a floating-point gradient at {name}, got {g.dtype}."
            )
    return g_leaves


def _moment_leaves(tree) -> tuple[list, object]:
    return tree_flatten(tree, is_leaf=lambda x: isinstance(x, (torch.Tensor, QuantizedMoment)))


def check_state(api: str, state, config, spec, leaves, names, quantized: list) -> tuple:
    """The moment leaves `(mu, nu)` of `state`, which must be an `AdamWState` of `config` made
    for params of this structure."""
    if not isinstance(state, AdamWState):
        raise TypeError(
            f"fp8fn.optim.{api}: expected the state this optimizer's `init` made (an "
            f"fp8fn.optim.AdamWState), got {type(state).__name__}. Make it with "
            "`opt.init(params)`."
        )
    if state.config != config:
        raise ValueError(
            f"fp8fn.optim.{api}: expected a state of {config}, got one of {state.config}: it "
            "comes from another optimizer (other moments, block, min_size or master). Build "
            "the optimizer with the settings the state was made with, or `init` a new state."
        )
    out = []
    for field in ("mu", "nu"):
        m_leaves, m_spec = _moment_leaves(getattr(state, field))
        if m_spec != spec:
            raise ValueError(
                f"fp8fn.optim.{api}: expected `state.{field}` with the structure of `params` "
                f"({spec}), got {m_spec}: the state was made for other params."
            )
        for name, m, p, q in zip(names, m_leaves, leaves, quantized):
            data = m.data if isinstance(m, QuantizedMoment) else m
            if isinstance(m, QuantizedMoment) != q or data.shape != p.shape:
                want = "block-scaled float8" if q else "a tensor"
                raise ValueError(
                    f"fp8fn.optim.{api}: expected `state.{field}` at {name} to be {want} of "
                    f"shape {tuple(p.shape)}, got {type(m).__name__} of shape "
                    f"{tuple(data.shape)}: the state was made for other params."
                )
            if _is_dtensor(data) != _is_dtensor(p):
                raise TypeError(
                    f"fp8fn.optim.{api}: expected `state.{field}` at {name} to be {_kind(p)} "
                    f"like its parameter, got {_kind(data)}. Make the state with "
                    "`opt.init(params)` on the params as they are placed now."
                )
        out.append(m_leaves)
    return tuple(out)
