"""The prune stage: score units on calibration data, remove the least important, optionally recover; write a dir.

    run(src, PruneConfig(calib_data=..., heads=0.5, ffn=0.5), out) -> report

The report (report.json) gives parameters, bytes and PyTorch generation latency before and after, and the task
metric before pruning, right after it, and after recovery (when `recover` is set).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass

from t5compress import artifacts
from t5compress.config import choose, option, require
from t5compress.data import DataConfig, batch_order, collate, encode, load_splits
from t5compress.errors import ConfigError
from t5compress.prune.importance import SCORES
from t5compress.prune.recover import RecoverConfig
from t5compress.prune.schedule import SCHEDULES, Targets

log = logging.getLogger(__name__)


def _ratio(value: float | None, name: str) -> None:
    require(value is None or 0 <= value < 1, name, f"must be in [0, 1), got {value}")


@dataclass(frozen=True)
class PruneConfig:
    calib_data: str = option(help="Calibration data (any format `train` reads); a held-out share measures the metric.")
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
    data: DataConfig = dataclasses.field(default_factory=DataConfig, metadata={"help": "How records are read."})
    recover: RecoverConfig | None = dataclasses.field(
        default=None, metadata={"help": "Recovery fine-tuning after pruning (None: none)."})

    def __post_init__(self) -> None:
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

    def targets(self) -> Targets:
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

    batches = calibration_batches(model, tokenizer, calib_ex, cfg)
    with Reporter("prune", len(batches), unit="batch", what=f"scoring ({cfg.criterion})", enabled=progress,
                  transient=True) as bar:
        scores = SCORES[cfg.criterion](model, bar.track(batches))
    plan = SCHEDULES[cfg.schedule](model, scores, targets)
    schedule.apply_plan(model, plan)
    return plan


@artifacts.claims_output
def run(src: str | os.PathLike, cfg: PruneConfig, out: str | os.PathLike, *, force: bool = False,
        progress: bool = True, resume: bool = False, on_step=None) -> artifacts.Report:
    """Prune `src` into `out` as `cfg` says (recovering when `cfg.recover`); returns the report."""
    from t5compress.model import layout, units
    from t5compress.model.load import describe, load_model, load_tokenizer, save_model_dir
    from t5compress.prune import measure, schedule

    if resume and cfg.recover is None:
        raise ConfigError("resume: only a recovery can be resumed; give the same --recover-data as the first run")
    out = artifacts.check_output(out, force, inputs=[src, cfg])
    model, tokenizer = load_model(src), load_tokenizer(src)
    calib_ex, eval_ex, data_stats = load_splits(cfg.calib_data, cfg.eval_data, cfg.data)
    eval_ex = eval_ex[: cfg.eval_max_examples]
    lat_ex = eval_ex[: cfg.latency_examples]
    targets = cfg.targets()
    from t5compress.prune.importance import magnitude

    SCHEDULES[cfg.schedule](model, magnitude(model), targets)  # rejects impossible ratios before any heavy work
    work = None
    if cfg.recover is not None:
        from t5compress.train.checkpoint import prepare_workdir

        work = prepare_workdir(out, cfg, force, resume)
    started = time.perf_counter()
    before = _snapshot(model, tokenizer, eval_ex, cfg)
    unpruned = copy.deepcopy(model) if cfg.latency_examples or (cfg.recover and cfg.recover.distill) else None
    plan = _prune(model, tokenizer, calib_ex, cfg, targets, progress)
    pruned = _snapshot(model, tokenizer, eval_ex, cfg)
    before["latency_ms"], pruned["latency_ms"] = measure.latency_ms(
        [unpruned, model], tokenizer, lat_ex, cfg.data, cfg.latency_new_tokens)
    log.info("pruned: %d -> %d parameters", before["parameters"], pruned["parameters"])
    report = {
        "stage": "prune", "criterion": cfg.criterion, "schedule": cfg.schedule, "targets": targets.ratios,
        "plain": units.is_plain(model), "kept": schedule.summary(plan), "model": describe(model), "data": data_stats,
        "before": before, "after_pruning": pruned, "after_recovery": None, "recovery": None,
    }
    if cfg.recover is not None:
        from t5compress.prune.recover import recover_model

        teacher = unpruned if cfg.recover.distill else None
        report["recovery"] = recover_model(model, tokenizer, teacher, cfg.recover, work, resume, progress, on_step)
        report["after_recovery"] = {**pruned, **_snapshot(model, tokenizer, eval_ex, cfg)}  # same shapes, new metric
    report["eval"] = (report["after_recovery"] or pruned)["eval"]  # what `t5compress info` shows
    report["seconds"] = round(time.perf_counter() - started, 1)
    if not report["plain"]:
        report["layout"] = layout.layout_of(model)
    with artifacts.staged_output(out, force, inputs=[src, cfg]) as tmp:
        save_model_dir(model, tokenizer, tmp)
        artifacts.write_meta(tmp, "prune", dataclasses.asdict(cfg), parent=src)
        artifacts.write_report(tmp, report)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return report


