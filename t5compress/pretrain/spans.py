"""T5's span-corruption objective: the length arithmetic, the random span mask, and a vectorised batch collator.

The rules are those of T5 (`t5.data.preprocessors.random_spans_noise_mask` / `random_spans_helper`) as nanoT5 and
Hugging Face's `run_t5_mlm_flax` use them:
- a packed example of `tokens_length` tokens has `round(tokens_length * noise_density)` noise tokens in
  `round(noise_tokens / mean_noise_span_length)` noise spans; spans alternate non-noise / noise, starting with
  non-noise, and every such mask is equally likely;
- the input keeps the non-noise tokens and puts one sentinel in place of each noise span (extra_id_0 for the first,
  extra_id_1 for the next, ...), then </s>; the target is the mirror image: each noise span after its sentinel, then
  </s>. So every token of the example appears exactly once, in the input or in the target;
- `compute_input_and_target_lengths` picks the longest `tokens_length` whose corrupted input fits `inputs_length`
  exactly (512 -> 568 tokens, targets 114 at density 0.15 and mean span 3): packed batches have no padding at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from t5compress.errors import ConfigError


def _lengths_after(tokens_length: int, noise_density: float, mean_span: float) -> tuple[int, int, int]:
    """(input length, target length, noise spans) of a `tokens_length`-token example after corruption."""
    noise = int(round(tokens_length * noise_density))
    spans = int(round(noise / mean_span))
    return tokens_length - noise + spans + 1, noise + spans + 1, spans  # +1: the closing </s>


def compute_input_and_target_lengths(
    inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """(tokens_length, targets_length): raw tokens per packed example so that the corrupted input is exactly
    `inputs_length` long, and the length of its target. Raises ConfigError when no span of noise fits."""
    if not 0 < noise_density < 1:
        raise ConfigError(f"noise_density: must be between 0 and 1, got {noise_density}")
    if mean_noise_span_length < 1:
        raise ConfigError(f"mean_noise_span_length: must be >= 1, got {mean_noise_span_length}")
    found = _tokens_length(inputs_length, noise_density, mean_noise_span_length)
    if found is None:
        shortest = next(n for n in range(2, 100_000) if _tokens_length(n, noise_density, mean_noise_span_length))
        raise ConfigError(
            f"inputs_length: {inputs_length} is too short for noise_density {noise_density} and mean span "
            f"{mean_noise_span_length} (no whole noise span fits); use inputs_length >= {shortest}"
        )
    tokens_length, targets = found
    if noise_density == 0.5 and targets > inputs_length:  # T5's own tweak: keep targets at the (round) input length
        tokens_length, targets = tokens_length - 1, targets - 1
    return tokens_length, targets


def _tokens_length(inputs_length: int, noise_density: float, mean_span: float) -> tuple[int, int] | None:
    """(tokens_length, targets_length) as T5 computes them, or None when no whole noise span fits."""
    tokens_length = inputs_length
    while _lengths_after(tokens_length + 1, noise_density, mean_span)[0] <= inputs_length:
        tokens_length += 1
    inputs, targets, spans = _lengths_after(tokens_length, noise_density, mean_span)
    noise = int(round(tokens_length * noise_density))
    if spans < 1 or noise >= tokens_length or inputs != inputs_length:
        return None
    return tokens_length, targets


def _segment_lengths(rng: np.random.Generator, batch: int, items: int, segments: int) -> np.ndarray:
    """(batch, segments) positive lengths summing to `items` per row; every partition equally likely."""
    if segments == 1:
        return np.full((batch, 1), items, dtype=np.int64)
    # choose segments-1 distinct cut points among the items-1 gaps, independently per row
    keys = rng.random((batch, items - 1))  # (B, items-1)
    cuts = np.sort(np.argpartition(keys, segments - 2, axis=1)[:, : segments - 1], axis=1) + 1  # (B, segments-1)
    bounds = np.concatenate([np.zeros((batch, 1), np.int64), cuts, np.full((batch, 1), items)], axis=1)
    return np.diff(bounds, axis=1)  # (B, segments)


def noise_mask(
    rng: np.random.Generator, batch: int, length: int, noise_density: float, mean_noise_span_length: float
) -> np.ndarray:
    """(batch, length) boolean noise mask with T5's span statistics; every row ends inside a noise span."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = max(int(round(noise / mean_noise_span_length)), 1)
    noise_lengths = _segment_lengths(rng, batch, noise, spans)  # (B, spans)
    keep_lengths = _segment_lengths(rng, batch, length - noise, spans)  # (B, spans)
    interleaved = np.stack([keep_lengths, noise_lengths], axis=2).reshape(batch, 2 * spans)  # keep, noise, ...
    starts = np.cumsum(interleaved, axis=1)[:, :-1]  # (B, 2*spans-1): where each span after the first begins
    indicator = np.zeros((batch, length), dtype=np.int64)
    np.put_along_axis(indicator, starts, 1, axis=1)
    return np.cumsum(indicator, axis=1) % 2 == 1  # odd span numbers are noise


