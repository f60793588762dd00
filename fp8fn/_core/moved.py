"""Types saved under the private module they lived in then: found again on both load paths.

fp8fn 0.3 pickled its states and recipes by their defining modules (`fp8fn._state.State`,
`fp8fn._recipe.DelayedScaling`); those modules moved in 0.4. Public types now pickle as
`fp8fn.<Name>` (their `__module__`), and each old name resolves to the class on both of
`torch.load`'s paths: `weights_only=True` through torch's safe globals, and `weights_only=False`
(plain pickle, which imports the module: needed by any checkpoint that also holds non-tensor
objects) through an alias module in `sys.modules`.
"""

from __future__ import annotations

import sys
import types

import torch


def register_moved(module: str, classes) -> None:
    """Make `{module}.{cls.__name__}` load as `cls` for each of `classes` (and pickle new ones
    as `fp8fn.{cls.__name__}`)."""
    alias = sys.modules.get(module)
    if alias is None:
        alias = sys.modules[module] = types.ModuleType(module, f"fp8fn 0.3's {module} (moved).")
    for cls in classes:
        cls.__module__ = "fp8fn"
        setattr(alias, cls.__name__, cls)
    torch.serialization.add_safe_globals(
        [*classes, *((c, f"{module}.{c.__name__}") for c in classes)]
    )
