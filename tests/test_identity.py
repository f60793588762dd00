"""`ByIdentity` (fp8fn/_transform/identity.py): values kept per tensor and found by the very
tensor. A tensor given to the call is found by `id` eagerly and by `is` while dynamo traces (a
lookup by `id` would make dynamo guard on the ids: a recompile per step of new tensors); a
tensor the call made carries its values in an attribute until the call ends (kept in the list,
a frame called once per expert guarded on how many there were: a recompile per expert)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fp8fn
from fp8fn._transform.identity import ByIdentity


def test_values_are_those_of_the_very_tensor_in_the_order_added():
    table, a, b = ByIdentity("_test_marks"), torch.ones(2), torch.ones(2)
    table.keep(a, "first")
    table.keep(b, "other")
    table.keep(a, "second")
    made = a.view(2)
    table.mark(made, "made")
    table.mark(made, "again")
    assert table.values(a) == ["first", "second"]
    assert table.values(b) == ["other"]
    assert table.values(made) == ["made", "again"]
    assert table.values(a.view(2)) == []  # a view is another tensor
    assert table.values(torch.ones(2)) == []
    assert ByIdentity("_other_marks").values(made) == []  # (another transform's table)


def test_clear_ends_the_marks_and_keeps_what_was_given():
    table, given = ByIdentity("_test_marks"), torch.ones(2)
    table.keep(given, "given")
    made = [given.view(2) for _ in range(3)]
    for i, t in enumerate(made):
        table.mark(t, i)
    table.clear()
    assert [table.values(t) for t in made] == [[], [], []]
    assert [t._test_marks for t in made] == [None, None, None]
    assert table.values(given) == ["given"]
    table.mark(made[0], "next")  # (a table goes on after `clear`)
    assert table.values(made[0]) == ["next"]


@pytest.mark.slow  # (dynamo: a few seconds)
def test_a_table_added_to_while_dynamo_traces_is_searched_by_identity_after():
    """A call run eagerly around frames that dynamo compiles (`apply` fallen back to eager)
    adds in both ways: what a compiled frame kept or marked is found eagerly too, and new
    tensors at each call compile once."""
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def make(table, x):
        found = table.values(x)  # (before the table learns it was traced)
        y, z = x * 2, x * 3
        table.keep(y, "kept")
        table.mark(z, "made")
        return y, z, found

    for step in range(3):
        table, x = ByIdentity("_test_marks"), torch.full((2,), float(step))
        table.keep(x, "given")
        y, z, found = make(table, x)
        assert found == ["given"]
        assert table.values(y) == ["kept"] and table.values(x) == ["given"]
        assert table.values(z) == ["made"]
        assert table.values(torch.full((2,), 2.0 * step)) == []
        table.clear()
        assert table.values(z) == []
    assert counter.frame_count == 1


@pytest.mark.slow  # (dynamo: a few seconds)
def test_a_frame_called_once_per_made_tensor_compiles_once():
    """transformers' eager experts loop makes `W[e]` for each expert hit, eagerly, and calls a
    frame between (GPT-OSS's `_apply_gate`): the lookups it traces guard on neither how many
    tensors were made before nor their ids, whatever the number of experts hit per step. With
    the made tensors kept in the list, it compiled once per expert (8 entries: dynamo's
    limit)."""
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def gate(table, h):
        return h * 2 if not table.values(h) else h * 3

    weights = torch.randn(5, 4, 4)
    for hit in (range(5), range(2), (4, 1, 3)):  # (steps hitting other experts)
        table = ByIdentity("_test_marks")
        table.keep(weights, "experts")
        for e in hit:
            table.mark(weights[e], e)
            h = torch.randn(3, 4)
            assert torch.equal(gate(table, h), h * 2)
        table.clear()
    assert counter.frame_count == 1


@pytest.mark.parametrize("form", ["experts unbind", "attention split"])
def test_pieces_of_a_multi_output_op_are_marked_in_one_graph(form):
    """dynamo refuses `setattr` on an output of a multi-output op (`unbind`, `split`): the
    pieces of a tracked weight are marked as views of themselves while tracing, so the call
    stays one graph (`fullgraph=True`) with the eager bits. (With the pieces marked as they
    came, experts' `unbind` and nn.MultiheadAttention's packed `split`, for cross-attention,
    broke the graph.)"""
    from test_converted_layers import _Attention
    from test_moe_models import _Experts

    gen = torch.Generator().manual_seed(1)
    if form == "experts unbind":
        module, ends = _Experts("unbind_matmul"), [5, 5, 13, 20]
        args, sites = (torch.randn(ends[-1], 32, generator=gen), ends), 4
    else:
        module = _Attention()
        args = (torch.randn(3, 5, 16, generator=gen), torch.randn(3, 7, 16, generator=gen))
        sites = 4
    fn = fp8fn.transform(module, fp8fn.DelayedScaling())
    state = fn.init(*args)
    params = dict(module.named_parameters())
    torch._dynamo.reset()
    try:
        got = torch.compile(fn.apply, fullgraph=True, backend="eager")(params, state, *args)
    finally:
        torch._dynamo.reset()
    assert len(state.sites) == sites
    assert torch.equal(got, fn.apply(params, state, *args))
