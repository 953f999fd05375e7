"""The search in ONNX Runtime (`generate --search graph`, generator.onnx) against the Python search, same graphs.

For each export dir given (fp32 or int8; a generator.onnx is built in a temporary copy when the dir has none): both
runtimes in one process, called in turn so load from other processes hits both alike, pinned thread count, 32 input
tokens and exactly 32 output tokens (min_new_tokens = max_new_tokens), a warm-up call excluded, the median of
`--repeats` calls per cell, and how many rows hold the same tokens.

    .venv/bin/python benchmarks/search_graph.py --export fp32=DIR --export int8=DIR2 --threads 1

Writes benchmarks/results/current/search_graph.json and .md (`--name` changes the stem).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
CELLS = ((1, 1), (1, 4), (8, 1), (8, 4))  # (batch, beams)


def with_generator(src: Path, scratch: Path) -> Path:
    from t5compress.export.generator import write_generator

    if (src / "generator.onnx").is_file():
        return src
    dst = scratch / src.name
    shutil.copytree(src, dst)
    write_generator(dst)
    return dst


def timed(runtime, ids: np.ndarray, gen: dict) -> float:
    start = time.perf_counter()
    runtime.generate(ids, **gen)
    return (time.perf_counter() - start) * 1000


def measure(path: Path, threads: int, repeats: int, seed: int = 0) -> list[dict]:
    from t5compress.export.generator import same_rows
    from t5compress.runtime import load_runtime

    python, graph = load_runtime(path, threads=threads), load_runtime(path, threads=threads, search="graph")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rows = []
    for batch, beams in CELLS:
        ids = np.random.default_rng(seed).integers(5, min(vocab, 32000), size=(batch, 32))
        ids[:, -1] = 1
        gen = dict(num_beams=beams, max_new_tokens=32, min_new_tokens=32)
        same = same_rows(python.generate(ids, **gen), graph.generate(ids, **gen), python.tokens, beams)  # warm-up
        ms = {"python": [], "graph": []}
        for _ in range(repeats):  # alternate, one call each, so drift hits both
            ms["python"].append(timed(python, ids, gen))
            ms["graph"].append(timed(graph, ids, gen))
        p50 = {k: round(statistics.median(v), 1) for k, v in ms.items()}
        rows.append({"batch": batch, "beams": beams, "python_ms": p50["python"], "graph_ms": p50["graph"],
                     "speedup": round(p50["python"] / p50["graph"], 3), "identical_rows": same, "rows": batch})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", action="append", required=True, help="LABEL=DIR, an ONNX export dir; repeatable")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="search_graph")
    args = ap.parse_args()
    results = {"threads": args.threads, "repeats": args.repeats, "variants": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for spec in args.export:
            label, _, where = spec.partition("=")
            path = with_generator(Path(where), Path(scratch))
            results["variants"][label] = {"dir": where, "cells": measure(path, args.threads, args.repeats)}
    md = [f"# Search in ONNX Runtime (generator.onnx) vs the Python search, {args.threads} thread(s)", "",
          "Same export dir, both runtimes in one process, 32 tokens in and exactly 32 out, median of "
          f"{args.repeats} calls; speed-up = Python ms / graph ms.", "",
          "| variant | batch | beams | Python search ms | in-graph search ms | speed-up | identical rows |",
          "|---|---|---|---|---|---|---|"]
    for label, v in results["variants"].items():
        md += [f"| {label} | {c['batch']} | {c['beams']} | {c['python_ms']} | {c['graph_ms']} | {c['speedup']}x | "
               f"{c['identical_rows']}/{c['rows']} |" for c in v["cells"]]
    from t5compress.bench.stamp import write_result

    write_result((ROOT / "results" / "current" / args.name).with_suffix(""), results, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
