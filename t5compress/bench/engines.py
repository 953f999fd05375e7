"""How each kind of variant is loaded and asked to generate, inside the bench worker process.

A loader is `load(path, threads, settings) -> generate`, where `generate(ids, mask, max_new, min_new, beams)` returns
each input row's new tokens (the decoder start token dropped, cut after the first EOS, no padding). Lengths are
forced by passing `min_new == max_new`; the worker checks that every engine really produced that many. Libraries are
imported inside the loaders: the ONNX path of our runtime never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

Generate = Callable[[np.ndarray, np.ndarray, int, int, int], list[list[int]]]
Loader = Callable[[Path, int, dict], Generate]


def trim(rows: np.ndarray, eos: tuple[int, ...], skip_first: bool = True) -> list[list[int]]:
    """(batch, len) ids from a `generate` -> each row's new tokens up to and including its first EOS."""
    out = []
    for row in rows.tolist():
        row = row[1:] if skip_first else row
        for i, t in enumerate(row):
            if t in eos:
                row = row[: i + 1]
                break
        out.append(row)
    return out


def _eos(settings: dict) -> tuple[int, ...]:
    return tuple(settings.get("eos", (1,)))


# ---------------------------------------------------------------- PyTorch and the Hugging Face style `generate`s
def hf_generate(model, threads: int, settings: dict, extra: dict | None = None) -> Generate:
    """transformers' `generate` around `model`; torch pinned to `threads` too, for every engine that uses it: its
    search and logits processing run torch ops, and unpinned torch threads fight the engine's own for the cores
    (measured: optimum at batch 8, 3.3 s per call unpinned, 1.2 s pinned, on 2 busy cores)."""
    import torch

    torch.set_num_threads(threads)
    eos = _eos(settings)

    def generate(ids, mask, max_new, min_new, beams):
        with torch.inference_mode():
            out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 max_new_tokens=max_new, min_new_tokens=min_new, num_beams=beams, do_sample=False,
                                 **(extra or {}))
        return trim(out.numpy(), eos)
    return generate


def load_pytorch(path: Path, threads: int, settings: dict) -> Generate:
    from t5compress.model.load import load_model
    from t5compress.train.evaluation import generate_kwargs

    model = load_model(path)  # generate_kwargs: a dynamic_full cache, el2's decoder depth differs from its encoder's
    return hf_generate(model, threads, settings, generate_kwargs(model))


# ---------------------------------------------------------------- ours (ONNX Runtime or TorchScript graphs)
def load_ours(path: Path, threads: int, settings: dict) -> Generate:
    import logging

    from t5compress.runtime import load_runtime

    logging.basicConfig(format="%(name)s: %(message)s")  # the worker's stderr: the variant's log
    rt = load_runtime(path, threads=threads, max_input_tokens=None, device=settings.get("device", "cpu"))
    eos = _eos(settings)

    def generate(ids, mask, max_new, min_new, beams):
        return trim(rt.generate(ids, mask, max_new_tokens=max_new, min_new_tokens=min_new, num_beams=beams), eos)
    return generate


# ---------------------------------------------------------------- optimum (ONNX Runtime)
def load_optimum(path: Path, threads: int, settings: dict) -> Generate:
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    from t5compress.runtime.threads import pool_entries

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    for key, value in pool_entries(threads).items():  # fair: the thread-pool settings ours use
        so.add_session_config_entry(key, value)
    model = ORTModelForSeq2SeqLM.from_pretrained(path, use_merged=False, use_cache=True, session_options=so)
    return hf_generate(model, threads, settings)


# ---------------------------------------------------------------- CTranslate2
def load_ctranslate2(path: Path, threads: int, settings: dict) -> Generate:
    import ctranslate2

    compute = settings.get("compute_type", "int8")
    tr = ctranslate2.Translator(str(path), device="cpu", compute_type=compute, inter_threads=1, intra_threads=threads)
    vocab = _ct2_vocab(path)
    index = {tok: i for i, tok in enumerate(vocab)}
    eos = _eos(settings)

    def generate(ids, mask, max_new, min_new, beams):
        tokens = [[vocab[i] for i in row[m.astype(bool)].tolist()] for row, m in zip(ids, mask, strict=True)]
        res = tr.translate_batch(tokens, beam_size=beams, num_hypotheses=1, max_decoding_length=max_new,
                                 min_decoding_length=min_new, max_batch_size=0, return_end_token=True)
        rows = [[index[t] for t in r.hypotheses[0]] for r in res]
        return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]
    return generate


def _ct2_vocab(path: Path) -> list[str]:
    for name in ("shared_vocabulary.json", "source_vocabulary.json"):
        if (path / name).is_file():
            return json.loads((path / name).read_text())
    for name in ("shared_vocabulary.txt", "source_vocabulary.txt"):
        if (path / name).is_file():
            return (path / name).read_text(encoding="utf-8").split("\n")
    raise FileNotFoundError(f"no vocabulary file in {path}")


# ---------------------------------------------------------------- OpenVINO (optimum-intel)
def load_openvino(path: Path, threads: int, settings: dict) -> Generate:
    from optimum.intel import OVModelForSeq2SeqLM

    ov_config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": ""}
    if "INFERENCE_PRECISION_HINT" in settings:  # the fp32 peer: f32 arithmetic, not the CPU's bf16 default
        ov_config["INFERENCE_PRECISION_HINT"] = settings["INFERENCE_PRECISION_HINT"]
    return hf_generate(OVModelForSeq2SeqLM.from_pretrained(path, ov_config=ov_config), threads, settings)


# ---------------------------------------------------------------- a model served by Triton (text in, ids out)
def load_triton(path: Path, threads: int, settings: dict) -> Generate:
    """Requests to a served text model: the ids decoded to text with the bench's tokenizer, one request per call
    with the generation settings as inputs; its OUTPUT_IDS are the new tokens. `threads` is the server's business."""
    from t5compress.runtime.text import load_text_tokenizer
    from t5compress.triton.client import connect, inputs
    from t5compress.triton.repository import BATCH_PARAM

    tok = load_text_tokenizer(Path(settings["tokenizer"]))
    protocol, model = settings["protocol"], settings["model"]
    client = connect(settings["host"], protocol)
    eos = _eos(settings)
    config = client.get_model_config(model, **({"as_json": True} if protocol == "grpc" else {}))
    config = config.get("config", config)
    # The text model's real limit is a parameter (its declared max_batch_size lets an oversized request reach it).
    limit = config.get("parameters", {}).get(BATCH_PARAM, {}).get("string_value")
    most = int(limit or config.get("max_batch_size") or 1)  # a larger batch is split into requests

    def generate(ids, mask, max_new, min_new, beams):
        texts = tok.decode([row[m.astype(bool)].tolist() for row, m in zip(ids, mask, strict=True)])
        out = []
        for i in range(0, len(texts), most):
            result = client.infer(model, inputs(protocol, texts[i:i + most], max_new_tokens=max_new,
                                                min_new_tokens=min_new, num_beams=beams))
            out += trim(result.as_numpy("OUTPUT_IDS")[:, 0, :], eos)  # (texts, 1 sequence, start + new tokens)
        return out
    return generate


LOADERS: dict[str, Loader] = {
    "pytorch": load_pytorch, "onnx": load_ours, "torchscript": load_ours, "optimum": load_optimum,
    "ctranslate2": load_ctranslate2, "openvino": load_openvino, "triton": load_triton,
}
