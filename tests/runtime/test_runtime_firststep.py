"""The first decoder step on the with-past graph (`runtime.firststep`): what decoder_model gives, without its
session (the decoder's weights in memory once)."""

from __future__ import annotations

import numpy as np
import pytest

from t5compress.runtime import load_runtime
from t5compress.runtime.firststep import ENV, FirstStep
from t5compress.runtime.sessions import OnnxGraph
from tests.runtime.test_runtime_sharedkv import dirs  # noqa: F401  (the fixture)


@pytest.mark.parametrize("name", ["pruned", "relu"])
def test_first_step_gives_decoder_models_logits_and_cache(dirs, name, monkeypatch):  # noqa: F811
    rt = load_runtime(dirs[name], threads=1)
    first = rt.backend.decoder
    assert isinstance(first, FirstStep) and first._stored is None  # no decoder_model session at load
    stored = OnnxGraph(dirs[name] / "decoder_model.onnx", 1)
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 200, (3, 7))
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    hidden = rt.backend.encoder.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
    feeds = {"input_ids": np.zeros((3, 1), np.int64), "encoder_hidden_states": hidden, "encoder_attention_mask": mask}
    got, want = first.run(feeds), stored.run(feeds)
    assert list(got) == list(want)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], atol=1e-5, rtol=1e-5, err_msg=n)
    greedy = rt.generate(ids, mask, max_new_tokens=10)
    beams = rt.generate(ids, mask, max_new_tokens=10, num_beams=3)
    assert first._stored is None  # generation never opened decoder_model
    # teacher forcing (the quantize check): several tokens at once go to decoder_model, opened then
    seq = np.concatenate([np.zeros((3, 1), np.int64), ids[:, :4]], axis=1)
    many = {**feeds, "input_ids": seq}
    np.testing.assert_array_equal(first.run(many)["logits"], stored.run(many)["logits"])
    monkeypatch.setenv(ENV, "decoder")  # as stored: the same tokens
    plain = load_runtime(dirs[name], threads=1)
    assert isinstance(plain.backend.decoder, OnnxGraph)
    np.testing.assert_array_equal(plain.generate(ids, mask, max_new_tokens=10), greedy)
    np.testing.assert_array_equal(plain.generate(ids, mask, max_new_tokens=10, num_beams=3), beams)
