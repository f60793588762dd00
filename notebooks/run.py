"""Execute notebooks and save them with their outputs: `python notebooks/run.py [PATH ...]`.

Without arguments, every `notebooks/*.ipynb`. Each notebook is cleared, run top to bottom in a
fresh kernel from its own folder (figures inline, so they are saved as PNG outputs), and
written back in place; a cell that raises stops the run with its traceback.

Needs only the README's install (`pip install -e ".[test]"` brings nbclient, nbformat and
ipykernel). Each notebook's first cell seeds torch and sets its intra-op threads to 1 (a CPU
matmul's float32 sums depend on how many threads split them), so its numbers do not depend on
the machine's thread count; `tests/test_notebooks.py` executes them with this same function and
compares the outputs number for number with the saved ones.
"""

from __future__ import annotations

import os
import pathlib
import sys

import nbclient
import nbformat


def execute(path: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook at `path`, outputs cleared, then executed; raises on a cell's error."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        record_timing=False,  # no timestamps: a rerun changes only what the cells print
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not its note on TCP transport
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def main(paths: list[str]) -> None:
    os.environ.pop("MPLBACKEND", None)  # the kernel's default, inline, saves figures as PNGs
    here = pathlib.Path(__file__).parent
    for path in [pathlib.Path(p) for p in paths] or sorted(here.glob("*.ipynb")):
        print(f"executing {path}", flush=True)
        nbformat.write(execute(path), path)


if __name__ == "__main__":
    main(sys.argv[1:])
