"""`t5compress export MODEL OUT --onnx|--torchscript`."""

from __future__ import annotations

from typing import Annotated

import typer

from t5compress.cli.common import (
    Force,
    ModelDir,
    OutDir,
    command,
    config_from,
    fail,
    field_options,
    show,
    with_options,
)
from t5compress.export.stage import ExportConfig as E
from t5compress.stages import stage


@command
@with_options(field_options(E, skip=("format",)))
def export(
    model: ModelDir,
    out: OutDir,
    onnx: Annotated[bool, typer.Option("--onnx", help="Write ONNX graphs (the default).")] = False,
    torchscript: Annotated[bool, typer.Option("--torchscript", help="Write TorchScript graphs (.pt).")] = False,
    force: Force = False,
    **opts,
) -> None:
    """Export encoder, decoder and decoder-with-past graphs, checked against PyTorch (optimum's file layout)."""
    run = stage("export").runner()

    if onnx and torchscript:
        fail("choose one of --onnx and --torchscript")
    cfg = config_from(E, opts, format="torchscript" if torchscript else "onnx")
    show("export", run(model, cfg, out, force=force), out, f"exported {cfg.format} graphs")
