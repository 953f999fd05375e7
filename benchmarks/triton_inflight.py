"""In-flight batching and streaming on a real Triton server: short requests mixed with long ones, and the first piece.

A random-weight model of the t5-small shape is exported twice: as today (`export --onnx`, served by the default
in-process text model: dynamic batching, batch-at-a-time) and with `--inflight` (served by `triton --inflight`: the
decoupled text model, whose greedy requests join the running batch at the next decoder step and leave when done).
Both get the same open-loop load: requests sent at fixed (seeded exponential) arrival times, half with 8 new tokens
and half with 64 (lengths forced with min_new_tokens), 32 tokens in, greedy, over gRPC; a request's latency runs from
its scheduled send time to its final answer, so time queued in the client counts. Equal offered load: when both keep
up, throughput is equal, and the p50 latency of the short requests is the number compared (target: in-flight at
least 1.5x lower).

Streaming: sequential greedy requests with `stream` true to the in-flight server; the time to the first streamed
piece of text against the runtime's own time to first token on the same export (`generate_text(max_new_tokens=1)`:
tokenize, encoder, first decoder step, decode), target at most 1.5x. The model's non-ASCII and non-byte token rows
are scaled down so that nearly every token decodes to a character (a random model otherwise emits ids that are no
text, and a piece would wait for a printable one); shapes and ops are t5-small's.

    .venv/bin/python benchmarks/triton_inflight.py            # ~4 min on 2 cores (two exports ~2 min)
    .venv/bin/python benchmarks/triton_inflight.py --quick

Needs `make triton-env`. Writes benchmarks/results/current/triton_inflight.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
SHORT, LONG = 8, 64


def build(work: Path) -> dict[str, Path]:
    """The random t5-small-shaped model and its two exports (plain and --inflight)."""
    import torch

    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.model.load import create_model, save_model_dir
    from t5compress.model.tokenization import byte_level

    model_dir = work / "model"
    if not model_dir.is_dir():
        model = create_model("t5-small", vocab_size=32128)
        with torch.no_grad():
            model.shared.weight.mul_(0.3)
            text_ids = torch.arange(3 + 32, 3 + 127)  # printable ASCII bytes under the byte tokenizer
            rest = torch.ones(model.shared.weight.shape[0], dtype=torch.bool)
            rest[text_ids] = False
            model.shared.weight[rest] *= 0.05  # tied head: these rarely win the argmax, so tokens decode to text
        save_model_dir(model, byte_level(), model_dir)
    dirs = {"batch": work / "plain", "inflight": work / "inflight"}
    for name, path in dirs.items():
        if not path.is_dir():
            export(model_dir, ExportConfig(inflight=name == "inflight"), path)
    return dirs


def texts(n: int) -> list[str]:
    """n distinct texts of 31 bytes: 32 tokens with EOS under the byte-level tokenizer."""
    return [f"input {k:04d}: the quick brown fox"[:31].ljust(31, ".") for k in range(n)]


def schedule(n: int, rate: float, seed: int = 0) -> list[tuple[float, int]]:
    """(send time in s, max_new_tokens) per request: exponential gaps at `rate` per second, short and long in turn."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [(float(t), SHORT if k % 2 == 0 else LONG) for k, t in enumerate(np.cumsum(gaps) - gaps[0])]


def open_loop(url: str, decoupled: bool, plan: list[tuple[float, int]], inputs: list[str], workers: int) -> dict:
    """Send `plan` (each request at its time, by a pool of gRPC clients); latency per request from its send time."""
    from t5compress.triton.client import connect, infer, stream_infer

    results: list[tuple[int, float, float]] = []  # (max_new_tokens, latency s, end s)
    errors: list[str] = []
    nxt = iter(range(len(plan)))
    lock = threading.Lock()
    t0 = time.perf_counter() + 0.5

    def worker() -> None:
        client = connect(url, "grpc")
        try:
            while True:
                with lock:
                    k = next(nxt, None)
                if k is None:
                    return
                at, new = plan[k]
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                gen = dict(max_new_tokens=new, min_new_tokens=new)
                try:
                    if decoupled:
                        stream_infer(client, "t5", [inputs[k % len(inputs)]], stream=False, **gen)
                    else:
                        infer(client, "grpc", "t5", [inputs[k % len(inputs)]], **gen)
                except Exception as e:  # noqa: BLE001 -- counted, the load goes on
                    with lock:
                        errors.append(str(e))
                    continue
                end = time.perf_counter()
                with lock:
                    results.append((new, end - (t0 + at), end - t0))
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarise(results, errors, plan)


def summarise(results: list[tuple[int, float, float]], errors: list[str], plan: list[tuple[float, int]]) -> dict:
    def pct(new: int | None, q: int) -> float | None:
        ms = [lat * 1000 for n, lat, _ in results if new is None or n == new]
        return round(float(np.percentile(ms, q)), 1) if ms else None

    span = max(end for *_, end in results) if results else float("nan")
    return {"requests": len(plan), "ok": len(results), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "short_p50_ms": pct(SHORT, 50), "short_p90_ms": pct(SHORT, 90),
            "long_p50_ms": pct(LONG, 50), "long_p90_ms": pct(LONG, 90),
            "all_p50_ms": pct(None, 50), "all_p90_ms": pct(None, 90),
            "offered_rps": round(len(plan) / (plan[-1][0] or 1.0), 2),
            "throughput_rps": round(len(results) / span, 2), "seconds": round(span, 1)}


