"""Pre-training throughput: `t5compress pretrain` vs Hugging Face's span-corruption recipe, same model and tokens.

The peer is the recipe of transformers' `examples/flax/language-modeling/run_t5_mlm_flax.py` (Apache-2.0) run with
PyTorch, as a plain transformers loop: tokenize every text (</s> appended), concatenate, cut into
`expanded_inputs_length` chunks, shuffle, and per batch its `FlaxDataCollatorForT5MLM` logic (a noise mask per
example with `np.random.shuffle`, sentinel ids by cumsum, `filter_input_ids`, `shift_tokens_right`), then
`model(input_ids, labels=..., decoder_input_ids=...).loss`, `torch.optim.AdamW` with linear warm-up and decay (the
script's optimiser and schedule). `hf_collate` below re-implements that collator step by step.

Ours is the real stage, `t5compress.pretrain.run` (streamed corpus, packed blocks, vectorised collator in a prefetch
thread, AdamW with RMS-scaled steps, cosine schedule, bf16 autocast on CPUs that have it).

Fairness on a shared machine: the two loops run in one process, same threads, same initial weights, same packed
length, batch and number of steps (so the same tokens), and they *alternate step by step* (ours calls the peer's
step from its `on_step` hook), so background load hits both alike. Step times exclude the first `--skip` steps
(warm-up) and the last one (final evaluation and checkpoint). Held-out loss: both models on the same fixed
span-corrupted held-out batches after the same tokens.

    PYTHONPATH=. .venv/bin/python benchmarks/pretrain_speed.py --steps 60       # ~5 min on 2 busy cores

Writes benchmarks/results/current/pretrain_speed.json and .md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
GOAL = 1.3


# --- the peer: run_t5_mlm_flax's collator logic, per example, in numpy ------------------------------------------

def _hf_random_spans_noise_mask(length: int, noise_density: float, mean_span: float) -> np.ndarray:
    num_noise = min(max(int(np.round(length * noise_density)), 1), length - 1)
    num_spans = max(int(np.round(num_noise / mean_span)), 1)
    num_nonnoise = length - num_noise

    def segmentation(items: int, segments: int) -> np.ndarray:
        first = np.arange(items - 1) < (segments - 1)
        np.random.shuffle(first)
        segment_id = np.cumsum(np.pad(first, [[1, 0]]))
        return np.bincount(segment_id)  # the script sums ones per segment id (jax segment_sum)

    interleaved = np.stack([segmentation(num_nonnoise, num_spans), segmentation(num_noise, num_spans)], axis=1)
    starts = np.cumsum(interleaved.reshape(num_spans * 2))[:-1]
    indicator = np.zeros((length,), dtype=np.int8)
    indicator[starts] = True
    return np.equal(np.cumsum(indicator) % 2, 1)


def _hf_sentinel_ids(mask: np.ndarray, n_tokens: int) -> np.ndarray:
    start = mask - np.roll(mask, 1, axis=-1) * mask
    start[:, 0] = mask[:, 0]
    sentinel = np.where(start != 0, np.cumsum(start, axis=-1), start)
    # the script's current form, len(tokenizer) - k: extra_id_0 = len(tokenizer) - 1, counting down (older versions
    # had `k + vocab_size - 1`, which counts *up* from past the vocabulary)
    sentinel = np.where(sentinel != 0, n_tokens - sentinel, 0)
    return sentinel - (mask - start)


def _hf_filter(input_ids: np.ndarray, sentinel: np.ndarray, eos: int) -> np.ndarray:
    full = np.where(sentinel != 0, sentinel, input_ids)
    kept = full[full > 0].reshape((input_ids.shape[0], -1))
    return np.concatenate([kept, np.full((input_ids.shape[0], 1), eos, dtype=np.int32)], axis=-1)


def hf_collate(examples: np.ndarray, n_tokens: int, eos: int, density: float, mean_span: float,
               decoder_start: int = 0) -> dict[str, torch.Tensor]:
    batch, length = examples.shape
    mask = np.asarray([_hf_random_spans_noise_mask(length, density, mean_span) for _ in range(batch)])
    input_ids = _hf_filter(examples, _hf_sentinel_ids(mask.astype(np.int8), n_tokens), eos)
    labels = _hf_filter(examples, _hf_sentinel_ids((~mask).astype(np.int8), n_tokens), eos)
    decoder_input_ids = np.zeros_like(labels)  # transformers' shift_tokens_right
    decoder_input_ids[:, 1:] = labels[:, :-1]
    decoder_input_ids[:, 0] = decoder_start
    return {k: torch.from_numpy(v.astype(np.int64)) for k, v in
            (("input_ids", input_ids), ("labels", labels), ("decoder_input_ids", decoder_input_ids))}


class HFLoop:
    """The peer's pipeline and training step; `step()` runs one optimizer step and returns its seconds."""

    def __init__(self, model, tokenizer, texts: list[str], tokens_length: int, args) -> None:
        t0 = time.perf_counter()
        ids = np.concatenate([np.asarray(x) for x in tokenizer(texts)["input_ids"]])  # </s> appended by the tokenizer
        chunks = ids[: len(ids) // tokens_length * tokens_length].reshape(-1, tokens_length)
        np.random.seed(args.seed)
        self.samples = chunks[np.random.permutation(len(chunks))]
        self.prep_seconds = time.perf_counter() - t0
        self.model, self.tok, self.args, self.i = model.train(), tokenizer, args, 0
        self.n_tokens = len(tokenizer)  # sentinels included: extra_id_0 is the last one
        vocab = tokenizer.get_vocab()
        assert vocab["<extra_id_0>"] == self.n_tokens - 1 and vocab["<extra_id_1>"] == self.n_tokens - 2
        self.opt = torch.optim.AdamW(model.parameters(), lr=args.hf_lr, weight_decay=0.0)
        warm = args.warmup

        def linear(s: int) -> float:
            return (s + 1) / warm if s < warm else max(0.0, (args.steps - s) / max(1, args.steps - warm))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, linear)

    def step(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        n = self.args.batch_size
        rows = self.samples[(self.i * n) % len(self.samples):][:n]
        self.i += 1
        batch = hf_collate(rows, self.n_tokens, self.tok.eos_token_id, 0.15, 3.0)
        loss = self.model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the timing")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--inputs-length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", type=int, default=12000, help="toy corpus documents")
    ap.add_argument("--arch", default="t5-efficient-tiny-nl2")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--lr", type=float, default=2e-2, help="ours: adamwscale")
    ap.add_argument("--hf-lr", type=float, default=5e-3, help="the peer: AdamW (run_t5_mlm_flax's README example)")
    ap.add_argument("--precision", default="bf16", help="ours: bf16 (autocast) or fp32")
    ap.add_argument("--compile", action="store_true", help="ours: torch.compile (compile time counts as warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current")
    ap.add_argument("--name", default="pretrain_speed", help="stem of the JSON and Markdown files")
    args = ap.parse_args()

    from t5compress import pretrain
    from t5compress.pretrain.stage import corpus_of, new_model
    from t5compress.pretrain.toy import write_toy_corpus
    from t5compress.train.loop import TrainConfig

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="pretrain-speed-"))
    corpus_file = write_toy_corpus(work / "toy.jsonl", args.docs, seed=args.seed)
    train = TrainConfig(max_steps=args.steps, batch_size=args.batch_size, optimizer="adamwscale", lr=args.lr,
                        warmup_steps=args.warmup, eval_every=args.steps, save_every=args.steps, metric="loss",
                        eval_max_examples=64, precision=args.precision, compile=args.compile, seed=args.seed)
    overrides = {"dropout_rate": 0.0}
    cfg = pretrain.PretrainConfig(model=args.arch, overrides=overrides, vocab_size=2000,
                                  inputs_length=args.inputs_length, train=train, seed=args.seed)
    corpus = corpus_of(corpus_file, cfg)
    hf_model, tokenizer = new_model(corpus, cfg)  # the same initial weights and tokenizer as ours (same seed)
    collator = pretrain.SpanCorruption.for_tokenizer(tokenizer, inputs_length=args.inputs_length)
    hf = HFLoop(hf_model, tokenizer, list(corpus.split(train=True)), collator.tokens_length, args)

    marks: list[float] = []
    hf_times: list[float] = []
    hf_losses: list[float] = []

    def alternate(state: dict) -> None:  # after each of our steps: one step of the peer
        marks.append(time.perf_counter())
        dt, loss = hf.step()
        hf_times.append(dt)
        hf_losses.append(loss)
        marks.append(time.perf_counter())

    t_start = time.perf_counter()
    report = pretrain.run(str(corpus_file), cfg, work / "ours", progress=False, on_step=alternate)
    ours_times = [marks[2 * i] - marks[2 * i - 1] for i in range(1, args.steps)]  # hook exit -> next hook entry
    ours_times = ours_times[args.skip : -1]  # warm-up out, and the last step (final evaluation + checkpoint)
    hf_steady = hf_times[args.skip + 1 : -1]
    tokens_per_step = args.batch_size * (args.inputs_length + collator.targets_length)

    from t5compress.pretrain.stream import SpanEval

    evalset = SpanEval.build(corpus, tokenizer, collator, 64, 32, seed=args.seed)
    hf_eval = evalset.evaluate(hf.model)
    ours_eval = report["eval"]
    med_ours, med_hf = statistics.median(ours_times), statistics.median(hf_steady)
    result = {
        "setup": {"arch": args.arch, "parameters": report["model"]["parameters"],
                  "vocab_size": report["model"]["vocab_size"], "inputs_length": args.inputs_length,
                  "tokens_length": collator.tokens_length, "targets_length": collator.targets_length,
                  "batch_size": args.batch_size, "steps": args.steps, "tokens_per_step": tokens_per_step,
                  "tokens_each": tokens_per_step * args.steps, "threads": args.threads,
                  "timed_steps": len(ours_times), "corpus": f"toy corpus, {args.docs} documents",
                  "ours": {"optimizer": "adamwscale", "lr": args.lr, "schedule": "cosine", "precision": args.precision,
                           "compile": args.compile},
                  "hf": {"optimizer": "torch AdamW", "lr": args.hf_lr, "schedule": "linear", "precision": "fp32"},
                  "load_average": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
                  "torch": torch.__version__, "wall_seconds": round(time.perf_counter() - t_start, 1)},
        "ours": {"median_step_ms": round(1000 * med_ours, 1), "tokens_per_second": round(tokens_per_step / med_ours),
                 "mean_tokens_per_second": round(tokens_per_step / statistics.mean(ours_times)),
                 "held_out_loss_before": report["eval_before"]["loss"], "held_out_loss": ours_eval["loss"]},
        "hf": {"median_step_ms": round(1000 * med_hf, 1), "tokens_per_second": round(tokens_per_step / med_hf),
               "mean_tokens_per_second": round(tokens_per_step / statistics.mean(hf_steady)),
               "held_out_loss": hf_eval["loss"], "final_train_loss": round(hf_losses[-1], 4),
               "data_prep_seconds": round(hf.prep_seconds, 2)},
    }
    ratio = med_hf / med_ours
    result["ratio"] = {"tokens_per_second": round(ratio, 2), "goal": GOAL, "speed_goal_met": ratio >= GOAL,
                       "loss_goal_met": ours_eval["loss"] <= hf_eval["loss"]}
    assert math.isfinite(ratio)
    from t5compress.bench.stamp import write_result

    write_result(args.out / args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    s = r["setup"]
    lines = [
        "# Pre-training throughput: t5compress pretrain vs Hugging Face's span-corruption recipe",
        "",
        f"{s['arch']} ({s['parameters']:,} parameters, vocabulary {s['vocab_size']}), {s['corpus']}, inputs "
        f"{s['inputs_length']} (packed {s['tokens_length']}), targets {s['targets_length']}, batch {s['batch_size']}, "
        f"{s['steps']} steps each ({s['tokens_each']:,} tokens), {s['threads']} threads, steps alternating in one "
        f"process; median of {s['timed_steps']} timed steps. Load average during the run: "
        f"{', '.join(f'{x:.1f}' for x in s['load_average'])}.",
        "",
        "| pipeline | optimiser, schedule, precision | median step (ms) | tokens/s | held-out loss |",
        "|---|---|---:|---:|---:|",
        f"| Hugging Face run_t5_mlm_flax collator + PyTorch loop | AdamW {s['hf']['lr']}, linear, fp32 | "
        f"{r['hf']['median_step_ms']} | {r['hf']['tokens_per_second']:,} | {r['hf']['held_out_loss']} |",
        f"| t5compress pretrain | adamwscale {s['ours']['lr']}, cosine, {s['ours']['precision']}"
        f"{', compiled' if s['ours']['compile'] else ''} | {r['ours']['median_step_ms']} | "
        f"{r['ours']['tokens_per_second']:,} | {r['ours']['held_out_loss']} |",
        "",
        f"Ratio of tokens/s: **{r['ratio']['tokens_per_second']}x** (goal {r['ratio']['goal']}x: "
        f"{'met' if r['ratio']['speed_goal_met'] else 'not met'}); held-out loss equal or lower: "
        f"{'yes' if r['ratio']['loss_goal_met'] else 'no'} (untrained: {r['ours']['held_out_loss_before']}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
