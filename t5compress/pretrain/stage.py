"""The `pretrain` stage: T5 span-corruption pre-training of a new model, or continued pre-training of a checkpoint.

The pipeline, as in nanoT5: stream documents -> (new model: train a SentencePiece tokenizer on them) -> tokenize ->
pack into blocks of `tokens_length` -> corrupt spans (inputs exactly `inputs_length`, no padding) -> the shared
trainer (AdamW with RMS-scaled steps, cosine schedule with warm-up, gradient accumulation, bf16 / torch.compile
where asked, resumable checkpoints, periodic held-out span-corruption loss) -> a plain model directory.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.model.architectures import check_overrides
from t5compress.model.load import describe, is_local, save_model_dir
from t5compress.model.tokenization import TOKENIZERS
from t5compress.pretrain.corpus import Corpus
from t5compress.pretrain.spans import SpanCorruption, compute_input_and_target_lengths
from t5compress.train.loop import TrainConfig, fit

log = logging.getLogger(__name__)

# nanoT5's choices (batch 128 x 512 inputs, AdamW with RMS-scaled steps at 2e-2, cosine with 10k warm-up steps).
NANOT5 = TrainConfig(max_steps=65536, batch_size=128, optimizer="adamwscale", lr=2e-2, warmup_steps=10000,
                     schedule="cosine", eval_every=1000, eval_max_examples=256, eval_batch_size=32, metric="loss",
                     max_grad_norm=1.0)


@dataclass(frozen=True)
class PretrainConfig:
    model: str = option("t5-efficient-tiny", "Architecture of a new model (e.g. t5-efficient-small-el2), or a model "
                        "directory / hub id to continue pre-training.")
    overrides: dict[str, Any] = field(default_factory=dict, metadata={"help": "T5Config fields of a new model."})
    tokenizer: str = option("unigram", "Tokenizer of a new model: unigram (SentencePiece trained on the corpus) or "
                            "byte.")
    vocab_size: int = option(32000, "Upper bound on unigram pieces (fewer are kept when the corpus is small).")
    tokenizer_docs: int = option(100_000, "Documents read to train the unigram tokenizer.")
    text_field: str = option("text", "Field holding the text in JSON Lines records and datasets.")
    hf_split: str = option("train", "Split of a datasets folder or Hugging Face dataset.")
    hf_config: str | None = option(None, "Configuration of a Hub dataset that has several (e.g. 'en' of c4).")
    holdout_every: int = option(50, "Every Nth document is held out for the evaluation loss.")
    inputs_length: int = option(512, "Tokens per corrupted input; packed blocks are longer (568 for 512).")
    noise_density: float = option(0.15, "Share of tokens corrupted.")
    mean_noise_span_length: float = option(3.0, "Mean length of a corrupted span.")
    dropout: float = option(0.0, "Dropout while pre-training (nanoT5: none); the saved config keeps its own rate.")
    shuffle_buffer: int = option(1000, "Packed blocks held in the streaming shuffle buffer.")
    train: TrainConfig = field(default_factory=lambda: NANOT5, metadata={"help": "Optimisation settings."})
    seed: int = option(0, "Seed of the initialisation, the shuffle and the span masks.")

    def __post_init__(self) -> None:
        require(bool(self.model), "model", "give an architecture name or a model directory")
        require(self.tokenizer in TOKENIZERS, "tokenizer", f"choose one of {', '.join(TOKENIZERS)}")
        require(self.vocab_size > 8, "vocab_size", "must be > 8")
        require(self.tokenizer_docs > 0, "tokenizer_docs", "must be > 0")
        require(bool(self.text_field), "text_field", "must not be empty")
        require(self.holdout_every >= 2, "holdout_every", "must be >= 2")
        require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        check_overrides(self.overrides, self.overrides)
        require(self.shuffle_buffer >= 1, "shuffle_buffer", "must be >= 1")
        require(self.train.max_steps > 0, "max_steps", "a streamed corpus has no epochs; must be > 0")
        require(self.train.metric == "loss", "metric", "pre-training evaluates the held-out loss only; use loss")
        compute_input_and_target_lengths(self.inputs_length, self.noise_density, self.mean_noise_span_length)

    @property
    def is_new(self) -> bool:
        """A new model (architecture name) rather than a checkpoint to continue from."""
        return not is_local(self.model) and "/" not in self.model


def corpus_of(src: str | Path, cfg: PretrainConfig) -> Corpus:
    return Corpus(str(src), cfg.text_field, cfg.hf_split, cfg.hf_config, cfg.holdout_every)


def new_model(corpus: Corpus, cfg: PretrainConfig):
    """A tokenizer trained on the corpus's training documents (unigram) or bytes, and a fresh model of `cfg.model`."""
    from t5compress.model.architectures import architecture
    from t5compress.model.load import create_model
    from t5compress.model.tokenization import new_tokenizer

    architecture(cfg.model, cfg.overrides)  # fail on a bad name before reading the corpus
    texts = itertools.islice(corpus.split(train=True), cfg.tokenizer_docs)
    tokenizer = new_tokenizer(cfg.tokenizer, list(texts) if cfg.tokenizer == "unigram" else (), cfg.vocab_size)
    vocab = len(tokenizer)
    vocab = (vocab + 127) // 128 * 128 if cfg.tokenizer == "unigram" else vocab  # T5 pads to a multiple of 128
    vocab = cfg.overrides.get("vocab_size", vocab)
    require(vocab >= len(tokenizer), "overrides", f"vocab_size must be >= {len(tokenizer)} tokens")
    return create_model(cfg.model, vocab, cfg.overrides, seed=cfg.seed), tokenizer


