"""Plain-autograd routes: observations through `.backward()`, and a compilable `value_and_grad`."""

from __future__ import annotations

import torch

from .._torch_private import functorch_level, tree_flatten, tree_unflatten
from .registries import OBSERVED
from .state import State, check_state, warn_if_superseded


def observe(state: State) -> State:
    """`state` made observable by plain autograd: its `amax_history` a fresh leaf requiring grad.

    After `loss.backward()`, `fp8fn.observations(state)` gives the observation for
    `fp8fn.update`. Make a fresh one for every backward (a microbatch each, then `fp8fn.merge`):
    `.grad` accumulation would sum observations, and `fn.apply` refuses a state it has seen.

    Example:
      >>> import torch, fp8fn
      >>> recipe = fp8fn.DelayedScaling()
      >>> state = fp8fn.observe(fp8fn.init_state(recipe, ["fc"]))
      >>> x, w = torch.randn(8, 32), torch.randn(16, 32, requires_grad=True)
      >>> fp8fn.linear(x, w, None, state["fc"], recipe).sum().backward()
      >>> obs = fp8fn.observations(state)
      >>> bool(obs["fc"].input.amax_history[0] == x.abs().max())
      True
    """
    check_state("observe", state, batch_dims=None)
    warn_if_superseded("observe", state)
    history = state.amax_history.detach().requires_grad_()
    OBSERVED[history] = state.amax_history  # (for `claim`'s advice, `warn_if_never_updated`)
    history.register_hook(_one_gradient())
    return state._observable(history)


def _one_gradient():
    """A hook for an observed history: a second gradient means a second backward through one
    forward pass (`backward(retain_graph=True)` twice), which autograd would sum."""
    seen = []

    def hook(grad):
        if seen:
            raise RuntimeError(
                "fp8fn.observe: a second backward pass reached this observed state (e.g. "
                "`l1.backward(retain_graph=True); l2.backward()`); autograd would sum the two "
                "passes' observations, and fp8fn combines them by max. Call backward once, on "
                "the sum of the losses, or make a fresh fp8fn.observe(state) for each forward."
            )
        seen.append(True)

    return hook


def observations(state: State) -> State:
    """The observation recorded in an `observe`d state by `backward()`: a `State` for `update`.

    Raises:
      RuntimeError: when nothing was observed (its `amax_history` has no `.grad`: the state was
        not made with `fp8fn.observe`, not passed to the forward, or `backward()` not called).
    """
    check_state("observations", state, batch_dims=None)
    grad = state.amax_history.grad
    if grad is None and not len(state):  # no stateful layer: the empty observation
        grad = torch.zeros_like(state.amax_history)
    if grad is None:
        raise RuntimeError(
            "fp8fn.observations: nothing was observed: `state.amax_history.grad` is None. Make "
            "the state with `state = fp8fn.observe(state)`, pass that state to the forward, call "
            "`loss.backward()`, then `fp8fn.observations(state)`."
        )
    key = None if state.key is None else torch.zeros_like(state.key)  # observations never move it
    return state._replace(amax_history=grad, scale=torch.zeros_like(state.scale), key=key)


def refuse_untrained_backward(params: dict, held, state: State) -> None:
    """In a plain autograd loop (`state` from `fp8fn.observe`), make `backward()` raise when
    `params` holds tensors that autograd does not track where the module's own (`held(name)`,
    the tensor the module holds) require grad (`{k: v.detach()}`, `model.state_dict()`): it
    would succeed on the observed state alone (plain PyTorch raises there) and the optimizer
    get no gradient. `torch.autograd.grad` of the observed history alone (observations only)
    stays allowed: it accumulates no `.grad`. Eager, outside torch.func only."""
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or functorch_level() is not None
        or state.amax_history not in OBSERVED
    ):
        return
    detached = [
        name
        for name, t in params.items()
        if isinstance(t, torch.Tensor) and not t.requires_grad and held(name).requires_grad
    ]
    if not detached:
        return
    message = (
        "fp8fn.apply: `loss.backward()` of a forward on parameters that autograd does not "
        f"differentiate, where the module's parameters require grad ({len(detached)}: "
        f"{', '.join(map(repr, detached[:3]))}{', ...' if len(detached) > 3 else ''}): only "
        "the observed state got a gradient, the optimizer none; this loop would train "
        "nothing. Pass the module's own parameters: `fn.apply(dict(model.named_parameters()), "
        "observed, x)`, not `.detach()` copies or `model.state_dict()` (for observations "
        "only, `torch.autograd.grad(loss, observed.amax_history)`)."
    )

    def refuse(_):
        raise ValueError(message)

    state.amax_history.register_post_accumulate_grad_hook(refuse)


