"""Thread scaling beside the peers (issue 43): p50 ms of one greedy call at 1 and 2 threads for our static int8 export
(and 4-bit, `--int4`; fp32, `--fp32`), CTranslate2 int8 and llama.cpp Q8_0 (and Q4_0, `--llama4`) of the same
checkpoint, and the 2-thread/1-thread speed-up. Before the first round and after each, the memory bandwidth one core
gets and two get together (the host's other tenants share it; a batch-1 step streams tens of MB of weights).

Each (engine, threads, batch) cell runs in a process of its own; the processes run in rounds, every cell once per
round in the same order (1t ours, 2t ours, 1t CTranslate2, 2t CTranslate2, 1t llama.cpp, ...), so a drift in the
machine's load hits every cell alike. Each process: 2 warm-up calls (not timed), then `--calls` timed calls with
`--pause` s before each. A cell's p50 is over all its timed calls of all rounds. Greedy, 32 tokens in (random ids,
the last `</s>`) and exactly 32 out (min = max new tokens; llama.cpp: EOS ignored); batch 1 for every engine and the
`--batches` beyond 1 for ours and CTranslate2 (the llama.cpp driver decodes one sequence).

llama.cpp runs through `benchmarks/thread_peers_llama.cpp`, a small driver on llama.h (encode once, then one
`llama_decode` per token, greedy argmax over the logits in C++); build it against llama.cpp (the copy vendored in
the llama-cpp-python 0.3.16 sdist here) and convert the checkpoint with its `convert_hf_to_gguf.py --outtype q8_0`
(Q4_0: `--outtype f16`, then its `llama-quantize F16.gguf Q4_0.gguf Q4_0`, built with `-DLLAMA_BUILD_TOOLS=ON`); see
docs/benchmarks.md, "Threads: 1 vs 2 at batch 1 and 8 (issue 43)".

    PYTHONPATH=. .venv/bin/python benchmarks/thread_peers.py --ours t5-small=DIR --ct2 t5-small=CT2_DIR \
        --llama t5-small=MODEL.gguf --llama-driver BUILD/t5drive --peer-python .venv-bench/bin/python \
        --out benchmarks/results/current/thread_peers

More models: more NAME=PATH of each engine. Writes OUT.json and OUT.md (stamped).
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

ENGINES = {"ours": "our static int8", "int4": "our 4-bit", "fp32": "our fp32", "ct2": "CTranslate2 int8",
           "llama": "llama.cpp Q8_0", "llama4": "llama.cpp Q4_0"}
LLAMA = ("llama", "llama4")  # GGUF files, run by the driver at batch 1
BANDWIDTH_MB, BANDWIDTH_S = 256, 2.0  # the probe's array and how long each process reads it
N_IN, N_OUT, WARMUP = 32, 32, 2


def input_rows(batch: int) -> np.ndarray:
    rows = np.random.default_rng(0).integers(3, 250, size=(batch, N_IN))
    rows[:, -1] = 1
    return rows


def ours(path: str, threads: int, batch: int):
    from t5compress.runtime import load_runtime

    rt = load_runtime(path, threads=threads, max_input_tokens=None)
    rows = input_rows(batch)

    def call() -> int:
        out = rt.generate(rows, np.ones_like(rows), max_new_tokens=N_OUT, min_new_tokens=N_OUT, num_beams=1)
        return int(np.asarray(out).shape[1]) - 1  # without the decoder start token
    return call


def ct2(path: str, threads: int, batch: int):
    import ctranslate2

    tr = ctranslate2.Translator(path, device="cpu", compute_type="int8", inter_threads=1, intra_threads=threads)
    vocab = json.loads((Path(path) / "shared_vocabulary.json").read_text())
    tokens = [[vocab[i] for i in row.tolist()] for row in input_rows(batch)]

    def call() -> int:
        out = tr.translate_batch(tokens, beam_size=1, max_decoding_length=N_OUT, min_decoding_length=N_OUT,
                                 max_batch_size=0)
        return min(len(r.hypotheses[0]) for r in out)
    return call


def child(engine: str, path: str, threads: int, batch: int, calls: int, pause: float) -> dict:
    """The timed calls of one cell in this process: ms per call, load average, tokens out."""
    call = {"ours": ours, "int4": ours, "fp32": ours, "ct2": ct2}[engine](path, threads, batch)
    ms, outs = [], set()
    for i in range(WARMUP + calls):
        time.sleep(pause)
        t0 = time.perf_counter()
        outs.add(call())
        if i >= WARMUP:
            ms.append((time.perf_counter() - t0) * 1000)
    huge = next((int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHuge")), 0)
    return {"ms": ms, "tokens_out": sorted(outs), "huge_mb": round(huge / 1024)}


def run_cell(engine: str, path: str, threads: int, batch: int, args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]
    if engine in LLAMA:
        ids = ",".join(str(i) for i in input_rows(1)[0].tolist())
        cmd = [str(args.llama_driver), path, str(threads), ids, str(N_OUT), str(WARMUP), str(args.calls),
               str(round(args.pause * 1000))]
    else:
        python = str(args.peer_python) if engine == "ct2" else sys.executable
        cmd = [python, __file__, "--child", engine, path, str(threads), str(batch), str(args.calls), str(args.pause)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        raise SystemExit(f"error: {engine} {threads}t b{batch}: {done.stderr.strip().splitlines()[-1:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if engine in LLAMA:
        out = {"ms": out["ms"], "tokens_out": [len(out["tokens"])]}
    return {**out, "load": [round(load, 2), round(os.getloadavg()[0], 2)]}


def read_memory(start: float) -> tuple[float, float, float]:
    """GB/s of this process reading a `BANDWIDTH_MB` array (numpy max, one core) for `BANDWIDTH_S` from `start`, and
    when it began and ended (epoch s)."""
    a = np.ones(BANDWIDTH_MB << 20, np.uint8)
    a.max()
    while time.time() < start:
        time.sleep(0.001)
    n, t0, began = 0, time.perf_counter(), time.time()
    while time.perf_counter() - t0 < BANDWIDTH_S:
        a.max()
        n += 1
    return n * (BANDWIDTH_MB << 20) / 1e9 / (time.perf_counter() - t0), began, time.time()


def bandwidth() -> dict:
    """The memory bandwidth one core gets alone and two cores get together, now: the host's other tenants share
    it, and a batch-1 step streams its weights from memory (tens of MB a step), so it bounds what a second thread
    can gain."""
    def at_once(k: int) -> list[list[float]]:
        start = time.time() + 1.5  # after both processes have their arrays
        ps = [subprocess.Popen([sys.executable, __file__, "--bandwidth", str(start)], stdout=subprocess.PIPE,
                               text=True) for _ in range(k)]
        return [json.loads(p.communicate()[0]) for p in ps]
    one, two = at_once(1)[0][0], at_once(2)
    overlap = (min(t[2] for t in two) - max(t[1] for t in two)) / BANDWIDTH_S  # 1.0: the two read side by side
    total = sum(t[0] for t in two)
    return {"one_core_gb_s": round(one, 1), "two_cores_gb_s": round(total, 1), "ratio": round(total / one, 2),
            "overlap": round(overlap, 2)}


def measure(models: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    cells = [{"model": m["name"], "engine": e, "batch": b, "threads": t, "path": m[e], "runs": []}
             for m in models for e in ENGINES if m.get(e)
             for b in args.batches if b == 1 or e not in LLAMA for t in args.threads]
    probes = [bandwidth()]
    for r in range(args.rounds):
        for c in cells:
            c["runs"].append(run_cell(c["engine"], c["path"], c["threads"], c["batch"], args))
        probes.append(bandwidth())
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}, memory {probes[-1]}",
              file=sys.stderr, flush=True)
    rows = []
    for c in cells:
        ms = [x for run in c["runs"] for x in run["ms"]]
        rows.append({"model": c["model"], "engine": c["engine"], "batch": c["batch"], "threads": c["threads"],
                     "p50_ms": round(float(np.median(ms)), 1), "p90_ms": round(float(np.percentile(ms, 90)), 1),
                     "p50_ms_each_round": [round(float(np.median(run["ms"])), 1) for run in c["runs"]],
                     "huge_pages_mb_each_round": [run.get("huge_mb") for run in c["runs"]],
                     "timed_calls": len(ms), "tokens_out": sorted({n for run in c["runs"] for n in run["tokens_out"]}),
                     "load": [x for run in c["runs"] for x in run["load"]]})
    return rows, probes


def table(rows: list[dict], threads: list[int]) -> list[str]:
    base = threads[0]
    head = ["model", "engine", "batch", *[f"{t} thread{'s' if t > 1 else ''}" for t in threads],
            *[f"{t} vs {base}" for t in threads[1:]], "rounds' p50s", "load"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|" + "---:|" * (2 * len(threads) - 1) + "---|---|"]
    keyed = {(r["model"], r["engine"], r["batch"], r["threads"]): r for r in rows}
    for model, engine, batch in dict.fromkeys((r["model"], r["engine"], r["batch"]) for r in rows):
        cell = [keyed[(model, engine, batch, t)] for t in threads]
        speed = [f"**{cell[0]['p50_ms'] / c['p50_ms']:.2f}x**" for c in cell[1:]]
        rounds = "; ".join(f"{t}t " + "/".join(f"{x:g}" for x in c["p50_ms_each_round"])
                           + (" (huge pages MB " + "/".join(str(h) for h in c["huge_pages_mb_each_round"]) + ")"
                              if c["huge_pages_mb_each_round"][0] is not None else "")
                           for t, c in zip(threads, cell, strict=True))
        load = [x for c in cell for x in c["load"]]
        lines.append(f"| {model} | {ENGINES[engine]} | {batch} | " + " | ".join(f"{c['p50_ms']}" for c in cell)
                     + " | " + " | ".join(speed) + f" | {rounds} | {min(load):.2f}-{max(load):.2f} |")
    return lines


def markdown(result: dict) -> str:
    return "\n".join([
        "# Thread scaling beside the peers (greedy, 32 in / exactly 32 out, p50 ms per call)", "",
        f"Each engine, thread count and batch in a process of its own, in {result['rounds']} rounds (every cell once "
        f"per round, in the table's order); {WARMUP} warm-up calls per process, then {result['calls']} timed calls "
        f"({result['pause']} s pause before each); p50 over the timed calls of all rounds. Load: the 1-minute load "
        "average before and after each process. Tokens out per call: "
        + ", ".join(sorted({str(n) for r in result["rows"] for n in r["tokens_out"]})) + ".", "",
        *table(result["rows"], result["threads"]), "",
        "Memory bandwidth before the first round and after each (GB/s, numpy reading a 256 MB array for 2 s: one "
        "core alone / two cores at once, ratio, and the share of the 2 s the two read side by side): " + "; ".join(
            f"{b['one_core_gb_s']} / {b['two_cores_gb_s']} ({b['ratio']:.2f}x, {b['overlap']:.0%})"
            for b in result["bandwidth"])
        + ".", ""])


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--bandwidth":
        print(json.dumps(read_memory(float(sys.argv[2]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        engine, path, threads, batch, calls, pause = sys.argv[2:8]
        print(json.dumps(child(engine, path, int(threads), int(batch), int(calls), float(pause))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for engine, what in (("ours", "our static int8 export dir"), ("int4", "our 4-bit export dir (--bits 4)"),
                         ("fp32", "our fp32 export dir"), ("ct2", "CTranslate2 int8 dir"),
                         ("llama", "llama.cpp Q8_0 GGUF file"), ("llama4", "llama.cpp Q4_0 GGUF file")):
        ap.add_argument(f"--{engine}", action="append", default=[], metavar="NAME=PATH", help=f"{what} of model NAME")
    ap.add_argument("--llama-driver", type=Path, help="the built thread_peers_llama.cpp driver")
    ap.add_argument("--peer-python", type=Path, default=Path(sys.executable), help="a Python with ctranslate2")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per process")
    ap.add_argument("--pause", type=float, default=0.06, help="seconds before each call")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    models: dict[str, dict] = {}
    for engine in ENGINES:
        for spec in getattr(args, engine):
            name, _, path = spec.partition("=")
            models.setdefault(name, {"name": name})[engine] = path
    models = list(models.values())
    if any(m.get(e) for m in models for e in LLAMA) and not args.llama_driver:
        raise SystemExit("error: --llama needs --llama-driver")
    rows, probes = measure(models, args)
    result = {"threads": args.threads, "batches": args.batches, "rounds": args.rounds, "calls": args.calls,
              "pause": args.pause, "models": models, "rows": rows, "bandwidth": probes}
    from t5compress.bench.stamp import write_result

    md = markdown(result)
    write_result(args.out, result, md)
    print(md)


if __name__ == "__main__":
    main()
