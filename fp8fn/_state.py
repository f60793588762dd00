"""The packed scaling state: every site of a model in two tensors, names in the tree structure.

`State` is a pytree node (registered with `torch.utils._pytree` and optree, namespace "fp8fn")
whose only leaves are `amax_history` and `scale`; the site names and the recipe's static config
are aux data. So torch.func differentiates two leaves, `update` and `merge` are a constant number
of kernels, and an observation (the gradient with respect to a `State`) is a `State` too.
"""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch
from torch.utils import _pytree as pytree

from ._recipe import DelayedScaling

ROLES = ("input", "weight", "grad_output")


class ScaleState(NamedTuple):
    """One role of one site: views into a `State`."""

    amax_history: torch.Tensor  # (..., history_len), float32, newest first; 0 = not observed
    scale: torch.Tensor  # (...,), float32; fp8 = saturate(hp * scale), finite and > 0


class SiteState(NamedTuple):
    """One site's rows of a `State` (views); `.input`, `.weight`, `.grad_output` give its roles.

    It is what `fp8fn.linear` takes as `site_state`: the gradient with respect to it is the
    site's observation, of the same type.
    """

    amax_history: torch.Tensor  # (..., 3, history_len), float32; roles input, weight, grad_output
    scale: torch.Tensor  # (..., 3), float32

    @property
    def input(self) -> ScaleState:
        return ScaleState(self.amax_history[..., 0, :], self.scale[..., 0])

    @property
    def weight(self) -> ScaleState:
        return ScaleState(self.amax_history[..., 1, :], self.scale[..., 1])

    @property
    def grad_output(self) -> ScaleState:
        return ScaleState(self.amax_history[..., 2, :], self.scale[..., 2])


class State:
    """The delayed-scaling state of all sites of a model, packed.

    A read-only mapping from site names (call order) to `SiteState` views, and a pytree of two
    leaves. Observations (the gradient of a loss with respect to a `State`) have the same type:
    `obs.amax_history[..., 0]` holds the amaxes seen in the step, zeros elsewhere.

    Attributes:
      amax_history: float32 `(..., n_sites, 3, history_len)`, roles input, weight, grad_output,
        newest first; a history of zeros means "never observed". Leading dims: e.g. a stacked
        ensemble of E members is `(E, n_sites, 3, history_len)`.
      scale: float32 `(..., n_sites, 3)`; a cast is `saturate(hp * scale)`.
      sites: the site names, a tuple of str (static).
      amax_compute: `"max"` or `"most_recent"` (static).
      margin: int >= 0 (static).

    Example:
      >>> import fp8fn
      >>> state = fp8fn.init_state(fp8fn.DelayedScaling(history_len=4), ["fc1", "fc2"])
      >>> len(state), list(state), tuple(state.amax_history.shape)
      (2, ['fc1', 'fc2'], (2, 3, 4))
      >>> state["fc2"].input.amax_history
      tensor([0., 0., 0., 0.])
    """

    __slots__ = ("amax_history", "scale", "sites", "amax_compute", "margin", "_index", "_views")

    def __init__(self, amax_history, scale, sites, amax_compute="max", margin=0):
        self.amax_history, self.scale = amax_history, scale
        self.sites, self.amax_compute, self.margin = tuple(sites), amax_compute, margin
        self._index, self._views = None, {}

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[-1]

    @property
    def static(self) -> tuple:
        """`(sites, amax_compute, margin)`: what the tree structure holds besides the leaves."""
        return (self.sites, self.amax_compute, self.margin)

    def _replace(self, **leaves) -> State:
        """A new `State` with `amax_history` and/or `scale` replaced (like NamedTuple's)."""
        unknown = set(leaves) - {"amax_history", "scale"}
        if unknown:
            raise TypeError(f"fp8fn.State._replace: unknown fields {sorted(unknown)}.")
        fields = {"amax_history": self.amax_history, "scale": self.scale, **leaves}
        return State(fields["amax_history"], fields["scale"], *self.static)

    def __len__(self) -> int:
        return len(self.sites)

    def __iter__(self):
        return iter(self.sites)

    def __contains__(self, site) -> bool:
        return site in self._positions()

    def __getitem__(self, site: str) -> SiteState:
        """The rows of `site` (views); the same objects each time (see `fp8fn.linear`)."""
        view = self._views.get(site)
        if view is None:
            i = self._positions().get(site)
            if i is None:
                raise KeyError(f"fp8fn.State: no site {site!r}; sites are {list(self.sites)}.")
            view = self._views[site] = SiteState(
                self.amax_history[..., i, :, :], self.scale[..., i, :]
            )
        return view

    def keys(self):
        return list(self.sites)

    def values(self):
        return [self[s] for s in self.sites]

    def items(self):
        return [(s, self[s]) for s in self.sites]

    def _positions(self) -> dict:
        if self._index is None:
            self._index = {s: i for i, s in enumerate(self.sites)}
        return self._index

    def __repr__(self) -> str:
        shape = tuple(self.amax_history.shape)
        return (
            f"fp8fn.State(sites={list(self.sites)}, amax_history={shape}, "
            f"amax_compute={self.amax_compute!r}, margin={self.margin})"
        )

    def __reduce__(self):
        return (State, (self.amax_history, self.scale, *self.static))


