"""Everything fp8fn keeps outside the state is named, in one place: every module-level registry
and context variable of the package is defined in `fp8fn/_core/registries.py`, with a comment
saying what it holds, who writes it, who reads it and why it cannot be in the state, and each,
like each process-wide switch, has its row in docs/semantics.md's table."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
REGISTRIES = ROOT / "fp8fn" / "_core" / "registries.py"
# The one registry elsewhere: a cache of torch.func's classes, made in the layer below `_core`.
BELOW = {ROOT / "fp8fn" / "_torch_private.py": {"SINGLE_LEVEL_FUNCTIONS"}}
# What a module-level registry is made of: a mark, a weak or plain mapping, a context variable.
MAKERS = {"Marks", "WeakIdKeyDictionary", "WeakKeyDictionary", "WeakSet", "ContextVar"}


def registries_in(tree: ast.Module) -> dict[str, ast.stmt]:
    """The module-level registries of `tree` (made by one of `MAKERS`, or an empty dict or set
    filled later), by name."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            value = node.value
            made = isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1]
            empty = isinstance(value, (ast.Dict, ast.Set)) and not ast.unparse(value)[1:-1]
            if made in MAKERS or empty:
                found[ast.unparse(target)] = node
    return found


def switches_in(tree: ast.Module) -> set[str]:
    """The globals that a function of `tree` rebinds (`global`)."""
    return {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}


def by_module() -> dict[pathlib.Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for p in sorted((ROOT / "fp8fn").rglob("*.py"))}


def test_every_registry_and_context_variable_is_defined_in_core_registries():
    elsewhere = {
        f"{path.relative_to(ROOT)}: {name}"
        for path, tree in by_module().items()
        if path != REGISTRIES
        for name in registries_in(tree)
        if name not in BELOW.get(path, ())
    }
    assert not elsewhere, "define these in fp8fn/_core/registries.py, with their comment"


@pytest.mark.parametrize("path", [REGISTRIES, *BELOW], ids=lambda p: p.name)
def test_every_registry_says_what_it_holds_who_writes_and_reads_it_and_why_not_in_the_state(path):
    lines = path.read_text().splitlines()
    found = registries_in(ast.parse(path.read_text()))
    assert path == REGISTRIES or set(found) == BELOW[path]
    for name, node in found.items():
        comment = []
        for line in reversed(lines[: node.lineno - 1]):
            if not line.startswith("# ") or line.startswith("# --"):
                break
            comment.insert(0, line[2:])
        text = " ".join(comment)
        for needed in (r"(Written|Set) (and read )?by", r"[Rr]ead by", r"Not in the state"):
            assert re.search(needed, text), f"{name}: its comment lacks {needed!r}: {text!r}"


def test_every_registry_context_variable_and_switch_has_its_row_in_the_docs():
    table = (ROOT / "docs" / "semantics.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \((?:[\w ]+, )?`([\w/.]+)`\)", table, re.M))
    trees = by_module()
    registries = set(registries_in(trees[REGISTRIES]))
    switches = {
        name: str(path.relative_to(ROOT / "fp8fn"))
        for path, tree in trees.items()
        for name in switches_in(tree)
    }
    below = {n: str(p.relative_to(ROOT / "fp8fn")) for p, names in BELOW.items() for n in names}
    assert rows == {**dict.fromkeys(registries, "_core/registries.py"), **below, **switches}
    assert (len(registries), len(switches)) == (11 + 2, 2)  # the docs' count
