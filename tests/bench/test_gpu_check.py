"""benchmarks/gpu_check.sh's CPU fallback, run for real with a tiny Flan-shaped model: the same checks as on a GPU
(fp16 parity against fp32 PyTorch, no NaN, the fp16-overflow model, greedy and beam tokens against PyTorch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~30-40 s on 2 busy cores: four exports and a small speed grid
def test_gpu_check_cpu_fallback_runs_the_checks_and_writes_json_and_markdown(tmp_path):
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    gpu_here = shutil.which("nvidia-smi") is not None
    if gpu_here:  # the test is about the fallback: never install the gpu extra from the test suite
        env["GPU_CHECK_DEVICE"] = "cpu"
    out = tmp_path / "gpu-check"
    proc = subprocess.run([str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--", "--shapes", "tiny",
                           "--batches", "1", "4", "--runs", "1"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert ("GPU_CHECK_DEVICE=cpu" if gpu_here else "no NVIDIA GPU found") in first, first
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["ok"] is True
    parity = report["shapes"]["tiny"]["device_parity"]
    assert parity["ok"] and parity["max_abs_diff"]["encoder_model"] < 0.02
    assert max(parity["max_abs_diff"].values()) < 0.1 and parity["worst_use_of_tolerance"] < 0.5
    assert parity["greedy_agreement"] >= 0.95
    overflow = report["overflow"]
    assert overflow["plain_half_pytorch_wo_inf"] is True and overflow["ok"] is True
    assert max(overflow["max_abs_diff"].values()) < 0.1
    exports = report["shapes"]["tiny"]["exports"]
    assert exports["fp16"]["onnx_bytes"] < exports["fp32"]["onnx_bytes"]
    rows = {(r["engine"], r["batch"], r["beams"]): r for r in report["shapes"]["tiny"]["speed"]}
    for batch in (1, 4):
        for beams in (1, 4):
            assert rows[("ours fp32", batch, beams)]["agreement_with_pytorch_fp32"] == 1.0
            fp16 = rows[("ours fp16", batch, beams)]["agreement_with_pytorch_fp32"]
            assert fp16 >= 0.9 and rows[("ours fp16 io-binding", batch, beams)]["agreement_with_pytorch_fp32"] == fp16
            assert rows[("PyTorch fp32", batch, beams)]["p50_ms"] > 0
    if any(e == "CTranslate2" for e, _, _ in rows):
        assert rows[("CTranslate2", 1, 1)]["agreement_with_pytorch_fp32"] >= 0.9
    markdown = (out / "gpu_check.md").read_text()
    assert "| tiny | ours fp16 | 4 | 4 |" in markdown and "Overflow model" in markdown
