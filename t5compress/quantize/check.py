"""What an int8 export is checked on: it cannot match fp32 to 1e-4, so check what matters to its users.

- Teacher-forced next-token agreement and logit error: both models read the same inputs and the fp32 model's own
  greedy outputs; per position, does the int8 model pick the same next token, and how far are its logits (relative
  to the fp32 logits' scale)? This is the number a broken quantization cannot hide, so it has a threshold.
- Greedy agreement: the share of whole generated outputs that are identical.
- Task metrics (exact match, ROUGE-L, BLEU) of both on held-out data, when there is some.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from t5compress.quantize.calibrate import RUN_TOKENS, batches

CHECK_TEXTS = 200  # the texts the stage checks on (and a guided choice of groups is measured on)


class Reference:
    """fp32's greedy outputs on `texts`, its encoder states and its logits along them: what int8 graphs are compared
    with (computed once, so many variants can be measured). With `store`, each batch's arrays are written there and
    read back one batch at a time, so memory does not grow with the texts (200 texts of 512 tokens of a t5-base shape
    are ~1.1 GB of logits and states)."""

    def __init__(self, fp32, texts: Sequence[str], batch_size: int = 16, max_new_tokens: int = 32,
                 store: Path | None = None):
        self.fp32, self.chunks = fp32, []
        for i, item in enumerate(_references(fp32, texts, batch_size, max_new_tokens)):
            if store is not None:
                path = store / f"reference.{i}.npz"
                np.savez(path, *item)
                item = path
            self.chunks.append(item)

    def compare(self, encoder=None, decoder=None) -> dict:
        """Next-token agreement and logit error of the given graphs (None: fp32's) along fp32's greedy outputs."""
        return _compare(self.fp32, (_loaded(c) for c in self.chunks), encoder, decoder)


def _loaded(chunk):
    if isinstance(chunk, Path):
        with np.load(chunk) as z:
            return tuple(z[f"arr_{k}"] for k in range(len(z.files)))
    return chunk


def _references(fp32, texts: Sequence[str], batch_size: int, max_new_tokens: int) -> Iterator[tuple]:
    """Per batch of `texts`: (ids, mask, fp32's greedy sequence, encoder states, logits along it, live positions)."""
    for chunk in batches(texts, rows_for(fp32, texts, batch_size)):
        ids, mask = fp32.encode(chunk)
        seq = fp32.generate(ids, mask, max_new_tokens=max_new_tokens, num_beams=1)  # (batch, 1 + steps)
        hidden = _encode(fp32.backend.encoder, ids, mask)
        live = seq[:, 1:] != fp32.tokens.pad  # (batch, steps): positions before padding
        live[:, 0] = True
        yield ids, mask, seq, hidden, _decode(fp32.backend.decoder, hidden, mask, seq), live


def _compare(fp32, chunks, encoder=None, decoder=None) -> dict:
    agree = total = rows = 0
    worst_rel, sum_rel = 0.0, 0.0
    for ids, mask, seq, hidden, ref, live in chunks:
        if encoder is not None:
            hidden = _encode(encoder, ids, mask)
        got = _decode(decoder if decoder is not None else fp32.backend.decoder, hidden, mask, seq)
        same = ref.argmax(-1) == got.argmax(-1)
        agree += int((same & live).sum())
        total += int(live.sum())
        scale = np.abs(ref).max(axis=(1, 2))  # (batch,)
        rel = np.abs(got - ref).max(axis=(1, 2)) / np.maximum(scale, 1e-6)
        worst_rel = max(worst_rel, float(rel.max()))
        sum_rel += float(rel.sum())
        rows += len(ids)
    return {"next_token_agreement": round(agree / max(total, 1), 4), "positions": total,
            "max_rel_logit_error": round(worst_rel, 4), "mean_rel_logit_error": round(sum_rel / max(rows, 1), 4)}


def _encode(encoder, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return encoder.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]


def _decode(decoder, hidden: np.ndarray, mask: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Logits for every position of `seq` (decoder input = seq without its last token), one decoder call."""
    out = decoder.run({"input_ids": seq[:, :-1], "encoder_hidden_states": hidden, "encoder_attention_mask": mask})
    return out["logits"].astype(np.float32)


def rows_for(rt, texts: Sequence[str], batch_size: int) -> int:
    """Rows per batch: `batch_size`, fewer when the longest text (as the runtime truncates it) would put more than
    RUN_TOKENS input tokens in a batch (the encoder's attention scores grow with rows x length^2)."""
    enc = rt.tokenize(list(texts))
    longest = max(enc.lengths, default=1) if enc.limit is None else min(max(enc.lengths, default=1), enc.limit)
    return max(1, min(batch_size, RUN_TOKENS // max(longest, 1)))


def greedy_outputs(rt, texts: Sequence[str], batch_size: int = 32, max_new_tokens: int = 32) -> list[str]:
    """Greedy outputs in the order of `texts` (batched by length, so padding stays small)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batch_size = rows_for(rt, texts, batch_size)
    out: list[str] = [""] * len(texts)
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        for j, text in zip(idx, rt.generate_text([texts[k] for k in idx], max_new_tokens=max_new_tokens),
                           strict=True):
            out[j] = text.strip()
    return out


def agreement(a: Sequence[str], b: Sequence[str]) -> float:
    return round(sum(x == y for x, y in zip(a, b, strict=True)) / max(len(a), 1), 4)
