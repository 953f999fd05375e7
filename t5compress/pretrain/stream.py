"""Batches for the trainer from a streamed corpus: tokenize, pack, shuffle in a buffer, corrupt spans, prefetch.

`PackedStream` is a `t5compress.train.loop.BatchStream`: deterministic in (seed, epoch, batch index), so a resumed run
sees the same batches it would have seen. The span masks come from a generator seeded by (seed, epoch, batch), so
skipping batches on resume costs only reading and packing, not corrupting. A background thread builds the next
batches while the model trains (the tokenizer and numpy release the GIL for most of that work).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from t5compress.errors import DataError
from t5compress.pretrain.corpus import Corpus, tokenized
from t5compress.pretrain.spans import SpanCorruption, pack

log = logging.getLogger(__name__)


def _as_batch(corrupted: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    input_ids = torch.from_numpy(corrupted["input_ids"])  # (B, inputs_length): packed, never padded
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "labels": torch.from_numpy(corrupted["labels"])}  # (B, targets_length)


def _shuffled(blocks: Iterator[np.ndarray], size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """A streaming shuffle: keep `size` blocks, emit a random one as each new block arrives."""
    buffer: list[np.ndarray] = []
    for block in blocks:
        if len(buffer) < size:
            buffer.append(block)
            continue
        i = int(rng.integers(size))
        yield buffer[i]
        buffer[i] = block
    rng.shuffle(buffer)
    yield from buffer


@dataclass
class PackedStream:
    """Endless training batches of span-corrupted packed blocks from the training documents of `corpus`."""

    corpus: Corpus
    tokenizer: object
    collator: SpanCorruption
    batch_size: int
    seed: int = 0
    shuffle_buffer: int = 1000
    prefetch: int = 4

    def _blocks(self, epoch: int) -> Iterator[np.ndarray]:
        docs = tokenized(self.corpus.split(train=True), self.tokenizer)
        blocks = pack(docs, self.collator.tokens_length)
        return _shuffled(blocks, self.shuffle_buffer, np.random.default_rng([self.seed, epoch, 1]))

    def _epoch(self, epoch: int, skip: int, rank: int, world: int) -> Iterator[tuple[int, int, dict, int]]:
        group: list[np.ndarray] = []
        index = 0
        for block in self._blocks(epoch):
            group.append(block)
            if len(group) < self.batch_size * world:
                continue
            index += 1
            if index > skip:
                tokens = np.stack(group[rank::world])  # (B, tokens_length)
                rng = np.random.default_rng([self.seed, epoch, index])
                yield epoch, index, _as_batch(self.collator(tokens, rng)), len(tokens)
            group = []
        if index == 0:
            raise DataError(f"{self.corpus.source}: the training text fills no batch of {self.batch_size * world} "
                            f"blocks of {self.collator.tokens_length} tokens; use more text, a smaller --batch-size "
                            "or a shorter --inputs-length")

    def _endless(self, epoch: int, pos: int, rank: int, world: int) -> Iterator[tuple[int, int, dict, int]]:
        while True:
            yield from self._epoch(epoch, pos, rank, world)
            epoch, pos = epoch + 1, 0

    def batches(self, epoch: int, pos: int, rank: int, world: int) -> Iterator[tuple[int, int, dict, int]]:
        return _prefetched(self._endless(epoch, pos, rank, world), self.prefetch)


def _prefetched(items: Iterator, depth: int) -> Iterator:
    """Run `items` in a daemon thread, `depth` ahead of the consumer; its exceptions surface in the consumer."""
    if depth <= 0:
        yield from items
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            q.put((False, e))

    thread = threading.Thread(target=work, name="t5compress-pretrain-batches", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            yield item
    finally:
        stop.set()


@dataclass
class SpanEval:
    """Fixed held-out span-corruption batches (same masks every time): the pre-training evaluation."""

    batches: list[dict[str, torch.Tensor]]

    @classmethod
    def build(cls, corpus: Corpus, tokenizer, collator: SpanCorruption, max_examples: int, batch_size: int,
              seed: int = 0) -> SpanEval:
        blocks: list[np.ndarray] = []
        for block in pack(tokenized(corpus.split(train=False), tokenizer), collator.tokens_length):
            blocks.append(block)
            if len(blocks) == max_examples:
                break
        if not blocks:
            raise DataError(f"{corpus.source}: the held-out documents (every {corpus.holdout_every}th) fill no block "
                            f"of {collator.tokens_length} tokens; use more text, a smaller --holdout-every or a "
                            "shorter --inputs-length")
        rng = np.random.default_rng([seed, 7])
        batches = [_as_batch(collator(np.stack(blocks[i : i + batch_size]), rng))
                   for i in range(0, len(blocks), batch_size)]
        return cls(batches)

    @property
    def examples(self) -> int:
        return sum(len(b["input_ids"]) for b in self.batches)

    @torch.no_grad()
    def evaluate(self, model, tokenizer=None, cfg=None, device=None) -> dict:
        """Mean cross-entropy per target token on the held-out batches."""
        was_training = model.training
        model.eval()
        device = device or next(model.parameters()).device
        total, count = 0.0, 0
        for batch in self.batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            n = batch["labels"].numel()
            total += float(span_loss(model, batch)) * n
            count += n
        model.train(was_training)
        return {"loss": round(total / count, 4), "examples": self.examples}


def span_loss(model, batch: dict[str, torch.Tensor], label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy per target token, computed once (no `labels=` passed: the model would compute it too)."""
    labels = batch["labels"]  # (B, T): packed targets, no padding
    decoder_input_ids = model._shift_right(labels) if hasattr(model, "_shift_right") else _shift(model, labels)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   decoder_input_ids=decoder_input_ids, use_cache=False).logits  # (B, T, vocab)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                             ignore_index=-100, label_smoothing=label_smoothing)


def _shift(model, labels: torch.Tensor) -> torch.Tensor:
    """T5's right shift for a wrapped (e.g. torch.compile'd) model: decoder_start_token_id, then labels[:-1]."""
    inner = getattr(model, "_orig_mod", model)
    return inner._shift_right(labels)
