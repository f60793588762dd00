"""The layers of fp8fn as a rule: the order written in `fp8fn/__init__.py`'s docstring, checked
on every import of the package (also those inside functions), with no exemptions.

A module imports from its own layer and the layers below it. A strict order of the layers
leaves no room for a cycle between them: an import from a higher layer is the only way to make
one, and it fails here.
"""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fp8fn"


def layers() -> list[str]:
    """The layers, lowest first, as `fp8fn/__init__.py`'s docstring lists them."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    return re.findall(r"^    (\w+)  ", doc.partition("Layers")[2], re.M)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    """`fp8fn._core.state` -> `_core`; `fp8fn` (the package's `__init__`) -> `fp8fn`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports():
    """`(importer, imported module, name or None, line)` for every import of fp8fn by fp8fn: the
    name is what `from module import name` takes when `name` is not itself a module."""
    for importer, path in MODULES.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "fp8fn":
                        yield importer, alias.name, None, node.lineno
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                if base.split(".")[0] != "fp8fn":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in MODULES:
                        yield importer, sub, None, node.lineno
                    else:
                        yield importer, base, alias.name, node.lineno


def test_the_layers_name_every_subpackage_and_top_level_module_once():
    order = layers()
    assert len(order) == len(set(order)), order
    assert set(order) == {layer_of(m) for m in MODULES}


def test_no_module_imports_from_a_higher_layer():
    rank = {layer: i for i, layer in enumerate(layers())}
    upward = [
        f"{importer}:{line} imports {imported} ({layer_of(imported)} above {layer_of(importer)})"
        for importer, imported, _, line in imports()
        if rank[layer_of(imported)] > rank[layer_of(importer)]
    ]
    assert upward == []


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    found = set((importer, imported) for importer, imported, _, _ in imports())
    assert ("fp8fn._kernels.cast", "fp8fn._kernels.triton_jit") in found  # inside a function
    assert ("fp8fn.testing.cuda_contract", "fp8fn._torch_private") in found  # `from .. import`
    assert ("fp8fn.demo", "fp8fn") in found  # `import fp8fn`
