"""Text handling of the runtime: ByT5 byte-level dirs (no tokenizer.json) and input truncation, against transformers.

Real tiny T5 exports; the reference is transformers' own tokenizers (`ByT5Tokenizer`, the dir's fast tokenizer
with `truncation=True`) and `model.generate`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from t5compress import artifacts
from t5compress.cli import app
from t5compress.errors import DataError
from t5compress.export import ExportConfig, run
from t5compress.runtime import ByteTokenizer, load_runtime
from t5compress.runtime.text import read_tokenizer_config
from tests.conftest import build_tiny_t5

runner = CliRunner()
TEXTS = ["hello world", "héllo wörld — ünïcode 🙂", "a </s> b", "x<extra_id_0>y <extra_id_12> z", "", "ends</s>",
         "  spaced  <pad>  out  ", "<unk>"]
TRAINED = 16  # the input length the "trained" model dir records


@pytest.fixture(scope="module")
def byt5_dir(tmp_path_factory) -> Path:
    """A tiny T5 saved with transformers' ByT5Tokenizer: no tokenizer.json, as google/byt5-* checkpoints."""
    from transformers import ByT5Tokenizer

    path = build_tiny_t5(tmp_path_factory.mktemp("byt5") / "model", seed=3)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / f).unlink(missing_ok=True)
    ByT5Tokenizer().save_pretrained(path)
    assert not (path / "tokenizer.json").exists()
    return path


@pytest.fixture(scope="module")
def byt5_export(byt5_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("byt5") / "onnx"
    run(byt5_dir, ExportConfig(), out)
    return out


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(model dir whose t5compress.json says it was trained on 16-token inputs, its export)."""
    root = tmp_path_factory.mktemp("trained")
    src = root / "model"
    shutil.copytree(tiny_model_dir, src)
    artifacts.write_meta(src, "train", {"data": {"max_source_length": TRAINED}}, parent=None)
    run(src, ExportConfig(), root / "onnx")
    return src, root / "onnx"


@pytest.mark.filterwarnings("ignore:This sequence already has </s>:UserWarning")  # ByT5Tokenizer on "ends</s>"
def test_byte_tokenizer_matches_byt5_tokenizer_encode_and_decode():
    from transformers import ByT5Tokenizer

    hf = ByT5Tokenizer()
    table = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip}
             for i, t in hf.added_tokens_decoder.items()}
    ours = ByteTokenizer.from_config({"added_tokens_decoder": table})
    assert ours.encode(TEXTS) == hf(TEXTS).input_ids
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, len(hf), 40).tolist() for _ in range(20)]  # specials, sentinels, broken UTF-8
    rows.append([3 + b for b in "añ🙂".encode()][:-1])  # a cut multi-byte character at the end
    assert ours.decode(rows) == hf.batch_decode(rows, skip_special_tokens=True)
    legacy = ByteTokenizer.from_config({"extra_ids": 125})  # a config without the added-tokens table
    assert legacy.encode(TEXTS) == hf(TEXTS).input_ids


def test_byt5_dir_exports_and_generates_like_transformers(byt5_dir, byt5_export):
    import torch
    from transformers import ByT5Tokenizer, T5ForConditionalGeneration

    assert not (byt5_export / "tokenizer.json").exists()
    assert read_tokenizer_config(byt5_export)["tokenizer_class"] == "ByT5Tokenizer"
    report = json.loads((byt5_export / "report.json").read_text())
    assert report["parity"]["generation"]["identical"]
    assert report["max_input_tokens"] == {"value": None, "from": "tokenizer (model_max_length)"}  # ByT5: no limit
    rt = load_runtime(byt5_export)
    assert isinstance(rt.tokenizer, ByteTokenizer) and rt.max_input_tokens is None
    tok, model = ByT5Tokenizer.from_pretrained(byt5_dir), T5ForConditionalGeneration.from_pretrained(byt5_dir).eval()
    texts = TEXTS[:4]
    enc = tok(texts, return_tensors="pt", padding=True)
    for gen in (dict(max_new_tokens=10), dict(num_beams=3, max_new_tokens=10)):
        with torch.inference_mode():
            want = tok.batch_decode(model.generate(**enc, **gen), skip_special_tokens=True)
        assert rt.generate_text(texts, **gen) == want
    result = runner.invoke(app, ["generate", str(byt5_export), *texts, "--max-new-tokens", "10"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [" ".join(t.splitlines()) for t in rt.generate_text(texts, max_new_tokens=10)]


def test_truncation_matches_transformers_and_says_which_inputs(trained):
    from transformers import AutoTokenizer

    src, export = trained
    rt = load_runtime(export)
    texts = ["short", "a" * 40, "b" * 15, "c" * 16]  # 6, 41, 16, 17 tokens with </s>
    enc = rt.tokenize(texts)
    hf = AutoTokenizer.from_pretrained(src)(texts, truncation=True, max_length=TRAINED, padding=True,
                                             return_tensors="np")
    np.testing.assert_array_equal(enc.input_ids, hf["input_ids"])
    np.testing.assert_array_equal(enc.attention_mask, hf["attention_mask"])
    assert enc.lengths == (6, 41, 16, 17) and enc.truncated == (False, True, False, True)
    assert enc.input_ids[1, TRAINED - 1] == 1  # the EOS is kept as the last token
    results = rt.generate_results(texts, max_new_tokens=5)
    assert [r.truncated for r in results] == [False, True, False, True] and results[1].input_tokens == 41
    assert results[1].outputs == rt.decode(rt.generate(enc.input_ids[1:2], enc.attention_mask[1:2],
                                                       max_new_tokens=5))
    untruncated = rt.tokenize(texts, max_input_tokens=0)
    assert untruncated.input_ids.shape == (4, 41) and not any(untruncated.truncated)
    with pytest.raises(DataError, match="max_input_tokens must be >= 1"):
        rt.tokenize(texts, max_input_tokens=-3)
    assert load_runtime(export, max_input_tokens=None).tokenize(texts).input_ids.shape[1] == 41


def test_export_records_the_trained_input_length_else_the_tokenizers(trained, tiny_model_dir, byt5_export):
    _, export = trained
    assert read_tokenizer_config(export)["model_max_length"] == TRAINED
    report = json.loads((export / "report.json").read_text())
    assert report["max_input_tokens"] == {"value": TRAINED, "from": "training (data.max_source_length)"}
    assert load_runtime(export).max_input_tokens == TRAINED
    assert artifacts.trained_input_length(tiny_model_dir) is None  # made by a test, no lineage
    assert read_tokenizer_config(tiny_model_dir)["model_max_length"] == 1024


def test_cli_generate_truncates_reports_it_and_rejects_a_negative_limit(trained):
    _, export = trained
    texts = ["short", "a" * 40]
    result = runner.invoke(app, ["generate", str(export), *texts, "--jsonl", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["input_tokens"], r["truncated"]) for r in records] == [(6, False), (41, True)]
    assert "input 2 truncated from 41 to 16 tokens" in result.stderr
    wide = runner.invoke(app, ["generate", str(export), *texts, "--jsonl", "--max-input-tokens", "0"])
    assert wide.exit_code == 0 and not any(json.loads(line)["truncated"] for line in wide.stdout.splitlines())
    assert "truncated" not in wide.stderr
    bad = runner.invoke(app, ["generate", str(export), "hi", "--max-input-tokens", "-1"])
    assert bad.exit_code != 0 and "max-input-tokens" in bad.output
