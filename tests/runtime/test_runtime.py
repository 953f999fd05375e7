"""The generation runtime on real exports of tiny T5s: token identity with transformers, no torch, CLI.

Each model is exported once per module. Every comparison runs real ONNX Runtime sessions against
`T5ForConditionalGeneration.generate` with the same settings and asserts identical token ids (same shape, same values).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from t5compress.errors import ConfigError, ModelError
from t5compress.runtime import CachedDecoder, load_runtime
from t5compress.runtime.settings import GenerationSettings

EOS = 1
MODELS = {
    # T5 v1.0: relu FFN, tied embeddings.
    "relu-tied": dict(seed=0),
    # T5 v1.1 / Flan: gated-gelu FFN, untied embeddings.
    "gated-untied": dict(seed=1, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    # Head size that is not d_model / num_heads (as after head pruning), encoder deeper than decoder (like el2).
    "odd-shape": dict(seed=2, d_model=64, num_heads=3, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=2,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def build_model(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random T5 whose greedy and beam outputs vary and often end with EOS at different steps.

    Plain random init repeats one token forever and never ends; a larger init (factor 3) makes the decoder depend
    on its input, a small embedding (x0.1) keeps logits moderate, and a larger EOS output row makes EOS win often
    enough that finished rows, padding and finished beam hypotheses are all exercised.
    """
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from t5compress.model.load import save_model_dir
    from t5compress.model.tokenization import byte_level

    tok = byte_level()
    kwargs = dict(vocab_size=len(tok), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=EOS, dropout_rate=0.0, initializer_factor=3.0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(T5Config(**kwargs)).eval()
    with torch.no_grad():
        model.shared.weight.mul_(0.1)
        (model.shared if model.config.tie_word_embeddings else model.lm_head).weight[EOS].mul_(3.0)
    save_model_dir(model, tok, path)
    return path


def export_with(fmt: str, model_dir: Path, out: Path) -> Path:
    """An export dir written by the package's export stage (what `t5compress export --onnx|--torchscript` runs)."""
    from t5compress.export import stage

    # These models' large activations (init factor 3) put fp32 differences above the default 1e-4; token identity
    # with transformers is what the tests below assert.
    stage.run(model_dir, stage.ExportConfig(format=fmt, atol=1e-2), out)
    return out


@pytest.fixture(scope="module")
def exports(runtime_export, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (model dir, ONNX export dir), built once for the module; relu-tied is `build_model`'s default model,
    built once for the session."""
    root = tmp_path_factory.mktemp("runtime")
    return {name: runtime_export if name == "relu-tied" else
            (m := build_model(root / name, **kw), export_with("onnx", m, root / f"{name}-onnx"))
            for name, kw in MODELS.items()}


_hf_cache: dict[Path, object] = {}
_rt_cache: dict[Path, object] = {}


def hf_model(model_dir: Path):
    from transformers import T5ForConditionalGeneration

    if model_dir not in _hf_cache:
        _hf_cache[model_dir] = T5ForConditionalGeneration.from_pretrained(model_dir).eval()
    return _hf_cache[model_dir]


def runtime(export_dir: Path):
    if export_dir not in _rt_cache:
        _rt_cache[export_dir] = load_runtime(export_dir, threads=1)
    return _rt_cache[export_dir]


def reference(model_dir: Path, ids: np.ndarray, mask: np.ndarray | None, **gen) -> np.ndarray:
    import torch

    model = hf_model(model_dir)
    if model.config.num_layers != model.config.num_decoder_layers:
        gen["cache_implementation"] = "dynamic_full"  # transformers 4.57 sizes its cache by the encoder depth
    with torch.inference_mode():
        mask_t = None if mask is None else torch.from_numpy(mask)
        return model.generate(torch.from_numpy(ids), attention_mask=mask_t, **gen).numpy()


def inputs(batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask), (batch, 12): byte ids ending in EOS, rows after the first right-padded to different lengths."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 259, (batch, 12))
    for row, length in enumerate([12, 6, 9, 4, 11][:batch]):
        ids[row, length - 1] = EOS
        ids[row, length:] = 0
    return ids, (ids != 0).astype(np.int64)


def assert_same(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.int64
    assert ours.shape == ref.shape, f"shape {ours.shape} != transformers {ref.shape}\n{ours}\n{ref}"
    np.testing.assert_array_equal(ours, ref)


def rows_ended_early(ref: np.ndarray) -> int:
    """Rows whose EOS came before the last column (the rest of the row is padding)."""
    return int((ref[:, 1:-1] == EOS).any(axis=1).sum())


GREEDY = [
    dict(),
    dict(max_new_tokens=12, repetition_penalty=1.5),
    dict(max_new_tokens=14, no_repeat_ngram_size=2),
    dict(max_new_tokens=10, min_new_tokens=6),
]
BEAM = [
    dict(num_beams=4, early_stopping=True, length_penalty=0.7),
    dict(num_beams=4, early_stopping=False, length_penalty=1.5),
    dict(num_beams=4, early_stopping="never", length_penalty=2.0, max_new_tokens=12),
    dict(num_beams=3, no_repeat_ngram_size=2, repetition_penalty=1.3, max_new_tokens=14),
    dict(num_beams=4, num_return_sequences=2, min_new_tokens=4, max_new_tokens=9, length_penalty=0.5),
]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers(exports, name):
    model_dir, onnx_dir = exports[name]
    rt = runtime(onnx_dir)
    ended_early = 0
    for batch in (1, 3):
        ids, mask = inputs(batch)
        for gen in GREEDY:
            ref = reference(model_dir, ids, mask, **gen)
            assert_same(rt.generate(ids, mask, **gen), ref)
            ended_early += rows_ended_early(ref)
    assert ended_early > 0, "no row ended before the others: padding of finished rows was not exercised"


@pytest.mark.parametrize("name", MODELS)
def test_beam_search_matches_transformers(exports, name):
    model_dir, onnx_dir = exports[name]
    rt = runtime(onnx_dir)
    short = 0
    for batch in (1, 3):
        ids, mask = inputs(batch, seed=1)
        for gen in BEAM:
            ref = reference(model_dir, ids, mask, **gen)
            assert_same(rt.generate(ids, mask, **gen), ref)
            short += rows_ended_early(ref)
    assert short > 0, "no hypothesis ended before the others: finished-hypothesis padding was not exercised"


@pytest.mark.parametrize("name", ["relu-tied", "odd-shape"])
def test_torchscript_backend_matches_transformers(exports, tmp_path, name):
    model_dir = exports[name][0]
    export = export_with("torchscript", model_dir, tmp_path / "ts")
    rt = load_runtime(export, threads=1)
    assert rt.format == "torchscript"
    ids, mask = inputs(3, seed=4)
    for gen in (GREEDY[0], BEAM[0], BEAM[1]):
        assert_same(rt.generate(ids, mask, **gen), reference(model_dir, ids, mask, **gen))
    (export / "graphs.json").unlink()  # without the manifest, the runtime assumes the exporter's declared order
    assert_same(load_runtime(export).generate(ids, mask), reference(model_dir, ids, mask))


def test_optimum_export_dirs_work_too(exports, tmp_path):
    """optimum's exporter writes the same file and tensor names (its own input order, no graphs.json)."""
    from optimum.exporters.onnx import main_export

    model_dir = exports["gated-untied"][0]
    main_export(str(model_dir), str(tmp_path / "opt"), task="text2text-generation-with-past", no_post_process=True,
                do_validation=False)
    rt = load_runtime(tmp_path / "opt", threads=1)
    ids, mask = inputs(3, seed=5)
    for gen in (GREEDY[0], BEAM[1]):
        assert_same(rt.generate(ids, mask, **gen), reference(model_dir, ids, mask, **gen))


def test_attention_mask_is_inferred_from_padding_like_transformers(exports):
    model_dir, onnx_dir = exports["relu-tied"]
    ids, _ = inputs(3, seed=2)
    assert_same(runtime(onnx_dir).generate(ids, max_new_tokens=8), reference(model_dir, ids, None, max_new_tokens=8))


def test_defaults_come_from_generation_config(exports, tmp_path):
    model_dir, onnx_dir = exports["gated-untied"]
    export = shutil.copytree(onnx_dir, tmp_path / "export")
    gen_file = export / "generation_config.json"
    gen_file.write_text(json.dumps({**json.loads(gen_file.read_text()), "num_beams": 3, "max_length": 9,
                                    "length_penalty": 0.6}))
    rt = load_runtime(export)
    assert rt.settings() == GenerationSettings(num_beams=3, max_new_tokens=8, length_penalty=0.6)
    ids, mask = inputs(3, seed=3)
    ours = rt.generate(ids, mask)
    assert_same(ours, reference(model_dir, ids, mask, num_beams=3, max_length=9, length_penalty=0.6))
    assert_same(rt.generate(ids, mask, num_beams=1), reference(model_dir, ids, mask, max_length=9))


def test_generate_text_round_trip_matches_the_transformers_pipeline(exports):
    import torch
    from transformers import AutoTokenizer

    model_dir, onnx_dir = exports["relu-tied"]
    texts = ["translate: hello world", "a much longer input sentence, with punctuation!", "é ü ß"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(texts, return_tensors="pt", padding=True, return_token_type_ids=False)
    for gen in (dict(max_new_tokens=10), dict(num_beams=4, max_new_tokens=10, length_penalty=0.7)):
        with torch.inference_mode():
            ref = tok.batch_decode(hf_model(model_dir).generate(**enc, **gen), skip_special_tokens=True)
        assert runtime(onnx_dir).generate_text(texts, **gen) == ref
    ids, mask = runtime(onnx_dir).encode(texts)
    np.testing.assert_array_equal(ids, enc["input_ids"].numpy())
    np.testing.assert_array_equal(mask, enc["attention_mask"].numpy())


def test_onnx_path_imports_neither_torch_nor_transformers_nor_onnx(exports):
    assert_light_imports(exports["gated-untied"][1])


def assert_light_imports(onnx_dir: Path) -> None:
    """Loading `onnx_dir` and generating text imports neither torch, transformers, optimum nor onnx (its C++
    extension: 12-15 MB resident; `onnxproto`), and still rewrites the with-past step and cuts the first step."""
    code = (
        "import sys\n"
        "from t5compress.runtime import load_runtime, sharedkv\n"
        "from t5compress.runtime.firststep import FirstStep\n"
        f"rt = load_runtime({str(onnx_dir)!r}, threads=1)\n"
        "assert sharedkv.is_shared(rt.backend.decoder_with_past) and isinstance(rt.backend.decoder, FirstStep)\n"
        "out = rt.generate_text(['hello', 'world!'], num_beams=2, max_new_tokens=5)\n"
        "assert len(out) == 2 and all(isinstance(o, str) for o in out), out\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'optimum', 'onnx') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_cross_attention_cache_is_computed_once_and_never_reordered(exports):
    rt = runtime(exports["relu-tied"][1])
    ids, mask = inputs(2)
    hidden = rt.backend.encoder.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
    dec = CachedDecoder(rt.backend, hidden, mask, beams=3)
    dec.step(np.zeros(6, dtype=np.int64))
    cross = dict(dec.cross_cache)
    assert all(v.shape[0] == 6 for v in cross.values())  # (batch*beams, heads, enc_len, d_kv)
    dec.step(np.arange(3, 9, dtype=np.int64))
    before = {n: v.copy() for n, v in dec.self_cache.items()}  # (batch*beams, heads, 2, d_kv)
    rows = np.array([2, 2, 0, 5, 3, 3])
    dec.reorder(rows)
    for n, v in dec.self_cache.items():
        np.testing.assert_array_equal(v, before[n][rows])
    dec.step(np.arange(6, dtype=np.int64))
    assert all(dec.cross_cache[n] is cross[n] for n in cross)  # the very same arrays: no copies per step


def test_not_an_export_dir_is_one_line_naming_what_is_missing(exports, tmp_path):
    model_dir, onnx_dir = exports["relu-tied"]
    for path, needle in [(tmp_path / "nope", "not a directory"), (model_dir, "encoder_model.onnx")]:
        with pytest.raises(ModelError, match=needle) as e:
            load_runtime(path)
        assert "\n" not in str(e.value)
    partial = shutil.copytree(onnx_dir, tmp_path / "partial")
    (partial / "decoder_with_past_model.onnx").unlink()
    with pytest.raises(ModelError, match="missing decoder_with_past_model.onnx$"):
        load_runtime(partial)
    (partial / "tokenizer.json").unlink()
    shutil.copy(onnx_dir / "decoder_with_past_model.onnx", partial)
    with pytest.raises(ModelError, match="tokenizer.json"):
        load_runtime(partial).generate_text(["x"])


def test_bad_settings_name_the_field(exports):
    rt = runtime(exports["relu-tied"][1])
    ids, _ = inputs(1)
    for gen, needle in [(dict(num_beams=0), "num_beams"), (dict(num_beams=2, num_return_sequences=3),
                        "num_return_sequences"), (dict(early_stopping="sometimes"), "early_stopping")]:
        with pytest.raises(ConfigError, match=needle):
            rt.generate(ids, **gen)
    with pytest.raises(ConfigError, match="unknown generation setting"):
        rt.settings(temperature=0.5)


runner = CliRunner()


def test_cli_generate_happy_path_files_stdin_and_jsonl(exports, tmp_path):
    from t5compress.cli import app

    onnx_dir = exports["gated-untied"][1]
    rt = runtime(onnx_dir)
    texts = ["hello world", "a longer input, to pad the batch", "x"]
    want = rt.generate_text(["summarize: " + t for t in texts], num_beams=2, max_new_tokens=6)
    args = ["--prefix", "summarize: ", "--num-beams", "2", "--max-new-tokens", "6", "--batch-size", "2"]
    result = runner.invoke(app, ["generate", str(onnx_dir), *texts, *args])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [" ".join(w.splitlines()) for w in want]

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "question": t}) + "\n\n" for i, t in enumerate(texts)))
    result = runner.invoke(app, ["generate", str(onnx_dir), "-i", str(src), "--field", "question", "--jsonl", *args])
    assert result.exit_code == 0, result.output
    assert [json.loads(line) for line in result.output.splitlines()] == [
        {"input": t, "output": w, "input_tokens": len(("summarize: " + t).encode()) + 1, "truncated": False}
        for t, w in zip(texts, want, strict=True)
    ]
    result = runner.invoke(app, ["generate", str(onnx_dir), "-", *args], input="\n".join(texts) + "\n")
    assert result.exit_code == 0 and len(result.output.splitlines()) == 3, result.output


def test_cli_generate_bad_inputs(exports, tmp_path):
    from t5compress.cli import app

    onnx_dir = exports["gated-untied"][1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "fine"}\n{"target": "no source here"}\n')
    for args, needle in [
        ([str(tmp_path / "missing"), "hi"], "not a directory"),
        ([str(onnx_dir)], "no input text"),
        ([str(onnx_dir), "--input", str(bad)], "bad.jsonl:2"),
        ([str(onnx_dir), "hi", "--num-beams", "2", "--max-new-tokens", "0"], "max-new-tokens"),
    ]:
        result = runner.invoke(app, ["generate", *args])
        assert result.exit_code != 0 and needle in result.output, result.output
        assert "Traceback" not in result.output