def _model_and_tokenizer(corpus: Corpus, cfg: PretrainConfig, work: Path, resume: bool):
    """New model: built once, its tokenizer kept in the work dir so a resumed run tokenizes the same way."""
    from t5compress.model.load import create_model, load_model, load_tokenizer
    from t5compress.runtime.limits import check_model_fits

    if not cfg.is_new:
        check_model_fits("pretrain", cfg.model)
        return load_model(cfg.model), load_tokenizer(cfg.model)
    if resume and (work / "tokenizer").is_dir():
        tokenizer = load_tokenizer(work / "tokenizer")
        vocab = artifacts.read_json(work / "tokenizer" / "vocab.json")["vocab_size"]
        return create_model(cfg.model, vocab, cfg.overrides, seed=cfg.seed), tokenizer
    model, tokenizer = new_model(corpus, cfg)
    tokenizer.save_pretrained(work / "tokenizer")
    artifacts.write_json(work / "tokenizer" / "vocab.json", {"vocab_size": model.config.vocab_size})
    return model, tokenizer


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 autocast trains ~1.5-2x faster;
    elsewhere bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _resolved(train: TrainConfig) -> TrainConfig:
    """nanoT5 trains in bf16 where the hardware has it: `auto` also means bf16 on CPUs with native bf16."""
    import torch

    if train.precision == "auto" and not torch.cuda.is_available() and native_bf16_cpu():
        return dataclasses.replace(train, precision="bf16")
    return train


def _set_dropout(model, p: float) -> float:
    """Set every dropout module's rate (the config keeps its own value for fine-tuning); returns the old rate."""
    import torch

    old = model.config.dropout_rate
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
    return old


def run(
    src: str | Path, cfg: PretrainConfig, out: str | Path, *, force: bool = False, progress: bool = True,
    resume: bool = False, on_step=None,
) -> artifacts.Report:
    """Pre-train on the corpus `src` (file, folder or dataset) and write the model directory `out`; the report."""
    from t5compress.model.architectures import architecture
    from t5compress.pretrain.stream import PackedStream, SpanEval, span_loss  # torch: not for the CLI's start
    from t5compress.train.checkpoint import prepare_workdir

    record = {"corpus": str(src), **dataclasses.asdict(cfg)}
    parent = None if cfg.is_new else cfg.model
    with artifacts.envelope("pretrain", src, cfg, out, force=force, record=record, parent=parent) as env:
        corpus = corpus_of(src, cfg)
        next(iter(corpus.documents()))  # fail on a missing, empty or malformed corpus before any other work
        if cfg.is_new:
            architecture(cfg.model, cfg.overrides)  # a bad name fails before anything is written
        work = prepare_workdir(env.out, cfg, force, resume)
        try:
            model, tokenizer = _model_and_tokenizer(corpus, cfg, work, resume)
            collator = SpanCorruption.for_tokenizer(tokenizer, inputs_length=cfg.inputs_length,
                                                    noise_density=cfg.noise_density,
                                                    mean_noise_span_length=cfg.mean_noise_span_length)
            evalset = SpanEval.build(corpus, tokenizer, collator, cfg.train.eval_max_examples,
                                     cfg.train.eval_batch_size, seed=cfg.seed)
            before = artifacts.read_json(work / "eval_before.json")
            if before is None:
                before = evalset.evaluate(model)
                artifacts.write_json(work / "eval_before.json", before)
        except BaseException:
            if not resume:  # nothing trained yet: leave no work dir that a rerun would have to --force away
                shutil.rmtree(work, ignore_errors=True)
            raise
        stream = PackedStream(corpus, tokenizer, collator, cfg.train.batch_size, seed=cfg.seed,
                              shuffle_buffer=cfg.shuffle_buffer)
        saved_rate = _set_dropout(model, cfg.dropout)
        train = _resolved(cfg.train)
        summary = fit(model, tokenizer, stream, evalset, train, work, resume, loss_fn=span_loss, progress=progress,
                      on_step=on_step, label="pretrain", lower_with="--batch-size, --inputs-length, --max-steps")
        _set_dropout(model, saved_rate)
        from t5compress.train.checkpoint import load_best

        best = load_best(work, model)
        after = evalset.evaluate(model)
        report = {
            "stage": "pretrain",
            "model": describe(model),
            "corpus": {"source": str(src), "held_out_examples": evalset.examples, "holdout_every": cfg.holdout_every},
            "objective": {"inputs_length": cfg.inputs_length, "tokens_length": collator.tokens_length,
                          "targets_length": collator.targets_length, "noise_density": cfg.noise_density,
                          "mean_noise_span_length": cfg.mean_noise_span_length},
            "tokens_trained": summary["steps"] * cfg.train.batch_size * cfg.train.grad_accum
            * (cfg.inputs_length + collator.targets_length),
            "eval_before": before,
            "eval": {**after, "step": (best or {}).get("step", summary["steps"])},
            "train": {**summary, "precision": train.precision},
        }
        env.write(report, lambda tmp: save_model_dir(model, tokenizer, tmp))
        shutil.rmtree(work, ignore_errors=True)
        return report
