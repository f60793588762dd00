"""The packed scaling state: every site of a model in two tensors, names in the tree structure.

`State` is a pytree node (registered with `torch.utils._pytree` and optree, namespace "fp8fn")
whose leaves are `amax_history` and `scale` (and `key`, NVFP4's random key, when it has one);
the site names and the recipe's static config are aux data. So torch.func differentiates two
leaves (three with a key), `update` and `merge` are a constant number of kernels, and an
observation (the gradient with respect to a `State`) is a `State` too.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import optree
import torch

from .._torch_private import (
    GetAttrKey,
    assert_in_graph,
    differentiated,
    register_pytree_node,
    unwrapped,
)
from .keys import check_key
from .moved import register_moved
from .recipes import RECIPES, DelayedScaling
from .registries import (
    FILLED,
    NEVER_UPDATED,
    OBSERVED,
    PREDECESSOR,
    SUPERSEDED,
    VALID_SCALES,
)

ROLES = ("input", "weight", "grad_output")


class ScaleState(NamedTuple):
    """One role of one site: views into a `State`."""

    amax_history: torch.Tensor  # (..., history_len), float32, newest first; 0 = not observed
    scale: torch.Tensor  # (...,), float32; fp8 = saturate(hp * scale), finite and > 0


def _refuse_assignment(self, name, value=None):
    raise AttributeError(
        f"fp8fn.{type(self).__name__} is immutable data: make a new one with "
        f"`._replace({name}=...)` instead of assigning `.{name}`."
    )


def _immutable(cls):
    """`cls` as a `dataclass(frozen=True, slots=True)`, equal by identity (its fields hold
    tensors), with its own `repr` and `__reduce__` (the saved format), whose assignment and
    deletion raise fp8fn's error pointing to `_replace` (the dataclass's says only "cannot
    assign to field")."""
    cls = dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False)(cls)
    cls.__setattr__ = cls.__delattr__ = _refuse_assignment
    return cls


@_immutable
class SiteState:
    """One site's rows of a `State` (views); `.input`, `.weight`, `.grad_output` give its roles.

    It is what `fp8fn.linear` takes as `site_state`: the gradient with respect to it is the
    site's observation, of the same type. Its two tensors are the pytree leaves; the static
    config (`amax_compute`, `margin`) lives in the tree structure, so `fp8fn.linear` can check it
    against the recipe. It unpacks like a pair: `amax_history, scale = site_state`.
    """

    amax_history: torch.Tensor  # (..., 3, history_len) float32, roles input, weight, grad_output
    scale: torch.Tensor  # (..., 3) float32
    amax_compute: str = "max"  # static
    margin: int = 0  # static
    # `(the State's amax_history, this site's index)` when `State[site]` made it, else None:
    # what `claim` knows this site by (not data: no leaf, not pickled)
    _row: tuple | None = dataclasses.field(default=None, init=False)
    _fields = ("amax_history", "scale")  # the leaves, as NamedTuple's (a class attribute)

    @property
    def static(self) -> tuple:
        """`(amax_compute, margin)`: what the tree structure holds besides the leaves."""
        return (self.amax_compute, self.margin)

    def _replace(self, **leaves) -> SiteState:
        fields = {**self._asdict(), **_known_fields("SiteState", leaves)}
        return SiteState(fields["amax_history"], fields["scale"], *self.static)

    def _asdict(self) -> dict:
        return {"amax_history": self.amax_history, "scale": self.scale}

    def __iter__(self):
        return iter((self.amax_history, self.scale))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return (self.amax_history, self.scale)[i]

    def __repr__(self) -> str:
        return (
            f"fp8fn.SiteState(amax_history={self.amax_history!r}, scale={self.scale!r}, "
            f"amax_compute={self.amax_compute!r}, margin={self.margin})"
        )

    def __reduce__(self):
        return (SiteState, (self.amax_history, self.scale, *self.static))

    @property
    def input(self) -> ScaleState:
        return ScaleState(self.amax_history[..., 0, :], self.scale[..., 0])

    @property
    def weight(self) -> ScaleState:
        return ScaleState(self.amax_history[..., 1, :], self.scale[..., 1])

    @property
    def grad_output(self) -> ScaleState:
        return ScaleState(self.amax_history[..., 2, :], self.scale[..., 2])


