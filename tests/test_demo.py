"""The demo (`python -m fp8fn.demo`), run in-process on a tiny configuration."""

from __future__ import annotations

import math
import os
import socket
import struct
import subprocess
import sys

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


@pytest.mark.slow
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
        for key in ("train_loss", "val_loss"):
            assert math.isfinite(run[key])
    assert isinstance(results["recipe"], fp8fn.DelayedScaling)
    assert results["ranks"].world_size == 1
    # The fp8 run casts (its curve is not the float32 one) and tracks float32 closely.
    fp8_curve, hp_curve = results["fp8"]["train_curve"], results["float32"]["train_curve"]
    assert fp8_curve != hp_curve
    assert fp8_curve == pytest.approx(hp_curve, abs=0.1)
    assert abs(results["val_gap_pct"]) < 5
    assert results["sample"].startswith("The ") and len(results["sample"]) == 4 + 12


@pytest.mark.slow
def test_main_losses_decrease(tiny_results):
    results, _ = tiny_results
    log_vocab = math.log(len(demo.Corpus.load().chars))
    for name in ("float32", "fp8"):
        run = results[name]
        assert run["train_curve"][0] == pytest.approx(log_vocab, abs=0.1)  # uniform at init
        assert sum(run["train_curve"][-5:]) / 5 < run["train_curve"][0] - 0.5
        assert run["val_curve"][-1][1] < run["val_curve"][0][1]
        assert run["val_loss"] < log_vocab - 0.5


@pytest.mark.slow
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
    # Each delayed scale is 448 / max(history), the documented formula written out here.
    qkv = state["blocks.0.attn.qkv"].input
    assert qkv.scale.item() == torch.tensor(448.0 / qkv.amax_history.max().item()).item()


@pytest.mark.slow
def test_main_plot_is_a_png_with_the_gap_panel(tiny_results):
    _, plot = tiny_results
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (700, 600)  # two panels: the curves, and fp8 - float32 below


def test_every_flag_has_help():
    actions = [a for a in demo.build_parser()._actions if a.dest != "help"]
    assert [a.dest for a in actions] == [
        "steps", "recipe", "checkpoint", "compile", "fsdp", "device", "plot", "optim", "seed",
        "seeds",
        "threads",
        "d_model",
        "layers", "heads", "seq_len", "batch_size", "lr", "eval_batches", "sample_chars", "quiet",
        "moe",
    ]  # fmt: skip
    assert all(a.help and a.help.strip() for a in actions), [a.dest for a in actions if not a.help]


@pytest.mark.slow
def test_main_current_recipe_without_checkpoint_has_no_state():
    results = demo.main([*TINY, "--steps", "6", "--recipe", "current", "--no-checkpoint"])
    assert results["checkpointed"] == []
    assert len(results["fp8"]["state"]) == 0  # CurrentScaling is stateless
    assert results["fp8"]["train_curve"][-1] < results["fp8"]["train_curve"][0]


@pytest.mark.slow
def test_main_moe_runs_the_experts_in_float8_next_to_float32():
    results = demo.main([*TINY, "--moe", "--steps", "8", "--sample-chars", "0"])
    assert {"blocks.0.mlp.w_in", "blocks.0.mlp.w_out"} <= set(results["fp8_layers"])
    assert "blocks.0.mlp.router" not in results["fp8_layers"]  # stays float32, as the head
    # 4 experts x (64x32 + 32x64) and attention 4 x 32x32 in float8; head 103x32, router 4x32
    assert results["float8_share"] == "float8: 20,480 of 23,904 matmul weight elements (85.7%)"
    assert "blocks.0.mlp.w_in[3]" in results["fp8"]["state"]
    assert abs(results["train_gap_pct"]) < 5 and abs(results["val_gap_pct"]) < 5
    fp8, hp = results["fp8"]["train_curve"], results["float32"]["train_curve"]
    assert fp8[0] == pytest.approx(hp[0], rel=1e-3) and fp8[-1] < fp8[0]


@pytest.mark.slow
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


