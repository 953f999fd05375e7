"""The `create` stage: a new, randomly initialised T5 of a named architecture, with a tokenizer, as a model dir."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.data import DataConfig, load_examples
from t5compress.model.architectures import check_overrides
from t5compress.model.load import create_model, describe, save_model_dir
from t5compress.model.tokenization import TOKENIZERS, new_tokenizer


@dataclass(frozen=True)
class CreateConfig:
    arch: str = option("t5-efficient-tiny", "Architecture: t5-small, flan-t5-small, t5-efficient-small-el2, ...")
    tokenizer: str = option("unigram", "New tokenizer: unigram (SentencePiece, trained on --text) or byte.")
    text: str | None = option(None, "Text to train the unigram tokenizer on (a data file; sources and targets).")
    vocab_size: int = option(8000, "Upper bound on unigram pieces (fewer are kept when the text is small).")
    overrides: dict[str, Any] = field(default_factory=dict, metadata={"help": "T5Config fields to override."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "How --text records are read."})
    seed: int = option(0, "Seed of the random initialisation.")

    def __post_init__(self) -> None:
        require(self.tokenizer in TOKENIZERS, "tokenizer", f"choose one of {', '.join(TOKENIZERS)}")
        require(self.tokenizer != "unigram" or bool(self.text), "text", "a unigram tokenizer needs --text to train on")
        require(self.vocab_size > 8, "vocab_size", "must be > 8")
        check_overrides(self.overrides, self.overrides)  # a recipe's --dry-run refuses d_model: abc too


def run(src: str | None, cfg: CreateConfig, out: str | Path, *, force: bool = False,
        progress: bool = True) -> artifacts.Report:
    """Build the tokenizer and the model of architecture `src` (None: `cfg.arch`), and write them as a Hugging Face
    model directory. `create` reads no directory: its source is the architecture's name."""
    from t5compress.model.architectures import architecture

    if src is not None and src != cfg.arch:
        cfg = dataclasses.replace(cfg, arch=src)

    with artifacts.envelope("create", None, cfg, out, force=force, inputs=[cfg]) as env:
        architecture(cfg.arch, cfg.overrides)  # fail on a bad name before training a tokenizer
        texts: list[str] = []
        if cfg.text:
            for ex in load_examples(cfg.text, cfg.data):
                texts += [cfg.data.prefix + ex.source, ex.target]
        tokenizer = new_tokenizer(cfg.tokenizer, texts, vocab_size=cfg.vocab_size)
        vocab = len(tokenizer)
        vocab = (vocab + 127) // 128 * 128 if cfg.tokenizer == "unigram" else vocab  # T5 pads to a multiple of 128
        vocab = cfg.overrides.get("vocab_size", vocab)
        require(vocab >= len(tokenizer), "overrides", f"vocab_size must be >= {len(tokenizer)} tokens")
        model = create_model(cfg.arch, vocab, cfg.overrides, seed=cfg.seed)
        tok_info = {"kind": cfg.tokenizer, "size": len(tokenizer)}
        report = {"stage": "create", "model": describe(model), "tokenizer": tok_info}
        return env.write(report, lambda tmp: save_model_dir(model, tokenizer, tmp))
