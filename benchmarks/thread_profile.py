"""Where a second intra-op thread is won or lost at batch 1: ONNX Runtime's per-node profile of one greedy call
(32 tokens in, exactly 32 out) at 1 and at 2 threads, per graph (encoder, first decoder step, with-past step).

Each export dir is opened three times in one process, every graph at 1 thread, at 2 threads without spinning (the
settings before issue 43) and at 2 threads as the runtime now opens them (spinning while a run lasts), always the
shared-cache with-past graph the runtime runs, with ONNX Runtime's profiler on, and the three are called in turn so
that a busy moment costs each alike. From the traces: per graph, ms per run (`model_run`), kernel ms, nodes, which
op types got faster or slower and by how much, the nodes that gained and lost, and the main thread's time in the
thread pool (ONNX Runtime's thread-pool profiler: handing work out, waiting for the worker). The profiler adds its
own cost to every node, so absolute times are above the runtime's; the 1-vs-2 comparison is the point. Unprofiled
wall-clock ratios come from `thread_scaling.py`.

    PYTHONPATH=. .venv/bin/python benchmarks/thread_profile.py int8=DIR fp32=DIR \
        --out benchmarks/results/current/thread_profile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

GRAPHS = (("encoder", "encoder_model"), ("first", "decoder_model"), ("past", "decoder_with_past_model"))
POOL_KEYS = ("Distribution", "DistributionEnqueue", "Wait", "WaitRevoke")


# name -> (intra-op threads, session config entries over the runtime's own)
CONFIGS = {"1t": (1, {}), "2t no spin (before)": (2, {"session.intra_op.allow_spinning": "0",
                                                      "session.force_spinning_stop": "0"}),
           "2t spin in run (today)": (2, {})}


def profiled_runtime(path: Path, config: str, prefix: Path):
    """The runtime on `path` with every graph at `config`'s threads and entries, and the profiler on."""
    threads, entries = CONFIGS[config]
    from t5compress.runtime import load_runtime, session_options
    from t5compress.runtime.sessions import OnnxGraph, onnx_session
    from t5compress.runtime.sharedkv import open_shared

    def options(name: str):
        so = session_options(threads)
        for k, v in entries.items():
            so.add_session_config_entry(k, v)
        so.enable_profiling, so.profile_file_prefix = True, str(prefix / f"{name}-{config.replace(' ', '-')}")
        return so

    rt = load_runtime(path, threads=1)
    graphs = {}
    for key, stem in GRAPHS[:2]:  # the graphs as stored (the runtime's own encoder reads the with-past's table)
        graph = path / f"{stem}.onnx"
        graphs[key] = OnnxGraph(graph, threads, session=onnx_session(graph, options(key)))
    graphs["past"] = open_shared(path, options("past"))
    rt.backend = dataclasses.replace(rt.backend, encoder=graphs["encoder"], decoder=graphs["first"],
                                     decoder_with_past=graphs["past"])
    return rt, graphs


