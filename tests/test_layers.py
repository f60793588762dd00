"""The layers of fp8fn as a rule: the order written in `fp8fn/__init__.py`'s docstring, checked
on every import of the package (also those inside functions), with no exemptions.

A module imports from its own layer and the layers below it. A strict order of the layers
leaves no room for a cycle between them: an import from a higher layer is the only way to make
one, and it fails here.
"""

import ast
import pathlib
import re
import typing

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


class Import(typing.NamedTuple):
    importer: str  # the module that imports, `fp8fn._core.state`
    imported: str  # the module imported from
    name: str | None  # what `from module import name` takes, None when it is a module itself
    bound: str  # the name the import binds in the importer
    line: int


def imports(only: str | None = None):
    """Every import of fp8fn by fp8fn (by the module `only` when given)."""
    for importer, path in MODULES.items():
        if only is not None and importer != only:
            continue
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "fp8fn":
                        bound = alias.asname or alias.name.split(".")[0]
                        yield Import(importer, alias.name, None, bound, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                if base.split(".")[0] != "fp8fn":
                    continue
                for alias in node.names:
                    sub, bound = f"{base}.{alias.name}", alias.asname or alias.name
                    if sub in MODULES:
                        yield Import(importer, sub, None, bound, node.lineno)
                    else:
                        yield Import(importer, base, alias.name, bound, node.lineno)


def module_attributes():
    """`(importer, module, attribute, line)` for every `alias.attribute` that a module reads of a
    module it imported as `alias` (`from . import fp8 as q`; `q._x`)."""
    for importer, path in MODULES.items():
        modules = {i.bound: i.imported for i in imports(importer) if i.name is None}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in modules:
                    yield importer, modules[node.value.id], node.attr, node.lineno


def test_the_layers_name_every_subpackage_and_top_level_module_once():
    order = layers()
    assert len(order) == len(set(order)), order
    assert set(order) == {layer_of(m) for m in MODULES}


def test_no_module_imports_from_a_higher_layer():
    rank = {layer: i for i, layer in enumerate(layers())}
    upward = [
        f"{importer}:{line} imports {imported} ({layer_of(imported)} above {layer_of(importer)})"
        for importer, imported, _, _, line in imports()
        if rank[layer_of(imported)] > rank[layer_of(importer)]
    ]
    assert upward == []


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    found = set((i.importer, i.imported) for i in imports())
    assert ("fp8fn._kernels.cast", "fp8fn._kernels.triton_jit") in found  # inside a function
    assert ("fp8fn.testing.cuda_contract", "fp8fn._torch_private") in found  # `from .. import`
    assert ("fp8fn.demo", "fp8fn") in found  # `import fp8fn`
    names = set((i.importer, i.name) for i in imports())
    assert ("fp8fn._ops.tensorwise", "first_order_only") in names  # a name, not a module
    reads = set((importer, name) for importer, _, name, _ in module_attributes())
    assert ("fp8fn._parallel.planes", "fp8_scale") in reads  # `from .._numerics import fp8 as q`


def test_no_module_imports_an_underscore_name_from_another_module():
    # A name that crosses a module boundary is shared: it is named without the underscore.
    private = [
        f"{importer}:{line} imports {name} from {imported}"
        for importer, imported, name, _, line in imports()
        if name is not None and name.startswith("_") and imported != importer
    ]
    private += [
        f"{importer}:{line} reads {imported}.{name}"
        for importer, imported, name, line in module_attributes()
        if name.startswith("_") and not name.startswith("__") and imported != importer
    ]
    assert private == []
