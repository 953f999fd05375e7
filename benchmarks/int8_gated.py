"""Static int8 on gated T5s (T5 v1.1 / Flan shapes): the default's next-token agreement, greedy outputs, task metric,
size and speed, before (keep `wo` fp32) and after (sensitivity-guided: keep the fewest groups fp32), plus the
per-group sensitivity table.

The fixture: a gated-gelu, untied T5 (4+4 layers, d_model 256, the flan-t5-small layout) pre-trained by
`t5compress pretrain` on the generated toy corpus, then fine-tuned by `t5compress train` on the demo tasks to real,
not perfect, skill. The flan-t5-small shape is random weights (speed and size mean something there; agreement little).

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/int8_gated.py      # ~15-25 min on 2 busy cores

Writes benchmarks/results/int8_gated.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
FIXTURE_SHAPE = {"d_model": 256, "d_ff": 768, "num_heads": 4, "d_kv": 64, "num_layers": 4, "num_decoder_layers": 4,
                 "dropout_rate": 0.0, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}


def build_fixture(work: Path, pretrain_steps: int, finetune_steps: int, seed: int = 0) -> dict:
    """pretrain + train the gated fixture into `work`; returns paths and what training measured."""
    from t5compress import pretrain
    from t5compress.data import DataConfig
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.pretrain.toy import write_toy_corpus
    from t5compress.tasks import make_examples, write_jsonl
    from t5compress.train import stage as training
    from t5compress.train.loop import TrainConfig

    work.mkdir(parents=True, exist_ok=True)
    corpus = write_toy_corpus(work / "toy.jsonl", 8000, seed=seed)
    write_jsonl(work / "train.jsonl", make_examples(2000, seed))
    write_jsonl(work / "eval.jsonl", make_examples(200, seed + 1))
    t0 = time.perf_counter()
    pre = pretrain.run(str(corpus), pretrain.PretrainConfig(
        model="flan-t5-small", overrides=FIXTURE_SHAPE, vocab_size=2000, inputs_length=128, seed=seed,
        train=TrainConfig(max_steps=pretrain_steps, batch_size=16, optimizer="adamwscale", lr=2e-2,
                          warmup_steps=max(pretrain_steps // 10, 1), eval_every=pretrain_steps,
                          eval_max_examples=64, metric="loss", precision="bf16", seed=seed),
    ), work / "pretrained", force=True, progress=False)
    t1 = time.perf_counter()
    ft = training.run(str(work / "pretrained"), training.FinetuneConfig(
        train_data=str(work / "train.jsonl"), eval_data=str(work / "eval.jsonl"),
        data=DataConfig(max_source_length=32, max_target_length=32),
        train=TrainConfig(max_steps=finetune_steps, batch_size=32, lr=1e-3, eval_every=finetune_steps,
                          eval_max_examples=200, metric="exact_match", seed=seed)), work / "model", force=True,
        progress=False)
    t2 = time.perf_counter()
    export(work / "model", ExportConfig(), work / "onnx", force=True)
    return {"pretrain_steps": pretrain_steps, "finetune_steps": finetune_steps,
            "parameters": pre["model"]["parameters"], "pretrain_loss": pre["eval"]["loss"],
            "pretrain_s": round(t1 - t0, 1), "finetune_s": round(t2 - t1, 1),
            "exact_match": ft["eval"]["exact_match"], "rougeL": ft["eval"]["rougeL"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("runs/int8-gated"))
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--finetune-steps", type=int, default=300)
    ap.add_argument("--fixture-only", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    fixture = args.work / "fixture"
    if not (fixture / "onnx").is_dir():
        info = build_fixture(fixture, args.pretrain_steps, args.finetune_steps)
        (fixture / "fixture.json").write_text(json.dumps(info, indent=1))
    print(json.loads((fixture / "fixture.json").read_text()))
    if args.fixture_only:
        return


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
