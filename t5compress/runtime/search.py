"""Greedy and beam search in numpy, step for step the algorithm of `transformers` 4.57 `generate`.

The searches drive a `Decoder` (one call per step, logits out) and never see the graphs or the cache, so the same
code serves ONNX Runtime and TorchScript. Matching transformers is the contract: same logits processors in the same
order, beam search's top-2k candidate bookkeeping, length penalty, early-stopping heuristic and output padding.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from t5compress.runtime.settings import GenerationSettings, SpecialTokens

NEG = np.float32(-1.0e9)  # transformers' "very large negative" for unusable beams (not -inf: it is added to scores)


class Decoder(Protocol):
    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed the last token of every row, (rows,) int64; return next-token logits, (rows, vocab) float32."""

    def reorder(self, rows: np.ndarray) -> None:
        """Make row i of the self-attention cache the former row `rows[i]`, a beam of the same input."""

    def keep(self, rows: np.ndarray) -> None:
        """Drop every row not in `rows` (finished greedy rows), keeping the order of `rows`."""


def process_scores(scores: np.ndarray, sequences: np.ndarray, s: GenerationSettings, tok: SpecialTokens) -> np.ndarray:
    """transformers' logits processors, in its order: repetition penalty, no-repeat n-grams, minimum length.

    scores: (rows, vocab) float32, modified in place; sequences: (rows, cur_len) int64 tokens so far.
    """
    if s.repetition_penalty != 1.0:
        seen = np.take_along_axis(scores, sequences, axis=1)  # (rows, cur_len)
        seen = np.where(seen < 0, seen * np.float32(s.repetition_penalty), seen / np.float32(s.repetition_penalty))
        np.put_along_axis(scores, sequences, seen, axis=1)
    if s.no_repeat_ngram_size > 0:
        for row, banned in enumerate(banned_ngram_tokens(sequences, s.no_repeat_ngram_size)):
            if banned:
                scores[row, banned] = -np.inf
    if sequences.shape[1] < s.min_length and tok.eos:
        scores[:, list(tok.eos)] = -np.inf
    return scores


def banned_ngram_tokens(sequences: np.ndarray, n: int) -> list[list[int]]:
    """Per row, the tokens that would repeat an n-gram already in that row (fairseq's rule, as transformers)."""
    cur_len = sequences.shape[1]
    if cur_len + 1 < n:
        return [[] for _ in range(sequences.shape[0])]
    out = []
    for row in sequences.tolist():
        prefix = tuple(row[cur_len + 1 - n:])  # the last n-1 tokens
        out.append([row[i + n - 1] for i in range(cur_len - n + 1) if tuple(row[i:i + n - 1]) == prefix])
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    """(rows, vocab) float32 -> log-probabilities, float32 like torch's.

    Run by ONNX Runtime's LogSoftmax kernel (vectorised exp): numpy's float32 exp made this 9% of a batch-8 beam-4
    call (2.9 ms per step for 32 x 32128 scores, 0.6 ms in ONNX Runtime). numpy is the fallback without it.
    """
    session = _log_softmax_session()
    if session is not None and x.dtype == np.float32 and x.ndim == 2:
        return session.run(None, {"x": np.ascontiguousarray(x)})[0]
    out = x - x.max(axis=-1, keepdims=True)
    out -= np.log(np.exp(out).sum(axis=-1, keepdims=True))  # in place: one (rows, vocab) temporary, not two
    return out


# A one-node ONNX model, LogSoftmax(axis=-1) on x: float32 (rows, vocab) -> y, opset 13, serialised here because the
# runtime does not import the onnx package; tests/runtime/test_search.py rebuilds it with onnx.helper and checks the
# bytes.
LOG_SOFTMAX_ONNX = bytes.fromhex(
    "0808120a7435636f6d70726573733a730a280a0178120179220a4c6f67536f66746d61782a140a046178697318ffffffffffffffffff01"
    "a00102120b6c6f675f736f66746d61785a1c0a017812170a15080112110a061204726f77730a071205766f636162621c0a017912170a15"
    "080112110a061204726f77730a071205766f63616242040a00100d"
)
_SESSION: list = []  # [session or None], built on first use


