"""`t5compress prune MODEL OUT --heads R --ffn R --calib-data FILE` and `t5compress recover PRUNED OUT --data FILE`."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import Force, ModelDir, OutDir, command, config_from, field_options, show, with_options
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.prune import recover as rec
from t5compress.prune.recover import RecoverConfig as R
from t5compress.prune.stage import PruneConfig as P
from t5compress.stages import stage
from t5compress.train.distill import DistillConfig as K
from t5compress.train.loop import TrainConfig as T

Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted recovery from its checkpoint.")]
Teacher = Annotated[str | None, typer.Option("--teacher", help=_h(R, "teacher"))]
STEPS_HELP = ("Recovery optimizer steps: the default won back a d256 model trained to the end of its schedule to "
              "within 1% (600 steps: 11% below); fewer for a quick run. The run warns when its held-out loss was "
              "still falling at the end.")


def _option(name: str, kind: type, default, help_: str, flag: str | None = None) -> inspect.Parameter:
    option = typer.Option(flag, help=help_) if flag else typer.Option(help=help_)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option])


# The recovery options `prune --recover-data` and `recover` share; both receive them in **opts.
RECOVERY_OPTIONS = [
    _option("distill", bool, _d(R, "distill"), _h(R, "distill"), "--distill/--no-distill"),
    _option("temperature", float, rec.RECOVER_KD.temperature, _h(K, "temperature")),
    _option("alpha", float, rec.RECOVER_KD.alpha, _h(K, "alpha")),
    _option("hidden_weight", float, rec.RECOVER_KD.hidden_weight, _h(K, "hidden_weight")),
    _option("hidden_layers", str, rec.RECOVER_KD.hidden_layers, _h(K, "hidden_layers")),
    _option("lr", float | None, None, f"Peak learning rate of recovery; default {rec.RECOVER_LR:g} up to d_model "
                                       f"{rec.RECOVER_LR_WIDTH}, x ({rec.RECOVER_LR_WIDTH} / d_model)^2 above (5e-4 "
                                       "at 256, 1.25e-4 at 512; measured at 128 and 256: docs/prune.md)."),
    _option("batch_size", int, rec.RECOVER_BATCH, _h(T, "batch_size")),
    _option("eval_every", int | None, None,
            f"Evaluate every N optimizer steps; default: {rec.RECOVER_EVALS} times a run."),
    _option("seed", int, 0, _h(T, "seed")),
]


def _recover_cfg(data: str, eval_data: str | None, steps: int, teacher: str | None, opts: dict) -> R:
    """The recovery config from the shared options, popped from `opts`."""
    o = {p.name: opts.pop(p.name) for p in RECOVERY_OPTIONS}
    lr = rec.RECOVER_LR if o["lr"] is None else o["lr"]
    every = rec.eval_every(steps) if o["eval_every"] is None else o["eval_every"]
    train = T(max_steps=steps, lr=lr, batch_size=o["batch_size"], eval_every=every, metric="loss", seed=o["seed"])
    kd = K(temperature=o["temperature"], alpha=o["alpha"], hidden_weight=o["hidden_weight"],
           hidden_layers=o["hidden_layers"])
    return R(data=data, eval_data=eval_data, distill=o["distill"], teacher=teacher, kd=kd, train=train,
             lr_per_width=o["lr"] is None)


@command
@with_options(field_options(P, skip=("calib_data", "eval_data", "recover")), RECOVERY_OPTIONS)
def prune(
    model: ModelDir,
    out: OutDir,
    calib_data: Annotated[str | None, typer.Option("--calib-data", help=_h(P, "calib_data"))] = None,
    eval_data: Annotated[str | None, typer.Option("--eval", help=_h(P, "eval_data"))] = None,
    recover_data: Annotated[str | None, typer.Option(help="Recovery data; recovery runs when given.")] = None,
    recover_steps: Annotated[int, typer.Option(help=STEPS_HELP)] = rec.RECOVER_STEPS,
    resume: Resume = False,
    force: Force = False,
    **opts,
) -> None:
    """Remove the least important attention heads, FFN channels and layers, and the pieces a task never uses;
    optionally recover (by default distilling from the unpruned model, logits and every block's output)."""
    run = stage("prune").runner()

    recover = _recover_cfg(recover_data, None, recover_steps, None, opts) if recover_data is not None else None
    cfg = config_from(P, opts, calib_data=calib_data, eval_data=eval_data, recover=recover)
    show("prune", run(model, cfg, Path(out), force=force, resume=resume), out, "pruned")


@command
@with_options(RECOVERY_OPTIONS)
def recover(
    model: Annotated[str, typer.Argument(help="A pruned model directory.")],
    out: OutDir,
    data: Annotated[str, typer.Option("--data", help=_h(R, "data"))],
    eval_data: Annotated[str | None, typer.Option("--eval", help=_h(R, "eval_data"))] = None,
    steps: Annotated[int, typer.Option("--steps", help=STEPS_HELP)] = rec.RECOVER_STEPS,
    teacher: Teacher = None,
    resume: Resume = False,
    force: Force = False,
    **opts,
) -> None:
    """Fine-tune a pruned model to win back accuracy, by default distilling from the unpruned teacher (logits and
    every block's output)."""
    run = stage("recover").runner()

    cfg = _recover_cfg(data, eval_data, steps, teacher, opts)
    show("recover", run(model, cfg, Path(out), force=force, resume=resume), out, "recovered")
