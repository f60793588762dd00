"""`ByIdentity` (fp8fn/_transform/identity.py): values kept per tensor and found by the very
tensor, which carries them in an attribute until the call ends. dynamo guards on that attribute
of the tensor a frame receives, never on an id or on which tensor of a list it is: a lookup by
`id` made a recompile per step of new tensors; one along a list, a compile per expert (a frame
called once per made tensor) and per layer (a frame called once per layer's weight)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fp8fn
from fp8fn._transform.identity import ByIdentity


def test_values_are_those_of_the_very_tensor_in_the_order_kept():
    table, a, b = ByIdentity("_test_marks"), torch.ones(2), torch.ones(2)
    table.keep(a, "first")
    table.keep(b, "other")
    table.keep(a, "second")
    made = a.view(2)
    table.keep(made, "made")
    table.keep(made, "again")
    assert table.values(a) == ("first", "second")
    assert table.values(b) == ("other",)
    assert table.values(made) == ("made", "again")
    assert table.values(a.view(2)) == ()  # a view is another tensor
    assert table.values(torch.ones(2)) == ()
    assert ByIdentity("_other_marks").values(made) == ()  # (another transform's table)


def test_clear_leaves_no_attribute_on_a_kept_tensor():
    table, given = ByIdentity("_test_marks"), torch.ones(2)
    table.keep(given, "given")
    made = [given.view(2) for _ in range(3)]
    for i, t in enumerate(made):
        table.keep(t, i)
    table.clear()
    assert [table.values(t) for t in (given, *made)] == [()] * 4
    assert not any(hasattr(t, "_test_marks") for t in (given, *made))
    table.keep(made[0], "next")  # (a table goes on after `clear`)
    assert table.values(made[0]) == ("next",)


def test_a_nested_table_hides_the_enclosing_values_until_it_clears():
    """A `checkpoint_fn` recompute runs a call inside the forward's, on the same weights: its
    own values, not the enclosing call's, until it ends."""
    outer, inner, w = ByIdentity("_test_marks"), ByIdentity("_test_marks"), torch.ones(2)
    outer.keep(w, "outer")
    inner.hide(w)
    inner.hide(w)  # (a weight shared by two layers: hidden once)
    inner.keep(w, "inner")
    assert outer.values(w) == inner.values(w) == ("inner",)
    inner.clear()
    assert outer.values(w) == ("outer",)
    outer.clear()
    assert not hasattr(w, "_test_marks")


@pytest.mark.slow  # (dynamo: a few seconds)
def test_a_frame_given_each_layers_weight_compiles_once():
    """A frame the model calls once per layer (a decoder layer or an MoE block compiled apart
    by a graph break) finds the layer's values through the weight it receives: one compile for
    every layer, every step (new tensors each step), and the values of the right layer."""
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def block(table, w, x):
        (row,) = table.values(w)
        return x @ w + row

    for step in range(3):
        table = ByIdentity("_test_marks")
        weights = [torch.randn(4, 4) for _ in range(5)]
        rows = [torch.full((4,), float(i)) for i in range(5)]
        for w, row in zip(weights, rows):
            table.keep(w, row)
        x = torch.randn(2, 4)
        for w, row in zip(weights, rows):
            assert torch.equal(block(table, w, x), x @ w + row)
        table.clear()
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
            table.keep(weights[e], e)
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


def test_apply_leaves_no_attribute_on_the_tensors_it_is_given():
    """The weights given to `apply` (and the module's own, used where `params` leaves one out)
    carry their layer's values during the call only: none is left after it, nor after a call
    that raised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fn = fp8fn.transform(model, fp8fn.DelayedScaling())
    x = torch.randn(4, 8)
    state = fn.init(x)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    del params["2.weight"]  # (the module's own)
    fn.apply(params, state, x).sum().backward()
    with pytest.raises(ValueError, match="fp8fn.apply"):
        fn.apply(params, state, x[:, :5])  # (raises inside the model)
    tensors = [*params.values(), *model.parameters()]
    assert not [a for t in tensors for a in vars(t) if a.startswith("_fp8fn")]
