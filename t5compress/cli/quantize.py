"""`t5compress quantize EXPORT_DIR OUT --static --calib-data FILE`, `--dynamic`, `--blockwise` or `--bits 4`."""

from __future__ import annotations

from typing import Annotated

import typer

from t5compress.cli.common import Force, OutDir, command, config_from, fail, field_options, show, with_options
from t5compress.quantize.modes import METHODS
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
    bits: Annotated[int, typer.Option("--bits", help="Block-wise weight bits: 8, or 4 (half the bytes: "
                                      "MatMulNBits with 4-bit weights, blocks of 64, int8 arithmetic; rounded by "
                                      "GPTQ by default when --calib-data is given; a gated model's FFN outputs, "
                                      "and its LM head without GPTQ, stay 8-bit: --keep-8bit). Implies "
                                      "--blockwise.")] = 8,
    force: Force = False,
    **opts,
) -> None:
    """Quantize an ONNX export to int8 (static, dynamic or block-wise) or block-wise 4-bit, checked against fp32
    before anything is written."""
    run = stage("quantize").runner()

    if static + dynamic + blockwise > 1:
        fail("choose one of --static, --dynamic and --blockwise")
    if bits not in (4, 8):
        fail(f"--bits: choose 4 or 8, got {bits}")
    if bits == 4 and (static or dynamic):
        fail("--bits 4 is block-wise (MatMulNBits): use it with --blockwise or alone, not with --static or --dynamic")
    mode = "int4" if bits == 4 else "dynamic" if dynamic else "blockwise" if blockwise else "static"
    cfg = config_from(Q, opts, mode=mode)
    show("quantize", run(export_dir, cfg, out, force=force), out, f"{METHODS[mode].label} export")
