"""`t5compress quantize EXPORT_DIR OUT --static --calib-data FILE`, `--dynamic` or `--blockwise`."""

from __future__ import annotations

from typing import Annotated

import typer

from t5compress.cli.common import Force, OutDir, command, config_from, console, fail, field_options, with_options
from t5compress.quantize.stage import QuantizeConfig as Q
from t5compress.quantize.stage import applied
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
    report = run(export_dir, cfg, out, force=force)
    print_report(report, console)
    console.print(f"int8 export → [bold]{out}[/bold]")


def print_report(report: dict, con) -> None:
    """Sizes, agreement with fp32 and task metrics as one readable table."""
    from rich.table import Table

    mode = report["mode"] + (f" ({report['method']}, {report['format']})" if report["mode"] == "static" else "")
    size, check = report["size"], report["check"]
    t = Table(title=f"int8 {mode}", title_justify="left")
    for col in ("", "fp32", "int8"):
        t.add_column(col, justify="right")
    t.add_row("size MB", f"{size['fp32_bytes'] / 1e6:.2f}", f"{size['int8_bytes'] / 1e6:.2f} ({size['ratio']:.2f}x)")
    ev = report.get("eval")
    if ev:
        for k in ("exact_match", "rougeL", "bleu"):
            t.add_row(f"{k} ({ev['examples']} eval)", str(ev["fp32"][k]), str(ev["int8"][k]))
    con.print(t)
    con.print(f"vs fp32 on {check['texts']} {check['on']}: next token {check['next_token_agreement']:.2%}, "
              f"greedy outputs {check['greedy_agreement']:.2%} identical; logit error "
              f"{check['mean_rel_logit_error']:.3f} of the logit range on average, "
              f"{check['max_rel_logit_error']:.3f} at worst", highlight=False)
    tuned = report["graphs"].get("tuning")
    if tuned:
        con.print(f"tuned by onnx-neural-compressor: {len(tuned['trials'])} trial(s), {tuned['metric']} "
                  f"{tuned['int8']:g} vs fp32 {tuned['fp32']:g} (goal {tuned['goal']:g})", highlight=False)
    sens = report["graphs"].get("sensitivity")
    target = report.get("target_agreement")
    if not sens and not tuned and target and check["next_token_agreement"] < target:
        con.print(f"next token {check['next_token_agreement']:.2%} is below the target {target:.1%}: "
                  "--keep-fp32 sensitive measures each layer group and keeps the fewest fp32 that reach it",
                  highlight=False)
    if sens:
        from t5compress.quantize.sensitivity import ranked, summary

        con.print(summary(sens), highlight=False)
        if sens["groups"]:  # the default measures them only when all int8 misses the target
            top = ", ".join(f"{r['group']} {r['next_token_agreement']:.1%}" for r in ranked(sens)[:5])
            con.print(f"most sensitive alone (only that group int8): {top}; every group: `t5compress info`",
                      highlight=False)
    kept = sorted({n for g in report["graphs"].values() if isinstance(g, dict) for n in g.get("kept_fp32", [])})
    if kept:
        con.print(f"kept fp32: {len(kept)} node(s), e.g. {kept[0]}", highlight=False)
    for label, text in applied(report):
        con.print(f"{label}: {text}", highlight=False)
