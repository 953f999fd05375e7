"""Happy path and one bad input for create, train, info and demo (Typer's CliRunner, real models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from t5compress.cli import app

runner = CliRunner()


def _ok(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def _bad(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert needle in result.output, result.output
    assert "Traceback" not in result.output
    return result.output


def test_help_lists_only_working_commands():
    out = _ok(["--help"])
    for cmd in ("create", "train", "info", "demo"):
        assert cmd in out
    assert "--resume" in _ok(["train", "--help"])


def test_the_cli_starts_without_torch_transformers_or_onnx():
    """Every CLI process (`--help` too) imports the command table; the heavy libraries come with the command that
    runs (measured: torch alone was 2.5 CPU s of each start, then 0.5 s in all)."""
    heavy = ("torch", "transformers", "onnxruntime", "onnx")
    code = f"import sys, t5compress.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[2])
    assert result.stdout.strip() == "[]", result.stdout


def test_create_a_t5_efficient_model_with_a_unigram_tokenizer(tmp_path, demo_jsonl):
    out = tmp_path / "new"
    text = _ok(["create", "t5-efficient-tiny-nl2", str(out), "--text", str(demo_jsonl), "--vocab-size", "200",
                "-o", "d_model=64", "-o", "d_ff=128"])
    assert "parameters" in text
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_layers"], cfg["num_decoder_layers"], cfg["d_model"], cfg["d_ff"]) == (2, 2, 64, 128)
    assert cfg["vocab_size"] % 128 == 0 and (out / "tokenizer.json").is_file()
    _bad(["create", "t5-efficient-tiny", str(out), "--text", str(demo_jsonl)], "already exists")
    _bad(["create", "t5-gigantic", str(tmp_path / "x"), "--text", str(demo_jsonl)], "unknown architecture")
    assert not (tmp_path / "x").exists()


def test_info_shows_architecture_lineage_and_metrics(tiny_model_dir, tmp_path):
    out = _ok(["info", str(tiny_model_dir)])
    assert "d_model" in out and "parameters" in out
    data = json.loads(_ok(["info", str(tiny_model_dir), "--json"]))
    assert data["kind"] == "model" and data["parameters"] > 10_000
    assert data["size_bytes"] > data["parameters"] * 4 * 0.9
    (tmp_path / "empty").mkdir()
    _bad(["info", str(tmp_path / "empty")], "neither a model directory")


def test_train_happy_path_and_bad_data(tiny_model_dir, demo_jsonl, tmp_path):
    out = tmp_path / "ft"
    text = _ok(["train", str(tiny_model_dir), str(demo_jsonl), str(out), "--max-steps", "6", "--eval-every", "3",
                "--eval-max-examples", "8", "--batch-size", "8"])
    assert "exact_match" in text and str(out) in text.replace("\n", "")
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["steps"] == 6 and len(report["train"]["history"]) == 2
    info = json.loads(_ok(["info", str(out), "--json"]))
    assert info["lineage"]["stage"] == "train" and info["lineage"]["parent"]["path"] == str(tiny_model_dir.resolve())

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a", "target": "b"}\n{"source": "c"\n')
    _bad(["train", str(tiny_model_dir), str(bad), str(tmp_path / "o2")], "bad.jsonl:2")
    _bad(["train", str(tiny_model_dir), str(demo_jsonl), str(tmp_path / "o3"), "--lr=-1"], "lr")
    (tmp_path / "not-a-model").mkdir()
    _bad(["train", str(tmp_path / "not-a-model"), str(demo_jsonl), str(tmp_path / "o4")], "config.json")
    _bad(["train", "google/t5-efficient-tiny", str(demo_jsonl), str(tmp_path / "o5")], "cannot be reached")
    assert not any((tmp_path / n).exists() for n in ("o2", "o3", "o4", "o5", "o2.partial"))