def value_and_grad(f, argnums=None, has_aux=False):
    """`f`'s value and its gradient with respect to the arguments `argnums`, JAX style.

    Like `torch.func.grad_and_value` (value first, as in `jax.value_and_grad`), but built on
    `torch.autograd.grad`, so `torch.compile(fp8fn.value_and_grad(f, ...))` compiles the forward
    and the backward with fp8fn's backward intact (pytorch#193279 drops it when torch.func
    transforms are compiled). Differentiating an `fp8fn.State` gives its observation.

    Args:
      f: a function returning a scalar tensor (or `(scalar, aux)` with `has_aux=True`).
      argnums: an int or a tuple of ints: the arguments (pytrees of floating tensors) to
        differentiate. Left out: 0, unless another positional argument is an `fp8fn.State` with
        sites, which is refused (its gradient is the observation `fp8fn.update` needs: pass
        `argnums=(0, 1)`; `argnums=0` differentiates the parameters only).
      has_aux: whether `f` returns `(value, aux)`.

    Returns:
      A function of `f`'s arguments returning `(value, grads)` (`((value, aux), grads)` with
      `has_aux`); `grads` has the structure of the argument (a tuple of them for a tuple of
      `argnums`). Leaves that did not take part get zeros.

    Example:
      >>> import torch, fp8fn
      >>> model = torch.nn.Linear(32, 8)
      >>> fn = fp8fn.transform(model, fp8fn.DelayedScaling())
      >>> x = torch.randn(16, 32)
      >>> params, state = dict(model.named_parameters()), fn.init(x)
      >>> loss = lambda p, s, x: fn.apply(p, s, x).square().mean()
      >>> value, (grads, obs) = fp8fn.value_and_grad(loss, argnums=(0, 1))(params, state, x)
      >>> state = fp8fn.update(state, obs)
    """
    single = argnums is None or isinstance(argnums, int)
    nums = (0,) if argnums is None else (argnums,) if single else tuple(argnums)
    if not nums or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TypeError(
            f"fp8fn.value_and_grad: expected `argnums` an int or a tuple of ints, got {argnums!r}."
        )

    def wrapped(*args, **kwargs):
        # Dynamo cannot trace these queries (graph breaks); compiled, torch's own errors at
        # torch.autograd.grad say it.
        compiling = torch.compiler.is_compiling()
        if not compiling and functorch_level() is not None:
            raise RuntimeError(
                "fp8fn.value_and_grad: it differentiates with torch.autograd.grad, which "
                "torch.func transforms (vmap, grad) do not allow inside them. Under torch.vmap "
                "use torch.func.grad_and_value (fp8fn gives the same numbers on that route)."
            )
        if not compiling and torch.is_inference_mode_enabled():
            raise RuntimeError(
                "fp8fn.value_and_grad: no gradient can be computed inside "
                "torch.inference_mode(). Call it outside; for evaluation without gradients, "
                "call the function itself under torch.no_grad()."
            )
        args = list(args)
        if argnums is None:
            _refuse_undifferentiated_state(args)
        specs = []
        for i in nums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"fp8fn.value_and_grad: expected each of `argnums` in [{-len(args)}, "
                    f"{len(args)}) (the {len(args)} positional arguments), got {i}."
                )
            leaves, spec = tree_flatten(args[i])
            for leaf in leaves:
                if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
                    raise TypeError(
                        f"fp8fn.value_and_grad: expected argument {i} to be a pytree of floating "
                        f"tensors, got a leaf {getattr(leaf, 'dtype', type(leaf).__name__)}."
                    )
                if not compiling and leaf.is_inference():
                    raise RuntimeError(
                        f"fp8fn.value_and_grad: argument {i} holds a tensor made under "
                        "torch.inference_mode(), which autograd cannot differentiate. Make it "
                        "outside inference mode (or `.clone()` it there)."
                    )
            # A tensor given twice in one argument (tied weights) stays one tensor; one given in
            # two arguments is two (two copies of a state, for two forward passes).
            memo = {}
            leaves = [memo.setdefault(id(t), t.detach().requires_grad_()) for t in leaves]
            args[i] = tree_unflatten(leaves, spec)
            specs.append((leaves, spec))
        with torch.enable_grad():
            out = f(*args, **kwargs)
        value, aux = out if has_aux else (out, None)
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise ValueError(
                "fp8fn.value_and_grad: expected `f` to return a scalar tensor"
                f"{' (first of (value, aux))' if has_aux else ''}, got "
                f"{getattr(value, 'shape', type(value).__name__)}."
            )
        flat = [t for leaves, _ in specs for t in leaves]
        grads = iter(torch.autograd.grad(value, flat, allow_unused=True, materialize_grads=True))
        trees = tuple(tree_unflatten([next(grads) for _ in ls], sp) for ls, sp in specs)
        result = trees[0] if single else trees
        value = value.detach()
        return ((value, aux) if has_aux else value), result

    return wrapped


def _refuse_undifferentiated_state(args: list) -> None:
    """`fp8fn.value_and_grad` with `argnums` left out: refuse an `fp8fn.State` (with sites) among
    the positional arguments after the first, whose observation would not be computed."""
    for i, arg in enumerate(args[1:], start=1):
        if isinstance(arg, State) and len(arg):
            raise ValueError(
                f"fp8fn.value_and_grad: expected `argnums` to include argument {i}, an "
                "fp8fn.State, got `argnums` left out (0: the first argument only), so its "
                "observation, the gradient that fp8fn.update needs, is not computed. Use "
                f"`loss, (grads, obs) = fp8fn.value_and_grad(f, argnums=(0, {i}))(...)`: the "
                "value first, as jax.value_and_grad (torch.func.grad_and_value returns "
                "`((grads, obs), loss)`). To differentiate the parameters only, pass "
                "`argnums=0`."
            )