def _flatten(state: State):
    return [state.amax_history, state.scale], state.static


def _unflatten(leaves, static) -> State:
    return State(*leaves, *static)


pytree.register_pytree_node(
    State,
    _flatten,
    _unflatten,
    serialized_type_name="fp8fn.State",
    flatten_with_keys_fn=lambda s: (
        [
            (pytree.GetAttrKey("amax_history"), s.amax_history),
            (pytree.GetAttrKey("scale"), s.scale),
        ],
        s.static,
    ),
)
optree.register_pytree_node(
    State,
    lambda s: ([s.amax_history, s.scale], s.static, ("amax_history", "scale")),
    lambda static, leaves: State(*leaves, *static),
    namespace="fp8fn",
)
# So that a state saved with torch.save loads with torch.load(..., weights_only=True).
torch.serialization.add_safe_globals([State])


def init_state(recipe: DelayedScaling, sites, device=None) -> State:
    """The initial state of `sites` under `recipe`: zero histories (never observed), scales 1.

    Args:
      recipe: an `fp8fn.DelayedScaling`.
      sites: site names (e.g. `["fc"]`), distinct.
      device: where the tensors live.

    Returns:
      A `State` with `amax_history` float32 `(len(sites), 3, history_len)` of zeros and `scale`
      float32 `(len(sites), 3)` of ones.

    Example:
      >>> import torch, fp8fn
      >>> recipe = fp8fn.DelayedScaling()
      >>> state = fp8fn.init_state(recipe, ["fc"])
      >>> y = fp8fn.linear(torch.randn(8, 32), torch.randn(16, 32), None, state["fc"], recipe)
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            f"fp8fn.init_state: expected `recipe` to be an fp8fn.DelayedScaling (the stateful "
            f"recipe), got {type(recipe).__name__}."
        )
    sites = tuple(sites)
    if not all(isinstance(s, str) for s in sites) or len(set(sites)) != len(sites):
        raise ValueError(f"fp8fn.init_state: expected distinct str site names, got {sites!r}.")
    n, h = len(sites), recipe.history_len
    return State(
        torch.zeros(n, 3, h, dtype=torch.float32, device=device),
        torch.ones(n, 3, dtype=torch.float32, device=device),
        sites,
        recipe.amax_compute,
        recipe.margin,
    )


def check_state(api: str, state, name: str = "state", batch_dims: int | None = 0) -> None:
    """Raise a clear error unless `state` is a well-formed `State` (metadata only, no sync).

    `batch_dims`: the number of leading dims allowed, or None for any.
    """
    if not isinstance(state, State):
        raise TypeError(
            f"fp8fn.{api}: expected `{name}` to be an fp8fn.State (made by fn.init or "
            f"fp8fn.init_state), got {type(state).__name__}."
        )
    h, s = state.amax_history, state.scale
    for field, t in (("amax_history", h), ("scale", s)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fp8fn.{api}: expected `{name}.{field}` to be a tensor, got {type(t).__name__}."
            )
        if t.dtype != torch.float32:
            raise TypeError(f"fp8fn.{api}: expected `{name}.{field}` to be float32, got {t.dtype}.")
        if t.device.type == "meta":
            raise ValueError(
                f"fp8fn.{api}: expected `{name}.{field}` on a device that holds values, got meta."
            )
    n = len(state.sites)
    lead = h.dim() - 3
    if (
        lead < 0
        or (batch_dims is not None and lead != batch_dims)
        or h.shape[-3:-1] != (n, 3)
        or h.shape[-1] < 1
        or s.shape != h.shape[:-1]
        or s.device != h.device
    ):
        want = "(n_sites, 3, history_len)" if batch_dims == 0 else "(..., n_sites, 3, history_len)"
        raise ValueError(
            f"fp8fn.{api}: expected `{name}.amax_history` of shape {want} and `{name}.scale` of "
            f"its shape without the last dim, on one device, with n_sites = {n}; got "
            f"{tuple(h.shape)} and {tuple(s.shape)} on {h.device} and {s.device}."
        )


def check_site_state(api: str, site_state, where: str = "`site_state`") -> None:
    """Raise a clear error unless `site_state` is a `SiteState` of float32 tensors."""
    if not isinstance(site_state, SiteState):
        raise TypeError(
            f"fp8fn.{api}: expected {where} to be an fp8fn.SiteState (e.g. state[site] of an "
            f"fp8fn.State), got {type(site_state).__name__}."
        )
    h, s = site_state
    if not (isinstance(h, torch.Tensor) and isinstance(s, torch.Tensor)):
        raise TypeError(f"fp8fn.{api}: expected {where} to hold tensors.")
    if h.dtype != torch.float32 or s.dtype != torch.float32:
        raise TypeError(
            f"fp8fn.{api}: expected {where} to be float32, got {h.dtype} and {s.dtype}."
        )
    if h.dim() != 2 or h.shape[0] != 3 or h.shape[1] < 1 or tuple(s.shape) != (3,):
        raise ValueError(
            f"fp8fn.{api}: expected {where} of shapes (3, history_len) and (3,), got "
            f"{tuple(h.shape)} and {tuple(s.shape)}."
        )


def claim(history: torch.Tensor, api: str, what: str) -> None:
    """Refuse a second use of `history` while gradients are recorded for it.

    Autograd sums the gradients of a tensor used twice; fp8fn combines observations by max. So
    each observed state (and each site's rows) may take part once in a recorded gradient.
    """
    if not (torch.is_grad_enabled() and history.requires_grad) or not history.numel():
        return
    if getattr(history, "_fp8fn_used", False):
        raise RuntimeError(
            f"fp8fn.{api}: this {what} was already used by a forward pass whose observations "
            "are being recorded; autograd would sum the two passes' observations, and fp8fn "
            "combines them by max. Give each forward pass its own copy and merge:\n"
            "    # torch.func: grad(loss, argnums=(1, 2))(params, state, state, x1, x2)\n"
            "    # autograd:   s1, s2 = fp8fn.observe(state), fp8fn.observe(state)\n"
            "    obs = fp8fn.merge(obs1, obs2)\n"
            "or run the inputs as one batch, or (for fp8fn.linear) use one site per call."
        )
    history._fp8fn_used = True


def flatten_state(state: State) -> dict[str, torch.Tensor]:
    """A state as a flat `{"site.role.field": tensor}` dict of independent tensors.

    For safetensors and distributed checkpoints; `unflatten_state` is the inverse. Fields are
    `amax_history` `(history_len,)` and `scale` `()`, float32.

    Example:
      >>> import fp8fn
      >>> state = fp8fn.init_state(fp8fn.DelayedScaling(), ["fc"])
      >>> list(fp8fn.flatten_state(state))[:2]
      ['fc.input.amax_history', 'fc.input.scale']
    """
    check_state("flatten_state", state)
    return {
        f"{site}.{role}.{field}": leaf.clone()
        for site, site_state in state.items()
        for role in ROLES
        for field, leaf in getattr(site_state, role)._asdict().items()
    }


def unflatten_state(flat: dict[str, torch.Tensor], recipe: DelayedScaling) -> State:
    """The inverse of `flatten_state`, with the static config (`amax_compute`, `margin`) of
    `recipe`. Sites keep the order of `flat`.

    Raises:
      ValueError: naming the key, when a key is not 'site.role.field' or a field is missing.
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            f"fp8fn.unflatten_state: expected `recipe` to be an fp8fn.DelayedScaling, "
            f"got {type(recipe).__name__}."
        )
    fields = ScaleState._fields
    leaves: dict[str, dict] = {}
    for key, leaf in flat.items():
        parts = key.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in ROLES or parts[2] not in fields:
            raise ValueError(
                f"fp8fn.unflatten_state: expected keys 'site.role.field' with role in {ROLES} "
                f"and field in {fields}, got {key!r}."
            )
        leaves.setdefault(parts[0], {})[parts[1], parts[2]] = leaf
    missing = [
        f"{s}.{r}.{f}"
        for s, got in leaves.items()
        for r in ROLES
        for f in fields
        if (r, f) not in got
    ]
    if missing:
        raise ValueError(f"fp8fn.unflatten_state: missing keys {missing}.")
    sites = list(leaves)
    if not sites:
        return init_state(recipe, [])
    history = torch.stack(
        [torch.stack([leaves[s][r, "amax_history"] for r in ROLES]) for s in sites]
    )
    scale = torch.stack([torch.stack([leaves[s][r, "scale"] for r in ROLES]) for s in sites])
    state = State(history, scale, sites, recipe.amax_compute, recipe.margin)
    check_state("unflatten_state", state)
    return state
