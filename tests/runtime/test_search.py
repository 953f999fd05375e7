"""The numpy search on scripted decoders: finished rows, transformers' logits processors, chunked top-k.

No graphs here: the searches drive any `Decoder`, so these check the search itself against transformers.
"""

from __future__ import annotations

import numpy as np

from t5compress.runtime.search import banned_ngram_tokens, greedy_search, process_scores
from t5compress.runtime.settings import GenerationSettings, SpecialTokens

EOS = 1


class ScriptedDecoder:
    """Row r emits token 5 + r until its step `finish_at[r]`, then EOS; records how many rows each step ran."""

    def __init__(self, finish_at: list[int], vocab: int = 16):
        self.finish_at, self.vocab = finish_at, vocab
        self.rows = np.arange(len(finish_at))  # original row of each decoder row
        self.step_rows: list[int] = []

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.step_rows.append(len(tokens))
        logits = np.zeros((len(tokens), self.vocab), dtype=np.float32)  # (rows, vocab)
        for i, r in enumerate(self.rows):
            logits[i, EOS if len(self.step_rows) >= self.finish_at[r] else 5 + r] = 1.0
        return logits

    def keep(self, rows: np.ndarray) -> None:
        self.rows = self.rows[rows]

    def reorder(self, rows: np.ndarray) -> None:
        raise AssertionError("greedy search never reorders")


def test_greedy_drops_finished_rows_from_the_batch():
    dec = ScriptedDecoder([2, 4, 1])
    out = greedy_search(dec, 3, GenerationSettings(max_new_tokens=10), SpecialTokens(0, (EOS,), 0))
    np.testing.assert_array_equal(out, [[0, 5, 1, 0, 0], [0, 6, 6, 6, 1], [0, 1, 0, 0, 0]])
    assert dec.step_rows == [3, 2, 1, 1]


def test_logits_processors_match_transformers():
    import torch
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    rng = np.random.default_rng(0)
    seqs = rng.integers(0, 6, (4, 9))  # few distinct tokens: many repeated n-grams
    scores = rng.standard_normal((4, 10)).astype(np.float32)
    tok = SpecialTokens(decoder_start=0, eos=(EOS,), pad=0)
    for n in (1, 2, 3, 10):
        s = GenerationSettings(no_repeat_ngram_size=n, repetition_penalty=1.7, min_new_tokens=9)
        ref = torch.from_numpy(scores.copy())
        for proc in (RepetitionPenaltyLogitsProcessor(1.7), NoRepeatNGramLogitsProcessor(n),
                     MinNewTokensLengthLogitsProcessor(1, 9, EOS)):
            ref = proc(torch.from_numpy(seqs), ref)
        np.testing.assert_array_equal(process_scores(scores.copy(), seqs, s, tok), ref.numpy())
    assert banned_ngram_tokens(np.array([[5, 6, 5, 6, 5]]), 3) == [[6]]
    assert banned_ngram_tokens(np.array([[5, 6, 5, 6, 5, 6]]), 3) == [[5, 5]]


def test_topk_equals_a_full_stable_sort_including_ties():
    from t5compress.runtime.search import topk

    rng = np.random.default_rng(0)
    small = np.array([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0]], dtype=np.float32)  # beam search's 2k candidates
    assert topk(small, 4).tolist() == [[1, 3, 2, 4]]  # the tie across the cut keeps the lower indices
    for shape, k in [((8, 4 * 32128), 8), ((6, 32100), 4), ((2, 2049), 3)]:
        x = rng.standard_normal(shape).astype(np.float32)
        x[0, 5] = x[0, 7] = x[0, 3000 % shape[1]] = x[0].max() + 1  # a three-way tie at the top
        x[1, -1] = x[1].max() + 1  # the best entry in the padded last chunk
        want = np.argsort(-x, axis=1, kind="stable")[:, :k]
        assert (topk(x, k) == want).all(), shape


def test_beam_topk_equals_topk_of_the_full_sum():
    """Beam search's candidates without forming logp + scores: the same indices, best first (ties to the lower
    index), and bit-identical float32 values, for padded vocabularies, beams held back by NEG and toy sizes."""
    from t5compress.runtime.search import NEG, beam_topk

    rng = np.random.default_rng(0)
    cases = [(8, 4, 32128, 8), (1, 4, 32128, 8), (4, 2, 32128, 4), (2, 3, 8016, 6), (3, 2, 100, 4), (1, 2, 3, 4)]
    for batch, beams, vocab, k in cases:  # chunk maxima ranked in 16 groups, in 8, and whole
        for trial in range(4):
            logp = (rng.standard_normal((batch * beams, vocab)) * 3).astype(np.float32)
            logp[:, 1] = -np.inf  # a banned token
            scores = rng.standard_normal((batch, beams)).astype(np.float32)
            if trial == 1:
                scores[:, 1:] = NEG  # the first step: only beam 0 may expand
            if trial == 2:
                # a tie at the top, the last entry in the chunk padding fills
                logp[0, [4 % vocab, 9 % vocab, vocab - 1]] = logp[0].max() + 1
            full = (logp.reshape(batch, beams, vocab) + scores[:, :, None]).reshape(batch, beams * vocab)
            want = np.argsort(-full, axis=1, kind="stable")[:, :k]
            values, cand = beam_topk(logp, scores, k)
            np.testing.assert_array_equal(cand, want)
            np.testing.assert_array_equal(values, np.take_along_axis(full, want, axis=1))


def test_log_softmax_graph_is_the_one_node_model_and_matches_torch():
    """The embedded bytes are exactly LogSoftmax(axis=-1) built with onnx.helper; values match torch's log_softmax."""
    import onnx
    import torch
    from onnx import TensorProto, helper

    from t5compress.runtime.search import LOG_SOFTMAX_ONNX, log_softmax

    dims = ["rows", "vocab"]
    graph = helper.make_graph([helper.make_node("LogSoftmax", ["x"], ["y"], axis=-1)], "log_softmax",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="t5compress")
    model.ir_version = 8
    onnx.checker.check_model(model)
    assert model.SerializeToString() == LOG_SOFTMAX_ONNX
    x = (np.random.default_rng(0).standard_normal((5, 32128)) * 8).astype(np.float32)
    x[1, 7] = -np.inf  # a banned token stays -inf
    got = log_softmax(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, torch.log_softmax(torch.from_numpy(x), -1).numpy(), atol=2e-5, rtol=0)
    assert got[1, 7] == -np.inf
