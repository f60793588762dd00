"""The notebooks: committed with their outputs, and they still run top to bottom from a clean state.

Their cells assert what fp8fn does. `python notebooks/run.py` regenerates the saved outputs.
"""

from __future__ import annotations

import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WITH_FIGURES = ("01_quickstart", "03_watching_scales", "04_recipes")


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


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
def test_notebook_executes_from_a_clean_state(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    for cell in _code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no figures needed here
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    errors = [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors


def test_readme_quickstart_is_notebook_01s_first_cell():
    # The README's torch.optim loop runs here, as notebook 01's first code cell.
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    first = _code_cells(nb)[0].source
    assert "torch.optim.AdamW" in first and "loss.backward()" in first
    assert first.strip() in [b.strip() for b in blocks]
