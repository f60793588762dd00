"""The notebooks: committed with their outputs, and they still run top to bottom from a clean state,
printing what was saved.

Their cells assert what fp8fn does. Each seeds torch at the top, so a rerun prints the same
numbers: a re-executed notebook's text outputs must match the saved ones, every number to the
precision it was printed with. `python notebooks/run.py` regenerates the saved outputs.
"""

from __future__ import annotations

import math
import pathlib
import re
import runpy
import types

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).parents[1]
run = types.SimpleNamespace(**runpy.run_path(str(ROOT / "notebooks" / "run.py")))  # execute
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WITH_FIGURES = ("01_quickstart", "03_watching_scales", "04_recipes")


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")


def _texts(nb) -> list[str]:
    """Per code cell, what it printed and the text of its result, joined (a stream may come in
    several chunks)."""
    texts = []
    for cell in _code_cells(nb):
        parts = []
        for out in cell.outputs:
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type == "execute_result":
                parts.append(out.data.get("text/plain", "") + "\n")
        texts.append("".join(parts))
    return texts


def _unit(number: str) -> float:
    """The value of one unit in the last printed digit of `number`: 0.01 for "2.25", 1e-06 for
    "3.8421e-02"; 0 for an integer such as "448" (counts and sizes: exact)."""
    mantissa, _, exponent = number.lower().partition("e")
    if "." not in mantissa and not exponent:
        return 0.0
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def _differences(saved: str, new: str) -> list[str]:
    """Where `new` differs from `saved`: other words, or a number off by more than one unit of
    its last printed digit (a rounding that flips at a boundary is the same number); integers
    exactly."""
    if NUMBER.sub("#", saved) != NUMBER.sub("#", new):
        return [f"text: {saved!r} -> {new!r}"]
    return [
        f"{a} -> {b}"
        for a, b in zip(NUMBER.findall(saved), NUMBER.findall(new))
        if not math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=1.0001 * _unit(a))
    ]


@pytest.mark.parametrize(
    "saved, new, same",
    [
        ("loss 2.289 -> 0.424\n", "loss 2.289 -> 0.424\n", True),
        ("loss 2.289 -> 0.424\n", "loss 2.289 -> 0.425\n", True),  # a boundary's flip
        ("loss 2.289 -> 0.424\n", "loss 2.289 -> 0.426\n", False),  # drift in the 3rd digit
        ("tensor([3.8421e+00, 5.2508e-03])", "tensor([3.8421e+00, 5.2509e-03])", True),
        ("tensor([3.8421e+00, 5.2508e-03])", "tensor([3.8421e+00, 5.1182e-03])", False),
        ("c = 64:  94.2 %", "c = 64:  94.3 %", True),
        ("c = 64:  94.2 %", "c = 16:  94.2 %", False),  # integers exactly (to within 1)...
        ("margin 0 2.7044", "margin 0 2.7045", True),
        ("margin 0 2.7044", "margin 1 2.7044", False),
        ("float32 0.3777, fp8 0.3830", "float32 0.3777, fp8 0.3839", False),
        ("largest: 0.0", "largest: 1.19e-07", True),  # 0.0: one unit is 0.1
        ("largest: 0", "largest: 1.19e-07", False),
        ("18 tensors", "19 tensors", False),
        ("delayed 25.5", "current 25.5", False),  # words must match
    ],
)
def test_differences_are_to_the_printed_precision(saved, new, same):
    assert (not _differences(saved, new)) == same


def test_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_quickstart", "02_checkpointing_and_compile", "03_watching_scales", "04_recipes",
    ]  # fmt: skip


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_saved_with_its_outputs(path):
    # Outputs are committed so that notebooks read (plots included) where they are browsed.
    nb = nbformat.read(path, as_version=4)
    cells = _code_cells(nb)
    assert all(c.execution_count is not None for c in cells), "run python notebooks/run.py"
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))  # in order
    outputs = [o for c in cells for o in c.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    if path.stem in WITH_FIGURES:
        assert images, f"{path.name} has no saved figure"
    for image in images:
        assert len(image.data["image/png"]) < 200_000  # base64 bytes: modest figures


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_from_a_clean_state_to_its_saved_outputs(path, monkeypatch):
    saved = _texts(nbformat.read(path, as_version=4))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no figures needed here
    nb = run.execute(path)
    errors = [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors
    drift = {
        i: diff for i, (a, b) in enumerate(zip(saved, _texts(nb))) if (diff := _differences(a, b))
    }
    assert not drift, f"outputs differ from the saved ones by code cell: {drift}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_first_cell_sets_what_its_numbers_depend_on(path):
    # A reader's kernel, whatever its OMP_NUM_THREADS, prints the saved numbers.
    first = _code_cells(nbformat.read(path, as_version=4))[0].source.splitlines()
    assert "torch.manual_seed(0)" in [line.partition("  #")[0] for line in first]
    assert "torch.set_num_threads(1)" in [line.partition("  #")[0] for line in first]


def test_readme_quickstart_is_notebook_01s_first_cells():
    # The README's torch.optim loop runs here, as notebook 01's first three code cells (one
    # block in the README, split in the notebook with a sentence before each part).
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    first = "\n".join(c.source for c in _code_cells(nb)[:3])

    def lines(text):
        return [line for line in text.splitlines() if line.strip()]

    assert "torch.optim.AdamW" in first and "loss.backward()" in first
    assert lines(first) in [lines(b) for b in blocks]
