"""In-flight greedy batching: rows at different decoder positions share one decoder step; finished rows leave at once.

A request joins between two steps: its encoder pass and first decoder step run on their own, then its rows are
appended to the running batch. Every row keeps its own decoder position: the self-attention cache of a row that
joined later is left-padded to the batch's past length, and the in-flight layout's `attention_mask` input of
decoder_with_past_model (export --inflight) masks the padded slots. T5's self-attention position bias depends only
on key position - query position, so a right-aligned row decodes exactly as it would alone. Cross-attention caches
of different input lengths are right-padded to the longest, with `encoder_attention_mask` 0, as in any batch.

    engine = InflightBatch(runtime)                       # a Seq2SeqRuntime on an in-flight export
    pieces = engine.add("req-1", input_ids, mask, runtime.settings(max_new_tokens=8))
    while engine.rows:
        pieces += engine.step()                           # Piece(key, row, token, done) per live row

Greedy only (rows of any max_new_tokens, min_new_tokens, repetition_penalty, no_repeat_ngram_size share a step):
beam search reorders rows within an input and stays batch-at-a-time. Each row's tokens are those of
`runtime.generate` on that input alone (the tests check it), i.e. those of transformers' `generate`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from t5compress.errors import ConfigError, ModelError
from t5compress.names import DECODER_MASK
from t5compress.runtime.hugepages import trim_heap
from t5compress.runtime.limits import check_fits
from t5compress.runtime.model import Seq2SeqRuntime
from t5compress.runtime.search import process_scores
from t5compress.runtime.sessions import releases_working_memory
from t5compress.runtime.settings import GenerationSettings


def supports_inflight(runtime: Seq2SeqRuntime) -> bool:
    """Whether the runtime's decoder_with_past_model takes the self-attention mask (an export made with --inflight)."""
    return DECODER_MASK in runtime.backend.decoder_with_past.input_names


@dataclass(frozen=True)
class Piece:
    """One new token of one row: `key` of the request, `row` within it, and whether the row has finished."""

    key: Hashable
    row: int
    token: int
    done: bool


@dataclass
class Row:
    """A row being decoded: its request, settings and tokens so far (decoder start token first)."""

    key: Hashable
    index: int
    settings: GenerationSettings
    tokens: list[int] = field(default_factory=list)

    @property
    def plain(self) -> bool:
        """No logits processor changes this row's scores at its current length: argmax is its next token."""
        s = self.settings
        return s.repetition_penalty == 1.0 and s.no_repeat_ngram_size == 0 and len(self.tokens) >= s.min_length


