"""Generation speed on CPU: PyTorch fp32 `generate`, optimum's ORTModelForSeq2SeqLM fp32 and the t5compress runtime.

All three run in this one process on the same random-weight models of real shapes (speed does not depend on the
weights), with pinned thread counts, a forced output length (min_new_tokens = max_new_tokens), warm-up calls
excluded, and median / p90 per call. optimum loads the very export dir the t5compress runtime uses.

    .venv/bin/python benchmarks/generate_speed.py                 # full grid (~10-15 min on 2 cores)
    .venv/bin/python benchmarks/generate_speed.py --quick         # one shape, fewer repeats

Writes benchmarks/results/generate_speed.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
SHAPES = ["t5-small", "t5-efficient-small-el2"]


def build(arch: str, root: Path) -> tuple[Path, Path]:
    """Save a random-weight model of `arch` and export it with `t5compress export --onnx`."""
    import torch

    from t5compress.models import create_model, save_model_dir
    from t5compress.tokenization import byte_level

    model_dir, export_dir = root / arch, root / f"{arch}-onnx"
    model = create_model(arch, vocab_size=32128)
    with torch.no_grad():  # random init can repeat one token; a smaller embedding keeps the ops and varies output
        model.shared.weight.mul_(0.3)
    save_model_dir(model, byte_level(), model_dir)
    cli = [sys.executable, "-m", "t5compress.cli", "export", str(model_dir), str(export_dir), "--onnx"]
    subprocess.run(cli, check=True, stdout=subprocess.DEVNULL)
    return model_dir, export_dir


def timed(fn, args: tuple, warmup: int, repeat: int) -> dict:
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"median_ms": round(statistics.median(times), 1),
            "p90_ms": round(times[min(len(times) - 1, int(0.9 * len(times)))], 1),
            "out_len": int(np.asarray(out).shape[-1])}


def backends(model_dir: Path, export_dir: Path, threads: int) -> dict:
    """name -> callable(input_ids, mask, new_tokens, beams) returning token ids."""
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM
    from transformers import T5ForConditionalGeneration

    from t5compress.evaluation import generate_kwargs
    from t5compress.runtime import load_runtime

    torch.set_num_threads(threads)
    pt = T5ForConditionalGeneration.from_pretrained(model_dir).eval()
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # fair: the same setting ours uses
    opt = ORTModelForSeq2SeqLM.from_pretrained(export_dir, use_merged=False, use_cache=True, session_options=so)
    rt = load_runtime(export_dir, threads=threads)

    def hf(m, extra):
        def run(ids, mask, n, beams):
            with torch.inference_mode():
                return m.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                  max_new_tokens=n, min_new_tokens=n, num_beams=beams, do_sample=False,
                                  **extra).numpy()
        return run

    def ours(ids, mask, n, beams):
        return rt.generate(ids, mask, max_new_tokens=n, min_new_tokens=n, num_beams=beams)

    return {"pytorch fp32": hf(pt, generate_kwargs(pt)), "optimum ort fp32": hf(opt, {}), "t5compress fp32": ours}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="t5-small only, threads 1, fewer repeats")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    shapes, thread_counts = (SHAPES[:1], [1]) if args.quick else (SHAPES, [1, 2])
    repeat = 3 if args.quick else args.repeat
    rows = []
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in shapes:
            model_dir, export_dir = build(arch, Path(tmp))
            for threads in thread_counts:
                runners = backends(model_dir, export_dir, threads)
                for batch in (1, 8):
                    ids = rng.integers(3, 250, size=(batch, 32)).astype(np.int64)
                    ids[:, -1] = 1  # </s>
                    mask = np.ones_like(ids)
                    for beams in (1, 4):
                        row = {"shape": arch, "threads": threads, "batch": batch,
                               "decode": "greedy" if beams == 1 else f"beam {beams}"}
                        for name, fn in runners.items():
                            try:
                                row[name] = timed(fn, (ids, mask, 32, beams), 1, repeat)
                            except Exception as e:  # a peer's bug is a result, not a crash of the benchmark
                                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    write(rows, args.out)


def write(rows: list[dict], out: Path) -> None:
    names = ["pytorch fp32", "optimum ort fp32", "t5compress fp32"]
    out.mkdir(parents=True, exist_ok=True)
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "in_tokens": 32, "out_tokens": 32}
    (out / "generate_speed.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = ["| shape | threads | batch | decode | " + " | ".join(f"{n} ms (×PT)" for n in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        base = r["pytorch fp32"].get("median_ms")
        cells = []
        for n in names:
            v = r[n]
            if "error" in v:
                cells.append(f"fails: {v['error']}")
            else:
                cells.append(f"{v['median_ms']:.0f} (p90 {v['p90_ms']:.0f}, {base / v['median_ms']:.2f}×)" if base
                             else f"{v['median_ms']:.0f}")
        lines.append(f"| {r['shape']} | {r['threads']} | {r['batch']} | {r['decode']} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n\n×PT: speed-up over PyTorch fp32 generate in the same run (higher is better).\n"
    (out / "generate_speed.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
