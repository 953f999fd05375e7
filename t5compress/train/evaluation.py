"""Evaluation of a PyTorch T5 on text-to-text examples: loss on the references, and generation metrics."""

from __future__ import annotations

import logging

import torch

from t5compress import metrics
from t5compress.data import Encoded, Example, batch_order, collate

log = logging.getLogger(__name__)


def token_loss(model, batch: dict[str, torch.Tensor], label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy per target token (padding, labelled -100, ignored)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    logits = out.logits  # (batch, tgt_len, vocab)
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        batch["labels"].reshape(-1),
        ignore_index=-100,
        label_smoothing=label_smoothing,
    )


def generate_kwargs(model) -> dict:
    """transformers 4.57 sizes its default cache from the encoder depth: differing depths need dynamic_full."""
    c = model.config
    return {"cache_implementation": "dynamic_full"} if c.num_layers != c.num_decoder_layers else {}


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    examples: list[Example],
    encoded: Encoded,
    batch_size: int = 32,
    max_new_tokens: int = 64,
    num_beams: int = 1,
    device: torch.device | None = None,
) -> dict:
    """Loss on the references plus exact match, ROUGE-L and BLEU of generated outputs."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    pad = tokenizer.pad_token_id
    lengths = [len(x) for x in encoded.input_ids]
    predictions: list[str] = [""] * len(examples)
    loss_sum, tokens = 0.0, 0
    for idx in batch_order(lengths, batch_size, seed=0, epoch=0, bucket=True, shuffle=False):
        batch = {k: v.to(device) for k, v in collate(encoded, idx, pad).items()}
        n_tok = int((batch["labels"] != -100).sum())
        loss_sum += float(token_loss(model, batch)) * n_tok
        tokens += n_tok
        out = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            num_beams=num_beams,
            do_sample=False,
            **generate_kwargs(model),
        )
        for i, text in zip(idx, tokenizer.batch_decode(out, skip_special_tokens=True), strict=True):
            predictions[i] = text.strip()
    model.train(was_training)
    result = {"loss": round(loss_sum / max(tokens, 1), 4)}
    result.update(metrics.compute(predictions, [e.target for e in examples]))
    result["examples"] = len(examples)
    pairs = list(zip(examples, predictions, strict=True))[:3]
    result["samples"] = [{"source": e.source, "target": e.target, "prediction": p} for e, p in pairs]
    return result
