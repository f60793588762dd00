"""tools/gpu_smoke.py: its verdicts, budgets and skips (quick, with stub steps), and its
`--dry-run` on CPU (slow: every step, torch's CUDA rules checked on each float8 GEMM call)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_smoke.py"


def _smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_step_1_skips_steps_3_to_6_and_a_step_past_its_budget_times_out(monkeypatch):
    smoke = _smoke()

    def fails(ctx):
        raise AssertionError("e4m3 x e4m3 -> bf16: 12.0 dB")

    def sleeps(ctx):
        time.sleep(5)

    stubs = {step: (lambda ctx, step=step: {"step": step}) for step in range(7)}
    monkeypatch.setattr(smoke, "FUNCTIONS", {**stubs, 1: fails, 2: sleeps})
    monkeypatch.setattr(smoke, "STEPS", [(s, n, 1) for s, n, _ in smoke.STEPS])
    verdicts = smoke.run_steps(smoke.Context(dry=True), set(range(7)))
    assert [v["verdict"] for v in verdicts] == ["pass", "fail", "timeout"] + ["skipped"] * 4
    assert verdicts[0]["figures"] == {"step": 0}
    assert "12.0 dB" in verdicts[1]["error"] and "budget of 1 s" in verdicts[2]["error"]
    json.dumps(verdicts)  # one JSON verdict per step


@pytest.mark.slow
def test_dry_run_passes_every_step_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    verdicts = json.loads(out.read_text())
    assert [(v["step"], v["verdict"]) for v in verdicts] == [(s, "pass") for s in range(7)]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [v["step"] for v in lines] == list(range(7))
    assert verdicts[0]["figures"]["capability"] == [9, 0]  # the CPU standing in for sm_90
