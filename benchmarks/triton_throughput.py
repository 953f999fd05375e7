"""Served throughput: a Triton server with dynamic batching, 8 concurrent clients vs one client at a time, for each
repository flavour, against the local runtime on the same export, texts and thread budget.

A random-weight model of the t5-small shape (speed does not depend on the weights) is exported with
`t5compress export --onnx`, written as the default in-process repository (the text model runs the graphs itself) and
as the `--portable` one (leaf models called over BLS every step; the tritonserver of nvidia-pytriton has no ONNX
Runtime backend, so that is the leaf flavour that runs here), and served on 127.0.0.1 by the package's launcher.
Fixed inputs of 32 tokens, output length forced to 32 new tokens (min_new_tokens = max_new_tokens), greedy, warm-up
requests excluded, one thread per graph. The same inputs through the local runtime (one process, one thread; batch 1
and batch 8) give the server's overhead per request and the throughput a server could reach.

    .venv/bin/python benchmarks/triton_throughput.py            # ~4-6 min on 2 cores (export ~1 min)
    .venv/bin/python benchmarks/triton_throughput.py --quick    # fewer rounds and requests

Needs `make triton-env`. Writes benchmarks/results/current/triton_throughput.json and .md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NEW_TOKENS = 32
CONCURRENCY = 8


def texts(n: int) -> list[str]:
    """n distinct texts of 31 bytes: 32 tokens with EOS under the byte-level tokenizer."""
    return [f"input {k:04d}: the quick brown fox"[:31].ljust(31, ".") for k in range(n)]


def local_latency(rt, inputs: list[str], repeat: int, offset: int) -> list[float]:
    """Milliseconds per single-text call of the local runtime (same settings as the served requests)."""
    times = []
    for k in range(repeat):
        t0 = time.perf_counter()
        rt.generate_text([inputs[(offset + k) % len(inputs)]], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        times.append((time.perf_counter() - t0) * 1000)
    return times


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process `root` and all its descendants (the server and its python stubs)."""
    parents, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        pid = int(stat.parent.name)
        parents[pid], cpu[pid] = int(fields[1]), int(fields[11]) + int(fields[12])  # ppid, utime + stime (ticks)
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return sum(cpu.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def cpu_per_request(server_pid: int, phase) -> tuple[dict, float]:
    """Run `phase()` (a measure call); CPU ms per answered request, server tree plus this client process."""
    s0, c0 = tree_cpu_seconds(server_pid), time.process_time()
    result = phase()
    cpu = (tree_cpu_seconds(server_pid) - s0) + (time.process_time() - c0)
    return result, cpu * 1000 / max(result["ok"], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the machine's load drifts)")
    ap.add_argument("--queue-delay-us", type=int, default=20000,
                    help="dynamic batching delay: long enough for answered clients to send their next request")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the model, export and repository here")
    ap.add_argument("--flavours", default="in-process,portable",
                    help="repository flavours to serve, in order: in-process, portable, and either with "
                         "'-search-graph' (generator.onnx: the whole search in one call per batch)")
    ap.add_argument("--name", default="triton_throughput", help="file name of the results")
    args = ap.parse_args()
    rounds, sequential, concurrent = (2, 6, 24) if args.quick else (args.rounds, 8, 40)

    from generate_speed import build  # same random t5-small-shaped model and export as the goals benchmark

    from t5compress.runtime import load_runtime
    from t5compress.triton import TritonConfig, run

    work = args.workdir or Path(tempfile.mkdtemp(prefix="triton-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    export_dir = work / "t5-small" / "onnx"  # where build() puts it
    if not export_dir.is_dir():
        build("t5-small", work)
    inputs = texts(64)
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    rt = load_runtime(export_dir, threads=1)
    local_latency(rt, inputs, 1, 0)  # warm-up
    c0 = time.process_time()
    local_latency(rt, inputs, 4, 0)
    local_cpu_ms = (time.process_time() - c0) * 1000 / 4  # CPU time, unlike wall time, barely moves with the load
    results = {}
    for flavour in args.flavours.split(","):
        repo = work / f"repo-{flavour}"
        search_graph = flavour.endswith("-search-graph")
        if search_graph and not (export_dir / "generator.onnx").is_file():
            from t5compress.export.generator import write_generator

            write_generator(export_dir)
        cfg = TritonConfig(name="t5", portable=flavour.startswith("portable"), max_batch_size=CONCURRENCY, threads=1,
                           queue_delay_us=args.queue_delay_us, search_graph=search_graph)
        run(export_dir, cfg, repo, force=True, progress=False)
        results[flavour] = serve(flavour, repo, work, rt, inputs, gen, rounds, sequential, concurrent, args)
        results[flavour]["cpu_ms_per_request"]["local_runtime"] = round(local_cpu_ms, 1)
    from t5compress.bench.stamp import write_result

    text = "\n".join(markdown(r) for r in results.values()) + summary(results)
    write_result(ROOT / "results" / "current" / args.name, results, text)
    print(text)


def local_batch_throughput(rt, inputs: list[str], repeat: int) -> float:
    """Requests per second of the local runtime generating CONCURRENCY texts at once (what a server batches)."""
    batch = inputs[:CONCURRENCY]
    rt.generate_text(batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeat):
        rt.generate_text(batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return round(CONCURRENCY * repeat / (time.perf_counter() - t0), 2)


def serve(flavour: str, repo: Path, work: Path, rt, inputs, gen, rounds, sequential, concurrent, args) -> dict:
    """One flavour's rounds of local / one client / 8 clients, back to back, and its result."""
    from t5compress.triton.client import batch_statistics, measure
    from t5compress.triton.server import Ports, find_server, start

    # Rounds of local / one client / 8 clients, back to back: on a shared machine the load drifts between phases,
    # so each round gives its own ratio and the median of the ratios is reported.
    local_ms, ones, manys, grpcs, batches, cpu_one, cpu_many, local_rps = [], [], [], [], [], [], [], []
    with start(find_server(), repo, Ports.free(), log_path=work / f"server-{flavour}.log") as server:
        measure(server.http_url, "t5", "http", CONCURRENCY, CONCURRENCY, inputs, warmup=2, **gen)  # warm-up
        for r in range(rounds):
            local_ms += local_latency(rt, inputs, sequential // 2, r)
            local_rps.append(local_batch_throughput(rt, inputs, 2))
            one, cpu = cpu_per_request(server.pid, lambda: measure(server.http_url, "t5", "http", 1, sequential,
                                                                   inputs, warmup=0, **gen))
            ones.append(one)
            cpu_one.append(cpu)
            before = batch_statistics(server.http_url, "t5")
            many, cpu = cpu_per_request(server.pid, lambda: measure(server.http_url, "t5", "http", CONCURRENCY,
                                                                    concurrent, inputs, warmup=0, **gen))
            manys.append(many)
            cpu_many.append(cpu)
            after = batch_statistics(server.http_url, "t5")
            batches.append((after["inference_count"] - before["inference_count"])
                           / max(after["execution_count"] - before["execution_count"], 1))
        grpcs.append(measure(server.grpc_url, "t5", "grpc", CONCURRENCY, concurrent, inputs, warmup=0, **gen))
    ratios = [m["throughput_rps"] / o["throughput_rps"] for m, o in zip(manys, ones, strict=True)]
    med = statistics.median
    return {
        "flavour": flavour, "shape": "t5-small (random weights)", "tokens_in": 32, "tokens_out": NEW_TOKENS,
        "graph_threads": 1,
        "queue_delay_us": args.queue_delay_us, "rounds": rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "local_runtime": {"p50_ms": round(med(local_ms), 1), "throughput_rps": round(1000 / med(local_ms), 2),
                          f"batch_{CONCURRENCY}_rps": med(local_rps)},
        "sequential": ones, "concurrent_http": manys, "concurrent_grpc": grpcs,
        "mean_batch": round(med(batches), 2),
        "speedup_per_round": [round(x, 2) for x in ratios],
        "speedup": round(med(ratios), 2),
        "server_overhead_ms": round(med([o["p50_ms"] for o in ones]) - med(local_ms), 1),
        "cpu_ms_per_request": {"served_1_client": round(med(cpu_one), 1),
                               f"served_{CONCURRENCY}_clients": round(med(cpu_many), 1)},
    }


def summary(results: dict) -> str:
    """The served throughput at 8 clients against the local runtime's at batch 8, per flavour (goal >= 90%)."""
    med = statistics.median
    lines = ["", f"Served at {CONCURRENCY} clients (HTTP) vs the local runtime at batch {CONCURRENCY}, 1 thread, "
             "measured in the same rounds:", ""]
    for flavour, r in results.items():
        served = med([m["throughput_rps"] for m in r["concurrent_http"]])
        local = r["local_runtime"][f"batch_{CONCURRENCY}_rps"]
        lines.append(f"- {flavour}: {served} vs {local} req/s = **{served / local:.0%}** (goal >= 90%)")
    return "\n".join(lines) + "\n"


def markdown(r: dict) -> str:
    med, c = statistics.median, r["cpu_ms_per_request"]
    rows = [("local runtime, batch 1", 1, r["local_runtime"]["p50_ms"], "-", r["local_runtime"]["throughput_rps"]),
            (f"local runtime, batch {CONCURRENCY}", "-", "-", "-", r["local_runtime"][f"batch_{CONCURRENCY}_rps"])]
    for label, ms in (("served, HTTP", r["sequential"]), ("served, HTTP", r["concurrent_http"]),
                      ("served, gRPC", r["concurrent_grpc"])):
        rows.append((label, ms[0]["concurrency"], med([m["p50_ms"] for m in ms]), med([m["p99_ms"] for m in ms]),
                     med([m["throughput_rps"] for m in ms])))
    lines = [f"## {r['flavour']}", "",
             f"Triton throughput, {r['shape']}, {r['tokens_in']} tokens in / {r['tokens_out']} out, greedy, "
             f"{r['machine']}, 1 thread per graph, queue delay {r['queue_delay_us'] / 1000:g} ms, "
             f"median of {r['rounds']} rounds", "",
             "| client | concurrent | p50 ms | p99 ms | req/s |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    lines += ["", f"- {CONCURRENCY} clients vs 1 over HTTP: **{r['speedup']}x** throughput (rounds: "
              f"{', '.join(map(str, r['speedup_per_round']))}; goal >= 3x); mean batch {r['mean_batch']} requests per "
              "execution of the text model",
              f"- server overhead per request (p50 served with 1 client minus p50 of the local runtime, batch 1): "
              f"{r['server_overhead_ms']} ms (wall time: grows with the machine's load, 4 processes take turns "
              "every step)",
              f"- CPU ms per request (server processes + client, which the load barely changes): local runtime "
              f"{c['local_runtime']}, served 1 client {c['served_1_client']}, served {CONCURRENCY} clients "
              f"{c[f'served_{CONCURRENCY}_clients']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
