"""The embedded default: a small T5 built, fine-tuned, evaluated and shipped on data generated here (no download).

The task mixes two text-to-text problems with T5-style prefixes, small enough to learn in minutes on two CPU cores
(both order their output by content, which a tiny T5 with only relative positions learns much faster than copying
in order):
    "spell sorted: 4071"          -> "zero one four seven"
    "sort words: red apple stone" -> "apple red stone"
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from t5compress import artifacts
from t5compress.config import option, require

log = logging.getLogger(__name__)

_DIGITS = "zero one two three four five six seven eight nine".split()
_WORDS = (
    "red blue green apple stone river cloud tree bird fish light dark small large quick slow north south east west "
    "paper glass metal wood fire water earth wind moon sun star road house door window garden"
).split()


def make_examples(n: int, seed: int) -> list[dict[str, str]]:
    """`n` examples of the two demo tasks, deterministic in `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            digits = rng.sample(range(10), rng.randint(2, 7))
            out.append({"source": "spell sorted: " + "".join(map(str, digits)),
                        "target": " ".join(_DIGITS[d] for d in sorted(digits))})
        else:
            words = rng.sample(_WORDS, rng.randint(2, 6))
            out.append({"source": "sort words: " + " ".join(words), "target": " ".join(sorted(words))})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@dataclass(frozen=True)
class DemoConfig:
    train_examples: int = option(4000, "Generated training examples.")
    eval_examples: int = option(200, "Generated held-out examples.")
    arch: str = option("t5-efficient-tiny", "Architecture of the new model.")
    d_model: int = option(128, "Model width (overrides the architecture's).")
    layers: int = option(2, "Encoder and decoder layers.")
    max_steps: int = option(800, "Fine-tuning steps.")
    batch_size: int = option(32, "Batch size.")
    lr: float = option(1e-3, "Peak learning rate.")
    seed: int = option(0, "Seed for data, initialisation and training.")

    def __post_init__(self) -> None:
        require(self.train_examples >= 10, "train_examples", "must be >= 10")
        require(self.eval_examples >= 2, "eval_examples", "must be >= 2")
        require(self.max_steps > 0, "max_steps", "must be > 0")


def run(cfg: DemoConfig, out: str | Path, force: bool = False, progress: bool = True) -> dict:
    """Generate data, create and fine-tune a model, and write everything under `out`. Returns a summary."""
    from t5compress import create, training
    from t5compress.data import DataConfig
    from t5compress.trainer import TrainConfig

    out = artifacts.check_output(out, force)
    if out.exists():
        shutil.rmtree(out)
    (out / "data").mkdir(parents=True)
    try:
        write_jsonl(out / "data" / "train.jsonl", make_examples(cfg.train_examples, cfg.seed))
        write_jsonl(out / "data" / "eval.jsonl", make_examples(cfg.eval_examples, cfg.seed + 1))
        overrides = {"d_model": cfg.d_model, "d_ff": 4 * cfg.d_model, "num_heads": 4, "d_kv": cfg.d_model // 4,
                     "num_layers": cfg.layers, "num_decoder_layers": cfg.layers, "dropout_rate": 0.0}
        created = create.run(
            create.CreateConfig(arch=cfg.arch, text=str(out / "data" / "train.jsonl"), vocab_size=256,
                                overrides=overrides, seed=cfg.seed),
            out / "model-init",
        )
        ft = training.FinetuneConfig(
            train_data=str(out / "data" / "train.jsonl"),
            eval_data=str(out / "data" / "eval.jsonl"),
            data=DataConfig(max_source_length=32, max_target_length=32),
            train=TrainConfig(max_steps=cfg.max_steps, batch_size=cfg.batch_size, lr=cfg.lr,
                              eval_every=cfg.max_steps // 4,
                              metric="exact_match", seed=cfg.seed),
        )
        trained = training.run(str(out / "model-init"), ft, out / "model", progress=progress)
        shipped = ship(out / "model", out / "onnx", out / "data" / "eval.jsonl", int8_dir=out / "int8",
                       calib_file=out / "data" / "train.jsonl")
        summary = {"model": trained["model"], "parameters": created["model"]["parameters"], "eval": trained["eval"],
                   "train": {k: v for k, v in trained["train"].items() if k != "history"},
                   "backends": shipped["backends"], "parity": shipped["parity"],
                   "paths": {"data": str(out / "data"), "model": str(out / "model"), "onnx": str(out / "onnx"),
                             "int8": str(out / "int8")}}
        artifacts.write_json(out / "summary.json", summary)
        return summary
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def ship(model_dir: Path, onnx_dir: Path, eval_file: Path, int8_dir: Path, calib_file: Path,
         latency_examples: int = 20) -> dict:
    """Export to ONNX (verified) and quantize it to static int8 (calibrated on training texts), then score PyTorch,
    the ONNX Runtime runtime and its int8 export on the same held-out set."""
    import statistics
    import time

    import torch

    from t5compress import metrics
    from t5compress.evaluation import generate_kwargs
    from t5compress.export import stage as export
    from t5compress.models import load_model, load_tokenizer
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize
    from t5compress.runtime import load_runtime

    report = export.run(str(model_dir), export.ExportConfig(format="onnx"), onnx_dir)
    quantize(onnx_dir, QuantizeConfig(mode="static", calib_data=str(calib_file)), int8_dir, progress=False)
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    sources, targets = [r["source"] for r in rows], [r["target"] for r in rows]
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    rt, rt8 = load_runtime(onnx_dir, threads=1), load_runtime(int8_dir, threads=1)
    new = 32

    def pytorch(texts: list[str]) -> list[str]:
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new, do_sample=False, **generate_kwargs(model))
        return [t.strip() for t in tok.batch_decode(out, skip_special_tokens=True)]

    def onnx(texts: list[str]) -> list[str]:
        return [t.strip() for t in rt.generate_text(texts, max_new_tokens=new)]

    def int8(texts: list[str]) -> list[str]:
        return [t.strip() for t in rt8.generate_text(texts, max_new_tokens=new)]

    def size(d: Path) -> float:
        return round(sum(f.stat().st_size for f in d.iterdir() if f.suffix in (".onnx", ".safetensors")) / 1e6, 2)

    backends = {}
    torch.set_num_threads(1)
    runs = (("pytorch", pytorch, model_dir), ("t5compress onnx", onnx, onnx_dir), ("t5compress int8", int8, int8_dir))
    for name, fn, where in runs:
        preds = [p for i in range(0, len(sources), 32) for p in fn(sources[i : i + 32])]
        times = []
        for text in sources[:latency_examples]:  # batch 1, one thread: the edge-box case
            t0 = time.perf_counter()
            fn([text])
            times.append(1000 * (time.perf_counter() - t0))
        backends[name] = {**metrics.compute(preds, targets), "ms_per_example": round(statistics.median(times), 2),
                          "size_mb": size(where), "predictions": preds}

    def same(a: str, b: str) -> str:
        pairs = zip(backends[a]["predictions"], backends[b]["predictions"], strict=True)
        return f"{sum(x == y for x, y in pairs)}/{len(sources)}"

    parity = {"identical_outputs": same("pytorch", "t5compress onnx"),
              "int8_identical_outputs": same("t5compress onnx", "t5compress int8"),
              "max_abs_diff": report["parity"]["max_abs_diff"]}
    for b in backends.values():
        del b["predictions"]
    return {"backends": backends, "parity": parity}
