"""Separate decoders vs the merged decoder alone: bytes on disk, resident memory after loading, time per generate call.

One export dir written with `--decoders both` holds both layouts. Memory: each layout is opened by the t5compress
runtime in its own fresh process (so resident memory is that layout's alone). Time: both layouts in one process,
called in turn (so load from other processes hits both alike), pinned thread count, forced output length
(min_new_tokens = max_new_tokens), warm-up call excluded, median wall and CPU time per call, tokens compared.

    .venv/bin/python benchmarks/decoder_layouts.py                     # t5-small shape, random weights
    .venv/bin/python benchmarks/decoder_layouts.py --export-dir DIR    # an existing `--decoders both` export

Writes benchmarks/results/current/decoder_layouts.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
FILES = {"separate": ("encoder_model", "decoder_model", "decoder_with_past_model"),
         "merged": ("encoder_model", "decoder_model_merged")}
CASES = {"b1": dict(batch=1, num_beams=1), "b8": dict(batch=8, num_beams=1), "beam4": dict(batch=1, num_beams=4)}


def build(arch: str, root: Path) -> Path:
    """A random-weight model of `arch` exported with both decoder layouts."""
    import torch

    from t5compress.model.load import create_model, save_model_dir
    from t5compress.model.tokenization import byte_level

    model_dir, export_dir = root / arch, root / f"{arch}-both"
    model = create_model(arch, vocab_size=32128)
    with torch.no_grad():  # random init can repeat one token; a smaller embedding keeps the ops and varies output
        model.shared.weight.mul_(0.3)
    save_model_dir(model, byte_level(), model_dir)
    cli = [sys.executable, "-m", "t5compress.cli", "export", str(model_dir), str(export_dir), "--decoders", "both"]
    subprocess.run(cli, check=True, stdout=subprocess.DEVNULL)
    return export_dir


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def memory(export_dir: str, layout: str, threads: int, tokens: int) -> dict:
    """Run in a child process: resident memory after loading one layout, and after a batch-8 generate call."""
    from t5compress.runtime import load_runtime

    before = _rss_mb()
    rt = load_runtime(export_dir, threads=threads, decoders=layout)
    loaded = _rss_mb() - before
    ids = np.random.default_rng(0).integers(3, 259, (8, tokens)).astype(np.int64)
    rt.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens)
    return {"load_rss_mb": round(loaded, 1), "rss_after_b8_mb": round(_rss_mb() - before, 1)}


def timings(export_dir: str, threads: int, tokens: int, repeat: int) -> dict[str, dict]:
    """Both layouts loaded in this process and called in turn, so a busy machine slows both alike.

    Wall time and this process's CPU time per call (with 1 intra-op thread ONNX Runtime computes in the calling
    thread, so CPU time is the work done, whatever else the machine runs)."""
    from t5compress.runtime import load_runtime

    runtimes = {layout: load_runtime(export_dir, threads=threads, decoders=layout) for layout in FILES}
    rng = np.random.default_rng(0)
    out: dict[str, dict] = {layout: {} for layout in FILES}
    for name, case in CASES.items():
        ids = rng.integers(3, 259, (case["batch"], tokens)).astype(np.int64)
        gen = dict(num_beams=case["num_beams"], max_new_tokens=tokens, min_new_tokens=tokens)
        wall: dict[str, list[float]] = {layout: [] for layout in FILES}
        cpu: dict[str, list[float]] = {layout: [] for layout in FILES}
        results = {layout: rt.generate(ids, **gen) for layout, rt in runtimes.items()}  # warm-up
        same = all(np.array_equal(r, results["separate"]) for r in results.values())
        for k in range(repeat):
            order = list(FILES) if k % 2 == 0 else list(FILES)[::-1]
            for layout in order:
                t0, c0 = time.perf_counter(), time.process_time()
                runtimes[layout].generate(ids, **gen)
                wall[layout].append((time.perf_counter() - t0) * 1000)
                cpu[layout].append((time.process_time() - c0) * 1000)
        for layout in FILES:
            out[layout][name] = {"median_ms": round(statistics.median(wall[layout]), 1),
                                 "cpu_median_ms": round(statistics.median(cpu[layout]), 1),
                                 "same_tokens": same}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export-dir", help="An export dir written with --decoders both (default: build t5-small)")
    parser.add_argument("--arch", default="t5-small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32, help="Input tokens and forced output tokens.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(memory(args.child[0], args.child[1], args.threads, args.tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = Path(args.export_dir) if args.export_dir else build(args.arch, Path(tmp))
        rows = {}
        for layout, stems in FILES.items():
            disk = sum(f.stat().st_size for s in stems for f in export_dir.glob(f"{s}.onnx*"))
            cmd = [sys.executable, __file__, "--child", str(export_dir), layout, "--threads", str(args.threads),
                   "--tokens", str(args.tokens)]
            child = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows[layout] = {"disk_mb": round(disk / 1e6, 1), **json.loads(child.stdout.strip().splitlines()[-1])}
            print(layout, rows[layout], flush=True)
        for layout, cases in timings(str(export_dir), args.threads, args.tokens, args.repeat).items():
            rows[layout].update(cases)
            print(layout, cases, flush=True)
    results = {"arch": args.arch, "threads": args.threads, "tokens": args.tokens, "repeat": args.repeat,
               "layouts": rows}
    from t5compress.bench.stamp import write_result

    lines = [f"{args.arch} shape, random weights, {args.threads} thread(s), {args.tokens} in / {args.tokens} out, "
             f"median per generate call over {args.repeat} interleaved calls: CPU ms (wall ms)", "",
             "| decoders | disk MB | RSS after load MB | RSS after b8 MB | b1 | b8 | beam 4 |",
             "|---|---|---|---|---|---|---|"]
    for layout, r in rows.items():
        cells = " | ".join(f"{r[c]['cpu_median_ms']} ({r[c]['median_ms']})" for c in CASES)
        lines.append(f"| {layout} | {r['disk_mb']} | {r['load_rss_mb']} | {r['rss_after_b8_mb']} | {cells} |")
    write_result(ROOT / "results" / "current" / "decoder_layouts", results, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
