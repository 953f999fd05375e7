"""The embedded default, end to end, exactly as `make demo` runs it (no download, no argument but the output)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from t5compress.cli import app


@pytest.mark.slow
def test_demo_trains_exports_quantizes_and_scores_every_backend(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    torch_scores, onnx_scores = summary["backends"]["pytorch"], summary["backends"]["t5compress onnx"]
    assert torch_scores["exact_match"] >= 90.0  # measured: 100.0 after 800 steps
    assert onnx_scores["exact_match"] == torch_scores["exact_match"]
    assert summary["parity"]["identical_outputs"] == "200/200"
    assert max(summary["parity"]["max_abs_diff"].values()) < 1e-4
    int8 = summary["backends"]["t5compress int8"]
    assert int8["exact_match"] >= 0.99 * onnx_scores["exact_match"]  # static int8 within 1% relative of fp32
    assert int8["size_mb"] < 0.4 * onnx_scores["size_mb"]
    assert {"data", "model", "onnx", "int8"} <= {p.name for p in out.iterdir()}
    # The second run refuses to overwrite without --force.
    again = CliRunner().invoke(app, ["demo", "--out", str(out)])
    assert again.exit_code != 0 and "--force" in again.output
