"""`t5compress create` and `t5compress train`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import Force, ModelDir, OutDir, command, console
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.data import DataConfig as D
from t5compress.trainer import TrainConfig as T

# Data options, shared by create (tokenizer text) and train.
SourceField = Annotated[str, typer.Option(help=_h(D, "source_field"))]
TargetField = Annotated[str, typer.Option(help=_h(D, "target_field"))]
Prefix = Annotated[str, typer.Option(help=_h(D, "prefix"))]


@command
def create(
    arch: Annotated[str, typer.Argument(help="Architecture, e.g. t5-small, flan-t5-small, t5-efficient-small-el2.")],
    out: OutDir,
    text: Annotated[str | None, typer.Option(help="Data file whose sources and targets train the tokenizer.")] = None,
    tokenizer: Annotated[str, typer.Option(help="unigram (SentencePiece trained on --text) or byte.")] = "unigram",
    vocab_size: Annotated[int, typer.Option(help="Upper bound on unigram pieces.")] = 8000,
    override: Annotated[
        list[str] | None, typer.Option("--override", "-o", help="T5Config field, e.g. -o d_model=256.")
    ] = None,
    source_field: SourceField = _d(D, "source_field"),
    target_field: TargetField = _d(D, "target_field"),
    seed: Annotated[int, typer.Option(help="Seed of the random initialisation.")] = 0,
    force: Force = False,
) -> None:
    """Create a new, randomly initialised T5 of a named architecture, with a tokenizer, as a model directory."""
    from t5compress import create as stage
    from t5compress.architectures import parse_overrides

    cfg = stage.CreateConfig(
        arch=arch, tokenizer=tokenizer, text=text, vocab_size=vocab_size, overrides=parse_overrides(override or []),
        data=D(source_field=source_field, target_field=target_field), seed=seed,
    )
    report = stage.run(cfg, out, force=force)
    m = report["model"]
    console.print(f"created {arch}: {m['parameters']:,} parameters ({m['parameters'] / 1e6:.2f}M), "
                  f"vocabulary {m['vocab_size']} → [bold]{out}[/bold]")


@command
def train(
    model: ModelDir,
    data: Annotated[str, typer.Argument(help="Training data: .jsonl, .csv, .tsv, a datasets dir or dataset name.")],
    out: OutDir,
    eval_data: Annotated[str | None, typer.Option("--eval", help="Held-out data (default: split off DATA).")] = None,
    source_field: SourceField = _d(D, "source_field"),
    target_field: TargetField = _d(D, "target_field"),
    prefix: Prefix = _d(D, "prefix"),
    max_source_length: Annotated[int, typer.Option(help=_h(D, "max_source_length"))] = _d(D, "max_source_length"),
    max_target_length: Annotated[int, typer.Option(help=_h(D, "max_target_length"))] = _d(D, "max_target_length"),
    eval_fraction: Annotated[float, typer.Option(help=_h(D, "eval_fraction"))] = _d(D, "eval_fraction"),
    hf_split: Annotated[str, typer.Option(help=_h(D, "hf_split"))] = _d(D, "hf_split"),
    hf_eval_split: Annotated[str | None, typer.Option(help=_h(D, "hf_eval_split"))] = _d(D, "hf_eval_split"),
    hf_config: Annotated[str | None, typer.Option(help=_h(D, "hf_config"))] = _d(D, "hf_config"),
    max_steps: Annotated[int, typer.Option(help=_h(T, "max_steps"))] = _d(T, "max_steps"),
    epochs: Annotated[int, typer.Option(help=_h(T, "epochs"))] = _d(T, "epochs"),
    batch_size: Annotated[int, typer.Option(help=_h(T, "batch_size"))] = _d(T, "batch_size"),
    grad_accum: Annotated[int, typer.Option(help=_h(T, "grad_accum"))] = _d(T, "grad_accum"),
    optimizer: Annotated[str, typer.Option(help=_h(T, "optimizer"))] = _d(T, "optimizer"),
    lr: Annotated[float, typer.Option(help=_h(T, "lr"))] = _d(T, "lr"),
    weight_decay: Annotated[float, typer.Option(help=_h(T, "weight_decay"))] = _d(T, "weight_decay"),
    schedule: Annotated[str, typer.Option(help=_h(T, "schedule"))] = _d(T, "schedule"),
    warmup_steps: Annotated[int, typer.Option(help=_h(T, "warmup_steps"))] = _d(T, "warmup_steps"),
    label_smoothing: Annotated[float, typer.Option(help=_h(T, "label_smoothing"))] = _d(T, "label_smoothing"),
    max_grad_norm: Annotated[float, typer.Option(help=_h(T, "max_grad_norm"))] = _d(T, "max_grad_norm"),
    precision: Annotated[str, typer.Option(help=_h(T, "precision"))] = _d(T, "precision"),
    eval_every: Annotated[int, typer.Option(help=_h(T, "eval_every"))] = _d(T, "eval_every"),
    eval_max_examples: Annotated[int, typer.Option(help=_h(T, "eval_max_examples"))] = _d(T, "eval_max_examples"),
    eval_batch_size: Annotated[int, typer.Option(help=_h(T, "eval_batch_size"))] = _d(T, "eval_batch_size"),
    eval_num_beams: Annotated[int, typer.Option(help=_h(T, "eval_num_beams"))] = _d(T, "eval_num_beams"),
    metric: Annotated[str, typer.Option(help=_h(T, "metric"))] = _d(T, "metric"),
    patience: Annotated[int, typer.Option(help=_h(T, "patience"))] = _d(T, "patience"),
    save_every: Annotated[int, typer.Option(help=_h(T, "save_every"))] = _d(T, "save_every"),
    bucket: Annotated[bool, typer.Option(help=_h(T, "bucket"))] = _d(T, "bucket"),
    seed: Annotated[int, typer.Option(help=_h(T, "seed"))] = _d(T, "seed"),
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its checkpoint.")] = False,
    force: Force = False,
) -> None:
    """Fine-tune a T5-family checkpoint (local directory or hub id) on text-to-text data.

    Checkpoints of an unfinished run are kept in OUT.partial/; after a crash or kill, rerun the same command with
    --resume. On several GPUs: accelerate launch --multi_gpu -m t5compress.cli train ...
    """
    from t5compress import training

    data_cfg = D(
        source_field=source_field, target_field=target_field, prefix=prefix, max_source_length=max_source_length,
        max_target_length=max_target_length, eval_fraction=eval_fraction, hf_split=hf_split,
        hf_eval_split=hf_eval_split, hf_config=hf_config,
    )
    train_cfg = T(
        max_steps=max_steps, epochs=epochs, batch_size=batch_size, grad_accum=grad_accum, optimizer=optimizer, lr=lr,
        weight_decay=weight_decay, schedule=schedule, warmup_steps=warmup_steps, label_smoothing=label_smoothing,
        max_grad_norm=max_grad_norm, precision=precision, eval_every=eval_every, eval_max_examples=eval_max_examples,
        eval_batch_size=eval_batch_size, eval_num_beams=eval_num_beams, metric=metric, patience=patience,
        save_every=save_every, bucket=bucket, seed=seed,
    )
    cfg = training.FinetuneConfig(train_data=data, eval_data=eval_data, data=data_cfg, train=train_cfg)
    report = training.run(model, cfg, Path(out), force=force, resume=resume)
    if report["eval"] is not None:  # None on the non-main processes of a multi-GPU run
        print_train_summary(report, out)


def print_train_summary(report: dict, out: Path) -> None:
    from rich.table import Table

    t = Table(title="evaluation of the kept checkpoint", title_justify="left")
    ev = report.get("eval") or {}
    for k in ("step", "loss", "exact_match", "rougeL", "bleu", "examples"):
        t.add_column(k, justify="right")
    t.add_row(*(str(ev.get(k, "-")) for k in ("step", "loss", "exact_match", "rougeL", "bleu", "examples")))
    console.print(t)
    tr = report["train"]
    rate = tr["examples_per_second"]
    console.print(f"{tr['steps']} steps in {tr['seconds']} s ({rate} examples/s) → [bold]{out}[/bold]")
