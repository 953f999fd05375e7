"""The `train` stage: fine-tune a T5-family checkpoint on text-to-text data and write a model directory."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.data import DataConfig, Encoded, encode, load_splits
from t5compress.model.load import describe, load_model, load_tokenizer, save_model_dir
from t5compress.runtime.limits import check_model_fits
from t5compress.train.checkpoint import prepare_workdir, workdir_of
from t5compress.train.loop import EvalSet, TrainConfig, fit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneConfig:
    train_data: str = option(help="Training data: JSONL, CSV/TSV, a datasets directory or a dataset name.")
    eval_data: str | None = option(None, "Held-out data; default: a split of the training data.")
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "How records are read and tokenized."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Optimisation settings."})

    def __post_init__(self) -> None:
        require(bool(self.train_data), "train_data", "give a training data file or dataset")


@dataclass
class Session:
    """A fine-tuning run set up: the model, its tokenizer, encoded data and the work dir holding the checkpoints."""

    model: Any
    tokenizer: Any
    train: Encoded
    evalset: EvalSet
    data_report: dict
    work: Path
    is_main: bool


def open_session(src: str, cfg: FinetuneConfig, out: Path, force: bool, resume: bool, record: Any = None,
                 stage: str = "train") -> Session:
    """Load model, tokenizer and data, and prepare the work dir (`record`: the stage config it is started with)."""
    check_model_fits(stage, src, (cfg.train.batch_size, cfg.data.max_source_length, cfg.data.max_target_length))
    model = load_model(src)
    tokenizer = load_tokenizer(src)
    train_ex, eval_ex, data_stats = load_splits(cfg.train_data, cfg.eval_data, cfg.data)
    from accelerate import PartialState

    procs = PartialState()  # under `accelerate launch`, only the main process touches the work and output dirs
    work = prepare_workdir(out, record or cfg, force, resume) if procs.is_main_process else workdir_of(out)
    procs.wait_for_everyone()
    eval_ex = eval_ex[: cfg.train.eval_max_examples]
    train_enc, eval_enc = encode(train_ex, tokenizer, cfg.data), encode(eval_ex, tokenizer, cfg.data)
    max_new = cfg.train.eval_max_new_tokens or max(len(x) for x in eval_enc.labels)
    data_report = {**data_stats, "train_tokens": train_enc.stats, "eval_tokens": eval_enc.stats}
    return Session(model, tokenizer, train_enc, EvalSet(eval_ex, eval_enc, max_new), data_report, work,
                   procs.is_main_process)


def fit_session(s: Session, cfg: FinetuneConfig, resume: bool, progress: bool = True, on_step=None,
                label: str = "train") -> dict:
    """Train through the shared loop; on the main process, load the best checkpoint into `s.model`."""
    summary = fit(s.model, s.tokenizer, s.train, s.evalset, cfg.train, s.work, resume, progress=progress,
                  on_step=on_step, label=label)
    return {"train": summary, "eval": _load_best(s.model, s.work) if s.is_main else None}


def run(
    src: str, cfg: FinetuneConfig, out: str | Path, *, force: bool = False, progress: bool = True,
    resume: bool = False, on_step=None,
) -> artifacts.Report:
    """Fine-tune `src` (model dir or hub id) and write the best model to `out`. Returns the report."""
    with artifacts.envelope("train", src, cfg, out, force=force) as env:
        s = open_session(src, cfg, env.out, force, resume)
        result = fit_session(s, cfg, resume, progress, on_step)
        if not s.is_main:
            return {"stage": "train", **result}
        report = {"stage": "train", "model": describe(s.model), "data": s.data_report, **result}
        env.write(report, lambda tmp: save_model_dir(s.model, s.tokenizer, tmp))
        shutil.rmtree(s.work, ignore_errors=True)
        return report


def _load_best(model, work: Path) -> dict | None:
    from t5compress.train.checkpoint import load_best

    best = load_best(work, model)
    if best is not None:
        log.info("kept the best checkpoint: step %s", best.get("step"))
    return best
