"""The demo (`python -m fp8fn.demo`), run in-process on a tiny configuration."""

from __future__ import annotations

import math

import pytest
import torch

import fp8fn
from fp8fn import demo

TINY = [
    "--steps", "20", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16",
    "--batch-size", "8", "--eval-batches", "2", "--sample-chars", "12", "--lr", "1e-2", "--quiet",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    plot = tmp_path_factory.mktemp("demo") / "curves.png"
    return demo.main([*TINY, "--plot", str(plot)]), plot


def test_main_returns_both_runs_and_gaps(tiny_results):
    results, _ = tiny_results
    assert results["fp8_layers"] == [
        "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2",
    ]  # fmt: skip
    assert results["checkpointed"] == ["blocks.0"]
    for name in ("float32", "fp8"):
        run = results[name]
        assert len(run["train_curve"]) == 20
        assert [s for s, _ in run["val_curve"]] == list(range(2, 21, 2))
        assert run["step_ms"] > 0
        for key in ("train_loss", "val_loss"):
            assert math.isfinite(run[key])
    for split in ("train", "val"):
        hp, lp = results["float32"][f"{split}_loss"], results["fp8"][f"{split}_loss"]
        assert results[f"{split}_gap_pct"] == pytest.approx(100 * (lp - hp) / hp)
    assert results["sample"].startswith("The ") and len(results["sample"]) == 4 + 12


def test_main_losses_decrease(tiny_results):
    results, _ = tiny_results
    log_vocab = math.log(len(demo.Corpus.load().chars))
    for name in ("float32", "fp8"):
        run = results[name]
        assert run["train_curve"][0] == pytest.approx(log_vocab, abs=0.1)  # uniform at init
        assert sum(run["train_curve"][-5:]) / 5 < run["train_curve"][0] - 0.5
        assert run["val_curve"][-1][1] < run["val_curve"][0][1]
        assert run["val_loss"] < log_vocab - 0.5


def test_main_updates_fp8_state_and_leaves_baseline_stateless(tiny_results):
    results, _ = tiny_results
    assert isinstance(results["float32"]["state"], fp8fn.State)
    assert len(results["float32"]["state"]) == 0
    state = results["fp8"]["state"]
    assert isinstance(state, fp8fn.State)
    assert list(state) == results["fp8_layers"]
    assert state.amax_history.shape == (4, 3, 16) and state.scale.shape == (4, 3)
    assert bool((state.amax_history > 0).all())  # 20 steps fill a 16-long history
    assert bool((state.scale != 1.0).all())
    for site_state in state.values():
        for role in (site_state.input, site_state.weight, site_state.grad_output):
            assert role.amax_history.shape == (16,) and role.scale.shape == ()
    # A delayed scale follows the recipe from the history it holds.
    qkv = state["blocks.0.attn.qkv"].input
    assert torch.equal(qkv.scale, fp8fn.compute_scale(qkv.amax_history.max(), 448.0))


def test_main_plot_is_a_png(tiny_results):
    _, plot = tiny_results
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_main_current_recipe_without_checkpoint_has_no_state():
    results = demo.main([*TINY, "--steps", "6", "--recipe", "current", "--no-checkpoint"])
    assert results["checkpointed"] == []
    assert len(results["fp8"]["state"]) == 0  # CurrentScaling is stateless
    assert results["fp8"]["train_curve"][-1] < results["fp8"]["train_curve"][0]


def test_main_compile_matches_eager_on_the_first_steps():
    # --compile trains with torch.compile(fp8fn.value_and_grad(...)); the first step starts
    # from the same weights and scales, so its loss matches eager to float tolerance.
    argv = [*TINY, "--steps", "3", "--no-checkpoint", "--sample-chars", "0"]
    compiled, eager = demo.main([*argv, "--compile"]), demo.main(argv)
    for name in ("float32", "fp8"):
        got, want = compiled[name]["train_curve"], eager[name]["train_curve"]
        assert got[0] == pytest.approx(want[0], rel=1e-5)
        assert got == pytest.approx(want, rel=1e-2)
    state, state_e = compiled["fp8"]["state"], eager["fp8"]["state"]
    assert state.sites == state_e.sites
    torch.testing.assert_close(state.amax_history, state_e.amax_history, rtol=1e-2, atol=0)
    assert bool((state.amax_history[:, :, :3] > 0).all())  # every role observed 3 times


def test_main_prints_the_table(capsys):
    argv = [a for a in TINY if a != "--quiet"]
    demo.main([*argv, "--steps", "3", "--sample-chars", "5"])
    out = capsys.readouterr().out
    assert "fp8 (delayed)" in out and "float32" in out and "gap (%)" in out
    assert "sample from the fp8 model:" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipe", "tensorwise"], "invalid choice: 'tensorwise'"),
        (["--steps", "0"], "expected an integer >= 1, got 0"),
        (["--steps", "ten"], "invalid positive value: 'ten'"),
        (["--d-model", "30", "--heads", "4"], "must be divisible by --heads"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--sample-chars", "-1"], "expected an integer >= 0, got -1"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_main_bad_flags_exit_with_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit, match="2"):
        demo.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_main_cuda_without_a_gpu_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit, match="2"):
        demo.main(["--device", "cuda"])
    assert "no CUDA device is available" in capsys.readouterr().err
