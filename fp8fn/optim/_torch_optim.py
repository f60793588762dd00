"""`fp8fn.optim.AdamW`: a `torch.optim.Optimizer` whose step is `fp8fn.optim.adamw`'s pure
update, for loops that train with `loss.backward()` (FSDP2 included)."""

from __future__ import annotations

import itertools

import torch

from .._core.keys import fold_key, initial_key
from ._adamw import adamw, all_finite
from ._state import AdamWState, MomentConfig, QuantizedMoment

# self.state[p]: the moments (float8 bytes and their block scales, or tensors), the step count,
# the skipped count and, with master="bf16-sr", the parameter's random key.
_MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamW(torch.optim.Optimizer):
    """AdamW on `fp8fn.optim.adamw`'s update: the same bits as the pure functions.

    Args:
      params: parameters or parameter groups (dicts with "params" and any of "lr", "betas",
        "eps", "weight_decay"), as for `torch.optim.AdamW`.
      lr, betas, eps, weight_decay: as in `torch.optim.AdamW` (lr a float or a 0-dim tensor).
      moments, block, min_size, master: as in `fp8fn.optim.adamw`.
      seed: the initial random key of `master="bf16-sr"`.

    Each step updates the parameters that have a gradient, each with the pure update (its own
    step count; with "bf16-sr" its own key, the seed's folded with its position); a non-finite
    gradient in a group skips that group's step (its params and moments unchanged).

    `self.state[p]` holds `exp_avg` and `exp_avg_sq` (float8 bytes, with `exp_avg_scale` and
    `exp_avg_sq_scale`, for the block-scaled ones; DTensors for DTensor params), `step`,
    `skipped` and, for "bf16-sr", `key`. `state_dict()` / `load_state_dict()` round-trip them
    bit for bit (torch's loader would cast them to the parameter's dtype), and
    torch.distributed.checkpoint saves and reshards them: the block scales are of the global
    blocks, the same on every world size.

    Example:
      >>> import torch, fp8fn
      >>> model = torch.nn.Linear(128, 64)
      >>> opt = fp8fn.optim.AdamW(model.parameters(), lr=1e-2, moments="fp8")
      >>> model(torch.ones(2, 128)).sum().backward()
      >>> opt.step()
      >>> opt.state[model.weight]["exp_avg"].dtype
      torch.float8_e4m3fn
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        moments: str = "fp32",
        block: int = 128,
        min_size: int = 4096,
        master: str | None = None,
        seed: int = 0,
    ):
        self._statics = dict(moments=moments, block=block, min_size=min_size, master=master)
        initial_key(seed)  # checks `seed`
        self._seed = seed
        adamw(lr, betas, eps, weight_decay, **self._statics)  # checks the arguments
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _pure(self, group):
        return adamw(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], **self._statics
        )

    def _state_of(self, opt, p, index: int) -> AdamWState:
        """The pure state of the parameter `p` (the optimizer's `index`-th): read from
        `self.state`, or a new one whose key (with "bf16-sr") is folded with `index`."""
        s = self.state[p]
        if not s:
            state = opt.init([p], seed=self._seed)
            key = None if state.key is None else fold_key(state.key, index)
            return state._replace(key=key)

        def moment(name: str):
            return QuantizedMoment(s[name], s[name + "_scale"]) if name + "_scale" in s else s[name]

        config = MomentConfig(**self._statics)
        return AdamWState(
            s["step"],
            s["skipped"],
            [moment("exp_avg")],
            [moment("exp_avg_sq")],
            config,
            s.get("key"),
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns `closure()`'s loss.

        A group with a non-finite gradient is skipped (its counts `skipped` add one); else its
        parameters are updated one at a time, in place, so that a step holds the transients of
        one parameter (the pure update of a whole tree holds the old and the new of each)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and not bool(all_finite([p.grad for p in params], group["betas"][1])):
                for p in params:
                    if self.state[p]:
                        self.state[p]["skipped"] = self.state[p]["skipped"] + 1
                index += len(group["params"])
                continue
            opt = self._pure(group)
            for p in group["params"]:
                if p.grad is not None:
                    self._update(opt, p, index)
                index += 1
        return loss

    def _update(self, opt, p, index: int) -> None:
        state = self._state_of(opt, p, index)
        (value,), state = opt.update([p.grad], state, [p.detach()])
        p.copy_(value)
        s = self.state[p]
        s.update(step=state.count, skipped=state.skipped)
        if state.key is not None:
            s["key"] = state.key
        for name, (moment,) in zip(_MOMENTS, (state.mu, state.nu)):
            if isinstance(moment, QuantizedMoment):
                s[name], s[name + "_scale"] = moment
            else:
                s[name] = moment

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, then every state tensor put back with its own dtype (float8 bytes,
        the float64 key), on its parameter's device."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(ids, params):
            if saved_id in saved:
                self.state[p] = {
                    k: v.to(device=p.device) if isinstance(v, torch.Tensor) else v
                    for k, v in saved[saved_id].items()
                }