def _corrupt(tokens: np.ndarray, drop: np.ndarray, sentinel_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Replace each run of `drop` by the next sentinel, remove the rest of the run, append </s>."""
    batch = tokens.shape[0]
    first = drop & ~np.pad(drop[:, :-1], ((0, 0), (1, 0)))  # (B, L): first token of each dropped run
    run_index = np.cumsum(first, axis=1) - 1  # (B, L): which run (0, 1, ...) a position belongs to
    full = np.where(first, sentinel_ids[np.clip(run_index, 0, len(sentinel_ids) - 1)], tokens)
    kept = full[~drop | first].reshape(batch, -1)  # every row keeps the same count: same L, same span numbers
    return np.concatenate([kept, np.full((batch, 1), eos_id, dtype=kept.dtype)], axis=1)


@dataclass(frozen=True)
class SpanCorruption:
    """Turns packed (batch, tokens_length) token blocks into T5 span-corruption inputs and labels.

    `sentinel_ids[k]` is the id of `<extra_id_k>` (T5 vocabularies put extra_id_0 at the top and count down).
    """

    sentinel_ids: tuple[int, ...]
    eos_id: int
    inputs_length: int = 512
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0

    def __post_init__(self) -> None:
        tokens, targets = compute_input_and_target_lengths(self.inputs_length, self.noise_density,
                                                           self.mean_noise_span_length)
        spans = _lengths_after(tokens, self.noise_density, self.mean_noise_span_length)[2]
        if spans > len(self.sentinel_ids):
            raise ConfigError(f"inputs_length: {self.inputs_length} makes {spans} noise spans, but the tokenizer has "
                              f"only {len(self.sentinel_ids)} sentinel tokens; use a shorter inputs_length")
        object.__setattr__(self, "tokens_length", tokens)
        object.__setattr__(self, "targets_length", targets)

    @classmethod
    def for_tokenizer(cls, tokenizer, **kwargs) -> SpanCorruption:
        """Read the sentinel ids `<extra_id_0>`, `<extra_id_1>`, ... and </s> from a tokenizer."""
        vocab = tokenizer.get_vocab()
        ids = []
        while f"<extra_id_{len(ids)}>" in vocab:
            ids.append(vocab[f"<extra_id_{len(ids)}>"])
        if not ids:
            raise ConfigError("the tokenizer has no sentinel tokens (<extra_id_0>, ...); span corruption needs them")
        return cls(sentinel_ids=tuple(ids), eos_id=tokenizer.eos_token_id, **kwargs)

    def __call__(self, tokens: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """tokens (B, tokens_length) -> input_ids (B, inputs_length) and labels (B, targets_length), int64."""
        if tokens.ndim != 2 or tokens.shape[1] != self.tokens_length:
            raise ValueError(f"expected (batch, {self.tokens_length}) tokens, got {tokens.shape}")
        mask = noise_mask(rng, tokens.shape[0], self.tokens_length, self.noise_density, self.mean_noise_span_length)
        return apply_mask(tokens, mask, self.sentinel_ids, self.eos_id)


def apply_mask(tokens: np.ndarray, mask: np.ndarray, sentinel_ids, eos_id: int) -> dict[str, np.ndarray]:
    """T5 inputs and labels of `tokens` (B, L) under the noise `mask` (B, L); every row needs as many noise spans."""
    tokens = tokens.astype(np.int64, copy=False)
    sentinels = np.asarray(sentinel_ids, dtype=np.int64)
    return {"input_ids": _corrupt(tokens, mask, sentinels, eos_id),  # (B, L - noise + spans + 1)
            "labels": _corrupt(tokens, ~mask, sentinels, eos_id)}  # (B, noise + spans + 1)


def pack(documents: Iterable[list[int]], length: int) -> Iterator[np.ndarray]:
    """Concatenate token lists (each already ending in </s>) and cut the stream into blocks of exactly `length`.

    Documents run across block borders, as in T5 and nanoT5; the last partial block is dropped.
    """
    buffer: list[int] = []
    for ids in documents:
        buffer.extend(ids)
        if len(buffer) >= length:
            whole = len(buffer) // length * length
            yield from np.asarray(buffer[:whole], dtype=np.int64).reshape(-1, length)
            del buffer[:whole]
