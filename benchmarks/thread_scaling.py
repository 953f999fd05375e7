"""Does a second intra-op thread cut generate latency, and which session settings make it? The variants of the
runtime's thread settings are opened side by side in one process and called in turn, call after call (the order
rotated every round), with a pause before each call longer than ONNX Runtime's spin after a run (~50 ms), so that
a change in the machine's load, and a pool spinning after its run, cost each alike; each (dir, batch) cell is
measured in a process of its own, and each cell `--repeats` times (a fresh process each time). A cell's figure is
the median of the repeats' p50s.

Variants (all with the runtime's own code; the settings they change are patched while that runtime opens):
  1t               threads=1 (as before: no pool)
  2t               threads=2, today's settings (spin while a run lasts, `runtime.threads.SPIN_IN_RUN`)
  2t-nospin        threads=2 with the settings before issue 43 (workers never spin)
  2t-spin          threads=2 with ONNX Runtime's default spinning (workers spin ~50 ms after every run)
  2t-blockbase4    2t plus `session.dynamic_block_base` 4

(Its earlier results also have 2t-past1t, the with-past steps of up to 4 rows on a one-thread session, and
2t-pastspin, the with-past pool spinning on between steps: both measured slower, and the runtime code they patched
is gone.)

    PYTHONPATH=. .venv/bin/python benchmarks/thread_scaling.py int8=DIR fp32=DIR --batches 1 8 \
        --out benchmarks/results/current/thread_scaling

Greedy, 32 tokens in and exactly 32 out, random token ids. Writes OUT.json and OUT.md (stamped).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VARIANTS = ("1t", "2t", "2t-nospin", "2t-spin", "2t-blockbase4")


def opened(variant: str, path: str):
    """The runtime on `path` with `variant`'s settings (patched while it opens, restored after)."""
    from t5compress.runtime import load_runtime, threads

    spin = dict(threads.SPIN_IN_RUN)
    if variant == "2t-nospin":
        threads.SPIN_IN_RUN = dict(threads.NO_SPIN)
    elif variant == "2t-spin":
        threads.SPIN_IN_RUN = {"session.intra_op.allow_spinning": "1"}
    elif variant == "2t-blockbase4":
        threads.SPIN_IN_RUN = {**spin, "session.dynamic_block_base": "4"}
    try:
        return load_runtime(path, threads=1 if variant == "1t" else 2, max_input_tokens=None)
    finally:
        threads.SPIN_IN_RUN = spin


def child(variants: list[str], path: str, batch: int, calls: int, pause: float) -> dict:
    """p50 and p90 ms per variant of `calls` greedy calls each (after 2 warm-up calls), called in turn."""
    runtimes = {v: opened(v, path) for v in variants}
    rows = np.random.default_rng(0).integers(3, 250, size=(batch, 32))
    rows[:, -1] = 1
    gen = dict(max_new_tokens=32, min_new_tokens=32, num_beams=1)
    ms: dict[str, list[float]] = {v: [] for v in variants}
    loads = []
    for i in range(calls + 2):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:  # rotated: no variant always follows
            rt = runtimes[v]                                                      # the same one
            time.sleep(pause)
            t0 = time.perf_counter()
            rt.generate(rows, np.ones_like(rows), **gen)
            if i >= 2:
                ms[v].append((time.perf_counter() - t0) * 1000)
        loads.append(os.getloadavg()[0])
    return {"load": [min(loads), max(loads)],
            "variants": {v: {"p50": float(np.median(x)), "p90": float(np.percentile(x, 90)),
                             "with_past": type(runtimes[v].backend.decoder_with_past).__name__}
                         for v, x in ms.items()}}


def run_child(variants: list[str], path: str, batch: int, calls: int, pause: float) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", ",".join(variants), path, str(batch), str(calls),
                           str(pause)], capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(dirs: dict[str, str], batches: list[int], variants: list[str], repeats: int, calls: int,
            pause: float) -> list[dict]:
    cells = []
    for name, path in dirs.items():
        for batch in batches:
            runs = [run_child(variants, path, batch, calls, pause) for _ in range(repeats)]
            base = float(np.median([r["variants"][variants[0]]["p50"] for r in runs]))
            cell = {"dir": name, "batch": batch, "load": [x for r in runs for x in r["load"]], "variants": {}}
            for v in variants:
                p50 = [r["variants"][v]["p50"] for r in runs]
                ratio = [r["variants"][variants[0]]["p50"] / r["variants"][v]["p50"] for r in runs]
                cell["variants"][v] = {"p50_ms": round(float(np.median(p50)), 1),
                                       "p50_ms_each_repeat": [round(x, 1) for x in p50],
                                       "p90_ms_each_repeat": [round(r["variants"][v]["p90"], 1) for r in runs],
                                       f"speedup_vs_{variants[0]}": round(base / float(np.median(p50)), 2),
                                       "speedup_each_repeat": [round(x, 2) for x in ratio],
                                       "with_past_graph": sorted({r["variants"][v]["with_past"] for r in runs})}
            cells.append(cell)
            print(markdown_cell(cell, variants), flush=True)
    return cells


def markdown_cell(cell: dict, variants: list[str]) -> str:
    def one(v: str) -> str:
        x = cell["variants"][v]
        each = "/".join(f"{r:.2f}" for r in x["speedup_each_repeat"])
        return f"{x['p50_ms']} ({x[f'speedup_vs_{variants[0]}']:.2f}x; {each})"

    return (f"| {cell['dir']} | b{cell['batch']} | {min(cell['load']):.1f}-{max(cell['load']):.1f} | "
            + " | ".join(one(v) for v in variants) + " |")


def markdown(result: dict) -> str:
    variants = result["variants"]
    lines = ["# Thread scaling: 1 vs 2 intra-op threads (greedy, 32 in / exactly 32 out, p50 ms per call)", "",
             f"The variants side by side in one process, called in turn ({result['calls']} calls each, "
             f"{result['pause']} s pause before each); each cell {result['repeats']} times in a fresh process. "
             f"A cell: the median of the repeats' p50s (ms), its speed-up over `{variants[0]}`, and that speed-up "
             "in each repeat. Load: the 1-minute load average while the cell ran (other jobs at nice 19 on the "
             "same vCPUs).",
             "", "| dir | batch | load | " + " | ".join(variants) + " |", "|---|---|---|" + "---:|" * len(variants)]
    lines += [markdown_cell(c, variants) for c in result["cells"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        variants, path, batch, calls, pause = sys.argv[2:7]
        print(json.dumps(child(variants.split(","), path, int(batch), int(calls), float(pause))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="NAME=DIR (export dirs)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    help="the first is the baseline of the speed-ups")
    ap.add_argument("--repeats", type=int, default=2, help="processes per cell")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per variant and process")
    ap.add_argument("--pause", type=float, default=0.06, help="seconds before each call (ONNX Runtime spins ~50 ms)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    dirs = dict(spec.partition("=")[::2] for spec in args.dirs)
    cells = measure(dirs, args.batches, args.variants, args.repeats, args.calls, args.pause)
    result = {"variants": args.variants, "repeats": args.repeats, "calls": args.calls, "pause": args.pause,
              "cells": cells}
    from t5compress.bench.stamp import write_result

    md = markdown(result)
    write_result(args.out, result, md)
    print(md)


if __name__ == "__main__":
    main()
