"""The README's and docs/*.md's Python examples run as written.

Blocks fenced ```python run, each file's in order in one namespace; blocks fenced ```py (several
ranks, a GPU) are shown only, and are checked to be valid Python.
"""

import copy
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import fp8fn

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _blocks(path, fence="python"):
    return re.findall(rf"```{fence}\n(.*?)```", path.read_text(), flags=re.S)


def _run(path, blocks):
    namespace = {}
    for block in blocks:
        exec(compile(block, str(path), "exec"), namespace)
    return namespace


def _readme_block(marker):
    (block,) = [b for b in _blocks(README) if marker in b]
    return block


def _amaxes_pushed(state):
    return torch.count_nonzero(state.amax_history, dim=-1)


def test_readme_blocks_are_the_ones_tested():
    # every ```python block of the README is run by one of the tests below
    markers = ("torch.func.grad(loss_fn", "torch.compile(fp8fn.value", "opt = torch.optim.AdamW")
    markers += ("torch.save({",)
    assert len(_blocks(README)) == len(markers)
    for marker in markers:
        _readme_block(marker)


def test_readme_examples_run():
    namespace = _run(README, [_readme_block("torch.func.grad(")])
    state = namespace["state"]
    assert isinstance(state, fp8fn.State)
    assert list(state) == ["0", "2"]
    assert state.amax_history.shape == (2, 3, 16) and state.scale.shape == (2, 3)
    assert not state.amax_history.requires_grad  # update returns plain data
    # ten torch.func steps: ten amaxes pushed per role
    assert torch.equal(_amaxes_pushed(state), torch.full((2, 3), 10))
    # the views read the packed tensors, and each scale follows its history
    for i, site in enumerate(state):
        for r, role in enumerate(("input", "weight", "grad_output")):
            view = getattr(state[site], role)
            assert torch.equal(view.amax_history, state.amax_history[i, r])
            fp8_max = 57344.0 if role == "grad_output" else 448.0
            assert torch.equal(view.scale, fp8fn.compute_scale(view.amax_history.max(), fp8_max))
    # the last step's input amax is the input's
    assert state["0"].input.amax_history[0] == namespace["x"].abs().max()


