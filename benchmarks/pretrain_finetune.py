"""Does pre-training pay? Fine-tune on the demo task from a span-corruption pre-trained model vs from random init.

Same architecture (the demo's: t5-efficient-tiny, d_model 128, 2+2 layers), same tokenizer (trained on the corpus by
`pretrain`), same fine-tuning budget, data and seed; the only difference is the starting weights:
  toy corpus -> t5compress pretrain -> model dir  -> t5compress train (demo task) -> exact match on held-out data
                 (same config, random weights) ---> t5compress train (same options) -> exact match

    PYTHONPATH=. .venv/bin/python benchmarks/pretrain_finetune.py       # ~6 min on 2 busy cores (1 thread)

Writes benchmarks/results/current/pretrain_finetune.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
DEMO_SHAPE = {"d_model": 128, "d_ff": 512, "num_heads": 4, "d_kv": 32, "num_layers": 2, "num_decoder_layers": 2,
              "dropout_rate": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=12000, help="toy corpus documents")
    ap.add_argument("--pretrain-steps", type=int, default=800)
    ap.add_argument("--finetune-steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="bf16", help="pre-training precision (fine-tuning: the trainer default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current")
    args = ap.parse_args()

    from t5compress import pretrain
    from t5compress.bench.stamp import write_result
    from t5compress.data import DataConfig
    from t5compress.model.load import load_tokenizer, save_model_dir
    from t5compress.pretrain.toy import write_toy_corpus
    from t5compress.tasks import make_examples, write_jsonl
    from t5compress.train import stage as training
    from t5compress.train.loop import TrainConfig

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="pretrain-finetune-"))
    corpus = write_toy_corpus(work / "toy.jsonl", args.docs, seed=args.seed)
    write_jsonl(work / "train.jsonl", make_examples(2000, args.seed))
    write_jsonl(work / "eval.jsonl", make_examples(200, args.seed + 1))

    t0 = time.perf_counter()
    pre = pretrain.run(str(corpus), pretrain.PretrainConfig(
        model="t5-efficient-tiny", overrides=DEMO_SHAPE, vocab_size=2000, inputs_length=128, seed=args.seed,
        train=TrainConfig(max_steps=args.pretrain_steps, batch_size=32, optimizer="adamwscale", lr=2e-2,
                          warmup_steps=args.pretrain_steps // 10, eval_every=args.pretrain_steps // 4,
                          eval_max_examples=128, metric="loss", precision=args.precision, seed=args.seed),
    ), work / "pretrained", progress=False)
    pre_seconds = time.perf_counter() - t0

    # the control: the same config and tokenizer, fresh random weights (the seed pre-training started from)
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(args.seed)
    scratch = T5ForConditionalGeneration(T5Config.from_pretrained(work / "pretrained"))
    save_model_dir(scratch, load_tokenizer(work / "pretrained"), work / "scratch")

    ft_cfg = training.FinetuneConfig(
        train_data=str(work / "train.jsonl"), eval_data=str(work / "eval.jsonl"),
        data=DataConfig(max_source_length=32, max_target_length=32),
        train=TrainConfig(max_steps=args.finetune_steps, batch_size=32, lr=1e-3, eval_every=args.finetune_steps // 4,
                          eval_max_examples=200, metric="exact_match", seed=args.seed))
    rows = {}
    for name, start in (("from scratch", work / "scratch"), ("pre-trained", work / "pretrained")):
        t1 = time.perf_counter()
        r = training.run(str(start), ft_cfg, work / f"ft-{name.replace(' ', '-')}", progress=False)
        ev = r["eval"]
        rows[name] = {"exact_match": ev["exact_match"], "rougeL": ev["rougeL"], "loss": ev["loss"],
                      "best_step": ev["step"], "seconds": round(time.perf_counter() - t1, 1),
                      "history": [{k: h[k] for k in ("step", "loss", "exact_match")} for h in r["train"]["history"]]}
    result = {
        "setup": {"shape": DEMO_SHAPE, "parameters": pre["model"]["parameters"],
                  "vocab_size": pre["model"]["vocab_size"],
                  "corpus": f"toy corpus ({args.docs} documents, t5compress.pretrain.toy)",
                  "pretrain": {"steps": args.pretrain_steps, "batch_size": 32, "inputs_length": 128,
                               "precision": args.precision, "tokens": pre["tokens_trained"],
                               "seconds": round(pre_seconds, 1)},
                  "finetune": {"task": "t5compress.demo (spell sorted / sort words)", "train_examples": 2000,
                               "eval_examples": 200, "steps": args.finetune_steps, "batch_size": 32, "lr": 1e-3},
                  "threads": args.threads, "load_average": os.getloadavg(), "torch": torch.__version__},
        "pretrain": {"held_out_loss_before": pre["eval_before"]["loss"], "held_out_loss_after": pre["eval"]["loss"],
                     "tokens_per_second": pre["train"]["tokens_per_second"]},
        "finetune": rows,
    }
    write_result(args.out / "pretrain_finetune", result, markdown(result))
    print(markdown(result))
    print(json.dumps(result["finetune"], indent=1)[:400])


def markdown(r: dict) -> str:
    s, p = r["setup"], r["pretrain"]
    lines = [
        "# Pre-trained vs from-scratch fine-tuning on the demo task",
        "",
        f"Model: t5-efficient-tiny, d_model 128, 2+2 layers ({s['parameters']:,} parameters, vocabulary "
        f"{s['vocab_size']}). Pre-training: {s['corpus']}, {s['pretrain']['steps']} steps x 32 x 128 inputs "
        f"({s['pretrain']['tokens']:,} tokens, {s['pretrain']['precision']}, {s['pretrain']['seconds']} s); held-out "
        f"span-corruption loss {p['held_out_loss_before']} -> {p['held_out_loss_after']}. Fine-tuning: "
        f"{s['finetune']['task']}, {s['finetune']['steps']} steps x 32, lr {s['finetune']['lr']}, same for both; "
        f"scored on {s['finetune']['eval_examples']} held-out examples (greedy). {s['threads']} thread(s).",
        "",
        "| start | exact match | ROUGE-L | eval loss | best step | fine-tune s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in r["finetune"].items():
        lines.append(f"| {name} | {row['exact_match']} | {row['rougeL']} | {row['loss']} | {row['best_step']} | "
                     f"{row['seconds']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