@pytest.mark.parametrize(
    "recipe, cls",
    [
        ("rowwise", fp8fn.RowwiseScaling),
        ("blockwise", fp8fn.BlockwiseScaling),
        ("mx", fp8fn.MXScaling),
    ],
)
@pytest.mark.slow
def test_main_stateless_recipes_train_and_quiet_prints_only_the_table(recipe, cls, capsys):
    # d-model 32: blockwise casts partial 128-tiles, MX a 32-block per row.
    results = demo.main([*TINY, "--steps", "2", "--sample-chars", "0", "--recipe", recipe])
    captured = capsys.readouterr()
    assert isinstance(results["recipe"], cls)
    assert len(results["fp8"]["state"]) == 0  # stateless: no sites
    fp8_curve, hp_curve = results["fp8"]["train_curve"], results["float32"]["train_curve"]
    assert fp8_curve[0] != hp_curve[0]  # the same weights and batch, cast to float8
    assert fp8_curve == pytest.approx(hp_curve, abs=0.05)
    lines = captured.out.strip().splitlines()
    assert lines[0] == "2 steps of 8 sequences x 16 chars (cpu, 1 process)"
    assert lines[1].split() == ["run", "train", "loss", "val", "loss", "step", "(ms)"]
    assert [line.split()[0] for line in lines[3:]] == ["float32", "fp8", "gap"]
    assert f"fp8 ({recipe})" in lines[4] and len(lines) == 6
    assert captured.err == ""  # no progress bar


@pytest.mark.slow
def test_main_nvfp4_trains_and_its_state_is_the_advancing_key():
    results = demo.main([*TINY, "--steps", "6", "--sample-chars", "0", "--recipe", "nvfp4"])
    assert isinstance(results["recipe"], fp8fn.NVFP4Scaling)
    state = results["fp8"]["state"]
    assert len(state) == 0  # no amax history: only the random key, seeded by --seed 0
    fresh = fp8fn.transform(torch.nn.Linear(2, 2), fp8fn.NVFP4Scaling())
    start = fresh.init(torch.zeros(1, 2), seed=0).key.item()  # the key of --seed 0
    assert state.key.item() == start + 6  # advanced once per training step
    assert results["float32"]["state"].key is None
    fp8_curve, hp_curve = results["fp8"]["train_curve"], results["float32"]["train_curve"]
    assert fp8_curve[0] != hp_curve[0]  # the same weights and batch, in NVFP4
    assert fp8_curve == pytest.approx(hp_curve, abs=0.1)
    assert fp8_curve[-1] < fp8_curve[0] - 0.5


def _table(out: str) -> dict:
    """The final table's rows: {"float32": (train, val), "fp8": (train, val)}."""
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in ("float32", "fp8"):
            rows[words[0]] = (float(words[-3]), float(words[-2]))
    return rows


