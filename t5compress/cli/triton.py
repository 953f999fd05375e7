"""`t5compress triton EXPORT REPO`, `t5compress serve REPO`, `t5compress bench-triton URL`."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import (
    Force,
    OutDir,
    command,
    config_from,
    console,
    err_console,
    fail,
    field_options,
    show,
    with_options,
)
from t5compress.stages import stage
from t5compress.triton.serve import ServeConfig
from t5compress.triton.stage import TritonConfig as C

DEFAULT_TEXTS = ("translate English to German: The house is wonderful.",
                 "summarize: the quick brown fox jumps over the lazy dog while the cat sleeps in the sun.")


@command
@with_options(field_options(C))
def triton(
    export_dir: Annotated[Path, typer.Argument(help="ONNX export directory (t5compress export MODEL OUT --onnx).")],
    out: OutDir,
    force: Force = False,
    **opts,
) -> None:
    """Write a Triton model repository: a text-in/text-out BLS model and its encoder/decoder leaf models."""
    run = stage("triton").runner()

    report = run(export_dir, config_from(C, opts), out, force=force)
    show("triton", report, out, "Triton model repository")
    console.print(f"serve it: t5compress serve {out}", highlight=False)
    if report["flavour"] == "onnxruntime":
        console.print("(the leaf models need Triton's ONNX Runtime backend, as in NVIDIA's container; "
                      "--portable repositories run on any Triton with the python backend)", highlight=False)


@command
@with_options(field_options(ServeConfig))
def serve(
    repo: Annotated[Path, typer.Argument(help="Model repository (written by `t5compress triton`).")],
    **opts,
) -> None:
    """Start a Triton Inference Server on REPO, print its endpoints, and stop it on Ctrl-C."""
    run = stage("serve").runner()
    from t5compress.triton.server import find_server

    cfg = config_from(ServeConfig, opts)
    server = find_server(cfg.tritonserver)  # says how to get one before anything else
    console.print(f"starting tritonserver ({server.origin}) on {repo} ...", highlight=False)

    def ready(running, log_path) -> None:
        console.print(f"ready (pid {running.pid}): HTTP {running.http_url}  gRPC {running.grpc_url}  "
                      f"metrics {running.metrics_url}", highlight=False)
        console.print(f"server log: {log_path}; Ctrl-C to stop", highlight=False)

    def event(line: str) -> None:
        err_console.print(f"[yellow]serve:[/yellow] {line}", highlight=False, soft_wrap=True)

    report = run(repo, cfg, on_ready=ready, on_event=event)
    code = report["exit_code"]
    how = f"exit code {code}" if code is None or code >= 0 else f"ended by {signal.Signals(-code).name}"
    console.print(f"tritonserver stopped ({how})", highlight=False)


PERF_ANALYZER_HELP = "Run NVIDIA's perf_analyzer (must be on PATH) instead of the built-in client."


@command
def bench_triton(
    url: Annotated[str, typer.Argument(help="The server's HTTP endpoint, host:port.")],
    model: Annotated[str, typer.Option(help="Served model name.")] = "t5",
    protocol: Annotated[list[str], typer.Option(help="http, grpc and/or grpc-stream (repeat the option); "
                                                "grpc-stream: a decoupled model (triton --inflight), streamed, "
                                                "timing the first piece and each later one.")] = ["http"],  # noqa: B006
    grpc_url: Annotated[str | None, typer.Option(help="gRPC endpoint (default: URL's host, port + 1).")] = None,
    concurrency: Annotated[list[int], typer.Option(help="Concurrent clients (repeat for several levels).")] = [1, 8],  # noqa: B006
    requests: Annotated[int, typer.Option(min=1, help="Requests per level (bounded load).")] = 64,
    text: Annotated[list[str] | None, typer.Option(help="Input text (repeat; default: two fixed texts).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to generate per request.")] = None,
    min_new_tokens: Annotated[int | None, typer.Option(help="Force at least this many tokens.")] = None,
    num_beams: Annotated[int | None, typer.Option(help="Beam search width.")] = None,
    max_seconds: Annotated[float | None, typer.Option(min=1, help="Soak: stop sending after this many seconds per "
                                                    "row, however many --requests are left.")] = None,
    out: Annotated[Path | None, typer.Option(help="Also write the results as JSON here.")] = None,
    perf_analyzer: Annotated[bool, typer.Option("--perf-analyzer", help=PERF_ANALYZER_HELP)] = False,
) -> None:
    """Latency p50/p90/p99, throughput, errors and empty answers of a served text model at several concurrency
    levels; a soak with many --requests (and --max-seconds) also gives a local server's memory before and after."""
    from t5compress import artifacts
    from t5compress.triton.client import measure, server_rss_mb

    if perf_analyzer:
        _perf_analyzer(url, model, concurrency, requests)
        return
    host = url.removeprefix("http://").rsplit(":", 1)
    grpc = grpc_url or (f"{host[0]}:{int(host[1]) + 1}" if len(host) == 2 and host[1].isdigit() else None)
    if any(p.startswith("grpc") for p in protocol) and grpc is None:
        fail("pass --grpc-url (URL has no port to derive it from)")
    texts = list(text or DEFAULT_TEXTS)
    settings = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams)
    rows, rss_before = [], server_rss_mb(url)
    for p in protocol:
        for c in concurrency:
            rows.append(measure(url if p == "http" else grpc, model, p, c, requests, texts, max_seconds=max_seconds,
                                **settings))
    rss = {"before": rss_before, "after": server_rss_mb(url)}
    console.print(_rows_table(rows, f"{model} at {url}: {requests} requests per row"))
    if rss["before"] is not None and rss["after"] is not None:
        console.print(f"server memory (RSS of tritonserver and its stubs): {rss['before']} MB before, "
                      f"{rss['after']} MB after ({rss['after'] - rss['before']:+.1f} MB)")
    if out:
        artifacts.write_json(out, {"url": url, "model": model, "texts": texts, "settings": settings, "rows": rows,
                                   "server_rss_mb": rss})
        console.print(f"results → [bold]{out}[/bold]")
    if any(r["errors"] for r in rows):
        first = next(r["first_error"] for r in rows if r["errors"])
        err_console.print(f"[red]error:[/red] some requests failed, e.g. {first}", highlight=False)
        raise typer.Exit(code=1)
    if any(r["empty"] for r in rows):
        err_console.print(f"[red]error:[/red] {sum(r['empty'] for r in rows)} answer(s) held no text", highlight=False)
        raise typer.Exit(code=1)


