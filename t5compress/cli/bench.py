"""`t5compress bench VARIANT... --out DIR [--data EVAL] [--peers all] [--edge] [--expect KEY=RATIO]...`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from t5compress.bench.config import BenchConfig as B
from t5compress.bench.expect import MISSED_EXIT, exit_code
from t5compress.cli.common import Force, command, config_from, console, err_console, field_options, with_options
from t5compress.config import help_of as _h
from t5compress.stages import stage


@command
@with_options(field_options(B, skip=("expect",)))
def bench(
    variants: Annotated[list[str], typer.Argument(
        help="Variants: model dirs, ONNX / TorchScript export dirs (fp32, int8, QAT, pruned, merged), CTranslate2 "
             "or OpenVINO dirs, or a served model as http://HOST:PORT/MODEL (grpc:// too), each as it is or as "
             "NAME=SPEC. The first is the reference of the agreement.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (must not exist unless --force).")],
    expect: Annotated[list[str] | None, typer.Option(
        "--expect", metavar="KEY=RATIO", help=_h(B, "expect") + f" Repeatable. A missed one exits with code "
        f"{MISSED_EXIT} after the whole report is written (for CI).")] = None,
    force: Force = False,
    **opts,
) -> None:
    """Measure every variant (and the peers) on one grid: latency, cold start, memory, size, accuracy, the speed-up
    over the fastest peer; plots. Exit code 3: an --expect was missed (the report is written); 2: bad input."""
    run = stage("bench").runner()

    cfg = config_from(B, opts, expect=tuple(expect or ()))
    report = run(variants, cfg, out, force=force)
    print_report(report, console)
    console.print(f"bench report → [bold]{out}[/bold] (bench.json, report.md"
                  + (", " + ", ".join(report.get("plots", [])) if report.get("plots") else "") + ")")
    code = exit_code(report.get("expectations"))
    if code:
        err_console.print("[red]expectations missed:[/red] " + "; ".join(report["expectations"]["missed"]),
                          highlight=False, soft_wrap=True)
        raise typer.Exit(code=code)


def print_report(r: dict, con) -> None:
    """One row per variant: size, cold start, memory, p50 per grid cell, accuracy; then the speed-ups over the fastest
    peer per cell and the expectations asked for."""
    from rich.table import Table

    from t5compress.bench.compare import cell_of
    from t5compress.bench.report import decode_name, grid_of, mb, upgrade

    r = upgrade(r)  # a recipe's bench stage may hand back a bench.json written before speed-ups
    keys, n = grid_of(r), r["settings"]["output_tokens"]
    t = Table(title=f"bench: p50 ms per call, {r['settings']['input_tokens']} tokens in, {n} out (p90, p99 in "
                    "report.md)", title_justify="left")
    t.add_column("variant", no_wrap=True)
    for col in ("what", "MB", "cold s", "RSS MB"):
        t.add_column(col, justify="left" if col == "what" else "right")
    for th, b, k in keys:
        t.add_column(f"{th}t b{b} {decode_name(k)}", justify="right")
    acc_key = "exact_match" if r["inputs"]["source"] != "generated sentences" else None
    if acc_key:
        t.add_column("EM", justify="right")
    t.add_column("agree", justify="right")
    for e in r["entries"]:
        if "error" in e:
            t.add_row(e["name"], e["label"], mb(e["size_bytes"]), "[red]failed[/red]", "",
                      *([""] * len(keys)), *([""] if acc_key else []), e["error"][:60])
            continue
        a = e.get("accuracy", {})
        t.add_row(e["name"], e["label"], mb(e["size_bytes"]), f"{e['cold_start_s']:.2f}",
                  f"{e['peak_rss_mb']:.0f}", *[_p50(cell_of(e, k)) for k in keys],
                  *([str(a.get(acc_key, "–"))] if acc_key else []), str(a.get("agreement", "–")))
    con.print(t)
    _print_speedups(r, con)
    _print_expectations(r, con)
    for name, why in r["skipped"].items():
        con.print(f"skipped peer {name}: {why}", highlight=False)


def _p50(c: dict | None) -> str:
    if c is None:
        return "–"
    return f"short {c['new_tokens_min']}" if c["short"] else f"{c['p50_ms']:.1f}"


def _print_speedups(r: dict, con) -> None:
    from rich.table import Table

    from t5compress.bench.report import decode_name

    rows = r["speedups"]
    if not rows or not any(v["speedup"] is not None for row in rows for v in row["variants"].values()):
        con.print("speed-up vs peers: nothing to compare" + ("" if any(e["owner"] == "peer" for e in r["entries"])
                                                            else " (no peer measured; --peers)"), highlight=False)
        return
    t = Table(title="speed-up vs the fastest peer of its precision (its p50 / ours)", title_justify="left")
    t.add_column("variant", no_wrap=True)
    for row in rows:
        t.add_column(f"{row['threads']}t b{row['batch']} {decode_name(row['beams'])}", justify="right")
    for name in rows[0]["variants"]:
        xs = [row["variants"][name] for row in rows]
        t.add_row(name, *[f"{x['speedup']:.2f}x {x['peer']['name']}" if x["speedup"] is not None else "–"
                          for x in xs])
    con.print(t)


def _print_expectations(r: dict, con) -> None:
    from t5compress.bench.expect import need

    x = r.get("expectations")
    if not x:
        return
    for key, ratio in x["asked"].items():
        s = x["summary"][key]
        if key == "size":
            size = x["size"]
            what = (f"not measured ({size['why']})" if size.get("status") == "not measured" else
                    ", ".join(f"{n} {v['ratio']:.3f}x {v['status']}" for n, v in size["variants"].items()))
        elif s["met"] + s["missed"] == 0:
            what = f"not measured ({x['cells'][0]['results'][key]['why']})"
        else:
            what = (f"met in {s['met']} of {s['met'] + s['missed']} measured cells"
                    + (f", {s['not_measured']} not measured" if s["not_measured"] else ""))
        con.print(f"expect {need(key, ratio)}: {what}", highlight=False)
