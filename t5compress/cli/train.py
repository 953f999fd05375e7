"""`t5compress create` and `t5compress train`."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import Force, ModelDir, OutDir, command, config_from, field_options, show, with_options
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.data import DataConfig as D
from t5compress.model.create import CreateConfig
from t5compress.stages import stage
from t5compress.train.loop import TrainConfig as T

# Data options, shared by create (tokenizer text) and train.
SourceField = Annotated[str, typer.Option(help=_h(D, "source_field"))]
TargetField = Annotated[str, typer.Option(help=_h(D, "target_field"))]
Prefix = Annotated[str, typer.Option(help=_h(D, "prefix"))]


@command
@with_options(field_options(CreateConfig, "text", "tokenizer", "vocab_size", "seed"))
def create(
    arch: Annotated[str, typer.Argument(help="Architecture, e.g. t5-small, flan-t5-small, t5-efficient-small-el2.")],
    out: OutDir,
    override: Annotated[
        list[str] | None, typer.Option("--override", "-o", help="T5Config field, e.g. -o d_model=256.")
    ] = None,
    source_field: SourceField = _d(D, "source_field"),
    target_field: TargetField = _d(D, "target_field"),
    force: Force = False,
    **opts,
) -> None:
    """Create a new, randomly initialised T5 of a named architecture, with a tokenizer, as a model directory."""
    from t5compress.model.architectures import parse_overrides

    cfg = config_from(CreateConfig, opts, arch=arch, overrides=parse_overrides(override or []),
                      data=D(source_field=source_field, target_field=target_field))
    show("create", stage("create").runner()(arch, cfg, out, force=force), out, f"created {arch}")


# The data and training options of `train`, declared once; `qat` (and later recovery training) take the same.
DATA_OPTIONS = [
    inspect.Parameter("eval_data", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        str | None, typer.Option("--eval", help="Held-out data (default: split off DATA).")]),
    *field_options(D, "source_field", "target_field", "prefix", "max_source_length", "max_target_length",
                   "eval_fraction", "hf_split", "hf_eval_split", "hf_config"),
]
TRAIN_OPTIONS = field_options(T)
RUN_OPTIONS = [
    inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted run from its checkpoint.")]),
    inspect.Parameter("force", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Force),
]


def finetune_config(data: str, opts: dict):
    """The FinetuneConfig of a command's DATA argument and its shared options (pops them from `opts`)."""
    from t5compress.train.stage import FinetuneConfig

    return FinetuneConfig(train_data=data, eval_data=opts.pop("eval_data", None), data=config_from(D, opts),
                          train=config_from(T, opts))


TrainData = Annotated[str, typer.Argument(help="Training data: .jsonl, .csv, .tsv, a datasets dir or dataset name.")]


@command
@with_options(DATA_OPTIONS, TRAIN_OPTIONS, RUN_OPTIONS)
def train(model: ModelDir, data: TrainData, out: OutDir, **opts) -> None:
    """Fine-tune a T5-family checkpoint (local directory or hub id) on text-to-text data.

    Checkpoints of an unfinished run are kept in OUT.partial/; after a crash or kill, rerun the same command with
    --resume. On several GPUs: accelerate launch --multi_gpu -m t5compress.cli train ...
    """
    resume, force = opts.pop("resume"), opts.pop("force")
    cfg = finetune_config(data, opts)
    report = stage("train").runner()(model, cfg, Path(out), force=force, resume=resume)
    if report["eval"] is not None:  # None on the non-main processes of a multi-GPU run
        show("train", report, out, "fine-tuned")
