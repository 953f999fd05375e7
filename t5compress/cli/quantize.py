"""`t5compress quantize EXPORT_DIR OUT --static --calib-data FILE`, `--dynamic` or `--blockwise`."""

from __future__ import annotations

from typing import Annotated

import typer

from t5compress.cli.common import Force, OutDir, command, config_from, fail, field_options, show, with_options
from t5compress.quantize.stage import QuantizeConfig as Q
from t5compress.stages import stage


@command
@with_options(field_options(Q, skip=("mode",)))
def quantize(
    export_dir: Annotated[str, typer.Argument(help="An fp32 ONNX export directory (from `t5compress export`).")],
    out: OutDir,
    static: Annotated[bool, typer.Option("--static", help="Static int8 on --calib-data (default).")] = False,
    dynamic: Annotated[bool, typer.Option("--dynamic", help="Dynamic int8: no calibration data needed.")] = False,
    blockwise: Annotated[bool, typer.Option("--blockwise", help="Block-wise int8 (a scale per --block-size input "
                                            "channels of weights and activations; ONNX Runtime's MatMulNBits): "
                                            "fastest at batch 1, slower than static at batch > 1; with --calib-data "
                                            "smoothed and GPTQ-rounded, else no data needed.")] = False,
    force: Force = False,
    **opts,
) -> None:
    """Quantize an ONNX export to int8 (static, dynamic or block-wise), checked against fp32 before anything is
    written."""
    run = stage("quantize").runner()

    if static + dynamic + blockwise > 1:
        fail("choose one of --static, --dynamic and --blockwise")
    cfg = config_from(Q, opts, mode="dynamic" if dynamic else "blockwise" if blockwise else "static")
    show("quantize", run(export_dir, cfg, out, force=force), out, "int8 export")