class InflightBatch:
    """The running greedy batch of an in-flight export: `add` rows between steps, `step` all of them at once."""

    def __init__(self, runtime: Seq2SeqRuntime):
        if not supports_inflight(runtime):
            raise ModelError(f"'{runtime.path}' has no in-flight decoder_with_past_model (no {DECODER_MASK} input): "
                             "re-export it with `t5compress export MODEL OUT --onnx --inflight`")
        self.runtime, self.tokens = runtime, runtime.tokens
        self.rows: list[Row] = []
        self.self_cache: dict[str, np.ndarray] = {}  # (rows, heads, past_len, d_kv), real entries right-aligned
        self.self_mask = np.zeros((0, 0), dtype=np.int64)  # (rows, past_len): 0 for left padding
        self.cross_cache: dict[str, np.ndarray] = {}  # (rows, heads, enc_len, d_kv), right-padded
        self.enc_mask = np.zeros((0, 0), dtype=np.int64)  # (rows, enc_len)

    @property
    def past_len(self) -> int:
        return self.self_mask.shape[1]

    def add(self, key: Hashable, input_ids: np.ndarray, attention_mask: np.ndarray,
            settings: GenerationSettings) -> list[Piece]:
        """Encode one request's (n, len) inputs and run its first step; returns each row's first token.

        Rows that are not done join the batch: the next `step` decodes them with the others.
        """
        if settings.num_beams != 1:
            raise ConfigError(f"num_beams: in-flight batching is greedy only, got {settings.num_beams} beams")
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        attention_mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        n = input_ids.shape[0]
        check_fits(self.runtime.shape, len(self.rows) + n, 1, input_ids.shape[1], settings.max_new_tokens)
        backend = self.runtime.backend
        hidden = backend.encoder.run({"input_ids": input_ids, "attention_mask": attention_mask})["last_hidden_state"]
        start = np.full((n, 1), self.tokens.decoder_start, dtype=np.int64)
        out = backend.decoder.run({"input_ids": start, "encoder_hidden_states": hidden,
                                   "encoder_attention_mask": attention_mask})
        if self.runtime.device == "cpu" and releases_working_memory():  # what those graphs freed goes back
            trim_heap()
        rows = [Row(key, i, settings, [self.tokens.decoder_start]) for i in range(n)]
        pieces = self._advance(rows, out["logits"][:, -1, :].astype(np.float32, copy=False))
        live = np.array([not p.done for p in pieces])
        if live.any():
            own = {k: v[live] for k, v in out.items() if ".decoder." in k}  # (live, heads, 1, d_kv)
            cross = {k: v[live] for k, v in out.items() if ".encoder." in k}  # (live, heads, len, d_kv)
            self._join([r for r, keep in zip(rows, live, strict=True) if keep], own, cross, attention_mask[live])
        return pieces

    def step(self) -> list[Piece]:
        """One decoder step for every row in the batch; finished rows leave it."""
        if not self.rows:
            return []
        rows = len(self.rows)
        mask = np.concatenate([self.self_mask, np.ones((rows, 1), dtype=np.int64)], axis=1)  # (rows, past + 1)
        last = np.array([[r.tokens[-1]] for r in self.rows], dtype=np.int64)  # (rows, 1)
        feeds = {"input_ids": last, "encoder_attention_mask": self.enc_mask, DECODER_MASK: mask}
        feeds.update({_past(n): v for n, v in self.self_cache.items()})
        feeds.update({_past(n): v for n, v in self.cross_cache.items()})
        out = self.runtime.backend.decoder_with_past.run(feeds)
        self.self_cache = {n: v for n, v in out.items() if ".decoder." in n}
        self.self_mask = mask
        pieces = self._advance(self.rows, out["logits"][:, -1, :].astype(np.float32, copy=False))
        done = np.array([p.done for p in pieces])
        if done.any():
            self._keep(np.flatnonzero(~done))
        return pieces

    def cancel(self, key: Hashable) -> int:
        """Drop every row of request `key` (a client that went away); returns how many rows left."""
        keep = np.array([i for i, r in enumerate(self.rows) if r.key != key], dtype=np.int64)
        dropped = len(self.rows) - keep.size
        if dropped:
            self._keep(keep)
        return dropped

    def _advance(self, rows: list[Row], logits: np.ndarray) -> list[Piece]:
        """logits: (rows, vocab) -> each row's greedy token, appended to it, as a Piece."""
        picks = logits.argmax(axis=-1)  # (rows,)
        eos = set(self.tokens.eos)
        pieces = []
        for i, r in enumerate(rows):
            token = int(picks[i])
            if not r.plain:  # this row's own processors, on its own tokens (transformers' order)
                seq = np.array([r.tokens], dtype=np.int64)
                token = int(process_scores(logits[i : i + 1].copy(), seq, r.settings, self.tokens).argmax())
            r.tokens.append(token)
            done = token in eos or len(r.tokens) >= r.settings.max_length
            pieces.append(Piece(r.key, r.index, token, done))
        return pieces

    def _join(self, rows: list[Row], own: dict[str, np.ndarray], cross: dict[str, np.ndarray],
              enc_mask: np.ndarray) -> None:
        """Append rows whose caches hold their first step: self caches left-padded, cross caches right-padded."""
        past = max(self.past_len, 1)
        new_mask = np.zeros((len(rows), past), dtype=np.int64)
        new_mask[:, -1] = 1  # (new, past): the decoder start token's slot, right-aligned
        width = max(self.enc_mask.shape[1], enc_mask.shape[1])
        if self.rows:
            self.self_cache = {n: np.concatenate([v, _pad(own[n], past, left=True)])
                               for n, v in self.self_cache.items()}
            self.cross_cache = {n: np.concatenate([_pad(v, width), _pad(cross[n], width)])
                                for n, v in self.cross_cache.items()}
            self.self_mask = np.concatenate([self.self_mask, new_mask])
            self.enc_mask = np.concatenate([_pad_mask(self.enc_mask, width), _pad_mask(enc_mask, width)])
        else:
            self.self_cache, self.cross_cache = own, cross
            self.self_mask, self.enc_mask = new_mask, enc_mask
        self.rows += rows

    def _keep(self, keep: np.ndarray) -> None:
        """Go on with rows `keep` only; drop cache columns no remaining row uses (its longest rows left)."""
        self.rows = [self.rows[i] for i in keep]
        self_mask, enc_mask = self.self_mask[keep], self.enc_mask[keep]
        lead = int(np.argmax(self_mask.any(axis=0))) if keep.size else 0  # leading all-padding slots
        used = np.flatnonzero(enc_mask.any(axis=0)) if keep.size else np.zeros(0, dtype=np.int64)
        width = int(used[-1]) + 1 if used.size else enc_mask.shape[1]
        self.self_mask = np.ascontiguousarray(self_mask[:, lead:])
        self.enc_mask = np.ascontiguousarray(enc_mask[:, :width])
        self.self_cache = {n: np.ascontiguousarray(v[keep][:, :, lead:]) for n, v in self.self_cache.items()}
        self.cross_cache = {n: np.ascontiguousarray(v[keep][:, :, :width]) for n, v in self.cross_cache.items()}
        if not self.rows:
            self.self_cache, self.cross_cache = {}, {}
            self.self_mask = np.zeros((0, 0), dtype=np.int64)
            self.enc_mask = np.zeros((0, 0), dtype=np.int64)


def _past(name: str) -> str:
    return name.replace("present.", "past_key_values.", 1)


def _pad(v: np.ndarray, length: int, left: bool = False) -> np.ndarray:
    """(rows, heads, len, d_kv) zero-padded on the sequence axis to `length` (left: real entries right-aligned)."""
    extra = length - v.shape[2]
    if extra <= 0:
        return v
    return np.pad(v, ((0, 0), (0, 0), (extra, 0) if left else (0, extra), (0, 0)))


def _pad_mask(mask: np.ndarray, length: int) -> np.ndarray:
    return np.pad(mask, ((0, 0), (0, length - mask.shape[1]))) if mask.shape[1] < length else mask
