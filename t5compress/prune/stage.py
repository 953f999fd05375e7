"""The prune stage: score units on calibration data, remove the least important, optionally recover; write a dir.

    run(src, PruneConfig(calib_data=..., heads=0.5, ffn=0.5), out) -> report

    run(src, PruneConfig(vocab="task.jsonl"), out)   # keep only the pieces the task's texts use

The report (report.json) gives parameters, bytes and PyTorch generation latency before and after, and the task
metric before pruning, right after it, and after recovery (when `recover` is set); with `vocab`, its `vocab` section
gives the pieces kept, the sizes around the trim and the share of the data's tokens segmented differently.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from t5compress import artifacts
from t5compress.config import choose, option, require
from t5compress.data import DataConfig, batch_order, collate, encode, load_splits
from t5compress.errors import ConfigError
from t5compress.prune.recover import RecoverConfig

if TYPE_CHECKING:
    from t5compress.prune.schedule import Targets

log = logging.getLogger(__name__)


def _ratio(value: float | None, name: str) -> None:
    require(value is None or 0 <= value < 1, name, f"must be in [0, 1), got {value}")


@dataclass(frozen=True)
class PruneConfig:
    calib_data: str | None = option(None, "Calibration data (any format `train` reads); a held-out share measures "
                                          "the metric (default: the --vocab data).")
    eval_data: str | None = option(None, "Data the task metric is measured on; default: held out of calib data.")
    heads: float = option(0.0, "Share of attention heads removed (self and cross), in [0, 1).")
    encoder_heads: float | None = option(None, "Share of encoder self-attention heads removed (default: --heads).")
    decoder_heads: float | None = option(None, "Share of decoder self-attention heads removed (default: --heads).")
    cross_heads: float | None = option(None, "Share of cross-attention heads removed (default: --decoder-heads).")
    ffn: float = option(0.0, "Share of FFN channels removed, in [0, 1).")
    encoder_ffn: float | None = option(None, "Share of encoder FFN channels removed (default: --ffn).")
    decoder_ffn: float | None = option(None, "Share of decoder FFN channels removed (default: --ffn).")
    encoder_layers: int | None = option(None, "Encoder blocks to keep, the most important (default: all).")
    decoder_layers: int | None = option(None, "Decoder blocks to keep, the most important (default: all).")
    criterion: str = option("taylor", "Importance: taylor (head-mask gradient), activation or magnitude.")
    schedule: str = option("uniform", "uniform (same size in every layer, plain HF dir) or global (ranked across "
                                      "layers; per-layer sizes recorded for t5compress).")
    calib_examples: int = option(256, "Calibration examples used for scoring.")
    calib_batch_size: int = option(16, "Calibration batch size.")
    eval_max_examples: int = option(200, "Examples the task metric is measured on.")
    latency_examples: int = option(5, "Examples timed with PyTorch generate at batch 1 (0: skip latency).")
    latency_new_tokens: int = option(16, "Tokens generated per timed example.")
    vocab: str | None = option(None, "Trim the vocabulary to the pieces this data's sources and targets use (any "
                                     "format `train` reads), plus special and single-character pieces.")
    vocab_size: int | None = option(None, "Keep exactly this many pieces: the mandatory ones, then the most frequent "
                                          "in --vocab data (may change its segmentation).")
    vocab_keep: str | None = option(None, "File of pieces kept whatever the data, one per line (as the tokenizer "
                                          "spells them, e.g. ▁word).")
    vocab_keep_sentinels: bool = option(False, "Keep all <extra_id_*> sentinels, not only those --vocab data uses "
                                               "(for further span-corruption training).")
    data: DataConfig = dataclasses.field(default_factory=DataConfig, metadata={"help": "How records are read."})
    recover: RecoverConfig | None = dataclasses.field(
        default=None, metadata={"help": "Recovery fine-tuning after pruning (None: none)."})

    def __post_init__(self) -> None:
        from t5compress.prune.importance import SCORES  # torch: here, not when the CLI starts
        from t5compress.prune.schedule import SCHEDULES

        for name in ("heads", "encoder_heads", "decoder_heads", "cross_heads", "ffn", "encoder_ffn", "decoder_ffn"):
            _ratio(getattr(self, name), name)
        for name in ("encoder_layers", "decoder_layers"):
            value = getattr(self, name)
            require(value is None or value >= 1, name, f"must keep at least 1 layer, got {value}")
        choose(SCORES, self.criterion, "importance criterion")
        choose(SCHEDULES, self.schedule, "schedule")
        require(self.calib_examples >= 1, "calib_examples", "must be >= 1")
        require(self.calib_batch_size >= 1, "calib_batch_size", "must be >= 1")
        require(self.eval_max_examples >= 1, "eval_max_examples", "must be >= 1")
        require(self.latency_examples >= 0, "latency_examples", "must be >= 0")
        require(self.latency_new_tokens >= 1, "latency_new_tokens", "must be >= 1")
        require(bool(self.calib_data or self.vocab), "calib_data", "give calibration data, or --vocab data to trim "
                                                                   "the vocabulary only")
        for name in ("vocab_size", "vocab_keep", "vocab_keep_sentinels"):
            require(not getattr(self, name) or bool(self.vocab), name, "needs --vocab data")
        require(self.vocab_size is None or self.vocab_size >= 1, "vocab_size", "must be >= 1")

    @property
    def structural(self) -> bool:
        """Whether heads, FFN channels or layers are pruned (without --vocab, the stage always scores and plans)."""
        ratios = self.targets().ratios.values()
        return any(ratios) or self.encoder_layers is not None or self.decoder_layers is not None or not self.vocab

    def targets(self) -> Targets:
        from t5compress.prune.schedule import Targets

        pick = lambda v, default: default if v is None else v  # noqa: E731
        dec_heads = pick(self.decoder_heads, self.heads)
        ratios = {"encoder.heads": pick(self.encoder_heads, self.heads), "decoder.heads": dec_heads,
                  "decoder.cross": pick(self.cross_heads, dec_heads), "encoder.ffn": pick(self.encoder_ffn, self.ffn),
                  "decoder.ffn": pick(self.decoder_ffn, self.ffn)}
        return Targets(ratios, self.encoder_layers, self.decoder_layers)


def calibration_batches(model, tokenizer, examples, cfg: PruneConfig) -> list[dict]:
    enc = encode(examples[: cfg.calib_examples], tokenizer, cfg.data)
    lengths = [len(x) for x in enc.input_ids]
    device = next(model.parameters()).device
    order = batch_order(lengths, cfg.calib_batch_size, seed=0, epoch=0, bucket=True, shuffle=False)
    return [{k: v.to(device) for k, v in collate(enc, idx, tokenizer.pad_token_id).items()} for idx in order]


def _snapshot(model, tokenizer, eval_ex, cfg: PruneConfig) -> dict:
    from t5compress.prune import measure

    return {**measure.size(model), "eval": measure.measure_eval(model, tokenizer, eval_ex, cfg.data)}


def _prune(model, tokenizer, calib_ex, cfg: PruneConfig, targets, progress: bool):
    """Score the units on the calibration batches, plan what to keep, and shrink `model` in place; the plan."""
    from t5compress.progress import Reporter
    from t5compress.prune import schedule
    from t5compress.prune.importance import SCORES

    batches = calibration_batches(model, tokenizer, calib_ex, cfg)
    with Reporter("prune", len(batches), unit="batch", what=f"scoring ({cfg.criterion})", enabled=progress,
                  transient=True) as bar:
        scores = SCORES[cfg.criterion](model, bar.track(batches))
    plan = schedule.SCHEDULES[cfg.schedule](model, scores, targets)
    schedule.apply_plan(model, plan)
    return plan


def _vocab_plan(tokenizer, cfg: PruneConfig) -> dict:
    """Read the --vocab data and choose the ids to keep, before any heavy work, so that bad input fails first."""
    from t5compress.data import load_examples
    from t5compress.prune import vocab

    vocab.check_trimmable(tokenizer)
    examples = load_examples(cfg.vocab, cfg.data)
    keep_pieces = _read_pieces(cfg.vocab_keep) if cfg.vocab_keep else []
    counts = vocab.pieces_used(tokenizer, examples, cfg.data.prefix)
    mandatory = vocab.mandatory_ids(tokenizer, sentinels=cfg.vocab_keep_sentinels, keep_pieces=keep_pieces)
    keep = vocab.plan_vocab(tokenizer, counts, mandatory, cfg.vocab_size)
    reasons = {"used_by_data": len(set(keep) & set(counts)), **{k: len(v) for k, v in mandatory.items()}}
    return {"examples": examples, "keep": keep, "reasons": reasons}


def _read_pieces(path: str) -> list[str]:
    """The pieces of a --vocab-keep file, one a line (blank lines skipped)."""
    from t5compress.textio import read_lines

    return [text.strip() for _, text in read_lines(path, "--vocab-keep file") if text.strip()]


def _trim_vocab(model, tokenizer, job: dict, cfg: PruneConfig):
    """Trim `model` in place to the ids `job` keeps; the new tokenizer and the report's `vocab` section."""
    from t5compress.prune import measure, vocab

    before = {"pieces": len(tokenizer), **measure.size(model)}
    model, trimmed, _ = vocab.trim_vocab(model, tokenizer, job["keep"])
    after = {"pieces": len(trimmed), **measure.size(model)}
    seg = vocab.segmentation_changed(tokenizer, trimmed, vocab.task_texts(job["examples"], cfg.data.prefix))
    if seg["changed"]:
        log.warning("%d of %d tokens of the --vocab data are segmented differently after trimming", seg["changed"],
                    seg["tokens"])
    return trimmed, {"data": cfg.vocab, "vocab_size": cfg.vocab_size, "sentinels": cfg.vocab_keep_sentinels,
                     "kept": job["reasons"], "before": before, "after": after, "segmentation_changed": seg}