@pytest.mark.slow
def test_readme_value_and_grad_example_runs():
    # the compiled torch.func-style step, after the example
    torch._dynamo.reset()
    blocks = [_readme_block(m) for m in ("torch.func.grad(", "torch.compile(fp8fn.value")]
    namespace = _run(README, blocks)
    state, grads = namespace["state"], namespace["grads"]
    assert torch.equal(_amaxes_pushed(state), torch.full((2, 3), 11))
    assert set(grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    torch._dynamo.reset()


@pytest.mark.slow
def test_readme_usual_loop_runs():
    namespace = _run(README, [_readme_block("opt = torch.optim.AdamW")])
    state, losses, model = namespace["state"], namespace["losses"], namespace["model"]
    assert list(state) == ["0", "2", "4"]
    # 100 steps fill every history (16 entries), and the model's own parameters were trained
    assert torch.equal(_amaxes_pushed(state), torch.full((3, 3), 16))
    assert namespace["params"]["0.weight"] is model[0].weight
    assert len(losses) == 100 and losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_readme_save_and_resume_continues_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the block writes ckpt.pt
    namespace = _run(README, [_readme_block("opt = torch.optim.AdamW")])
    model, opt, state, fn = (namespace[k] for k in ("model", "opt", "state", "fn"))
    saved = copy.deepcopy((model.state_dict(), state))
    exec(compile(_readme_block("torch.save({"), "README.md", "exec"), namespace)
    assert type(namespace["state"]) is fp8fn.State and namespace["state"].static == state.static
    assert torch.equal(namespace["state"].amax_history, saved[1].amax_history)
    # A fresh model and optimizer loaded from the file take the same next step as the originals.
    fresh = copy.deepcopy(model)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    checkpoint = torch.load("ckpt.pt", weights_only=True)
    fresh.load_state_dict(checkpoint["model"])
    fresh_opt.load_state_dict(checkpoint["opt"])
    x, y = namespace["batch"]()
    steps = []
    for m, o, s in ((model, opt, state), (fresh, fresh_opt, checkpoint["fp8fn"])):
        observed = fp8fn.observe(s)
        loss = F.cross_entropy(fn.apply(dict(m.named_parameters()), observed, x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        steps.append((loss, m.state_dict(), fp8fn.update(s, fp8fn.observations(observed))))
    (loss_a, weights_a, state_a), (loss_b, weights_b, state_b) = steps
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert torch.equal(state_a.amax_history, state_b.amax_history)
    assert torch.equal(state_a.scale, state_b.scale)


# What each docs file's ```python blocks leave behind, checked after they ran.
def _check_semantics(namespace):
    assert namespace["state"]["fc1"].input.scale == 56.0


def _check_compile(namespace):
    assert torch.equal(_amaxes_pushed(namespace["state"]), torch.full((2, 3), 2))


def _check_recipes(namespace):
    fn, state = namespace["fn"], namespace["state"]
    assert list(state) == ["mlp"] and fn.layers == ["attn", "mlp"]
    assert isinstance(fn.recipes["attn"], fp8fn.RowwiseScaling)
    nvfp4, nvfp4_state = namespace["nvfp4"], namespace["nvfp4_state"]
    assert nvfp4.layers == ["0", "2"] and len(nvfp4_state) == 0
    assert isinstance(nvfp4.recipes["0"], fp8fn.NVFP4Scaling)
    x = torch.randn(8, 64)
    assert torch.equal(nvfp4_state.key, nvfp4.init(x, seed=0).key)
    assert not torch.equal(nvfp4_state.key, nvfp4.init(x, seed=1).key)
    net_fn, net_state = namespace["net_fn"], namespace["net_state"]  # fold_in's microbatches
    assert net_state.key.item() == net_fn.init(x, seed=0).key.item() + 1


def _check_huggingface(namespace):
    fn, state, logits = namespace["fn"], namespace["state"], namespace["logits"]
    convs = [f"transformer.h.{i}.{n}" for i in range(2) for n in ("attn.c_attn", "attn.c_proj")]
    convs += [f"transformer.h.{i}.{n}" for i in range(2) for n in ("mlp.c_fc", "mlp.c_proj")]
    assert sorted(fn.layers) == sorted(convs) and "lm_head" not in fn.layers
    assert fn.checkpointed == ["transformer.h.0", "transformer.h.1"]
    assert sorted(state) == sorted(convs)
    assert torch.equal(_amaxes_pushed(state), torch.ones(8, 3, dtype=torch.int64))
    assert logits.shape == (4, 32, 128)


def _check_moe(namespace):
    fn, state = namespace["fn"], namespace["state"]
    assert fn.summary().splitlines()[0] == (
        "float8: 57,344 of 57,600 matmul weight elements (99.6%)"
    )
    assert len(state) == 4 * 2 + 1 + 2 * 2 * 4  # q, k, v, o; lm_head; 4 experts x 2 weights
    assert namespace["expert_3"].input.amax_history.shape == (16,)


def _check_optim(namespace):
    moment, state = namespace["w_moment"], namespace["state"]
    assert moment.data.dtype == torch.float8_e4m3fn and moment.scale.shape == (128,)
    assert state.nu["b"].dtype == torch.float32 and int(state.count) == 1


CHECKS = {"semantics.md": _check_semantics, "compile.md": _check_compile}
CHECKS["optim.md"] = _check_optim
CHECKS["recipes.md"] = _check_recipes
CHECKS["moe.md"] = _check_moe


def _check_cuda(namespace):
    assert namespace["contract"].calls and namespace["contract"].calls[0][0] == "_scaled_mm"
    assert namespace["obs"].amax_history[:, :, 0].gt(0).all()  # every role observed


CHECKS["cuda.md"] = _check_cuda
CHECKS["huggingface.md"] = _check_huggingface
SLOW = {"compile.md", "huggingface.md"}  # torch.compile; transformers' GPT-2 with recompute


def test_docs_python_blocks_are_checked():
    assert {p.name for p in DOCS if _blocks(p)} == set(CHECKS)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(CHECKS)],
)
def test_docs_python_blocks_run(name):
    path = ROOT / "docs" / name
    torch._dynamo.reset()
    namespace = _run(path, _blocks(path))
    torch._dynamo.reset()
    CHECKS[name](namespace)


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_shown_blocks_are_python(path):
    # ```py blocks (several ranks, a GPU) are not run, but must be valid Python
    for block in _blocks(path, "py"):
        compile(block, str(path), "exec")


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(
    "path",
    [README, *DOCS, ROOT / "benchmarks" / "README.md"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_links_point_at_what_exists(path):
    # relative links name files that exist, and #anchors headings of the file they point at
    links = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: {link}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path.name}: {link}"
