"""`t5compress quantize EXPORT_DIR OUT --static --calib-data FILE` or `--dynamic`."""

from __future__ import annotations

from typing import Annotated

import typer

from t5compress.cli.common import Force, OutDir, Threads, command, console, fail
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.quantize.stage import QuantizeConfig as Q


@command
def quantize(
    export_dir: Annotated[str, typer.Argument(help="An fp32 ONNX export directory (from `t5compress export`).")],
    out: OutDir,
    static: Annotated[bool, typer.Option("--static", help="Static int8 on --calib-data (default).")] = False,
    dynamic: Annotated[bool, typer.Option("--dynamic", help="Dynamic int8: no calibration data needed.")] = False,
    calib_data: Annotated[str | None, typer.Option(help=_h(Q, "calib_data"))] = None,
    field: Annotated[str, typer.Option(help=_h(Q, "field"))] = _d(Q, "field"),
    prefix: Annotated[str, typer.Option(help=_h(Q, "prefix"))] = _d(Q, "prefix"),
    samples: Annotated[int, typer.Option(help=_h(Q, "samples"))] = _d(Q, "samples"),
    method: Annotated[str, typer.Option(help=_h(Q, "method"))] = _d(Q, "method"),
    per_channel: Annotated[bool, typer.Option(help=_h(Q, "per_channel"))] = _d(Q, "per_channel"),
    weight_range: Annotated[str, typer.Option(help=_h(Q, "weight_range"))] = _d(Q, "weight_range"),
    quant_format: Annotated[str, typer.Option("--format", help=_h(Q, "format"))] = _d(Q, "format"),
    op_types: Annotated[str, typer.Option(help=_h(Q, "op_types") + " Comma-separated.")] = ",".join(
        _d(Q, "op_types")),
    embeddings: Annotated[bool, typer.Option(help=_h(Q, "embeddings"))] = _d(Q, "embeddings"),
    keep_fp32: Annotated[str, typer.Option(help=_h(Q, "keep_fp32"))] = _d(Q, "keep_fp32"),
    smooth_alpha: Annotated[float, typer.Option(help=_h(Q, "smooth_alpha"))] = _d(Q, "smooth_alpha"),
    eval_data: Annotated[str | None, typer.Option(help=_h(Q, "eval_data"))] = None,
    eval_max: Annotated[int, typer.Option(help=_h(Q, "eval_max"))] = _d(Q, "eval_max"),
    max_new_tokens: Annotated[int, typer.Option(help=_h(Q, "max_new_tokens"))] = _d(Q, "max_new_tokens"),
    batch_size: Annotated[int, typer.Option(help=_h(Q, "batch_size"))] = _d(Q, "batch_size"),
    min_agreement: Annotated[float, typer.Option(help=_h(Q, "min_agreement"))] = _d(Q, "min_agreement"),
    tolerance: Annotated[float | None, typer.Option(help=_h(Q, "tolerance"))] = None,
    threads: Threads = _d(Q, "threads"),
    force: Force = False,
) -> None:
    """Quantize an ONNX export to int8 (static or dynamic), checked against fp32 before anything is written."""
    from t5compress.quantize.stage import run

    if static and dynamic:
        fail("choose one of --static and --dynamic")
    cfg = Q(
        mode="dynamic" if dynamic else "static", calib_data=calib_data, field=field, prefix=prefix, samples=samples,
        method=method, per_channel=per_channel, weight_range=weight_range, format=quant_format,
        op_types=tuple(t.strip() for t in op_types.split(",") if t.strip()), embeddings=embeddings,
        keep_fp32=keep_fp32, smooth_alpha=smooth_alpha, eval_data=eval_data, eval_max=eval_max,
        max_new_tokens=max_new_tokens, batch_size=batch_size, min_agreement=min_agreement, threads=threads,
        tolerance=tolerance,
    )
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
    kept = sorted({n for g in report["graphs"].values() if isinstance(g, dict) for n in g.get("kept_fp32", [])})
    if kept:
        con.print(f"kept fp32: {len(kept)} node(s), e.g. {kept[0]}", highlight=False)
