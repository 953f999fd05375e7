"""QAT accuracy and size on the demo task: fp32 vs the int8 ONNX export of a QAT run, on held-out data.

The demo model (`t5compress demo`) reaches 100% exact match, where quantization loss cannot show; this script trains
the same architecture for fewer steps (real, not perfect skill), then:
  fp32 model -> export --onnx                      (fp32 row)
  fp32 model -> train N more steps -> export       (fp32, same extra training as QAT: separates "more training")
  fp32 model -> qat N steps -> export --onnx       (int8 Q/DQ graphs with the learned scales)
and scores every ONNX dir with the t5compress runtime (greedy) on the same held-out examples.

    .venv/bin/python benchmarks/qat_accuracy.py --out runs/qat-bench     # ~10 min on 2 busy cores

Writes OUT/qat_accuracy.json and .md (and copies them to benchmarks/results/current/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def onnx_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.name.endswith((".onnx", ".onnx_data")))


def score(export_dir: Path, rows: list[dict]) -> dict:
    from t5compress import metrics
    from t5compress.quantize.check import greedy_outputs
    from t5compress.runtime import load_runtime

    preds = greedy_outputs(load_runtime(export_dir, threads=1), [r["source"] for r in rows])
    return {**metrics.compute(preds, [r["target"] for r in rows]), "predictions": preds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/qat-bench"))
    ap.add_argument("--steps", type=int, default=300, help="fp32 fine-tuning steps (the demo uses 800)")
    ap.add_argument("--qat-steps", type=int, default=200)
    ap.add_argument("--qat-lr", type=float, default=2e-4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="keep OUT's data and finished model dirs, redo the rest")
    ap.add_argument("--no-fp32-more", action="store_true", help="skip the fp32 row with the extra training steps")
    args = ap.parse_args()

    from t5compress.data import DataConfig
    from t5compress.export import stage as export
    from t5compress.model import create
    from t5compress.qat import stage as qat
    from t5compress.tasks import make_examples, write_jsonl
    from t5compress.train import stage as training
    from t5compress.train.loop import TrainConfig

    out = args.out
    if not args.reuse:
        shutil.rmtree(out, ignore_errors=True)
    (out / "data").mkdir(parents=True, exist_ok=True)
    train_file, eval_file = out / "data" / "train.jsonl", out / "data" / "eval.jsonl"
    write_jsonl(train_file, make_examples(4000, args.seed))
    write_jsonl(eval_file, make_examples(200, args.seed + 1))
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    d = args.d_model
    overrides = {"d_model": d, "d_ff": 4 * d, "num_heads": 4, "d_kv": d // 4, "num_layers": 2,
                 "num_decoder_layers": 2, "dropout_rate": 0.0}
    if not (out / "init").is_dir():
        create.run(None, create.CreateConfig(arch="t5-efficient-tiny", text=str(train_file), vocab_size=256,
                                       overrides=overrides, seed=args.seed), out / "init")
    data = DataConfig(max_source_length=32, max_target_length=32)

    def finetune(src: Path, dst: Path, steps: int, lr: float) -> training.FinetuneConfig:
        return training.FinetuneConfig(
            train_data=str(train_file), eval_data=str(eval_file), data=data,
            train=TrainConfig(max_steps=steps, batch_size=32, lr=lr, eval_every=max(1, steps // 2),
                              metric="exact_match", seed=args.seed),
        )

    t0 = time.perf_counter()
    if not (out / "fp32").is_dir():
        training.run(str(out / "init"), finetune(out / "init", out / "fp32", args.steps, 1e-3), out / "fp32",
                     progress=False, resume=(out / "fp32.partial" / "latest.json").is_file())
    names = ("fp32", "qat") if args.no_fp32_more else ("fp32", "fp32-more", "qat")
    if "fp32-more" in names and not (out / "fp32-more").is_dir():
        training.run(str(out / "fp32"), finetune(out / "fp32", out / "fp32-more", args.qat_steps, args.qat_lr),
                     out / "fp32-more", progress=False)
    if not (out / "qat").is_dir():
        qat.run(str(out / "fp32"), qat.QatConfig(finetune(out / "fp32", out / "qat", args.qat_steps, args.qat_lr)),
                out / "qat", progress=False, force=True)
    q = json.loads((out / "qat" / "report.json").read_text())
    results, exports = {}, {}
    for name in names:
        exports[name] = export.run(str(out / name), export.ExportConfig(), out / f"{name}-onnx", force=True)
        results[name] = score(out / f"{name}-onnx", rows)
        results[name]["onnx_bytes"] = onnx_bytes(out / f"{name}-onnx")
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    for mode in ("static", "dynamic"):  # post-training int8 of the same fp32 export, for comparison with QAT
        name = f"{mode}-int8"
        calib = str(train_file) if mode == "static" else None
        quantize(out / "fp32-onnx", QuantizeConfig(mode=mode, calib_data=calib), out / name, force=True,
                 progress=False)
        results[name] = score(out / name, rows)
        results[name]["onnx_bytes"] = onnx_bytes(out / name)
    base = results["fp32"]["predictions"]
    for r in results.values():
        r["same_output_as_fp32"] = round(sum(a == b for a, b in zip(r.pop("predictions"), base, strict=True))
                                         / len(base), 4)
    parity = exports["qat"]["parity"]
    summary = {
        "setup": vars(args) | {"out": str(out)},
        "rows": results,
        "qat_report_metrics": q["metrics"],
        "qat_parity": {k: parity[k] for k in ("rtol", "max_rel_diff", "max_abs_diff", "token_agreement")},
        "ort_kernels": exports["qat"]["int8"]["ort_kernels"],
        "size_ratio_int8_vs_fp32": round(results["qat"]["onnx_bytes"] / results["fp32"]["onnx_bytes"], 4),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    labels = {"fp32": f"fp32 ({args.steps} steps)", "fp32-more": f"fp32 (+{args.qat_steps} steps)",
              "qat": f"int8 QAT (+{args.qat_steps} steps)", "static-int8": f"int8 static of fp32 ({args.steps} steps)",
              "dynamic-int8": f"int8 dynamic of fp32 ({args.steps} steps)"}
    summary["qat_calibrated_before_training"] = q["metrics"]["int8_calibrated"]
    md = ["| model (ONNX, t5compress runtime, greedy) | exact match | ROUGE-L | BLEU | same output as fp32 | "
          "ONNX MB |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        md.append(f"| {labels[name]} | {r['exact_match']} | {r['rougeL']} | {r['bleu']} | "
                  f"{r['same_output_as_fp32']} | {r['onnx_bytes'] / 1e6:.2f} |")
    from t5compress.bench.stamp import write_result

    write_result(out / "qat_accuracy", summary, "\n".join(md) + "\n")
    (ROOT / "results" / "current").mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "qat_accuracy.json", ROOT / "results" / "current" / "qat_accuracy.json")
    shutil.copy(out / "qat_accuracy.md", ROOT / "results" / "current" / "qat_accuracy.md")
    print("\n".join(md))
    print(json.dumps({k: summary[k] for k in ("qat_parity", "size_ratio_int8_vs_fp32", "seconds")}, indent=1))


if __name__ == "__main__":
    main()
