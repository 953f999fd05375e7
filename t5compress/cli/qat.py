"""`t5compress qat MODEL DATA OUT`: quantization-aware fine-tuning (int8 fake quantization) through train's loop."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import ModelDir, OutDir, command, console, show
from t5compress.cli.train import DATA_OPTIONS, RUN_OPTIONS, TRAIN_OPTIONS, TrainData, finetune_config, with_options
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.qat.scheme import FakeQuantConfig as Q
from t5compress.stages import stage


@command
@with_options(DATA_OPTIONS, TRAIN_OPTIONS, RUN_OPTIONS)
def qat(
    model: ModelDir,
    data: TrainData,
    out: OutDir,
    act_scale: Annotated[str, typer.Option(help=_h(Q, "act_scale"))] = _d(Q, "act_scale"),
    ema_momentum: Annotated[float, typer.Option(help=_h(Q, "ema_momentum"))] = _d(Q, "ema_momentum"),
    calib_batches: Annotated[int, typer.Option(help=_h(Q, "calib_batches"))] = _d(Q, "calib_batches"),
    keep_wo: Annotated[str, typer.Option(help=_h(Q, "keep_wo"))] = _d(Q, "keep_wo"),
    lm_head: Annotated[bool, typer.Option(help=_h(Q, "lm_head"))] = _d(Q, "lm_head"),
    embedding: Annotated[bool, typer.Option(help=_h(Q, "embedding"))] = _d(Q, "embedding"),
    weight_range: Annotated[str, typer.Option(help=_h(Q, "weight_range"))] = _d(Q, "weight_range"),
    **opts,
) -> None:
    """Fine-tune with int8 fake quantization (per-channel weights, per-tensor activations with learned or averaged
    scales). OUT is a plain fp32 model dir with the scales beside it; `t5compress export OUT DIR --onnx` writes int8
    Q/DQ graphs with them. Takes every option of train; --resume continues after a kill.
    """
    from t5compress.qat import stage as qat

    run = stage("qat").runner()

    resume, force = opts.pop("resume"), opts.pop("force")
    quant = Q(act_scale=act_scale, ema_momentum=ema_momentum, calib_batches=calib_batches, keep_wo=keep_wo,
              lm_head=lm_head, embedding=embedding, weight_range=weight_range)
    cfg = qat.QatConfig(finetune=finetune_config(data, opts), quant=quant)
    report = run(model, cfg, Path(out), force=force, resume=resume)
    if report.get("metrics") is not None:  # absent on the non-main processes of a multi-GPU run
        show("qat", report, out, "int8 quantization-aware training")
        console.print(f"export int8 ONNX: t5compress export {out} OUT --onnx", highlight=False, markup=False)
