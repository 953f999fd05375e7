"""What the prune report compares before and after: parameters, bytes, PyTorch generation latency, task metric."""

from __future__ import annotations

import statistics
import time

import torch

from t5compress.data import DataConfig, Example, encode


def block_parameters(model) -> int:
    """Parameters inside the transformer blocks (embeddings, final norms and the LM head excluded)."""
    return sum(p.numel() for s in (model.encoder, model.decoder) for p in s.block.parameters())


def size(model) -> dict:
    from t5compress.model.load import count_parameters

    unique = {id(p): p for p in model.parameters()}.values()
    return {"parameters": count_parameters(model), "block_parameters": block_parameters(model),
            "bytes": sum(p.numel() * p.element_size() for p in unique)}


@torch.no_grad()
def latency_ms(models: list, tokenizers: list, examples: list[Example], cfg: DataConfig, new_tokens: int,
               repeat: int = 3) -> list[float | None]:
    """Median ms of greedy `generate` at batch 1 with exactly `new_tokens` new tokens, per model (each reading the
    examples through its own tokenizer: vocabulary pruning renumbers the pieces).

    The models take turns on every example (after one warm-up call each), so that a load change on a shared
    machine hits them alike; before/after numbers measured minutes apart are not comparable.
    """
    from t5compress.train.evaluation import generate_kwargs

    if not examples:
        return [None] * len(models)
    encoded = [encode(examples, tokenizer, cfg).input_ids for tokenizer in tokenizers]
    times: list[list[float]] = [[] for _ in models]
    for step, k in enumerate([0] + list(range(len(examples))) * repeat):  # example 0 first: the warm-up
        for j, model in enumerate(models):
            x = torch.tensor([encoded[j][k]])
            model.eval()
            t0 = time.perf_counter()
            model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, num_beams=1, **generate_kwargs(model))
            if step:
                times[j].append(1000 * (time.perf_counter() - t0))
    return [round(statistics.median(t), 2) for t in times]


def measure_eval(model, tokenizer, examples: list[Example], cfg: DataConfig, batch_size: int = 32) -> dict:
    """Loss, exact match, ROUGE-L and BLEU on `examples` (samples dropped)."""
    from t5compress.train.evaluation import evaluate

    enc = encode(examples, tokenizer, cfg)
    result = evaluate(model, tokenizer, examples, enc, batch_size, max(len(x) for x in enc.labels))
    return {k: v for k, v in result.items() if k != "samples"}