def _log_softmax_session():
    if not _SESSION:
        try:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            _SESSION.append(ort.InferenceSession(LOG_SOFTMAX_ONNX, so, providers=["CPUExecutionProvider"]))
        except ImportError:  # the TorchScript backend runs without onnxruntime
            _SESSION.append(None)
    return _SESSION[0]


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries per row of (rows, n), best first (ties: lower index first)."""
    if x.shape[1] <= _CHUNK:  # beam search's 2k candidates: one small sort beats partitioning first
        return np.argsort(-x, axis=1, kind="stable")[:, :k]
    if x.shape[1] >= _CHUNKED_MIN and k <= 64:
        return _topk_chunked(x, k)
    if k < x.shape[1]:
        part = np.argpartition(-x, k - 1, axis=1)[:, :k]  # (rows, k), unordered
        order = np.argsort(-np.take_along_axis(x, part, axis=1), axis=1, kind="stable")
        return np.take_along_axis(part, order, axis=1)
    return np.argsort(-x, axis=1, kind="stable")[:, :k]


_CHUNK = 128
_STRIDED = 32  # beam_topk: entries per strided chunk (fastest of 8 to 128 at 32 x 32128)
_CHUNKED_MIN = 16 * _CHUNK


def _topk_chunked(x: np.ndarray, k: int) -> np.ndarray:
    """topk over beams x vocab without partitioning all of it (it cost a quarter of beam search at batch 8).

    The k largest entries of a row lie in the k chunks with the largest maxima: a chunk holding one of them has a
    maximum at least that large, and k other chunks with larger maxima would give k larger entries. So one
    vectorised max pass picks k chunks, and only k * 128 candidates are ranked.
    """
    rows, n = x.shape
    pad = -n % _CHUNK
    xp = np.pad(x, ((0, 0), (0, pad)), constant_values=-np.inf) if pad else x
    chunks = xp.reshape(rows, -1, _CHUNK)  # (rows, n_chunks, chunk)
    best_chunks = np.sort(np.argpartition(-chunks.max(axis=2), k - 1, axis=1)[:, :k], axis=1)  # (rows, k), ascending
    cand = (best_chunks[:, :, None] * _CHUNK + np.arange(_CHUNK)).reshape(rows, -1)  # (rows, k*chunk), ascending
    vals = np.take_along_axis(xp, cand, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")[:, :k]  # stable over ascending indices: ties keep lower index
    return np.take_along_axis(cand, order, axis=1)


def beam_topk(logp: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of logp + scores over beams x vocab, per input, without adding the scores to every entry.

    logp: (batch*beams, vocab) float32; scores: (batch, beams) float32. Returns (batch, k) values, each
    logp[row, v] + scores[input, beam] in float32 as the full sum would have it, and their indices into beams x vocab,
    best first, ties to the lower index: what `topk` gives on the (batch, beams*vocab) sum.

    A beam's score shifts its whole row, so, as in `_topk_chunked`, the k best lie in the k chunks with the largest
    maximum + score. Chunks here are strided (entries j, j + n, j + 2n, ... of a row), so their maxima are one
    vectorised pass over contiguous memory: 0.5 instead of 1.1 ms per step for 32 x 32128 scores.
    """
    batch, beams = scores.shape
    vocab = logp.shape[1]
    if beams * -(-vocab // _STRIDED) < k:  # fewer chunks than candidates (a toy vocabulary): rank the whole sum
        full = (logp.reshape(batch, beams, vocab) + scores[:, :, None]).reshape(batch, beams * vocab)
        cand = topk(full, k)
        return np.take_along_axis(full, cand, axis=1), cand
    pad = -vocab % _STRIDED
    padded = np.pad(logp, ((0, 0), (0, pad)), constant_values=-np.inf) if pad else logp
    n = padded.shape[1] // _STRIDED  # chunks per row
    maxima = padded.reshape(batch, beams, _STRIDED, n).max(axis=2) + scores[:, :, None]  # (batch, beams, n)
    best = _best_chunks(maxima.reshape(batch, -1), k)  # (batch, k) chunks of beams x n
    cand = ((best // n) * (vocab + pad) + best % n)[:, :, None] + n * np.arange(_STRIDED)
    cand = np.sort(cand.reshape(batch, -1), axis=1)  # (batch, k*chunk) into beams x padded vocab, ascending
    values = np.take_along_axis(padded.reshape(batch, -1), cand, axis=1)
    values += np.take_along_axis(scores, cand // (vocab + pad), axis=1)
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    cand = np.take_along_axis(cand, order, axis=1)
    return np.take_along_axis(values, order, axis=1), cand // (vocab + pad) * vocab + cand % (vocab + pad)


def _best_chunks(maxima: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries per row of (rows, n), unordered, as `np.argpartition` picks them.

    Partitioning 8 rows of 4,016 beam-4 chunk maxima took 0.30 ms a step, more than the rest of `beam_topk`. The
    argument of `_topk_chunked` once more: the k largest lie among the members of the k strided groups (entries j,
    j + n/g, ...) with the largest maxima, so a max pass and a partition of n/g group maxima and of g*k members do
    it (0.04 ms). Rows too short for it, or whose length no group count divides, are partitioned whole."""
    rows, n = maxima.shape
    g = next((g for g in (16, 8) if n % g == 0 and n >= 4 * g * k), 0)
    if not g:
        return np.argpartition(maxima, -k, axis=1)[:, -k:]
    width = n // g
    groups = np.argpartition(maxima.reshape(rows, g, width).max(axis=1), -k, axis=1)[:, -k:]  # (rows, k)
    members = (groups[:, :, None] + width * np.arange(g)).reshape(rows, -1)  # (rows, g*k)
    pick = np.argpartition(np.take_along_axis(maxima, members, axis=1), -k, axis=1)[:, -k:]
    return np.take_along_axis(members, pick, axis=1)


def fill_value(tok: SpecialTokens, num_beams: int) -> int:
    """What pads a finished row: greedy, the pad id; beam search, transformers' `pad or eos` (for T5, whose pad is 0,
    the EOS id)."""
    if num_beams == 1:
        return tok.pad
    return tok.pad or (tok.eos[0] if tok.eos else -1)


def greedy_search(decoder: Decoder, batch: int, s: GenerationSettings, tok: SpecialTokens) -> np.ndarray:
    """(batch, out_len) int64: start token first; rows that finished early are padded with the pad id.

    Finished rows leave the decoder's batch (transformers keeps computing them and throws the result away): a batch
    whose outputs differ in length costs what its unfinished rows cost. Tokens are unchanged by this.
    """
    seqs = np.full((batch, s.max_length), tok.pad, dtype=np.int64)  # (batch, max_len); finished rows stay pad
    seqs[:, 0] = tok.decoder_start
    active = np.arange(batch)  # rows of `seqs` still decoding, in the decoder's row order
    eos = np.array(tok.eos, dtype=np.int64)
    cur = 1
    while True:
        logits = decoder.step(seqs[active, cur - 1])  # (active, vocab)
        nxt = process_scores(logits, seqs[active, :cur], s, tok).argmax(axis=-1)
        seqs[active, cur] = nxt
        cur += 1
        done = np.isin(nxt, eos)
        if cur >= s.max_length or done.all():
            return seqs[:, :cur]
        if done.any():
            keep = np.flatnonzero(~done)
            decoder.keep(keep)
            active = active[keep]


def beam_search(decoder: Decoder, batch: int, s: GenerationSettings, tok: SpecialTokens) -> np.ndarray:
    """(batch * num_return_sequences, out_len) int64, best hypothesis first within each input.

    Keeps, like transformers, the top 2k candidates per step (k = num_beams) so that k live beams remain when some
    candidates end in EOS; finished hypotheses compete on score / generated_length ** length_penalty.
    """
    k, max_len = s.num_beams, s.max_length
    k2 = max(2, 1 + len(tok.eos)) * k
    top_k_mask = np.arange(k2) < k  # only the best k candidates of a step may enter the finished set
    fill = fill_value(tok, k)
    run_seqs = np.full((batch, k, max_len), fill, dtype=np.int64)  # (batch, beams, max_len) live hypotheses
    run_seqs[:, :, 0] = tok.decoder_start
    run_scores = np.zeros((batch, k), dtype=np.float32)
    run_scores[:, 1:] = NEG  # all beams start identical: only beam 0 may expand at the first step
    fin = _Finished(run_seqs.copy(), k)
    improvable = np.ones((batch, 1), dtype=bool)  # can a live beam still beat the worst finished one?
    offsets = np.arange(batch)[:, None] * k  # (batch, 1): flat row of beam 0 of each input
    inputs = np.arange(batch)[:, None]  # (batch, 1): row index for picking per input with (batch, n) indices
    eos = np.array(tok.eos, dtype=np.int64)
    cur = 1
    while True:
        cand_scores, cand, vocab = _candidates(decoder, run_seqs[:, :, :cur], run_scores, k2, s, tok)
        parents, tokens = cand // vocab, cand % vocab  # (batch, 2k) each
        hits = (tokens[:, :, None] == eos).any(axis=-1) | (cur + 1 >= max_len)  # (batch, 2k): candidate ends here

        # Next live beams: the best k candidates that did not just end.
        live_scores = cand_scores + hits.astype(np.float32) * NEG
        keep = topk(live_scores, k)  # (batch, k) into 2k
        ended = hits & top_k_mask
        if ended.any():  # only then can the finished set change (see _Finished.update)
            cand_seqs = run_seqs[inputs, parents]  # (batch, 2k, max_len)
            cand_seqs[:, :, cur] = tokens
            fin.update(cand_seqs, cand_scores, ended, improvable, cur, s)
        kept_parents = parents[inputs, keep]  # (batch, k)
        run_seqs = run_seqs[inputs, kept_parents]  # a copy: rows may repeat
        run_seqs[:, :, cur] = tokens[inputs, keep]
        run_scores = live_scores[inputs, keep]

        decoder.reorder((kept_parents + offsets).reshape(-1))
        cur += 1
        improvable = _improvable(improvable, run_scores, fin, cur, s)
        all_full = bool(fin.done.all()) and s.early_stopping is True
        if not improvable.any() or all_full or hits.all():
            return fin.best(s.num_return_sequences)


def _candidates(decoder: Decoder, seqs: np.ndarray, run_scores: np.ndarray, k2: int, s: GenerationSettings,
                tok: SpecialTokens) -> tuple[np.ndarray, np.ndarray, int]:
    """One beam step: the best k2 (batch, k2) candidate scores (log-probability + beam score), their indices into
    beams x vocab, and the vocabulary size. seqs: (batch, beams, cur) tokens so far.

    A decoder with `step_top` (IO binding) ranks on its device and sends back only these; it applies the
    min-length ban itself, so the repetition penalty and no-repeat n-grams are what still need the host's scores.
    """
    batch, k, cur = seqs.shape
    step_top = getattr(decoder, "step_top", None)
    if step_top is not None and s.repetition_penalty == 1.0 and s.no_repeat_ngram_size == 0:
        banned = tuple(tok.eos) if cur < s.min_length else ()
        top = step_top(seqs[:, :, -1].reshape(-1), run_scores, k2, banned)
        if top is not None:
            return top
    logits = decoder.step(seqs[:, :, -1].reshape(-1))  # (batch*beams, vocab)
    vocab = logits.shape[-1]
    logp = process_scores(log_softmax(logits), seqs.reshape(batch * k, cur), s, tok)
    values, cand = beam_topk(logp, run_scores, k2)
    return values, cand, vocab


class _Finished:
    """The k best finished hypotheses per input, with their length-normalised scores."""

    def __init__(self, seqs: np.ndarray, k: int):
        batch = seqs.shape[0]
        self.seqs = seqs  # (batch, k, max_len)
        self.scores = np.full((batch, k), NEG, dtype=np.float32)
        self.done = np.zeros((batch, k), dtype=bool)
        self.lengths = np.zeros((batch, k), dtype=np.int64)  # generated tokens, start token excluded
        self.k = k

    def update(self, cand_seqs, cand_scores, ended, improvable, cur: int, s: GenerationSettings) -> None:
        """Merge this step's ended top-k candidates into the finished set (transformers' float32 arithmetic).

        A step where none ended changes nothing (every candidate gets + NEG, at best ties an empty slot and loses
        to it, the lower index): beam search skips the call then."""
        scores = cand_scores / np.float32(cur**s.length_penalty)  # each candidate has generated `cur` tokens
        full = self.done.all(axis=-1, keepdims=True) & (s.early_stopping is True)
        scores = scores + full.astype(np.float32) * NEG
        scores = scores + (~improvable).astype(np.float32) * NEG
        scores = scores + (~ended).astype(np.float32) * NEG
        merged_scores = np.concatenate([self.scores, scores], axis=1)  # (batch, k + 2k)
        best = topk(merged_scores, self.k)  # (batch, k) into k + 2k

        def take(a: np.ndarray) -> np.ndarray:
            return np.take_along_axis(a, best if a.ndim == 2 else best[:, :, None], axis=1)

        self.seqs = take(np.concatenate([self.seqs, cand_seqs], axis=1))
        self.scores = take(merged_scores)
        self.done = take(np.concatenate([self.done, ended], axis=1))
        self.lengths = take(np.concatenate([self.lengths, np.full(ended.shape, cur, dtype=np.int64)], axis=1))

    def best(self, n: int) -> np.ndarray:
        """(batch * n, 1 + longest generated) int64, cropped like transformers."""
        seqs = self.seqs[:, :n].reshape(-1, self.seqs.shape[-1])
        return seqs[:, : 1 + int(self.lengths[:, :n].max())]


def _improvable(improvable, run_scores, fin: _Finished, cur: int, s: GenerationSettings) -> np.ndarray:
    """transformers' early-stop heuristic: could the best live beam still beat the worst finished one?"""
    if s.early_stopping == "never" and s.length_penalty > 0.0:
        best_len = s.max_length - 1  # a positive penalty favours length: assume the longest possible
    else:
        best_len = cur - 1
    best_possible = run_scores[:, :1] / np.float32(best_len**s.length_penalty)  # (batch, 1)
    worst = np.where(fin.done, fin.scores.min(axis=1, keepdims=True), NEG)  # (batch, k)
    return improvable & (best_possible > worst).any(axis=-1, keepdims=True)
