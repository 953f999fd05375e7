"""How many held-out greedy outputs int8 *weights* alone change: the ceiling of any int8 scheme with one scale per
output channel, whatever it does with the activations; and, for scale, how many change under far smaller changes to
the same weights (rounded to bf16; 0.1% noise).

For each fixture built by `benchmarks/int8_gated.py`, the fp32 export's linear weights are rounded to int8 per output
channel (and the embedding rows per row, as the static default stores them) and stored back as fp32; activations stay
fp32; then the same with the linear weights rounded by GPTQ on the calibration texts (`quantize.gptq`). Greedy
outputs on the fixture's held-out inputs are compared with fp32's, beside the static default's
(`per-token/`, written by int8_gated.py) on the same inputs.

    PYTHONPATH=. .venv/bin/python benchmarks/int8_ceiling.py runs/int8-gated/fixture runs/int8-gated-doc150/fixture

Writes benchmarks/results/current/int8_ceiling.json and .md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def gptq_weights(src: Path, texts: list[str], work: Path) -> dict[str, dict]:
    """{graph: {node: (int8 weight, scale)}}: every linear weight of the fp32 export rounded by GPTQ on X^T X of its
    inputs while the fp32 runtime generates from `texts` (as the quantize stage does for per-token layers)."""
    import onnx

    from t5compress.quantize.calibrate import drive
    from t5compress.quantize.gptq import Gram, round_graphs
    from t5compress.quantize.graphs import linear_nodes
    from t5compress.runtime import load_runtime

    paths = {g: src / f"{g}.onnx" for g in ("encoder_model", "decoder_model", "decoder_with_past_model")}
    grams = {g: Gram(p, linear_nodes(onnx.load(str(p)), ("MatMul",)), work) for g, p in paths.items()}
    drive(load_runtime(src, threads=0), texts, {g: [grams[g]] for g in paths}, 16, 32)
    return round_graphs(paths, grams)


def round_weights(src: Path, dst: Path, rounded: dict[str, dict] | None = None, change=None) -> int:
    """Copy the export dir `src` to `dst` with every linear weight and embedding row rounded to int8 (kept fp32):
    to nearest, or the linear weights as `rounded` gives them ({graph: {node: (int8, scale)}}); or, with `change`,
    each of those tensors as change(w) makes it (a smaller perturbation, for comparison)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    shutil.copytree(src, dst)
    count = 0
    for path in sorted(dst.glob("*_model.onnx")):
        model = onnx.load(str(path))
        inits = {t.name: t for t in model.graph.initializer}
        done: set[str] = set()
        for node in model.graph.node:
            linear = node.op_type == "MatMul" and node.input[1] in inits
            lookup = node.op_type == "Gather" and "embed_tokens" in node.name and node.input[0] in inits
            name = node.input[1] if linear else node.input[0] if lookup else None
            if name is None or name in done:
                continue
            w = numpy_helper.to_array(inits[name]).astype(np.float32)
            given = (rounded or {}).get(path.stem, {}).get(node.name) if linear else None
            if change is not None:
                w = change(w)
            elif given is not None:
                w = given[0].astype(np.float32) * given[1]
            else:
                axis = 0 if linear else 1  # a scale per output channel (column) / per embedding row
                scale = np.maximum(np.abs(w).max(axis=axis, keepdims=True), 1e-12) / 127
                w = np.round(w / scale) * scale
            inits[name].CopyFrom(numpy_helper.from_array(w.astype(np.float32), name))
            done.add(name)
        count += len(done)
        onnx.save(model, str(path))
    return count