def summarise(trace: list[dict], calls: int) -> dict:
    """Per-run figures of one graph's trace (`calls` generate calls; the warm-up runs are dropped by the caller)."""
    runs = [e["dur"] for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    nodes = [e for e in trace if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    n_runs = max(len(runs), 1)
    by_op: dict[str, float] = {}
    by_node: dict[str, float] = {}
    pooled, pool_us = 0, 0.0
    for e in nodes:
        args = e.get("args", {})
        op = args.get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + e["dur"]
        by_node[e["name"]] = by_node.get(e["name"], 0.0) + e["dur"]
        stats = args.get("thread_scheduling_stats") or {}
        stats = json.loads(stats) if isinstance(stats, str) else stats  # a string at 1 thread (no pool)
        main = stats.get("main_thread", {}) if isinstance(stats, dict) else {}
        if main.get("block_size"):
            pooled += 1
        pool_us += sum(float(main.get(k, 0)) for k in POOL_KEYS)
    per = 1000.0 * n_runs  # µs summed over runs -> ms per run
    return {"runs_per_call": round(len(runs) / calls, 1), "ms_per_run": round(sum(runs) / per, 3),
            "kernel_ms_per_run": round(sum(by_op.values()) / per, 3), "nodes_per_run": round(len(nodes) / n_runs),
            "pooled_nodes_per_run": round(pooled / n_runs), "pool_ms_per_run": round(pool_us / per, 3),
            "by_op_ms": {k: v / per for k, v in by_op.items()}, "by_node_ms": {k: v / per for k, v in by_node.items()}}


def compare(one: dict, two: dict) -> dict:
    """The 1-vs-2 comparison of one graph: op types and nodes faster or slower at 2 threads (ms per run)."""
    ops = sorted(set(one["by_op_ms"]) | set(two["by_op_ms"]))
    delta = {op: (one["by_op_ms"].get(op, 0.0), two["by_op_ms"].get(op, 0.0)) for op in ops}
    nodes = set(one["by_node_ms"]) & set(two["by_node_ms"])
    gained = sum(max(one["by_node_ms"][n] - two["by_node_ms"][n], 0.0) for n in nodes)
    lost = sum(max(two["by_node_ms"][n] - one["by_node_ms"][n], 0.0) for n in nodes)
    top = sorted(delta.items(), key=lambda kv: -kv[1][0])[:10]
    return {"ops_ms_1t_2t": {op: [round(a, 3), round(b, 3)] for op, (a, b) in top},
            "nodes_faster_ms": round(gained, 3), "nodes_slower_ms": round(lost, 3),
            "nodes_faster": sum(two["by_node_ms"][n] < one["by_node_ms"][n] for n in nodes),
            "nodes_slower": sum(two["by_node_ms"][n] > one["by_node_ms"][n] for n in nodes)}


def profile_dir(path: Path, calls: int) -> dict:
    rows = np.random.default_rng(0).integers(3, 250, size=(1, 32))
    rows[:, -1] = 1
    gen = dict(max_new_tokens=32, min_new_tokens=32, num_beams=1)
    prefix = Path(tempfile.mkdtemp(prefix="t5c-threads-"))
    rts = {c: profiled_runtime(path, c, prefix) for c in CONFIGS}
    for rt, _ in rts.values():  # warm-up: the first runs allocate; they stay in the trace, dropped below by count
        rt.generate(rows, np.ones_like(rows), **gen)
    wall: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(calls):
        for t, (rt, _) in rts.items():
            time.sleep(0.02)
            t0 = time.perf_counter()
            rt.generate(rows, np.ones_like(rows), **gen)
            wall[t].append((time.perf_counter() - t0) * 1000)
    out: dict = {"wall_ms_profiled": {t: round(float(np.median(w)), 1) for t, w in wall.items()}, "graphs": {}}
    for key, _ in GRAPHS:
        per_t = {}
        for t, (_, graphs) in rts.items():
            trace = json.loads(Path(graphs[key].session.end_profiling()).read_text())
            per_run = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
            skip = len(per_run) // (calls + 1)  # the warm-up call's runs
            cut = per_run[skip]["ts"] if skip < len(per_run) else 0
            per_t[t] = summarise([e for e in trace if e.get("ts", 0) >= cut], calls)
        out["graphs"][key] = {
            **{t: {k: v for k, v in s.items() if not k.startswith("by_")} for t, s in per_t.items()},
            "compare": {t: compare(per_t["1t"], per_t[t]) for t in CONFIGS if t != "1t"}}
    return out


def markdown(result: dict) -> str:
    lines = ["# Where a second thread goes at batch 1 (greedy, 32 in / exactly 32 out, ONNX Runtime profiler on)", "",
             f"Load average when measured: {result['load']}.", "",
             "| dir | graph | runs/call | config | ms/run | vs 1t | kernel ms | nodes | nodes on the pool | "
             "main thread in pool ms | nodes faster: ms saved | nodes slower: ms lost |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["dirs"].items():
        for g, x in r["graphs"].items():
            one = x["1t"]
            for t in CONFIGS:
                b, c = x[t], x["compare"].get(t)
                won = f"{c['nodes_faster']}: {c['nodes_faster_ms']:.2f}" if c else ""
                lost = f"{c['nodes_slower']}: {c['nodes_slower_ms']:.2f}" if c else ""
                lines.append(f"| {name} | {g} | {one['runs_per_call']} | {t} | {b['ms_per_run']:.2f} | "
                             f"{one['ms_per_run'] / b['ms_per_run']:.2f}x | {b['kernel_ms_per_run']:.2f} | "
                             f"{b['nodes_per_run']} | {b['pooled_nodes_per_run']} | {b['pool_ms_per_run']:.2f} | "
                             f"{won} | {lost} |")
    lines += ["", "Op types by time at 1 thread, ms per run at 1 thread → each 2-thread config:", ""]
    for name, r in result["dirs"].items():
        for g, x in r["graphs"].items():
            first = next(iter(x["compare"].values()))["ops_ms_1t_2t"]
            ops = ", ".join(f"{op} {a:.2f}→" + "/".join(f"{x['compare'][t]['ops_ms_1t_2t'][op][1]:.2f}"
                                                         for t in x["compare"]) for op, (a, _) in first.items())
            lines.append(f"- {name} {g} ({' / '.join(x['compare'])}): {ops}")
    lines += ["", "Whole calls with the profiler on (ms, p50): " + "; ".join(
        f"{n} " + " / ".join(f"{t} {v}" for t, v in r["wall_ms_profiled"].items()) for n, r in result["dirs"].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="NAME=DIR (export dirs)")
    ap.add_argument("--calls", type=int, default=5, help="profiled generate calls per thread count")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    result = {"load": round(os.getloadavg()[0], 2), "dirs": {}}
    for spec in args.dirs:
        name, _, d = spec.partition("=")
        result["dirs"][name] = profile_dir(Path(d), args.calls)
    result["load_after"] = round(os.getloadavg()[0], 2)
    from t5compress.bench.stamp import write_result

    md = markdown(result)
    write_result(args.out, result, md)
    print(md)


if __name__ == "__main__":
    main()