def first_piece(url: str, rt, inputs: list[str], repeat: int) -> dict:
    """Sequential streamed greedy requests: time to the first piece, and the runtime's own time to first token."""
    from t5compress.triton.client import connect, stream_infer

    client = connect(url, "grpc")
    served, per_piece, own = [], [], []
    try:
        for k in range(repeat + 1):
            got = stream_infer(client, "t5", [inputs[k]], max_new_tokens=32, min_new_tokens=32)
            t = time.perf_counter()
            rt.generate_text([inputs[k]], max_new_tokens=1)
            if k:  # the first round warms up both
                own.append((time.perf_counter() - t) * 1000)
                served.append(got.piece_seconds[0] * 1000)
                times = got.piece_seconds
                per_piece.append((times[-1] - times[0]) * 1000 / max(len(times) - 1, 1))
    finally:
        client.close()
    med = statistics.median
    return {"requests": repeat, "first_piece_p50_ms": round(med(served), 1),
            "runtime_first_token_p50_ms": round(med(own), 1), "ratio": round(med(served) / med(own), 2),
            "ms_per_piece_p50": round(med(per_piece), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--rate", type=float, default=1.5,
                    help="requests per second offered to both servers (below what batch-at-a-time keeps up with)")
    ap.add_argument("--requests", type=int, default=60, help="requests per server")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the model, exports and repositories here")
    args = ap.parse_args()
    n = 24 if args.quick else args.requests

    from t5compress.bench.stamp import write_result
    from t5compress.runtime import load_runtime
    from t5compress.triton import TritonConfig, run
    from t5compress.triton.server import Ports, find_server, start

    work = args.workdir or Path(tempfile.mkdtemp(prefix="triton-inflight-"))
    work.mkdir(parents=True, exist_ok=True)
    dirs = build(work)
    inputs = texts(64)
    plan = schedule(n, args.rate)
    results: dict = {"shape": "t5-small (random weights)", "tokens_in": 32, "short_new_tokens": SHORT,
                     "long_new_tokens": LONG, "rate_rps": args.rate, "graph_threads": 1}
    for name, path in dirs.items():
        repo = work / f"repo-{name}"
        run(path, TritonConfig(name="t5", inflight=name == "inflight", max_batch_size=8, threads=1), repo,
            force=True, progress=False)
        with start(find_server(), repo, Ports.free(), log_path=work / f"server-{name}.log") as server:
            open_loop(server.grpc_url, name == "inflight", schedule(6, 10.0, seed=1), inputs, 8)  # warm-up
            results[name] = open_loop(server.grpc_url, name == "inflight", plan, inputs, 24)
            if name == "inflight":
                results["stream"] = first_piece(server.grpc_url, load_runtime(path, threads=1), inputs,
                                                5 if args.quick else 10)
        print(name, json.dumps(results[name]), flush=True)
    b, i = results["batch"], results["inflight"]
    results["short_p50_speedup"] = round(b["short_p50_ms"] / i["short_p50_ms"], 2)
    results["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at end"
    write_result(ROOT / "results" / "current" / "triton_inflight", results, markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    rows = [f"| {name} | {r[name]['ok']}/{r[name]['requests']} | {r[name]['short_p50_ms']} | "
            f"{r[name]['short_p90_ms']} | {r[name]['long_p50_ms']} | {r[name]['all_p50_ms']} | "
            f"{r[name]['all_p90_ms']} | {r[name]['offered_rps']} | {r[name]['throughput_rps']} |"
            for name in ("batch", "inflight")]
    s = r["stream"]
    return "\n".join([
        "# In-flight batching and streaming (Triton, in-process text model)", "",
        f"{r['shape']}, {r['tokens_in']} tokens in, half {r['short_new_tokens']} / half {r['long_new_tokens']} new "
        f"tokens (forced), greedy, open-loop arrivals at {r['rate_rps']} req/s over gRPC, 1 thread per graph, "
        f"{r['machine']}; one run.", "",
        "| server | ok | short p50 ms | short p90 ms | long p50 ms | all p50 ms | all p90 ms | offered req/s | "
        "served req/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        f"- short requests' p50: batch-at-a-time / in-flight = **{r['short_p50_speedup']}x** (target >= 1.5x at "
        "equal throughput)",
        f"- streamed greedy (32 tokens, sequential, {s['requests']} requests): first piece p50 "
        f"{s['first_piece_p50_ms']} ms vs the runtime's own time to first token {s['runtime_first_token_p50_ms']} "
        f"ms = **{s['ratio']}x** (target <= 1.5x); {s['ms_per_piece_p50']} ms per later piece", ""])


if __name__ == "__main__":
    main()