def bf16(w):
    """Rounded to bfloat16 (8 significant bits: a relative error of at most 2^-8), kept float32."""
    import numpy as np

    bits = w.astype(np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even, as torch's bfloat16 cast
    return bits.view(np.float32)


def noise(w):
    """w times (1 + 0.1% Gaussian noise), a fixed seed per tensor shape."""
    import numpy as np

    return (w * (1 + 1e-3 * np.random.default_rng(w.size).standard_normal(w.shape))).astype(np.float32)


# Changes far smaller than int8's, to the same tensors: how fragile the fixture's greedy outputs are in themselves.
SMALLER = {"bf16_weights": bf16, "noise_weights": noise}


def pytorch_outputs(model_dir: Path, texts: list[str], batch_size: int = 32) -> list[str]:
    """transformers' own greedy outputs (fp32), batched by length as `check.greedy_outputs` batches ours."""
    import torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = T5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    order, out = sorted(range(len(texts)), key=lambda i: len(texts[i])), [""] * len(texts)
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        with torch.no_grad():
            ids = model.generate(**tok([texts[k] for k in idx], return_tensors="pt", padding=True),
                                 max_new_tokens=32, do_sample=False, num_beams=1)
        for j, text in zip(idx, tok.batch_decode(ids, skip_special_tokens=True), strict=True):
            out[j] = text.strip()
    return out


def measure(fixture: Path, heldout: int) -> dict:
    from t5compress.data import DataConfig, load_examples
    from t5compress.quantize.calibrate import load_texts
    from t5compress.quantize.check import agreement, greedy_outputs
    from t5compress.runtime import load_runtime

    texts = [e.source for e in load_examples(str(fixture / "heldout.jsonl"), DataConfig())[:heldout]]
    fp32 = greedy_outputs(load_runtime(fixture / "onnx", threads=0), texts)
    about = json.loads((fixture / "fixture.json").read_text())
    row = {"fixture": f"{about.get('task', 'demo')}, pretrain {about['pretrain_steps']} + train "
                      f"{about['finetune_steps']} steps (exact match {about['exact_match']}, ROUGE-L "
                      f"{about['rougeL']})", "heldout": len(texts)}
    row["pytorch_fp32"] = agreement(fp32, pytorch_outputs(fixture / "model", texts))  # the engine's own share
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights"
        row["tensors_rounded"] = round_weights(fixture / "onnx", weights)
        row["weight_only_int8"] = agreement(fp32, greedy_outputs(load_runtime(weights, threads=0), texts))
        calib = load_texts(fixture / "train.jsonl", samples=128)
        rounded = gptq_weights(fixture / "onnx", calib, Path(tmp))
        round_weights(fixture / "onnx", Path(tmp) / "gptq", rounded)
        row["weight_only_int8_gptq"] = agreement(fp32, greedy_outputs(load_runtime(Path(tmp) / "gptq", threads=0),
                                                                      texts))
        for key, change in SMALLER.items():
            round_weights(fixture / "onnx", Path(tmp) / key, change=change)
            row[key] = agreement(fp32, greedy_outputs(load_runtime(Path(tmp) / key, threads=0), texts))
    if (fixture / "per-token").is_dir():
        row["static_default"] = agreement(fp32, greedy_outputs(load_runtime(fixture / "per-token", threads=0), texts))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fixtures", type=Path, nargs="+", help="fixture dirs written by int8_gated.py")
    ap.add_argument("--heldout", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current")
    args = ap.parse_args()
    from t5compress.bench.stamp import write_result
    from t5compress.cpu import cpu_features

    rows = [measure(f, args.heldout) for f in args.fixtures]
    result = {"cpu": cpu_features(), "rows": rows}
    write_result(args.out / "int8_ceiling", result, markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = ["# Held-out outputs int8 weights alone change (activations fp32), and far smaller changes", "",
             f"CPU: {result['cpu']['model']}. Greedy outputs identical to our fp32 export's on the fixture's "
             "held-out inputs: the same model run by transformers, and the same tensors (every linear weight and "
             "embedding row) rounded to bf16 (a relative error of at most 2^-8), times (1 + 0.1% Gaussian noise), or "
             "rounded to int8; activations fp32 in all of them.",
             "",
             "| fixture | held-out | PyTorch fp32 (transformers' generate) | weights rounded to bf16 | weights x "
             "(1 + 0.1% noise) | weights int8 to nearest (per channel, fp32 activations) | weights int8 by GPTQ | "
             "static int8 default |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        cells = [f"{r[k]:.1%}" if k in r else "" for k in ("pytorch_fp32", *SMALLER, "weight_only_int8",
                                                             "weight_only_int8_gptq", "static_default")]
        lines.append(f"| {r['fixture']} | {r['heldout']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
