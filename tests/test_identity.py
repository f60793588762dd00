"""`ByIdentity` (fp8fn/_transform/identity.py): values kept per tensor and found by the very
tensor, by `id` eagerly and by `is` while dynamo traces (a lookup by `id` would make dynamo
guard on the ids: a recompile per step of new tensors)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fp8fn._transform.identity import ByIdentity


def test_values_are_those_of_the_very_tensor_in_the_order_added():
    table, a, b = ByIdentity(), torch.ones(2), torch.ones(2)
    table.add(a, "first")
    table.add(b, "other")
    table.add(a, "second")
    assert table.values(a) == ["first", "second"]
    assert table.values(b) == ["other"]
    assert table.values(a.view(2)) == []  # a view is another tensor
    assert table.values(torch.ones(2)) == []


@pytest.mark.slow  # (dynamo: a few seconds)
def test_a_table_added_to_while_dynamo_traces_is_searched_by_identity_after():
    """A call run eagerly around frames that dynamo compiles (`apply` fallen back to eager)
    adds in both ways: what a compiled frame added is found eagerly too, and new tensors at
    each call compile once."""
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def make(table, x):
        found = table.values(x)  # (before the table learns it was traced)
        y = x * 2
        table.add(y, "made")
        return y, found

    for step in range(3):
        table, x = ByIdentity(), torch.full((2,), float(step))
        table.add(x, "given")
        y, found = make(table, x)
        assert found == ["given"]
        assert table.values(y) == ["made"] and table.values(x) == ["given"]
        assert table.values(torch.full((2,), 2.0 * step)) == []
    assert counter.frame_count == 1
