"""Shared fixtures: tiny real T5 models (built from T5Config, no network) and small generated datasets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tiny_t5(path: Path, seed: int = 0, tokenizer=None, **overrides) -> Path:
    """Save a tiny random T5 with `tokenizer` (default: a byte tokenizer) to `path` (safetensors, like any model
    directory)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from t5compress.model.load import save_model_dir
    from t5compress.model.tokenization import byte_level

    tok = tokenizer if tokenizer is not None else byte_level()
    kwargs = dict(vocab_size=len(tok), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(T5Config(**kwargs)).eval()
    with torch.no_grad():  # plain random init can decode one token forever; a smaller embedding varies the output
        model.shared.weight.mul_(0.3)
    path.mkdir(parents=True, exist_ok=True)
    save_model_dir(model, tok, path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """T5 v1.0 style: relu FFN, tied embeddings."""
    return build_tiny_t5(tmp_path_factory.mktemp("models") / "tiny-relu")


@pytest.fixture(scope="session")
def tiny_gated_dir(tmp_path_factory) -> Path:
    """T5 v1.1 / Flan style: gated-gelu FFN, untied embeddings."""
    return build_tiny_t5(
        tmp_path_factory.mktemp("models") / "tiny-gated", seed=1, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    )


def _export(src: Path, out: Path) -> Path:
    from t5compress.export import ExportConfig
    from t5compress.export import run as export

    export(src, ExportConfig(), out, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_export(tiny_model_dir, tmp_path_factory) -> Path:
    """`tiny_model_dir`'s default fp32 ONNX export, shared by the tests that only read it."""
    return _export(tiny_model_dir, tmp_path_factory.mktemp("relu") / "fp32")


@pytest.fixture(scope="session")
def gated_export(tiny_gated_dir, tmp_path_factory) -> Path:
    """`tiny_gated_dir`'s default fp32 ONNX export, shared by the tests that only read it."""
    return _export(tiny_gated_dir, tmp_path_factory.mktemp("gated") / "fp32")


@pytest.fixture(scope="session")
def runtime_export(tmp_path_factory) -> tuple[Path, Path]:
    """test_runtime's default model (its outputs end with EOS at different steps) and its ONNX export, shared by the
    in-flight and Triton tests that only read them."""
    from tests.runtime.test_runtime import build_model, export_with

    root = tmp_path_factory.mktemp("runtime-export")
    model = build_model(root / "model")
    return model, export_with("onnx", model, root / "onnx")


@pytest.fixture(scope="session")
def gated_int8(gated_export, demo_jsonl, tmp_path_factory) -> tuple[Path, dict]:
    """`gated_export` quantized by the default (static) mode on 32 calibration texts, and its report (random weights:
    the agreement floor lowered to 0.5)."""
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    out = tmp_path_factory.mktemp("gated-int8") / "default"
    return out, quantize(gated_export, QuantizeConfig(calib_data=str(demo_jsonl), samples=32, min_agreement=0.5),
                         out, progress=False)


@pytest.fixture(scope="session")
def demo_jsonl(tmp_path_factory) -> Path:
    """A few hundred examples of the demo task as JSON Lines."""
    from t5compress.tasks import make_examples, write_jsonl

    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    write_jsonl(path, make_examples(240, seed=0))
    return path


@pytest.fixture(scope="session")
def skilled(tmp_path_factory) -> Path:
    """The demo (data, model, ONNX and int8 exports) trained 150 steps: real but not perfect skill (about 70-90% exact
    match on its 200 eval examples), so a quantization or pruning loss can show. Shared by the int8 test files."""
    import torch

    from t5compress import demo

    out = tmp_path_factory.mktemp("skilled") / "demo"
    # One thread, whatever ran before: torch's thread count is process-wide (a TorchScript `generate` sets it), and
    # the trained weights, so the int8 tests' borderline metrics, differ with it.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the quickstart recipe's stages up to `int8` (data, model-init, model, onnx, int8): no pruning, no bench
        demo.run(None, demo.DemoConfig(train_examples=2000, eval_examples=200, max_steps=150, stages=("int8",)), out,
                 progress=False)
    finally:
        torch.set_num_threads(before)
    return out
