"""Recovery: fine-tune a pruned model through the shared trainer, optionally distilling from the unpruned teacher.

    run(pruned_dir, RecoverConfig(data="train.jsonl", teacher="model-dir"), out) -> report

Also called by the `prune` stage (`PruneConfig.recover`), with the in-memory unpruned model as the teacher. Like
`train`, an interrupted run resumes from the checkpoints in `OUT.partial/` (`resume=True`).

The defaults are what won back the most in `benchmarks/prune_recovery.py` (4+4-layer T5s at real but imperfect
skill, 50% of heads and FFN channels removed; tables in docs/prune.md): distillation from the unpruned teacher on
logits and on every block's output, batches of 32, 4,800 steps, at a peak learning rate of 2e-3 at d_model 128 and
less on wider models (`recovery_lr`). Against a d256 base trained to the end of its schedule, 4,800 steps at 5e-4
ended 0.1 / 0.7% below its ROUGE-L (two seeds), 2,400 steps 3.7 / 3.1%, the old default of 600 steps 11.0%.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.data import DataConfig, encode, load_splits
from t5compress.errors import ConfigError
from t5compress.train.distill import DistillConfig
from t5compress.train.loop import EvalSet, TrainConfig

log = logging.getLogger(__name__)

# Recovery's own defaults (measured: see the module docstring); `train`'s fine-tuning defaults are not recovery's.
RECOVER_LR = 2e-3  # peak learning rate up to d_model RECOVER_LR_WIDTH; wider models get less (recovery_lr)
RECOVER_LR_WIDTH = 128
RECOVER_STEPS = 4800
RECOVER_EVALS = 12  # held-out evaluations in a recovery run unless told how often (eval_every)
RECOVER_BATCH = 32
RECOVER_KD = DistillConfig(hidden_weight=1.0, hidden_layers="all")


@dataclass(frozen=True)
class RecoverConfig:
    data: str = option(help="Recovery training data: any format `train` reads.")
    eval_data: str | None = option(None, "Held-out data; default: a split of the recovery data.")
    distill: bool = option(True, "Distil from the unpruned teacher: KL on softened logits + cross-entropy, and every "
                                 "block's output (--no-distill: plain fine-tuning on the references).")
    teacher: str | None = option(None, "Teacher model dir; default: the pruned dir's parent (t5compress.json).")
    kd: DistillConfig = field(default_factory=lambda: RECOVER_KD, metadata={"help": "Distillation loss settings."})
    data_cfg: DataConfig = field(default_factory=DataConfig, metadata={"help": "How records are read."})
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=RECOVER_STEPS, lr=RECOVER_LR,
                                                                   batch_size=RECOVER_BATCH, metric="loss",
                                                                   eval_every=eval_every(RECOVER_STEPS)),
                               metadata={"help": "Optimisation settings (max_steps: recovery steps)."})
    lr_per_width: bool = option(True, "Take train.lr as the rate for d_model <= 128 and scale it by (128 / d_model)^2 "
                                      "on wider models (off: train.lr as given; the CLI turns it off with --lr).")

    def __post_init__(self) -> None:
        require(bool(self.data), "data", "give recovery data")
        require(self.train.max_steps > 0, "recover_steps", f"must be > 0, got {self.train.max_steps}")


def eval_every(steps: int) -> int:
    """Steps between held-out evaluations of a `steps`-long recovery: RECOVER_EVALS in a run."""
    return max(1, steps // RECOVER_EVALS)


def recovery_lr(cfg: RecoverConfig, d_model: int) -> float:
    """The peak learning rate recovery runs at on a model of width `d_model`: train.lr (2e-3) up to d_model 128,
    x (128 / d_model)^2 above (5e-4 at 256; t5-small's 512 gets 1.25e-4, not measured).

    Adam's usable step falls with width. At d128, 2e-3 won back the most. At d256, 2e-3 lost 13.9% in 600 steps where
    1e-3 lost 5.3% and 5e-4 5.8% (three seeds, an under-trained base); over the 4,800 steps of the default, against a
    base trained to the end of its schedule, 5e-4 ended 0.1 / 0.7% below it (two seeds, eval loss 3.13 / 3.16) where
    1e-3 ended 4.5 / 1.7% below (loss 3.27 / 3.28): the long run wants the smaller step (benchmarks/results/current/
    prune_recovery_d256_converged_4800*.md)."""
    if not cfg.lr_per_width:
        return cfg.train.lr
    return cfg.train.lr * min(1.0, RECOVER_LR_WIDTH / d_model) ** 2


def recover_model(model, tokenizer, teacher, cfg: RecoverConfig, work: Path, resume: bool = False,
                  progress: bool = True, on_step=None) -> dict:
    """Fine-tune `model` in place (distilling from `teacher` when cfg.distill); keeps the best checkpoint."""
    from t5compress.train.checkpoint import load_best
    from t5compress.train.distill import distill_loss
    from t5compress.train.loop import fit

    train_ex, eval_ex, stats = load_splits(cfg.data, cfg.eval_data, cfg.data_cfg)
    eval_ex = eval_ex[: cfg.train.eval_max_examples]
    train_enc, eval_enc = encode(train_ex, tokenizer, cfg.data_cfg), encode(eval_ex, tokenizer, cfg.data_cfg)
    max_new = cfg.train.eval_max_new_tokens or max(len(x) for x in eval_enc.labels)
    loss_fn = distill_loss(teacher, cfg.kd) if cfg.distill else None
    train = dataclasses.replace(cfg.train, lr=recovery_lr(cfg, model.config.d_model))
    summary = fit(model, tokenizer, train_enc, EvalSet(eval_ex, eval_enc, max_new), train, work, resume,
                  loss_fn=loss_fn, progress=progress, on_step=on_step, label="recover",
                  lower_with="--batch-size, --recover-steps (recover: --steps)")
    best = load_best(work, model)
    more = still_improving(summary["history"])
    if more:
        log.warning("%s", more)
    return {"train": summary, "lr": train.lr, "best": best and {k: v for k, v in best.items() if k != "samples"},
            "distill": dataclasses.asdict(cfg.kd) if cfg.distill else None, "data": stats,
            "still_improving": more}


def still_improving(history: list[dict], gain: float = 0.01) -> str | None:
    """A hint when recovery stopped while its held-out loss was still falling: the last evaluation the best and more
    than `gain` (relative) below the one before. Recovery's worth grows with its length on a well-trained model (d256
    trained to the end of its schedule: 11.0% below the unpruned ROUGE-L after 600 steps, 8.3% after 1,200, 3.7 / 3.1%
    after 2,400, 0.1 / 0.7% after 4,800; docs/prune.md), so a fixed default can stop short; this says so instead of
    leaving it to be found."""
    losses = [(h["step"], h["loss"]) for h in history if h.get("loss") is not None]
    if len(losses) < 2:
        return None
    (s0, l0), (s1, l1) = losses[-2], losses[-1]
    if l1 < min(loss for _, loss in losses[:-1]) and l1 < l0 * (1 - gain):
        return (f"recovery ended while the held-out loss was still falling ({l0:.4g} at step {s0}, {l1:.4g} at step "
                f"{s1}): more steps may win back more (--recover-steps; recover: --steps)")
    return None


def teacher_of(src: str | Path, cfg: RecoverConfig) -> str:
    if cfg.teacher:
        return cfg.teacher
    parent = ((artifacts.read_json(Path(src) / artifacts.META_FILE) or {}).get("parent") or {}).get("path")
    if not parent or not Path(parent).is_dir():
        raise ConfigError(f"distill: no teacher given and '{src}' names no existing parent dir; pass --teacher, "
                          "or --no-distill to fine-tune on the references only")
    return parent


def aligned_teacher(teacher_dir: str | Path, tokenizer):
    """The teacher model; when the student's vocabulary was pruned, the teacher's trimmed to the same pieces, so that
    their logits line up for distillation."""
    from t5compress.model.load import load_model, load_tokenizer
    from t5compress.prune.vocab import trim_vocab

    teacher, own = load_model(teacher_dir), load_tokenizer(teacher_dir)
    if own.get_vocab() == tokenizer.get_vocab():
        return teacher
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    vocab = own.get_vocab()
    ids = [vocab.get(p) for p in pieces]
    if None in ids or ids != sorted(ids):
        raise ConfigError(f"distill: the teacher '{teacher_dir}' has another vocabulary than the student (not a "
                          "trimmed copy of it); pass a --teacher with the student's tokenizer")
    return trim_vocab(teacher, own, ids)[0]


def run(src: str | Path, cfg: RecoverConfig, out: str | Path, *, force: bool = False, progress: bool = True,
        resume: bool = False, on_step=None) -> artifacts.Report:
    """Recover the pruned model `src` into `out`; the report has the metric before and after."""
    from t5compress.model.load import describe, load_model, load_tokenizer, save_model_dir
    from t5compress.prune.measure import measure_eval
    from t5compress.runtime.limits import check_model_fits
    from t5compress.train.checkpoint import prepare_workdir

    with artifacts.envelope("recover", src, cfg, out, force=force) as env:
        check_model_fits("recover", src)
        model, tokenizer = load_model(src), load_tokenizer(src)
        teacher = aligned_teacher(teacher_of(src, cfg), tokenizer) if cfg.distill else None
        work = prepare_workdir(env.out, cfg, force, resume)
        _, eval_ex, _ = load_splits(cfg.data, cfg.eval_data, cfg.data_cfg)
        eval_ex = eval_ex[: cfg.train.eval_max_examples]
        before = measure_eval(model, tokenizer, eval_ex, cfg.data_cfg, cfg.train.eval_batch_size)
        section = recover_model(model, tokenizer, teacher, cfg, work, resume, progress, on_step)
        after = measure_eval(model, tokenizer, eval_ex, cfg.data_cfg, cfg.train.eval_batch_size)
        teacher_dir = teacher_of(src, cfg) if cfg.distill else None
        report = {"stage": "recover", "model": describe(model), "teacher": teacher_dir, "eval_before": before,
                  "eval_after": after, "eval": after, **section}
        env.write(report, lambda tmp: save_model_dir(model, tokenizer, tmp))
        shutil.rmtree(work, ignore_errors=True)
        return report
