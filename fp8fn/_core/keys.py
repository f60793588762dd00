"""Random keys of the state (NVFP4's stochastic rounding and Hadamard signs): made, checked,
advanced, folded.

A key is an integer in `[0, 2**KEY_BITS)` held by a float64 tensor (`state.key`, shape `()` or
the state's leading dims), which holds every such integer exactly. `update` advances it modulo
`2**KEY_BITS`, so it never leaves that range, whatever the step count: the key cycles through
all `2**52` values before one repeats. Each cast draws its bits from `(key, site, role)`
(`_numerics.nvfp4.random_bits`); `site` is `site_id` of the call's name.

A key that enters from outside (a loaded or unflattened state, a key given to `fp8fn.linear`)
is checked once per tensor and version (`check_key`: a host read); keys that fp8fn makes
(`fn.init`, `update`, `fold_in`) are valid by construction and never read, until changed in
place (`registries.VALID_KEYS`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._numerics.nvfp4 import MASK32, make_key, mix32
from .._torch_private import unwrapped
from .registries import VALID_KEYS

KEY_BITS = 52  # keys are integers in [0, 2**52): float64 holds each, and each plus one, exactly


def site_id(name: str, start=0x811C9DC5):
    """A stable 32-bit id of the site name `name` (FNV-1a over its characters' code points).

    The same in every process and run (Python's `hash` of a str is salted per process), and
    plain integer arithmetic on a constant, which torch.compile folds away. `start`: the id of
    a prefix of the name (an int, or an int64 `()` tensor: then the id is one too), so that
    `site_id(b, site_id(a)) == site_id(a + b)`.
    """
    h = start
    for ch in name:
        h = ((h ^ ord(ch)) * 0x01000193) & MASK32
    return h


def seed_key(seed: int) -> int:
    """The initial key of `seed`: the top `KEY_BITS` bits of `make_key(seed)` (splitmix64),
    so that the keys of different seeds start far apart in `[0, 2**52)`."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"fp8fn.init: expected `seed` to be an int, got {type(seed).__name__} {seed!r}."
        )
    return int(make_key(seed)) >> (62 - KEY_BITS)


def initial_key(seed: int, device=None) -> torch.Tensor:
    """`seed_key(seed)` as the state's key leaf: float64 `()` on `device`."""
    return mark_key_valid(torch.tensor(float(seed_key(seed)), dtype=torch.float64, device=device))


def process_rank() -> int:
    """This process's rank in the default process group, or 0 without torch.distributed."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def advance_key(key: torch.Tensor) -> torch.Tensor:
    """The next step's key, `(key + 1) mod 2**KEY_BITS` (float64, exact: every value involved
    is an integer below 2**53); a new tensor."""
    return torch.remainder(key + 1.0, 4503599627370496.0)  # 2**52, a literal (see fp8.py's top)


def fold_key(key: torch.Tensor, data: int) -> torch.Tensor:
    """A key derived from `key` and the integer `data` in `[0, 2**63)`: float64 of `key`'s
    shape, an integer in `[0, 2**52)`. Two 32-bit lanes absorb the key's halves and `data`'s
    through `mix32`; the result takes 32 bits of one lane and 20 of the other."""
    k = key.to(torch.int64)
    d = torch.full_like(k, data)  # a tensor: compiled with a symbolic `data`, int64 bit ops
    lane_a, lane_b = torch.full_like(k, 0x3C6EF372), torch.full_like(k, 0x5BE0CD19)
    for word in (k & MASK32, k >> 32, d & MASK32, d >> 32):
        lane_a = mix32(lane_a ^ word)
        lane_b = mix32(lane_b ^ word ^ 0x510E527F)
    return ((lane_a << 20) | (lane_b >> 12)).to(torch.float64)


def mark_key_valid(key: torch.Tensor) -> torch.Tensor:
    """Record that `key` (made by fp8fn from valid keys) holds valid keys; returns it."""
    if not torch.compiler.is_compiling():
        VALID_KEYS.mark(key)
    return key


def check_key(api: str, key: torch.Tensor, name: str = "`state.key`") -> None:
    """Raise unless every value of `key` (float64) is an integer in `[0, 2**KEY_BITS)`.

    NaN, inf, a fraction, or a value beyond float64's exact integers would draw the same bits
    for different keys, or stop advancing. A host read, once per tensor (not for keys fp8fn
    made), and not while compiling.
    """
    if torch.compiler.is_compiling():
        return
    base = unwrapped(key)
    if base.device.type == "meta" or VALID_KEYS.get(base) is not None:
        return
    valid = (base >= 0) & (base < 2.0**KEY_BITS) & (base == base.floor())
    if not bool(valid.all()):
        bad = base[~valid].flatten()[:4].tolist()
        raise ValueError(
            f"fp8fn.{api}: expected {name} to hold integers in [0, 2**{KEY_BITS}), got "
            f"{', '.join(map(repr, bad))}. Make keys with fn.init(..., seed=...) and advance them "
            "with fp8fn.update (fp8fn.fold_in derives one per microbatch)."
        )
    VALID_KEYS.mark(base)
