"""`fp8fn.optim.AdamW`: a `torch.optim.Optimizer` whose step is `fp8fn.optim.adamw`'s pure
update, for loops that train with `loss.backward()` (FSDP2 included)."""

from __future__ import annotations

import itertools

import torch

from .._core.keys import initial_key
from ._adamw import adamw
from ._state import AdamWState, MomentConfig, QuantizedMoment

# self.state[p]: the moments (float8 bytes and their block scales, or tensors), the step count,
# the skipped count and, with master="bf16-sr", the group's random key.
_MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamW(torch.optim.Optimizer):
    """AdamW on `fp8fn.optim.adamw`'s update: the same bits as the pure functions.

    Args:
      params: parameters or parameter groups (dicts with "params" and any of "lr", "betas",
        "eps", "weight_decay"), as for `torch.optim.AdamW`.
      lr, betas, eps, weight_decay: as in `torch.optim.AdamW` (lr a float or a 0-dim tensor).
      moments, block, min_size, master: as in `fp8fn.optim.adamw`.
      seed: the initial random key of `master="bf16-sr"`.

    Each step updates, per group, the parameters that have a gradient, with one call of the
    pure update; a non-finite gradient in a group skips that group's step (its params and
    moments unchanged). `self.state[p]` holds `exp_avg` and `exp_avg_sq` (float8 bytes, with
    `exp_avg_scale` and `exp_avg_sq_scale`, for the block-scaled ones; DTensors for DTensor
    params), `step`, `skipped` and, for "bf16-sr", `key`. `state_dict()` / `load_state_dict()`
    round-trip them bit for bit (torch's loader would cast them to the parameter's dtype), and
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

    def _state_of(self, opt, params: list) -> AdamWState:
        """The pure state of `params` (one count): a new one, or read from `self.state`."""
        if not self.state[params[0]]:
            return opt.init(params, seed=self._seed)

        def moment(s: dict, name: str):
            return QuantizedMoment(s[name], s[name + "_scale"]) if name + "_scale" in s else s[name]

        first = self.state[params[0]]
        return AdamWState(
            first["step"],
            first["skipped"],
            [moment(self.state[p], "exp_avg") for p in params],
            [moment(self.state[p], "exp_avg_sq") for p in params],
            MomentConfig(**self._statics),
            first.get("key"),
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns `closure()`'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            by_count = itertools.groupby(
                sorted(params, key=lambda p: self._count(p)), key=self._count
            )
            opt = self._pure(group)
            for _, same in by_count:
                same = list(same)
                state = self._state_of(opt, same)
                new, state = opt.update([p.grad for p in same], state, [p.detach() for p in same])
                for p, value, m, v in zip(same, new, state.mu, state.nu):
                    p.copy_(value)
                    s = self.state[p]
                    s.update(step=state.count, skipped=state.skipped)
                    if state.key is not None:
                        s["key"] = state.key
                    for name, moment in zip(_MOMENTS, (m, v)):
                        if isinstance(moment, QuantizedMoment):
                            s[name], s[name + "_scale"] = moment
                        else:
                            s[name] = moment
        return loss

    def _count(self, p) -> tuple[int, int]:
        """Whether `p` has a state, and the steps it has taken: params that missed steps are
        updated apart (a host read of the count)."""
        s = self.state[p]
        return (1, int(s["step"])) if s else (0, 0)

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
