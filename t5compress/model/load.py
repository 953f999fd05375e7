"""Loading T5-family checkpoints (local directories or hub ids), creating new ones, and saving model directories.

Safety: weights are read from safetensors only, `trust_remote_code` is never passed, and nothing calls
`torch.load` without `weights_only=True`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from t5compress.errors import ModelError, first_line, hub_reachable
from t5compress.kinds import WEIGHTS
from t5compress.model.weights import read_bytes, weight_headers

log = logging.getLogger(__name__)

T5_MODEL_TYPES = ("t5", "mt5", "umt5")


def check_model_dir(path: str | os.PathLike) -> Path:
    """Raise a one-line ModelError unless `path` is a local T5 model directory with safetensors weights."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"'{p}' is not a directory")
    if not (p / "config.json").is_file():
        raise ModelError(f"'{p}' has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(read_bytes(p / "config.json"))
    except ValueError as e:
        raise ModelError(f"'{p / 'config.json'}' is not valid JSON: {first_line(e)}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in T5_MODEL_TYPES:
        families = ", ".join(T5_MODEL_TYPES)
        raise ModelError(f"'{p}' holds a {model_type!r} model; t5compress works on T5-family models ({families})")
    if not any((p / f).is_file() for f in WEIGHTS):
        if (p / "pytorch_model.bin").is_file():
            raise ModelError(
                f"'{p}' has only pytorch_model.bin; t5compress loads safetensors only "
                "(convert with model.save_pretrained(dir, safe_serialization=True))"
            )
        raise ModelError(f"'{p}' has no model.safetensors: no weights to load")
    weight_headers(p)  # a truncated or foreign weights file is named here, not as a traceback from the loader
    return p


def is_local(src: str | os.PathLike) -> bool:
    s = str(src)
    return Path(s).exists() or s.startswith((".", "/", "~")) or os.sep + os.sep in s


def load_model(src: str | os.PathLike, dtype: Any = None):
    """Load a T5ForConditionalGeneration from a local directory or a hub id (safetensors only)."""
    from transformers import T5ForConditionalGeneration

    if is_local(src):
        check_model_dir(src)
        from t5compress.model.layout import has_layout, load_pruned

        if has_layout(src):  # per-layer sizes after non-uniform pruning: built here, not by from_pretrained
            return load_pruned(src, dtype)
        kwargs: dict[str, Any] = {}
    else:
        kwargs = _hub_kwargs(str(src))
    from safetensors import SafetensorError

    try:
        model = T5ForConditionalGeneration.from_pretrained(str(src), use_safetensors=True, dtype=dtype, **kwargs)
    except SafetensorError as e:  # the header passed check_model_dir, the tensor data did not
        raise ModelError(f"model.safetensors in '{src}' is damaged or not a safetensors file: {first_line(e)}") from e
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: weights of other shapes than config.json says
        raise ModelError(f"cannot load model {str(src)!r}: {first_line(e)}") from e
    model.eval()
    return model


# What AutoTokenizer can build a T5 tokenizer from: a fast tokenizer's file, a SentencePiece model, or (ByT5) nothing
# but a tokenizer_config.json naming the byte tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
BYTE_TOKENIZER_CLASSES = ("ByT5Tokenizer",)


def load_tokenizer(src: str | os.PathLike):
    """Load the tokenizer that travels with a model directory or hub checkpoint (a fast one when possible).

    The one place a model dir's tokenizer is loaded: a dir without tokenizer files, or with damaged ones, is a
    one-line ModelError saying which files were looked for.
    """
    from transformers import AutoTokenizer

    local = is_local(src)
    if local:
        _check_tokenizer_files(Path(src))
    kwargs = {} if local else _hub_kwargs(str(src))
    try:
        return AutoTokenizer.from_pretrained(str(src), **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers, sentencepiece and tokenizers (Rust) raise all kinds
        raise ModelError(f"cannot load the tokenizer of {str(src)!r}: {first_line(e)}") from e


def _check_tokenizer_files(p: Path) -> None:
    if any((p / f).is_file() for f in TOKENIZER_FILES):
        return
    config = p / "tokenizer_config.json"
    try:
        cls = json.loads(read_bytes(config)).get("tokenizer_class") if config.is_file() else None
    except (ValueError, AttributeError):
        raise ModelError(f"'{config}' is not a JSON object: the tokenizer cannot be loaded") from None
    if cls in BYTE_TOKENIZER_CLASSES:
        return
    looked = f"{' and '.join(TOKENIZER_FILES)}, or a tokenizer_config.json naming {'/'.join(BYTE_TOKENIZER_CLASSES)}"
    raise ModelError(f"'{p}' has no tokenizer: looked for {looked}; copy the tokenizer files of its model")


def _hub_kwargs(repo_id: str) -> dict[str, Any]:
    """Prefer the local cache; with no network and no cache, fail with one line instead of retries."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return {"local_files_only": True}
    if not hub_reachable():
        raise ModelError(
            f"{repo_id!r} is not a local directory and the Hugging Face Hub cannot be reached (no network); "
            "pass a local model directory"
        )
    return {}


def create_model(arch: str, vocab_size: int, overrides: dict[str, Any] | None = None, seed: int = 0):
    """A new, randomly initialised T5 of a named architecture (see `t5compress.model.architectures`)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from t5compress.model.architectures import architecture

    kwargs = architecture(arch, overrides)
    kwargs.setdefault("vocab_size", vocab_size)
    config = T5Config(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **kwargs)
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(config).eval()


def count_parameters(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_model_dir(model, tokenizer, out: Path) -> None:
    """Write a plain Hugging Face model directory: config, safetensors weights, generation config, tokenizer."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_model_config(model.config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if not (out / "tokenizer.json").is_file():
        log.warning("tokenizer %s has no fast version; %s has no tokenizer.json", type(tokenizer).__name__, out)


def describe(model) -> dict[str, Any]:
    """Architecture summary used in reports and by `t5compress info`."""
    c = model.config
    return {
        "model_type": c.model_type,
        "parameters": count_parameters(model),
        "encoder_layers": c.num_layers,
        "decoder_layers": c.num_decoder_layers,
        "d_model": c.d_model,
        "d_ff": c.d_ff,
        "d_kv": c.d_kv,
        "num_heads": c.num_heads,
        "feed_forward_proj": c.feed_forward_proj,
        "tie_word_embeddings": c.tie_word_embeddings,
        "vocab_size": c.vocab_size,
    }
