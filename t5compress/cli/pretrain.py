"""`t5compress pretrain CORPUS OUT --arch NAME|MODEL_DIR`: span-corruption pre-training (nanoT5's recipe)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import OutDir, command, show
from t5compress.cli.train import RUN_OPTIONS, with_options
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.pretrain.stage import NANOT5
from t5compress.pretrain.stage import PretrainConfig as P
from t5compress.stages import stage
from t5compress.train.loop import TrainConfig as T

# The trainer's options that matter for pre-training, with nanoT5's defaults.
_TRAIN_FIELDS = ("max_steps", "batch_size", "grad_accum", "optimizer", "lr", "weight_decay", "schedule",
                 "warmup_steps", "max_grad_norm", "precision", "compile", "eval_every", "eval_max_examples",
                 "eval_batch_size", "save_every")
_OWN_FIELDS = ("tokenizer", "vocab_size", "tokenizer_docs", "text_field", "hf_split", "hf_config", "holdout_every",
               "inputs_length", "noise_density", "mean_noise_span_length", "dropout", "shuffle_buffer", "seed")


def _param(name: str, cls: type, default) -> inspect.Parameter:
    kind = type(default) if default is not None else str | None
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, typer.Option(help=_h(cls, name))])


PRETRAIN_OPTIONS = [_param(n, P, _d(P, n)) for n in _OWN_FIELDS]
NANOT5_OPTIONS = [_param(n, T, getattr(NANOT5, n)) for n in _TRAIN_FIELDS]
Corpus = Annotated[str, typer.Argument(help="Text file(s): .txt (a document per line), .jsonl, a folder of them, a "
                                            "datasets folder or a Hugging Face dataset name (streamed).")]


@command
@with_options(PRETRAIN_OPTIONS, NANOT5_OPTIONS, RUN_OPTIONS)
def pretrain(
    corpus: Corpus,
    out: OutDir,
    arch: Annotated[str, typer.Option(help=_h(P, "model"))] = _d(P, "model"),
    override: Annotated[
        list[str] | None, typer.Option("--override", "-o", help="T5Config field of a new model, e.g. -o d_model=256.")
    ] = None,
    **opts,
) -> None:
    """Pre-train a new T5 (or continue pre-training a checkpoint) with T5's span-corruption objective.

    Checkpoints of an unfinished run are kept in OUT.partial/; rerun the same command with --resume to continue.
    OUT is a normal model directory: fine-tune it with `t5compress train`, then prune, export and quantize it.
    """
    from t5compress.model.architectures import parse_overrides
    run = stage("pretrain").runner()

    resume, force = opts.pop("resume"), opts.pop("force")
    train = dataclasses.replace(NANOT5, **{n: opts.pop(n) for n in _TRAIN_FIELDS})
    cfg = P(model=arch, overrides=parse_overrides(override or []), train=train, **opts)
    report = run(corpus, cfg, Path(out), force=force, resume=resume)
    show("pretrain", report, out, "pre-trained")
