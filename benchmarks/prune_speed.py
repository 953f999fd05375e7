"""Generation speed of pruned vs unpruned T5 through the t5compress ONNX runtime (fp32, CPU).

t5-small shape with random weights (speed does not depend on the weights): unpruned; 50% of heads and 50% of FFN
channels removed (uniform schedule, magnitude scores: no data needed); and the same plus the decoder cut to 3 layers
(a deep encoder, a shallow decoder). Each is exported with `t5compress.export.run` (parity-checked) and run with
`t5compress.runtime.load_runtime`: 32 tokens in, exactly 32 out, greedy, batch 1 and 8, pinned threads, warm-up
excluded, median and p90 per call, all side by side in one process.

    .venv/bin/python benchmarks/prune_speed.py            # ~5 min on 2 cores
    .venv/bin/python benchmarks/prune_speed.py --repeat 3 --threads 1

Writes benchmarks/results/current/prune_speed.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
VARIANTS = {  # name -> (share of heads removed, share of FFN channels removed, decoder layers kept)
    "unpruned": (0.0, 0.0, None),
    "heads 50% + ffn 50%": (0.5, 0.5, None),
    "heads 50% + ffn 50% + decoder 3 layers": (0.5, 0.5, 3),
}


def build(root: Path, name: str, heads: float, ffn: float, decoder_layers: int | None) -> dict:
    """Create the random t5-small, prune it as asked, save it, export it; returns sizes and paths."""
    import torch

    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.model.load import create_model, save_model_dir
    from t5compress.model.tokenization import byte_level
    from t5compress.prune.importance import magnitude
    from t5compress.prune.measure import size
    from t5compress.prune.schedule import SCHEDULES, Targets, apply_plan

    model = create_model("t5-small", vocab_size=32128)
    with torch.no_grad():  # random init can repeat one token; a smaller embedding keeps the ops and varies output
        model.shared.weight.mul_(0.3)
    ratios = {"encoder.heads": heads, "decoder.heads": heads, "decoder.cross": heads, "encoder.ffn": ffn,
              "decoder.ffn": ffn}
    apply_plan(model, SCHEDULES["uniform"](model, magnitude(model), Targets(ratios, None, decoder_layers)))
    slug = name.replace(" ", "_").replace("%", "").replace("+", "")
    model_dir, export_dir = root / slug, root / f"{slug}-onnx"
    save_model_dir(model, byte_level(), model_dir)
    t0 = time.perf_counter()
    report = export(model_dir, ExportConfig(), export_dir)
    return {"model": str(model_dir), "export": str(export_dir), **size(model),
            "onnx_bytes": sum(p.stat().st_size for p in export_dir.glob("*.onnx*")),
            "export_s": round(time.perf_counter() - t0, 1),
            "parity_max_abs_diff": max(report["parity"]["max_abs_diff"].values())}


def timed(fn, warmup: int, repeat: int) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"median_ms": round(statistics.median(times), 1),
            "p90_ms": round(times[min(len(times) - 1, int(0.9 * len(times)))], 1)}


CT2 = "CTranslate2 int8, unpruned"


def ours(rt):
    return lambda ids, mask: rt.generate(ids, mask, max_new_tokens=32, min_new_tokens=32, num_beams=1)


def quantized(builds: dict) -> dict:
    """Each variant's dynamic int8 export (no calibration data: random weights)."""
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    out = {}
    for name, b in builds.items():
        dst = Path(b["export"] + "-int8")
        quantize(b["export"], QuantizeConfig(mode="dynamic", min_agreement=0.0), dst, progress=False)
        out[f"{name} + int8"] = {**b, "export": str(dst),
                                 "onnx_bytes": sum(p.stat().st_size for p in dst.glob("*.onnx*"))}
    return out


def ctranslate2_dir(root: Path, unpruned: dict) -> Path | None:
    try:
        import ctranslate2
    except ImportError:
        print("CTranslate2 not installed here (make bench-env): its row is skipped", flush=True)
        return None
    out = root / "ct2-int8"
    ctranslate2.converters.TransformersConverter(unpruned["model"]).convert(str(out), quantization="int8")
    return out