@pytest.mark.slow
def test_torchrun_two_ranks_train_data_parallel():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [a for a in TINY if a != "--quiet"]
    argv = [*argv, "--steps", "3", "--sample-chars", "5", "--no-checkpoint"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(port), "-m", "fp8fn.demo", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # Rank 0 prints, once; it says it ran on 2 ranks.
    assert out.count("char-level GPT:") == 1 and out.count("sample from the fp8 model:") == 1
    caption = "3 steps of 8 sequences x 16 chars (cpu, data parallel on 2 ranks (gloo))"
    assert out.count(caption) == 1
    assert "data parallel on 2 ranks (gloo): 4 sequences per rank and step" in out
    # Each rank trains on half of every batch; averaged gradients and max-combined observations
    # make the run match one process on the whole batch (up to float32 summation order).
    one = demo.main([*argv, "--quiet"])
    two = _table(out)
    for name in ("float32", "fp8"):
        want = (one[name]["train_loss"], one[name]["val_loss"])
        assert two[name] == pytest.approx(want, abs=2e-3 if name == "float32" else 1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_fsdp2_trains_with_float8_all_gathers(nproc):
    """`torchrun --nproc-per-node N -m fp8fn.demo --fsdp`: FSDP2 per block and root, float8
    weight all-gathers, torch.optim; it says so, and matches one process on the whole batch
    (up to float32 summation order and torch.optim's AdamW against the demo's). One rank is
    where a torchrun script is debugged first (FSDP2 then copies instead of all-gathering)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [a for a in TINY if a != "--quiet"]
    argv = [*argv, "--steps", "3", "--sample-chars", "5"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-port", str(port), "-m", "fp8fn.demo", "--fsdp", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "returned a view tensor" not in done.stderr  # FSDP2's wrong-gradient warning
    out = done.stdout
    ranks = "1 rank" if nproc == 1 else f"{nproc} ranks"
    where = f"FSDP2 on {ranks} (gloo) with float8 all-gathers"
    assert out.count(f"3 steps of 8 sequences x 16 chars (cpu, {where})") == 1, out
    assert out.count(f"{where}: {8 // nproc} sequences per rank and step") == 1, out
    assert "checkpointed: none" in out
    one = demo.main([*argv, "--quiet", "--no-checkpoint"])
    two = _table(out)
    for name in ("float32", "fp8"):
        want = (one[name]["train_loss"], one[name]["val_loss"])
        assert two[name] == pytest.approx(want, abs=2e-3 if name == "float32" else 1e-2)


@pytest.mark.slow
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
        (["--fsdp"], "--fsdp: expected to run under torchrun, got one process"),
        (["--moe", "--recipe", "mx"], "--moe: expected --recipe delayed or current, got mx"),
        (["--moe", "--compile"], "--moe: --fsdp and --compile are not available with experts"),
    ],
)
def test_main_bad_flags_exit_with_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit, match="2"):
        demo.main(argv)
    assert message in capsys.readouterr().err


def test_main_batch_not_divisible_by_the_ranks_is_an_argparse_error(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun sets it; checked before joining a group
    with pytest.raises(SystemExit, match="2"):
        demo.main(["--batch-size", "8"])
    assert "must be divisible by the number of ranks (3)" in capsys.readouterr().err


def test_main_fsdp_with_compile_is_an_argparse_error(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; checked before joining a group
    with pytest.raises(SystemExit, match="2"):
        demo.main(["--fsdp", "--compile"])
    assert "--fsdp: --compile is not available with FSDP2" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_main_cuda_without_a_gpu_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit, match="2"):
        demo.main(["--device", "cuda"])
    assert "no CUDA device is available" in capsys.readouterr().err


def test_plot_without_matplotlib_is_an_argparse_error_before_training(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(demo, "train", lambda *a, **k: pytest.fail("trained before the check"))
    with pytest.raises(SystemExit, match="2"):
        demo.main([*TINY, "--plot", str(tmp_path / "curves.png")])
    err = capsys.readouterr().err
    assert "--plot: needs matplotlib, which is not installed: pip install matplotlib" in err


def test_plot_into_a_missing_folder_is_an_argparse_error(capsys, tmp_path):
    with pytest.raises(SystemExit, match="2"):
        demo.main([*TINY, "--plot", str(tmp_path / "no-such-folder" / "curves.png")])
    assert "--plot: expected a path in an existing folder" in capsys.readouterr().err


@pytest.mark.slow
def test_the_table_is_printed_before_the_plot(monkeypatch, capsys, tmp_path):
    def failing_plot(*args):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(demo, "plot", failing_plot)
    argv = [*TINY, "--steps", "2", "--sample-chars", "0", "--plot", str(tmp_path / "c.png")]
    with pytest.raises(RuntimeError, match="the plot failed"):
        demo.main(argv)
    assert _table(capsys.readouterr().out).keys() == {"float32", "fp8"}  # the run is not lost


# --- every documented flag, in combination: a tiny model, 2 steps -----------------------------

RECIPE_CLASSES = {
    "delayed": fp8fn.DelayedScaling,
    "current": fp8fn.CurrentScaling,
    "rowwise": fp8fn.RowwiseScaling,
    "blockwise": fp8fn.BlockwiseScaling,
    "mx": fp8fn.MXScaling,
}
FLAG_CASES = [  # each recipe with and without checkpointing, --compile with and without it;
    # --quiet, --plot and --seed spread over them
    ["--recipe", "delayed", "--plot"],
    ["--recipe", "delayed", "--no-checkpoint", "--quiet", "--seed", "3"],
    ["--recipe", "current", "--quiet"],
    ["--recipe", "current", "--no-checkpoint", "--plot", "--seed", "1"],
    ["--recipe", "rowwise", "--seed", "2"],
    ["--recipe", "rowwise", "--no-checkpoint", "--quiet"],
    ["--recipe", "blockwise", "--quiet", "--plot"],
    ["--recipe", "blockwise", "--no-checkpoint"],
    ["--recipe", "mx"],
    ["--recipe", "mx", "--no-checkpoint", "--quiet", "--plot"],
    ["--optim", "adamw-fp8", "--quiet"],  # fp8fn.optim's float8 moments, both runs
    ["--optim", "adamw-bf16", "--recipe", "current"],
    ["--compile"],  # checkpointed blocks run eagerly, the rest compiled
    ["--compile", "--recipe", "current", "--seed", "5"],
]  # --compile --no-checkpoint: test_main_compile_matches_eager_on_the_first_steps
SMALL = [a for a in TINY if a != "--quiet"]
SMALL = [*SMALL, "--steps", "2", "--sample-chars", "8"]


@pytest.mark.slow
@pytest.mark.parametrize("flags", FLAG_CASES, ids=lambda f: "-".join(a.lstrip("-") for a in f))
def test_flag_combination_trains_and_reports(flags, tmp_path, capsys):
    argv = [*SMALL, *(a if a != "--plot" else f"--plot={tmp_path / 'c.png'}" for a in flags)]
    results = demo.main(argv)
    out = capsys.readouterr().out
    recipe = flags[flags.index("--recipe") + 1] if "--recipe" in flags else "delayed"
    assert isinstance(results["recipe"], RECIPE_CLASSES[recipe])
    assert results["checkpointed"] == ([] if "--no-checkpoint" in flags else ["blocks.0"])
    assert len(results["fp8"]["state"]) == (4 if recipe == "delayed" else 0)  # stateless: none
    fp8_curve, hp_curve = results["fp8"]["train_curve"], results["float32"]["train_curve"]
    assert len(fp8_curve) == len(hp_curve) == 2 and all(map(math.isfinite, fp8_curve + hp_curve))
    assert fp8_curve[0] != hp_curve[0]  # the same weights and batch, cast to float8
    assert fp8_curve == pytest.approx(hp_curve, abs=0.05)
    rows = _table(out)  # the table: both runs' losses as printed
    for name in ("float32", "fp8"):
        run = results[name]
        assert rows[name] == (round(run["train_loss"], 4), round(run["val_loss"], 4))
    lines = out.strip().splitlines()
    if "--quiet" in flags:
        assert len(lines) == 6 and lines[0].startswith("2 steps of 8 sequences")
    else:
        assert lines[0].startswith("char-level GPT:") and "sample from the fp8 model:" in out
        assert results["sample"].startswith("The ") and len(results["sample"]) == 4 + 8
    if "--plot" in flags:
        assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if "--compile" in flags:  # the first step's losses match eager (same weights and batch)
        eager = demo.main([a for a in argv if a != "--compile" and "--plot" not in a])
        for name in ("float32", "fp8"):
            got, want = results[name]["train_curve"], eager[name]["train_curve"]
            assert got[0] == pytest.approx(want[0], rel=1e-5)


@pytest.mark.slow
def test_seed_gives_the_same_run_and_another_seed_another():
    argv = [*TINY, "--steps", "2", "--sample-chars", "8"]
    a, b, c = (demo.main([*argv, "--seed", s]) for s in ("7", "7", "8"))
    for name in ("float32", "fp8"):
        assert a[name]["train_curve"] == b[name]["train_curve"]  # bit for bit
        assert a[name]["train_curve"] != c[name]["train_curve"]
    assert a["sample"] == b["sample"]
    assert torch.equal(a["fp8"]["state"].amax_history, b["fp8"]["state"].amax_history)


@pytest.mark.slow
def test_seeds_report_mean_and_spread_and_the_first_seed_is_the_single_run(tmp_path, capsys):
    argv = [*TINY, "--steps", "6", "--sample-chars", "4"]
    single = demo.main(argv)
    capsys.readouterr()
    several = demo.main([*argv, "--seeds", "3", "--plot", str(tmp_path / "band.png")])
    out = capsys.readouterr().out
    assert [r["config"]["seed"] for r in several["seeds"]] == [0, 1, 2]
    first = several["seeds"][0]
    for name in ("float32", "fp8"):  # seed 0 of three is the run of seed 0 alone
        assert first[name]["train_curve"] == single[name]["train_curve"]
    assert several["seeds"][1]["float32"]["train_curve"] != single["float32"]["train_curve"]
    gaps = [r["val_gap_pct"] for r in several["seeds"]]
    assert several["val_gap_pct"] == pytest.approx(sum(gaps) / 3, abs=1e-12)
    mean = sum(gaps) / 3
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / 2)
    assert several["val_gap_std"] == pytest.approx(std, abs=1e-12)
    assert single["val_gap_std"] is None
    assert "mean ± standard deviation over 3 seeds (0, 1, 2)" in out
    assert f"{mean:+.2f} ± {std:.2f}" in out
    assert (tmp_path / "band.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
