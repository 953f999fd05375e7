"""The embedded default, end to end, exactly as `make demo` runs it (no download, no argument but the output): the
quickstart recipe, ending in the benchmark of its variants."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from t5compress.cli import app


@pytest.mark.slow
def test_demo_trains_ships_and_benchmarks_every_variant_then_skips_on_rerun(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "ran 9, skipped 0" in result.output
    bench = json.loads((out / "bench" / "bench.json").read_text())
    e = {x["name"]: x for x in bench["entries"]}
    assert list(e) == ["model", "onnx", "int8", "pruned-int8"]  # PyTorch, ONNX fp32, int8, pruned + int8
    assert not [n for n, x in e.items() if "error" in x]
    acc = {n: x["accuracy"] for n, x in e.items()}
    assert acc["model"]["exact_match"] >= 90.0  # measured: 100.0 after 800 steps
    assert acc["onnx"]["exact_match"] == acc["model"]["exact_match"] and acc["onnx"]["agreement"] == 1.0
    assert acc["int8"]["exact_match"] >= 0.99 * acc["onnx"]["exact_match"]  # static int8 within 1% relative of fp32
    assert e["int8"]["size_bytes"] < 0.4 * e["onnx"]["size_bytes"]
    assert e["pruned-int8"]["size_bytes"] < e["int8"]["size_bytes"]
    export = json.loads((out / "onnx" / "report.json").read_text())
    assert max(export["parity"]["max_abs_diff"].values()) < 1e-4
    assert (out / "bench" / "report.md").is_file() and list((out / "bench").glob("*.png"))
    summary = json.loads((out / "summary.json").read_text())
    assert {s["id"] for s in summary["stages"]} == set(summary["paths"]) == {
        "data", "model-init", "model", "onnx", "int8", "pruned", "pruned-onnx", "pruned-int8", "bench"}
    # The second run finds every stage done and unchanged: it skips them all, and still prints the bench table.
    again = CliRunner().invoke(app, ["demo", "--out", str(out)])
    assert again.exit_code == 0 and "ran 0, skipped 9" in again.output and "pruned-int8" in again.output