def run(src: str | os.PathLike, cfg: PruneConfig, out: str | os.PathLike, *, force: bool = False,
        progress: bool = True, resume: bool = False, on_step=None) -> artifacts.Report:
    """Prune `src` into `out` as `cfg` says (recovering when `cfg.recover`); returns the report."""
    from t5compress.model import layout, units
    from t5compress.model.load import describe, load_model, load_tokenizer, save_model_dir
    from t5compress.prune import measure, schedule
    from t5compress.runtime.limits import check_model_fits

    if resume and cfg.recover is None:
        raise ConfigError("resume: only a recovery can be resumed; give the same --recover-data as the first run")
    with artifacts.envelope("prune", src, cfg, out, force=force) as env:
        check_model_fits("prune", src)
        model, tokenizer = load_model(src), load_tokenizer(src)
        job = _vocab_plan(tokenizer, cfg) if cfg.vocab else None
        calib_ex, eval_ex, data_stats = load_splits(cfg.calib_data or cfg.vocab, cfg.eval_data, cfg.data)
        eval_ex = eval_ex[: cfg.eval_max_examples]
        targets = cfg.targets()
        if cfg.structural:
            from t5compress.prune.importance import magnitude

            # rejects impossible ratios before heavy work
            schedule.SCHEDULES[cfg.schedule](model, magnitude(model), targets)
        work = None
        if cfg.recover is not None:
            from t5compress.train.checkpoint import prepare_workdir

            work = prepare_workdir(env.out, cfg, force, resume)
        before = _snapshot(model, tokenizer, eval_ex, cfg)
        unpruned = copy.deepcopy(model) if cfg.latency_examples or (cfg.recover and cfg.recover.distill) else None
        plan = _prune(model, tokenizer, calib_ex, cfg, targets, progress) if cfg.structural else None
        untrimmed, vocab_report = tokenizer, None
        if job is not None:
            tokenizer, vocab_report = _trim_vocab(model, tokenizer, job, cfg)
        pruned = _snapshot(model, tokenizer, eval_ex, cfg)
        before["latency_ms"], pruned["latency_ms"] = measure.latency_ms(
            [unpruned, model], [untrimmed, tokenizer], eval_ex[: cfg.latency_examples], cfg.data,
            cfg.latency_new_tokens)
        log.info("pruned: %d -> %d parameters", before["parameters"], pruned["parameters"])
        report = {
            "stage": "prune", "criterion": cfg.criterion, "schedule": cfg.schedule, "targets": targets.ratios,
            "plain": units.is_plain(model), "kept": plan and schedule.summary(plan), "model": describe(model),
            "data": data_stats, "before": before, "after_pruning": pruned, "after_recovery": None, "recovery": None,
            "vocab": vocab_report,
        }
        if cfg.recover is not None:
            from t5compress.prune.recover import recover_model

            teacher = _teacher(unpruned, untrimmed, job) if cfg.recover.distill else None
            report["recovery"] = recover_model(model, tokenizer, teacher, cfg.recover, work, resume, progress, on_step)
            report["after_recovery"] = {**pruned, **_snapshot(model, tokenizer, eval_ex, cfg)}  # same shapes
        report["eval"] = (report["after_recovery"] or pruned)["eval"]  # what `t5compress info` shows
        report["seconds"] = env.seconds()
        if not report["plain"]:
            report["layout"] = layout.layout_of(model)
        env.write(report, lambda tmp: save_model_dir(model, tokenizer, tmp))
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        return report


def _teacher(unpruned, tokenizer, job: dict | None):
    """The distillation teacher: the unpruned model, its vocabulary trimmed like the student's so logits align."""
    if job is None:
        return unpruned
    from t5compress.prune.vocab import trim_vocab

    return trim_vocab(unpruned, tokenizer, job["keep"])[0]