def ctranslate2_runner(path: Path, threads: int):
    import ctranslate2

    tr = ctranslate2.Translator(str(path), device="cpu", compute_type="int8", inter_threads=1, intra_threads=threads)
    vocab = json.loads((path / "shared_vocabulary.json").read_text()) if (path / "shared_vocabulary.json").is_file() \
        else (path / "shared_vocabulary.txt").read_text(encoding="utf-8").split("\n")

    def run(ids, mask):
        tokens = [[vocab[i] for i in row.tolist()] for row in ids]
        tr.translate_batch(tokens, beam_size=1, max_decoding_length=32, min_decoding_length=32, max_batch_size=0)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current")
    ap.add_argument("--int8", action="store_true", help="also each variant's dynamic int8 export")
    ap.add_argument("--ctranslate2", action="store_true", help="also CTranslate2 int8 of the unpruned model (the "
                                                               "issue's reference; needs `make bench-env`)")
    args = ap.parse_args()
    from t5compress.runtime import load_runtime

    rng = np.random.default_rng(0)
    inputs = {}
    for batch in (1, 8):
        ids = rng.integers(3, 250, size=(batch, 32)).astype(np.int64)
        ids[:, -1] = 1  # </s>
        inputs[batch] = (ids, np.ones_like(ids))
    rows, builds = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (heads, ffn, dec) in VARIANTS.items():
            builds[name] = build(Path(tmp), name, heads, ffn, dec)
            print(json.dumps({name: builds[name]}), flush=True)
        if args.int8:
            builds.update(quantized(builds))
        ct2 = ctranslate2_dir(Path(tmp), builds["unpruned"]) if args.ctranslate2 else None
        for threads in args.threads:
            runners = {name: ours(load_runtime(b["export"], threads=threads)) for name, b in builds.items()}
            if ct2:
                runners[CT2] = ctranslate2_runner(ct2, threads)
            for batch, (ids, mask) in inputs.items():
                row = {"threads": threads, "batch": batch}
                for name, run in runners.items():
                    row[name] = timed(lambda run=run, ids=ids, mask=mask: run(ids, mask), 1, args.repeat)
                rows.append(row)
                print(json.dumps(row), flush=True)
        if ct2:
            builds[CT2] = {"parameters": builds["unpruned"]["parameters"],
                           "block_parameters": builds["unpruned"]["block_parameters"],
                           "onnx_bytes": sum(p.stat().st_size for p in ct2.iterdir() if p.suffix == ".bin")}
    write(builds, rows, args.out)


def write(builds: dict, rows: list[dict], out: Path) -> None:
    from t5compress.bench.stamp import write_result

    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "shape": "t5-small (random weights)", "in_tokens": 32, "out_tokens": 32, "precision": "fp32",
           "engine": "t5compress ONNX runtime (and CTranslate2 with --ctranslate2)"}
    names = list(builds)
    base = builds[names[0]]
    lines = ["| variant | parameters | block parameters | ONNX MB | " +
             " | ".join(f"b{r['batch']} t{r['threads']} ms (×)" for r in rows) + " |",
             "|---|---|---|---|" + "---|" * len(rows)]
    for n in names:
        b = builds[n]
        cells = [f"{r[n]['median_ms']:.0f} (p90 {r[n]['p90_ms']:.0f}, "
                 f"{r[names[0]]['median_ms'] / r[n]['median_ms']:.2f}×)" for r in rows]
        lines.append(f"| {n} | {b['parameters'] / 1e6:.1f}M | {b['block_parameters'] / 1e6:.1f}M "
                     f"({b['block_parameters'] / base['block_parameters']:.0%}) | {b['onnx_bytes'] / 2**20:.0f} | "
                     + " | ".join(cells) + " |")
    md = ("\n".join(lines) + "\n\n32 tokens in, exactly 32 out, greedy; median (p90) per call; ×: speed-up over the "
          "unpruned model in the same run. Parameters include the 32128 × 512 embedding (16.4M), which pruning "
          "does not touch.\n")
    write_result(out / "prune_speed", {"env": env, "builds": builds, "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