def _rows_table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    streamed = any("first_piece_p50_ms" in r for r in rows)
    columns = ["protocol", "clients", "ok", "errors", "empty", "p50 ms", "p90 ms", "p99 ms", "req/s"]
    for col in columns + (["first piece p50 ms", "ms/piece"] if streamed else []):
        t.add_column(col, justify="right")
    for r in rows:
        cells = [r["protocol"], r["concurrency"], r["ok"], r["errors"], r["empty"], r["p50_ms"], r["p90_ms"],
                 r["p99_ms"], r["throughput_rps"]]
        cells += [r.get("first_piece_p50_ms", "-"), r.get("ms_per_piece_p50", "-")] if streamed else []
        t.add_row(*map(str, cells))
    return t


def _perf_analyzer(url: str, model: str, concurrency: list[int], requests: int) -> None:
    exe = shutil.which("perf_analyzer")
    if exe is None:
        fail("perf_analyzer is not on PATH (it ships in NVIDIA's tritonserver SDK container); "
             "drop --perf-analyzer to use the built-in client")
    levels = f"{min(concurrency)}:{max(concurrency)}"
    argv = [exe, "-m", model, "-u", url, "--concurrency-range", levels, "--request-count", str(requests),
            "--string-data", DEFAULT_TEXTS[0], "--shape", "TEXT:1"]
    console.print(" ".join(argv), highlight=False)
    raise typer.Exit(code=subprocess.call(argv))
