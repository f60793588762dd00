"""Every mutation of `tools/mutation.py` still applies: its code text stands exactly once in its
file (the script refuses a mutant whose text moved; this finds one without running a mutant)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
spec = importlib.util.spec_from_file_location("mutation", ROOT / "tools" / "mutation.py")
mutation = sys.modules.setdefault("mutation", importlib.util.module_from_spec(spec))
spec.loader.exec_module(mutation)


@pytest.mark.parametrize("m", mutation.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_text_stands_once_in_its_file(m):
    text = (ROOT / "fp8fn" / m.file).read_text()
    for old, new in m.edits:
        assert text.count(old) == 1, (m.name, old)
        text = text.replace(old, new)
