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
    assert "ran 12, skipped 0" in result.output
    bench = json.loads((out / "bench" / "bench.json").read_text())
    e = {x["name"]: x for x in bench["entries"]}
    # PyTorch, ONNX fp32, int8, pruned + int8, pruned + vocabulary-trimmed + int8
    assert list(e) == ["model", "onnx", "int8", "pruned-int8", "pruned-vocab-int8"]
    assert not [n for n, x in e.items() if "error" in x]
    acc = {n: x["accuracy"] for n, x in e.items()}
    assert acc["model"]["exact_match"] >= 90.0  # measured: 100.0 after 800 steps
    assert acc["onnx"]["exact_match"] == acc["model"]["exact_match"] and acc["onnx"]["agreement"] == 1.0
    assert acc["int8"]["exact_match"] >= 0.99 * acc["onnx"]["exact_match"]  # static int8 within 1% relative of fp32
    assert e["int8"]["size_bytes"] < 0.4 * e["onnx"]["size_bytes"]
    assert e["pruned-int8"]["size_bytes"] < e["int8"]["size_bytes"]
    assert e["pruned-vocab-int8"]["size_bytes"] < e["pruned-int8"]["size_bytes"]
    # Trimming keeps the logits at the kept pieces: the int8 variants agree to within 2 of the 200 eval examples
    # (static int8 calibrates the smaller LM head anew).
    assert abs(acc["pruned-vocab-int8"]["exact_match"] - acc["pruned-int8"]["exact_match"]) <= 1.0
    # the recipe's quantize stages check on the data stage's held-out eval texts, not on the training ones
    check = json.loads((out / "int8" / "report.json").read_text())["check"]
    assert (check["on"], check["texts"]) == ("eval texts", 200)
    export = json.loads((out / "onnx" / "report.json").read_text())
    assert max(export["parity"]["max_abs_diff"].values()) < 1e-4
    _check_vocabulary_trimming(out)
    assert (out / "bench" / "report.md").is_file() and list((out / "bench").glob("*.png"))
    summary = json.loads((out / "summary.json").read_text())
    assert {s["id"] for s in summary["stages"]} == set(summary["paths"]) == {
        "data", "model-init", "model", "onnx", "int8", "pruned", "pruned-onnx", "pruned-int8", "pruned-vocab",
        "pruned-vocab-onnx", "pruned-vocab-int8", "bench"}
    # The second run finds every stage done and unchanged: it skips them all, and still prints the bench table.
    again = CliRunner().invoke(app, ["demo", "--out", str(out)])
    assert again.exit_code == 0 and "ran 0, skipped 12" in again.output and "pruned-vocab-int8" in again.output


def _check_vocabulary_trimming(out):
    """The demo's tokenizer (256 pieces asked, 144 trained on this very data, + 100 sentinels) keeps the data's pieces,
    the single characters and the specials; the trimmed model's greedy output is the untrimmed one's."""
    pruned = json.loads((out / "pruned" / "report.json").read_text())
    report = json.loads((out / "pruned-vocab" / "report.json").read_text())
    vocab = report["vocab"]
    assert vocab["before"]["pieces"] == 244 and vocab["after"]["pieces"] == 93  # measured; sentinels dropped
    assert vocab["segmentation_changed"]["changed"] == 0
    assert vocab["after"]["parameters"] < vocab["before"]["parameters"]
    # Parity: the same metric before and after trimming, and the recovered pruned model's own.
    assert report["before"]["eval"]["exact_match"] == report["eval"]["exact_match"] == pruned["eval"]["exact_match"]
    export = json.loads((out / "pruned-vocab-onnx" / "report.json").read_text())
    assert max(export["parity"]["max_abs_diff"].values()) < 1e-4