def _known_fields(api: str, leaves: dict, fields=("amax_history", "scale")) -> dict:
    unknown = set(leaves) - set(fields)
    if unknown:
        raise TypeError(
            f"fp8fn.{api}._replace: expected fields {', '.join(fields[:-1])} and/or "
            f"{fields[-1]}, got {sorted(unknown)}."
        )
    return leaves


@_immutable
class State:
    """The delayed-scaling state of all sites of a model, packed.

    A read-only mapping from site names (call order) to `SiteState` views, and a pytree of two
    leaves (three with a `key`). Observations (the gradient of a loss with respect to a `State`)
    have the same type: `obs.amax_history[..., 0]` holds the amaxes seen in the step, zeros
    elsewhere.

    Attributes:
      amax_history: float32 `(..., n_sites, 3, history_len)`, roles input, weight, grad_output,
        newest first; a history of zeros means "never observed". Leading dims: e.g. a stacked
        ensemble of E members is `(E, n_sites, 3, history_len)`.
      scale: float32 `(..., n_sites, 3)`; a cast is `saturate(hp * scale)`.
      key: float64 `(...)` holding an integer, the random key of the layers that round
        stochastically (NVFP4), or None when no layer draws random bits (then the state has
        exactly the two leaves above). `fn.init(..., seed=...)` sets it, `fp8fn.update` adds
        one; an observation's key is 0.
      sites: the site names, a tuple of str (static).
      amax_compute: `"max"` or `"most_recent"` (static).
      margin: int >= 0 (static).
      filled: which histories hold an observation, a tuple of `3 * n_sites` bools (site-major,
        roles in order), or None when not known (static, in the tree structure, but not part of
        `static`: states and observations of other `filled` still pair). A filled history casts
        with its stored scale alone, so the cast needs no amax first (one pass over the tensor);
        an unknown or empty one decides in the graph (empty: current scaling). `init_state`
        sets all False, `update` sets it from the values it makes, `_replace(amax_history=...)`
        forgets it. A fact about values kept in the structure outlives them (`tree_map`,
        `tree_unflatten`, `copy_`): the ops trust it only through `known_filled`.

    Example:
      >>> import fp8fn
      >>> state = fp8fn.init_state(fp8fn.DelayedScaling(history_len=4), ["fc1", "fc2"])
      >>> len(state), list(state), tuple(state.amax_history.shape)
      (2, ['fc1', 'fc2'], (2, 3, 4))
      >>> state["fc2"].input.amax_history
      tensor([0., 0., 0., 0.])
    """

    amax_history: torch.Tensor  # (..., n_sites, 3, history_len) float32
    scale: torch.Tensor  # (..., n_sites, 3) float32
    sites: tuple  # static
    amax_compute: str = "max"  # static
    margin: int = 0  # static
    key: torch.Tensor | None = None  # (...) float64, or None: no leaf
    filled: tuple | None = None  # static, riding along (see the class docstring)
    _index: dict | None = dataclasses.field(default=None, init=False)  # `_positions`'s cache
    _views: dict = dataclasses.field(default_factory=dict, init=False)  # `__getitem__`'s cache

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(self.sites))

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[-1]

    @property
    def static(self) -> tuple:
        """`(sites, amax_compute, margin)`: what the tree structure holds besides the leaves."""
        return (self.sites, self.amax_compute, self.margin)

    def _replace(self, **leaves) -> State:
        """A new `State` with `amax_history`, `scale` and/or `key` replaced (like NamedTuple's)."""
        fields = {"amax_history": self.amax_history, "scale": self.scale, "key": self.key}
        fields.update(_known_fields("State", leaves, ("amax_history", "scale", "key")))
        filled = None if "amax_history" in leaves else self.filled
        return State(
            fields["amax_history"], fields["scale"], *self.static, key=fields["key"], filled=filled
        )

    def _observable(self, amax_history) -> State:
        """This state with `amax_history` replaced by a tensor of the same values (`filled`
        kept)."""
        return State(amax_history, self.scale, *self.static, key=self.key, filled=self.filled)

    def to(self, device) -> State:
        """The same state with its tensors on `device` (e.g. `"cuda"`, `torch.device`)."""
        key = None if self.key is None else self.key.to(device)
        history, scale = self.amax_history.to(device), self.scale.to(device)
        known = filled_mark(self.amax_history)
        if known[0] is not None and history is not self.amax_history:
            mark_filled(history, *known)  # the same values
        return State(history, scale, *self.static, key=key, filled=self.filled)

    def __len__(self) -> int:
        return len(self.sites)

    def __iter__(self):
        return iter(self.sites)

    def __contains__(self, site) -> bool:
        return site in self._positions()

    def __getitem__(self, site: str) -> SiteState:
        """The rows of `site` (views), cached: the same objects each time."""
        view = self._views.get(site)
        if view is None:
            i = self._positions().get(site)
            if i is None:
                close = difflib.get_close_matches(str(site), self.sites, n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise KeyError(f"fp8fn.State: no site {site!r} among its {len(self)} sites.{hint}")
            rows = (self.amax_history[..., i, :, :], self.scale[..., i, :])
            view = SiteState(*rows, *self.static[1:])
            object.__setattr__(view, "_row", (self.amax_history, i))
            # (not kept where a torch.func transform wrapped the rows of a state it does not
            # transform, e.g. one a loss closes over: the wrapper would outlive the transform;
            # compiled, no wrapper outlives the trace)
            if torch.compiler.is_compiling() or (unwrapped(rows[0]) is rows[0]) == (
                unwrapped(self.amax_history) is self.amax_history
            ):
                self._views[site] = view
        return view

    def keys(self):
        return list(self.sites)

    def values(self):
        return [self[s] for s in self.sites]

    def items(self):
        return [(s, self[s]) for s in self.sites]

    def _positions(self) -> dict:
        """`{site: row}`, built on first use (a cache, not data)."""
        if self._index is None:
            object.__setattr__(self, "_index", {s: i for i, s in enumerate(self.sites)})
        return self._index

    def __repr__(self) -> str:
        shape = tuple(self.amax_history.shape)
        key = "" if self.key is None else f", key={tuple(self.key.shape)}"
        return (
            f"fp8fn.State(sites={list(self.sites)}, amax_history={shape}, "
            f"amax_compute={self.amax_compute!r}, margin={self.margin}{key})"
        )

    def __reduce__(self):
        return (State, (self.amax_history, self.scale, *self.static, self.key))


def _register(cls, leaves, static, make_from=None):
    """Register `cls` as a pytree node (torch and optree) of the fields `leaves`, with the
    static config `static(obj)` as aux data; and as safe for `torch.load(weights_only=True)`.

    An optional `key` field (`State`'s) is a third leaf when it is a tensor and no leaf when it
    is None (both libraries: torch's pytree would count a None child as a leaf, optree not), so
    a state without a key keeps exactly its two leaves and its tree structure.
    """

    def fields(obj):
        return (*leaves, "key") if getattr(obj, "key", None) is not None else leaves

    def make(values, aux):
        *values, key = values if len(values) > len(leaves) else (*values, None)
        if make_from is not None:
            return make_from(values, aux, key)
        return cls(*values, *aux) if key is None else cls(*values, *aux, key=key)

    register_pytree_node(
        cls,
        lambda obj: ([getattr(obj, f) for f in fields(obj)], static(obj)),
        make,
        serialized_type_name=f"fp8fn.{cls.__name__}",
        flatten_with_keys_fn=lambda obj: (
            [(GetAttrKey(f), getattr(obj, f)) for f in fields(obj)],
            static(obj),
        ),
    )
    optree.register_pytree_node(
        cls,
        lambda obj: ([getattr(obj, f) for f in fields(obj)], static(obj), fields(obj)),
        lambda aux, values: make(list(values), aux),
        namespace="fp8fn",
    )
    torch.serialization.add_safe_globals([cls])


# The public types pickle as `fp8fn.State` (not this module's path), so that a saved state
# survives a reorganisation of the private modules; states saved by 0.3 name them by the module
# they then lived in, and load through its alias on both load paths.
register_moved("fp8fn._state", (ScaleState, SiteState, State))


@dataclasses.dataclass(frozen=True, slots=True)
class _TreeContext:
    """A `State`'s pytree aux data: its `static` config, and `filled` riding along. Equal by
    `static` alone, so that states and observations of other `filled` have one tree structure
    (torch.func, vmap, `merge`); torch.compile guards on `filled` where the op reads it."""

    static: tuple
    filled: tuple | None = dataclasses.field(compare=False)

    def __repr__(self):
        return repr(self.static)


_register(
    State,
    ("amax_history", "scale"),
    lambda s: _TreeContext(s.static, s.filled),
    lambda values, aux, key: State(*values, *aux.static, key=key, filled=aux.filled),
)
_register(SiteState, ("amax_history", "scale"), lambda s: s.static)
register_state_class = _register  # fp8fn.optim registers its state the same way


def site_name(path: str, k: int) -> str:
    """The site of a layer's k-th call (from 0) in one forward: `path`, `path#1`, `path#2`, ...

    A `#` in the path itself is doubled, so that no layer's name can alias another's call.
    """
    base = path.replace("#", "##")
    return base if k == 0 else f"{base}#{k}"


def parse_site(name: str) -> tuple[str, int]:
    """`(path, k)` of a site name: the inverse of `site_name`."""
    head, sep, digits = name.rpartition("#")
    if sep and digits.isdigit() and (len(head) - len(head.rstrip("#"))) % 2 == 0:
        return head.replace("##", "#"), int(digits)
    return name.replace("##", "#"), 0


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
    if isinstance(sites, (str, bytes)) or not isinstance(sites, Iterable):
        raise TypeError(
            f"fp8fn.init_state: expected `sites` a list of str site names, got "
            f"{type(sites).__name__} {sites!r}. For one site: [{sites!r}]."
        )
    sites = tuple(sites)
    if not all(isinstance(s, str) for s in sites) or len(set(sites)) != len(sites):
        raise ValueError(f"fp8fn.init_state: expected distinct str site names, got {sites!r}.")
    n, h = len(sites), recipe.history_len
    history = torch.zeros(n, 3, h, dtype=torch.float32, device=device)
    NEVER_UPDATED[history] = {}  # (see `warn_if_never_updated`)
    return State(
        history,
        mark_valid(torch.ones(n, 3, dtype=torch.float32, device=device)),
        sites,
        recipe.amax_compute,
        recipe.margin,
        filled=(False,) * (3 * n),
    )


def stack_states(states) -> State:
    """The states of an ensemble's members as one `State`, for `torch.func.vmap` over members.

    Args:
      states: a non-empty list or tuple of `State`s of one transform (the same sites and static
        config, e.g. `fn.init` once per member, or their updates), of equal shapes.

    Returns:
      A `State` with `amax_history` float32 `(E, n_sites, 3, history_len)`, `scale` float32
      `(E, n_sites, 3)` and `key` float64 `(E,)` (or None), E = `len(states)`: member `i` is
      `state[i]` along the leading dim (`pytree.tree_map(lambda t: t[i], stacked)`).

    Example:
      >>> import torch, fp8fn
      >>> fn = fp8fn.transform(torch.nn.Linear(8, 4), fp8fn.DelayedScaling(history_len=4))
      >>> stacked = fp8fn.stack_states([fn.init(torch.randn(2, 8)) for _ in range(3)])
      >>> tuple(stacked.amax_history.shape), tuple(stacked.scale.shape)
      ((3, 1, 3, 4), (3, 1, 3))
    """
    if not isinstance(states, (list, tuple)) or not states:
        raise TypeError(
            "fp8fn.stack_states: expected a non-empty list or tuple of fp8fn.State, got "
            f"{type(states).__name__}{' (empty)' if isinstance(states, (list, tuple)) else ''}."
        )
    for i, state in enumerate(states):
        check_state("stack_states", state, f"states[{i}]", batch_dims=None)
        if state.static != states[0].static or (state.key is None) != (states[0].key is None):
            raise ValueError(
                f"fp8fn.stack_states: expected the states of one transform, got states[{i}] with "
                f"sites {list(state.sites)} and config {state.static[1:]} against states[0]'s "
                f"{list(states[0].sites)} and {states[0].static[1:]}. Stack the states of one "
                "model's members (one fn.init each)."
            )
    shapes = {tuple(s.amax_history.shape) for s in states}
    if len(shapes) > 1:
        raise ValueError(f"fp8fn.stack_states: expected states of one shape, got {sorted(shapes)}.")
    key = None if states[0].key is None else torch.stack([s.key for s in states])
    return states[0]._replace(
        amax_history=torch.stack([s.amax_history for s in states]),
        scale=torch.stack([s.scale for s in states]),
        key=key,
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
    key = state.key
    if key is not None and not isinstance(key, torch.Tensor):
        raise TypeError(
            f"fp8fn.{api}: expected `{name}.key` to be a tensor or None, got {type(key).__name__}."
        )
    if key is not None and key.dtype != torch.float64:
        raise TypeError(
            f"fp8fn.{api}: expected `{name}.key` to be float64 (an integer held exactly), got "
            f"{key.dtype}. Make the state with fn.init(..., seed=...)."
        )
    n = len(state.sites)
    lead = h.dim() - 3
    if key is not None and (key.shape != h.shape[: max(lead, 0)] or key.device != h.device):
        raise ValueError(
            f"fp8fn.{api}: expected `{name}.key` of shape {tuple(h.shape[: max(lead, 0)])} (the "
            f"leading dims of `{name}.amax_history`) on {h.device}, got {tuple(key.shape)} on "
            f"{key.device}."
        )
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


def mark_valid(scale: torch.Tensor) -> torch.Tensor:
    """Record that `scale` (made by fp8fn from valid scales) is finite and > 0; returns it."""
    return VALID_SCALES.mark(scale)


def known_valid(scale: torch.Tensor) -> bool:
    """Whether `scale` (or the tensor it views, or one whose memory it shares) holds scales known
    to be finite and > 0, unchanged since they were checked (no host read)."""
    return VALID_SCALES.get(scale) is not None


def known_filled(state: State, api: str = "apply") -> tuple[bool, ...] | None:
    """`state.filled` where it is known true of `state`'s values, else None (decide in the graph).

    `filled` rides in the tree structure, which outlives the values (`tree_map`, `tree_unflatten`
    with an old structure, `copy_` into the tensors): a role that casts with its stored scale
    alone must know its history filled *for these values*. Eager: by `update`'s mark on the
    history (identity and version, no host read). Compiled: the structure's `filled`, checked by
    an assert in the graph (no host read), which refuses a state whose values contradict it.
    """
    filled = state.filled
    if filled is None or not any(filled):
        return filled  # an empty or unknown history decides in the graph: nothing to trust
    if not torch.compiler.is_compiling():
        return filled_mark(state.amax_history)[0]
    held = state.amax_history[..., 0] > 0  # (one reduction and the assert: 2 kernels)
    if not all(filled):
        held = held | ~torch.tensor(filled, device=held.device).reshape(-1, 3)
    assert_in_graph(
        held.all(),
        f"fp8fn.{api}: `state` says (in its tree structure) that its amax histories are "
        "filled, but its values hold an empty history: a state rebuilt on another's structure "
        "(`tree_map`, `tree_unflatten` with an old structure, `copy_` into its tensors) keeps "
        "what the structure says of the old values. Make states with fn.init, fp8fn.update or "
        "fp8fn.unflatten_state.",
    )
    return filled


def filled_mark(history: torch.Tensor) -> tuple[tuple[bool, ...] | None, int]:
    """`(filled, reads)` that `update` marked on `history` (`reads`: how many updates of its
    line read the values), or `(None, 0)` where no mark holds (another tensor, changed since)."""
    return FILLED.get(history) or (None, 0)


def mark_filled(history: torch.Tensor, filled: tuple[bool, ...], reads: int) -> None:
    """Record that `filled` is true of `history`'s values (made by `update`, outside
    torch.compile and torch.func), after `reads` updates of its line that read values."""
    FILLED.mark(history, (filled, reads))


def check_scales(api: str, scale: torch.Tensor, name: str = "state") -> None:
    """Raise unless every scale in `scale` (a `State`'s or a `SiteState`'s) is finite and > 0.

    A scale of 0 or NaN would cast everything to NaN, silently: it comes from passing an
    observation (whose scales are zeros) where a state belongs. Checked once per tensor and
    version (a host read, none for the states `init` and `update` make, and again after an
    in-place change), and not while compiling.
    """
    if torch.compiler.is_compiling():
        return
    base = unwrapped(scale)
    if base.device.type == "meta" or known_valid(base):
        return
    if not bool(((base > 0) & base.isfinite()).all()):
        raise ValueError(
            f"fp8fn.{api}: expected the scales of `{name}` finite and > 0, got "
            f"{base.flatten()[:6].tolist()}{'...' if base.numel() > 6 else ''}. Scales of 0 are "
            "an observation's: pass the state (from fn.init or fp8fn.update) here, and the "
            "observation to fp8fn.update(state, obs)."
        )
    mark_valid(base)


def supersede(state: State, new: State) -> None:
    """Note that `fp8fn.update` made `new` from `state` (see `warn_if_superseded`)."""
    old = unwrapped(state.amax_history)
    if old not in SUPERSEDED:
        SUPERSEDED[old] = False
    PREDECESSOR[unwrapped(new.amax_history)] = weakref.ref(old)


def warn_if_superseded(api: str, state: State) -> None:
    """Warn when `state` was already updated and no state that `update` made from it was used:
    the loop kept the old state and dropped the result of `fp8fn.update`, so its scales never
    move (the classic slip). Two experiments from one initial state (an A/B comparison, a
    re-run notebook cell) are not warned about: the first one used the result of its update."""
    if torch.compiler.is_compiling():
        return
    history = unwrapped(state.amax_history)
    old = PREDECESSOR.get(history)
    if old is not None and old() is not None:
        SUPERSEDED[old()] = True  # its update's result was kept and used
    if SUPERSEDED.get(history) is False:
        warnings.warn(
            f"fp8fn.{api}: this state was already updated by fp8fn.update, which returned a new "
            "state, and is used again: its scales never move. Keep the result: "
            "`state = fp8fn.update(state, obs)`.",
            stacklevel=3,
        )


def warn_if_never_updated(api: str, state: State, params: dict) -> None:
    """Warn when a state that `fp8fn.update` never advanced is observed by a second training
    step: the loop drops the observations, so every step casts with current scaling.

    A step is told from the next by the values of the parameters (the first 64 of the first
    one, a plain tensor): microbatches of one step, or two routes compared on the same
    parameters, see the same values and are not warned about. Only a state fresh from `init`
    that `update` never advanced is checked (a host read from its second observation on; a
    second experiment from an updated initial state is not), and each warns once.
    """
    history = state.amax_history
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and params):
        return
    source = OBSERVED.get(history, history)  # `observe`'s copy tells its source
    record = NEVER_UPDATED.get(unwrapped(source))
    if record is None or record.get("warned") or not differentiated(history):
        return
    if unwrapped(source) in SUPERSEDED:
        return  # `update` advanced it: a second run from one initial state
    param = unwrapped(next(iter(params.values())))
    if type(param) not in (torch.Tensor, torch.nn.Parameter) or param.device.type == "meta":
        return  # (a DTensor shard, a subclass: not worth a collective)
    seen = param.detach().reshape(-1)[:64].clone()
    if "seen" not in record:  # its first observation
        record["seen"] = seen
        return
    if torch.equal(record["seen"], seen):
        return  # another microbatch of the same step
    record["warned"] = True
    warnings.warn(
        f"fp8fn.{api}: this state has never been updated and is observed by a second training "
        "step: without fp8fn.update every step casts with current scaling and the amax "
        "histories stay empty. After each step: `state = fp8fn.update(state, obs)`.",
        stacklevel=4,  # the caller of fn.apply
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


def claim(history: torch.Tensor, api: str, what: str, row: tuple | None = None) -> None:
    """Refuse a second use of `history` while gradients are recorded for it.

    Autograd sums the gradients of a tensor used twice; fp8fn combines observations by max. So
    each observed state (and each site's rows) may take part once in a recorded gradient. `row`
    is `SiteState._row` for a site's rows (`(the State's history, the site's index)`): the
    site is known by it, however many view tensors of it there are.
    """
    if not (torch.is_grad_enabled() and history.requires_grad) or not history.numel():
        return
    owner, part = (history, None) if row is None else row
    # The parts of `owner` used: None for the whole `State` (`fn.apply`), a site's index for
    # its rows (`fp8fn.linear` of `state[site]`). An attribute of the tensor, not a registry:
    # see "What fp8fn touches outside the state" in docs/semantics.md.
    used = getattr(owner, "_fp8fn_used", ())
    if part in used:
        loop = (
            "Call `observed = fp8fn.observe(state)` inside the training loop, once per forward "
            "pass, not once before it. "
            if not torch.compiler.is_compiling() and owner in OBSERVED
            else ""
        )
        raise RuntimeError(
            f"fp8fn.{api}: this {what} was already used by a forward pass whose observations "
            "are being recorded; autograd would sum the two passes' observations, and fp8fn "
            f"combines them by max. {loop}Give each forward pass its own copy and merge:\n"
            "    # torch.func: grad(loss, argnums=(1, 2))(params, state, state, x1, x2)\n"
            "    # autograd:   s1, s2 = fp8fn.observe(state), fp8fn.observe(state)\n"
            "    obs = fp8fn.merge(obs1, obs2)\n"
            "or run the inputs as one batch, or (for fp8fn.linear) use one site per call."
        )
    owner._fp8fn_used = (*used, part)


def flatten_state(state: State) -> dict[str, torch.Tensor]:
    """A state as a flat `{"site.role.field": tensor}` dict of independent tensors.

    For safetensors and distributed checkpoints; `unflatten_state` is the inverse. Fields are
    `amax_history` `(history_len,)` and `scale` `()`, float32; a state with a random key
    (NVFP4) also has `"key"`, float64 `()`.

    Example:
      >>> import fp8fn
      >>> state = fp8fn.init_state(fp8fn.DelayedScaling(), ["fc"])
      >>> list(fp8fn.flatten_state(state))[:2]
      ['fc.input.amax_history', 'fc.input.scale']
    """
    check_state("flatten_state", state)
    flat = {
        f"{site}.{role}.{field}": leaf.clone()
        for site, site_state in state.items()
        for role in ROLES
        for field, leaf in getattr(site_state, role)._asdict().items()
    }
    if state.key is not None:  # no dot: never a "site.role.field" key
        flat["key"] = state.key.clone()
    return flat


def unflatten_state(flat: dict[str, torch.Tensor], recipe) -> State:
    """The inverse of `flatten_state`, with the static config (`history_len`, `amax_compute`,
    `margin`) of `recipe`. Sites keep the order of `flat`.

    Args:
      flat: `{"site.role.field": tensor}` as from `flatten_state`: float32 `amax_history`
        `(history_len,)` and `scale` `()` of every role of every site, and `"key"` (float64
        `()`, an integer in `[0, 2**52)`) for a model with NVFP4 layers.
      recipe: the model's `DelayedScaling`; for a model without delayed layers (no sites, e.g.
        NVFP4 only), its recipe (any recipe but `DelayedScaling` then means no sites).

    Raises:
      TypeError: naming the entry, when `flat` is not a dict of tensors of those dtypes.
      ValueError: naming the entry, when a key is not 'site.role.field', a field is missing, a
        shape is not the recipe's, or the random key is not an integer in range.
    """
    if not isinstance(recipe, RECIPES):
        raise TypeError(
            f"fp8fn.unflatten_state: expected `recipe` to be an fp8fn recipe (the model's "
            f"DelayedScaling, if it has delayed layers), got {type(recipe).__name__}."
        )
    if not isinstance(flat, Mapping):
        raise TypeError(
            "fp8fn.unflatten_state: expected `flat` a dict {'site.role.field': tensor} (from "
            f"fp8fn.flatten_state), got {type(flat).__name__}."
        )
    stateless = not isinstance(recipe, DelayedScaling)
    if stateless and any(name != "key" for name in flat):
        raise ValueError(
            f"fp8fn.unflatten_state: expected no sites under {type(recipe).__name__} (no "
            f"scaling state), got {[n for n in flat if n != 'key'][:3]}. Pass the model's "
            "DelayedScaling recipe."
        )
    fields = ScaleState._fields
    leaves: dict[str, dict] = {}
    random_key = flat.get("key")
    for key, leaf in flat.items():
        if key == "key":
            continue
        parts = key.rsplit(".", 2) if isinstance(key, str) else ()
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
    _check_flat(flat, 1 if stateless else recipe.history_len, recipe)
    if stateless:  # the state fn.init makes for a model without delayed layers
        recipe = DelayedScaling(history_len=1)
    sites = list(leaves)
    if not sites:
        return init_state(recipe, [])._replace(key=random_key)
    history = torch.stack(
        [torch.stack([leaves[s][r, "amax_history"] for r in ROLES]) for s in sites]
    )
    scale = torch.stack([torch.stack([leaves[s][r, "scale"] for r in ROLES]) for s in sites])
    state = State(history, scale, sites, recipe.amax_compute, recipe.margin, random_key)
    check_state("unflatten_state", state)
    return state


def _check_flat(flat: Mapping, history_len: int, recipe) -> None:
    """Raise unless every entry of `flat` is a tensor of its field's dtype and shape (an
    `amax_history` of `history_len` entries), and its `"key"` a valid key."""
    want = {
        "amax_history": (torch.float32, (history_len,)),
        "scale": (torch.float32, ()),
        "key": (torch.float64, ()),
    }
    for name, leaf in flat.items():
        dtype, shape = want[name.rsplit(".", 1)[-1]]  # names are 'site.role.field' or 'key'

        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"fp8fn.unflatten_state: expected a tensor at {name!r}, got "
                f"{type(leaf).__name__}. Convert it: torch.tensor(value, dtype={dtype})."
            )
        if leaf.dtype != dtype:
            raise TypeError(
                f"fp8fn.unflatten_state: expected {dtype} at {name!r}, got {leaf.dtype}."
            )
        if tuple(leaf.shape) != shape:
            why = f" (the history_len of {recipe})" if name != "key" and shape else ""
            raise ValueError(
                f"fp8fn.unflatten_state: expected shape {shape}{why} at {name!r}, got "
                f"{tuple(leaf.shape)}. Pass the recipe the state was saved with."
            )
    if "key" in flat:
        check_key("unflatten_state", flat["key"], "`flat['key']`")
