"""Each weight once (issue 41): bytes on disk, resident memory, and batch-1 speed of export dirs against the source
checkpoint and CTranslate2 int8.

Sizes: the bytes of every file of each deployable dir (graphs, weights, config, tokenizer), against the source's
`model.safetensors` and CTranslate2's dir. Memory: each dir is opened in its own fresh process (ours by the
t5compress runtime, CTranslate2 by its Translator, 1 thread), and /proc reports resident memory (VmRSS: what the
issue's numbers are; it counts a file page mapped twice twice), proportional memory (Pss, from smaps_rollup) and
the anonymous part after loading and after one batch-8 greedy call (32 tokens in, exactly 32 out; `--tokens IN:OUT`
for others), and VmRSS after a second such call (what a process that goes on serving holds); VmHWM is the peak.
Speed: batch 1, greedy (or `--batch`, `--beams`), 32 in / exactly 32 out, 1 thread, each runtime in its own worker
process driven in turn (round after round, so load from other processes hits all alike), warm-up excluded, median
and p90 per call of the wall time, median and minimum of the process's CPU time.
`--code NAME=CHECKOUT` runs a dir with another checkout's package (a before/after of the code on one dir).

    PYTHONPATH=. .venv-bench/bin/python benchmarks/stored_once.py --checkpoint MODEL_DIR \\
        --dir before=OLD_INT8_DIR --dir after=NEW_INT8_DIR --ct2 CT2_DIR [--code before=/path/to/old/checkout]

Writes benchmarks/results/current/stored_once.{json,md} (`--name` for another stem).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
# tokens in and exactly out: `--tokens IN:OUT` (default 32:32), handed to the worker processes in the environment
TOKENS_IN, TOKENS = (int(x) for x in os.environ.get("STORED_ONCE_TOKENS", "32:32").split(":"))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _memory() -> dict:
    """Resident (VmRSS), anonymous, file-backed and proportional (Pss) memory of this process, and its peak, MB."""
    status = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
              if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    pss = next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("Pss:"))
    return {k: round(v / 1024, 1) for k, v in {**status, "Pss": pss}.items()}


def _inputs(batch: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(5, min(vocab, 30000), size=(batch, TOKENS_IN))
    ids[:, -1] = 1
    return ids, np.ones_like(ids)


def _engine(kind: str, path: str, threads: int):
    """(generate(ids, mask) for exactly TOKENS new tokens, vocab size) of our runtime or CTranslate2."""
    if kind == "ct2":
        from t5compress.bench.engines import load_ctranslate2

        gen = load_ctranslate2(Path(path), threads, {"compute_type": "int8", "eos_token_id": 1})
        vocab = len(json.loads((Path(path) / "shared_vocabulary.json").read_text()))
        return (lambda ids, mask, beams=1: gen(ids, mask, TOKENS, TOKENS, beams)), vocab
    from t5compress.runtime import load_runtime

    path, _, decoders = path.partition("#")  # DIR#merged: the merged decoder for every step
    rt = load_runtime(path, threads=threads, decoders=decoders or "auto")
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    return (lambda ids, mask, beams=1: rt.generate(ids, mask, max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                                   num_beams=beams)), vocab


def worker(kind: str, path: str, threads: int, mode: str) -> None:
    """Child process: `memory` prints one JSON line; `time:BATCH:BEAMS` answers each 'N' line on stdin with N call
    times."""
    base = _memory()
    gen, vocab = _engine(kind, path, threads)
    if mode == "memory":
        loaded = _memory()
        gen(*_inputs(8, vocab))
        after = _memory()
        gen(*_inputs(8, vocab, seed=1))
        print(json.dumps({"start": base, "loaded": loaded, "after_b8": after, "after_b8x2": _memory()}), flush=True)
        return
    _, batch, beams = mode.split(":")
    ids, mask = _inputs(int(batch), vocab)
    gen(ids, mask, int(beams))  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            t, cpu = time.perf_counter(), time.process_time()
            gen(ids, mask, int(beams))
            times.append((time.perf_counter() - t, time.process_time() - cpu))
        print(json.dumps(times), flush=True)


ENVS: dict[str, dict[str, str]] = {}  # run name -> environment variables of its workers (`--env`)


def _child(kind: str, path: str, threads: int, mode: str, code: str | None, name: str = "") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=code or os.environ.get("PYTHONPATH", ""), **ENVS.get(name, {}))
    return subprocess.Popen([sys.executable, __file__, "--worker", kind, path, str(threads), mode], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def memory(runs: dict, threads: int, codes: dict) -> dict:
    out = {}
    for name, (kind, path) in runs.items():
        p = _child(kind, path, threads, "memory", codes.get(name), name)
        out[name] = json.loads(p.communicate()[0].strip().splitlines()[-1])
    return out


def timings(runs: dict, threads: int, codes: dict, rounds: int, calls: int, batch: int = 1, beams: int = 1) -> dict:
    children = {n: _child(k, p, threads, f"time:{batch}:{beams}", codes.get(n), n) for n, (k, p) in runs.items()}
    for p in children.values():
        assert p.stdout.readline().strip() == "ready"
    times = {n: [] for n in children}
    for _ in range(rounds):
        for n, p in children.items():
            p.stdin.write(f"{calls}\n")
            p.stdin.flush()
            times[n] += json.loads(p.stdout.readline())
    for p in children.values():
        p.stdin.close()
        p.wait()
    def ms(x: float) -> float:
        return round(x * 1e3, 1)

    return {n: {"median_ms": ms(statistics.median(w for w, _ in t)),
                "p90_ms": ms(np.percentile([w for w, _ in t], 90)),
                "cpu_median_ms": ms(statistics.median(c for _, c in t)), "cpu_min_ms": ms(min(c for _, c in t)),
                "calls": len(t)} for n, t in times.items()}


def render(result: dict) -> str:
    st = result["safetensors_bytes"]
    lines = ["# Each weight once: bytes, resident memory, speed", "",
             f"Source checkpoint `model.safetensors`: {st:,} bytes.", "",
             "| dir | bytes | vs safetensors | vs CTranslate2 int8 | RSS loaded MB | RSS after b8 MB "
             "| Pss after b8 MB | anon after b8 MB | peak MB | RSS after a 2nd b8 MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ct2 = result["bytes"].get("ct2")
    for name, size in result["bytes"].items():
        m = result["memory"].get(name, {})
        after, loaded, again = m.get("after_b8", {}), m.get("loaded", {}), m.get("after_b8x2", {})
        vs_ct2 = f"{size / ct2:.3f}x" if ct2 else "-"
        lines.append(f"| {name} | {size:,} | {size / st:.3f}x | {vs_ct2} | {loaded.get('VmRSS', '-')} | "
                     f"{after.get('VmRSS', '-')} | {after.get('Pss', '-')} | {after.get('RssAnon', '-')} | "
                     f"{after.get('VmHWM', '-')} | {again.get('VmRSS', '-')} |")
    if result.get("speed"):
        search = "greedy" if result.get("beams", 1) == 1 else f"beam {result['beams']}"
        lines += ["", f"Batch {result.get('batch', 1)} {search}, {TOKENS_IN} in / exactly {TOKENS} out, "
                  f"{result['threads']} thread(s), "
                  "interleaved rounds (wall time, and the process's CPU time, which other jobs on the machine disturb "
                  "less):", "", "| dir | median ms | p90 ms | CPU median ms | CPU min ms | calls |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {n} | {s['median_ms']} | {s['p90_ms']} | {s.get('cpu_median_ms', '-')} | "
                  f"{s.get('cpu_min_ms', '-')} | {s['calls']} |" for n, s in result["speed"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", type=Path, help="the source model dir (its model.safetensors)")
    ap.add_argument("--dir", action="append", default=[], help="NAME=EXPORT_DIR (ours; EXPORT_DIR#merged: opened "
                    "with the merged decoder)")
    ap.add_argument("--ct2", type=Path, help="a CTranslate2 int8 dir of the same checkpoint")
    ap.add_argument("--code", action="append", default=[], help="NAME=CHECKOUT: run that dir with this package")
    ap.add_argument("--env", action="append", default=[], help="NAME=KEY=VALUE: that run's workers get KEY=VALUE "
                    "(e.g. T5COMPRESS_WORKING_MEMORY=release)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="the timed calls' batch (memory is always batch 8)")
    ap.add_argument("--beams", type=int, default=1, help="the timed calls' beams (1: greedy)")
    ap.add_argument("--speed", nargs="*", default=None, help="names timed (default: every dir and ct2)")
    ap.add_argument("--tokens", default="32:32", help="IN:OUT tokens in and exactly out, every call (memory too)")
    ap.add_argument("--name", default="stored_once")
    args = ap.parse_args()
    if args.worker:  # its tokens come from the environment
        kind, path, threads, mode = args.worker
        return worker(kind, path, int(threads), mode)
    os.environ["STORED_ONCE_TOKENS"] = args.tokens  # read at import by the workers
    global TOKENS_IN, TOKENS
    TOKENS_IN, TOKENS = (int(x) for x in args.tokens.split(":"))
    from t5compress.bench.stamp import write_result

    runs = {n: ("ours", p) for n, p in (d.split("=", 1) for d in args.dir)}
    if args.ct2:
        runs["ct2"] = ("ct2", str(args.ct2))
    codes = dict(c.split("=", 1) for c in args.code)
    for e in args.env:
        name, key, value = e.split("=", 2)
        ENVS.setdefault(name, {})[key] = value
    result = {"safetensors_bytes": (args.checkpoint / "model.safetensors").stat().st_size, "threads": args.threads,
              "tokens_in": TOKENS_IN, "tokens_out": TOKENS,
              "batch": args.batch, "beams": args.beams,
              "bytes": {n: dir_bytes(Path(p.partition("#")[0])) for n, (_, p) in runs.items()}, "codes": codes,
              "envs": ENVS}
    result["memory"] = memory(runs, args.threads, codes)
    timed = {n: runs[n] for n in (args.speed if args.speed is not None else runs)}
    result["speed"] = (timings(timed, args.threads, codes, args.rounds, args.calls, args.batch, args.beams)
                       if timed else {})
    write_result(ROOT / "results" / "current" / args.name, result, render(result))
    print(render(result))


if __name__ == "__main__":
    main()
