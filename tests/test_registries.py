"""Everything fp8fn keeps outside the state is named: each module-level registry, context
variable and process-wide switch in the package has its row in docs/semantics.md's table."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What a module-level registry is made of: a mark, a weak or plain mapping, a context variable.
MAKERS = {"Marks", "WeakIdKeyDictionary", "WeakKeyDictionary", "WeakSet", "ContextVar"}


def kept_outside_the_state() -> set[str]:
    """The names of fp8fn's module-level registries (made by one of `MAKERS`, or an empty
    dict or set filled later), context variables and globals rebound by a function."""
    found = set()
    for path in (ROOT / "fp8fn").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                value = node.value
                made = isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1]
                empty = isinstance(value, (ast.Dict, ast.Set)) and not ast.unparse(value)[1:-1]
                if made in MAKERS or empty:
                    found.add(ast.unparse(target))
        found.update(
            n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names
        )
    return found


def test_every_registry_context_variable_and_switch_has_its_row_in_the_docs():
    table = (ROOT / "docs" / "semantics.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \(", table, re.M))
    found = kept_outside_the_state()
    assert found == rows
    assert len(found) == 11 + 2 + 2  # registries, context variables, switches (the docs' count)
