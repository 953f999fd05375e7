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
    console,
    fail,
    field_options,
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
    report = run(model, cfg, out, force=force)
    parity = report["parity"]
    if "int8" in report:  # a QAT dir: int8 Q/DQ graphs, checked against the fake-quantized model
        print_int8_parity(report, out)
        return
    diffs = ", ".join(f"{name} {d:.2e}" for name, d in parity["max_abs_diff"].items())
    gen = parity["generation"]
    dtype = report.get("dtype", "fp32")
    kept = "" if dtype == "fp32" else f" {dtype} (wo, residual sums, logits fp32)"
    what = f"{cfg.format}{kept} graphs"
    console.print(f"exported {what} to [bold]{out}[/bold]: {', '.join(report['graphs'])}")
    reference = "PyTorch" if dtype == "fp32" else "fp32 PyTorch"
    console.print(f"max |export - {reference}| (logits, cache): {diffs}", highlight=False)
    console.print(f"tolerance per tensor: atol {parity['atol']:g} + rtol {parity['rtol']:g} x max|PyTorch tensor|; "
                  f"worst use of it: {max(w['ratio'] for w in parity['worst'].values()):.0%}", highlight=False)
    if "token_agreement" in parity:  # half precision: agreement with fp32 greedy, not identity
        agree = parity["token_agreement"]
        console.print(f"greedy tokens agree with fp32 model.generate on {agree['agreement']:.1%} "
                      f"({agree['identical_rows']}/{agree['rows']} rows identical); no NaN or inf in any output",
                      highlight=False)
        return
    console.print(f"greedy tokens identical to model.generate ({gen['max_new_tokens']} new, batch {gen['batch']})")


def print_int8_parity(report: dict, out) -> None:
    parity, kernels = report["parity"], report["int8"]["ort_kernels"]
    rel = ", ".join(f"{name} {d:.2e}" for name, d in parity["max_rel_diff"].items())
    agree = parity["token_agreement"]
    fused = sum(n for k in kernels.values() for op, n in k.items() if op != "MatMul" and "Quantize" not in op)
    console.print(f"exported int8 Q/DQ ONNX graphs (learned QAT scales) to [bold]{out}[/bold]")
    console.print(f"max |export - fake-quant PyTorch| / logits scale: {rel} (rtol {parity['rtol']:g})",
                  highlight=False)
    console.print(f"greedy token agreement {agree['agreement']:.1%} ({agree['identical_rows']}/{agree['rows']} rows "
                  f"identical); ONNX Runtime int8 kernels: {fused}", highlight=False)
