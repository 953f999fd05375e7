"""Size, parity and speed of a QAT int8 export on real shapes (t5-small, ...), against the fp32 export.

Random weights of the real shape (size and speed do not depend on the weights; the embedding is scaled by 0.3 so
greedy decoding varies), made a QAT dir by calibration alone (prepare + calibrate + save_scales, no training), then
`export --onnx` of both. Reports ONNX bytes, the parity numbers of the int8 export, ONNX Runtime's int8 kernels, and
the runtime's median ms per greedy generate call (batch 1, 32 in / 32 out forced, 1 thread).

    .venv/bin/python benchmarks/qdq_size.py --arch t5-small --out runs/qdq-size
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np


def onnx_bytes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.name.endswith((".onnx", ".onnx_data"))}


def ms_per_call(export_dir: Path, vocab: int, repeats: int) -> float:
    from t5compress.runtime import load_runtime

    rt = load_runtime(export_dir, threads=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, (1, 32)).astype(np.int64)
    mask = np.ones_like(ids)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        rt.generate(ids, mask, max_new_tokens=32, min_new_tokens=32, num_beams=1)
        if i >= 2:  # warm-up excluded
            times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="t5-small")
    ap.add_argument("--out", type=Path, default=Path("runs/qdq-size"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from t5compress.bench.stamp import write_result
    from t5compress.export import stage as export
    from t5compress.model.load import create_model, save_model_dir
    from t5compress.model.tokenization import byte_level
    from t5compress.qat import fakequant as fq
    from t5compress.qat.scheme import FakeQuantConfig

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    model = create_model(args.arch, vocab_size=32128)
    with torch.no_grad():
        model.shared.weight.mul_(0.3)
    tok = byte_level()
    save_model_dir(model, tok, args.out / "fp32")
    cfg = FakeQuantConfig()
    fq.prepare(model, cfg)
    rng = np.random.default_rng(1)
    batches = [{"input_ids": torch.from_numpy(rng.integers(3, 32128, (4, 32))),
                "attention_mask": torch.ones(4, 32, dtype=torch.long),
                "labels": torch.from_numpy(rng.integers(3, 32128, (4, 16)))} for _ in range(4)]
    fq.calibrate(model, batches)
    with fq.plain_modules(model):
        save_model_dir(model, tok, args.out / "qat")
    fq.save_scales(model, args.out / "qat", cfg)
    results = {}
    for name in ("fp32", "qat"):
        t0 = time.perf_counter()
        report = export.run(str(args.out / name), export.ExportConfig(), args.out / f"{name}-onnx")
        files = onnx_bytes(args.out / f"{name}-onnx")
        results[name] = {"export_seconds": round(time.perf_counter() - t0, 1), "onnx_files": files,
                         "onnx_bytes": sum(files.values()),
                         "ms_b1_greedy_32": ms_per_call(args.out / f"{name}-onnx", 32128, args.repeats)}
        if name == "qat":
            results[name]["parity"] = {k: report["parity"][k] for k in ("rtol", "max_rel_diff", "token_agreement")}
            results[name]["ort_kernels"] = report["int8"]["ort_kernels"]
    results["size_ratio"] = round(results["qat"]["onnx_bytes"] / results["fp32"]["onnx_bytes"], 4)
    results["arch"] = args.arch
    print(json.dumps(write_result(args.out / "qdq_size", results), indent=2))


if __name__ == "__main__":
    main()
