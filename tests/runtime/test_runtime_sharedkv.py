"""The shared self-attention cache (`runtime.sharedkv`): the rewritten with-past step computes what the stored one
does, the runtime on it gives the stored graph's tokens (greedy with rows leaving, beams reordering), and graphs the
rewrite does not fit run as stored. Token identity with transformers on it is `test_runtime`'s (it runs this path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from t5compress.names import DECODER_WITH_PAST, WEIGHTS_FILE
from t5compress.runtime import load_runtime, session_options
from t5compress.runtime.sharedkv import ENV, WEIGHTS, SharedCacheDecoder, SharedGraph, open_shared, rewritten
from t5compress.runtime.stepgraph import rewrite
from tests.runtime.test_runtime import build_model, export_with, inputs


@pytest.fixture(scope="module")
def dirs(runtime_export, tmp_path_factory) -> dict[str, Path]:
    """A gated model with uneven head counts per decoder layer (pruned 4 -> 2 and 3), and a relu one (with its model
    dir)."""
    from t5compress.model import units
    from t5compress.model.layout import sync_config
    from t5compress.model.load import load_model, save_model_dir
    from t5compress.model.tokenization import byte_level

    root = tmp_path_factory.mktemp("sharedkv")
    gated = build_model(root / "gated", seed=1, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    model = load_model(gated)
    for block, keep in zip(model.decoder.block, ([0, 3], [1, 2, 3]), strict=True):
        units.prune_heads(units.self_attn(block), keep)
    units.sync_stack(model.decoder)
    sync_config(model)
    save_model_dir(model, byte_level(), root / "pruned")
    return {"pruned": export_with("onnx", root / "pruned", root / "pruned-onnx"), "relu": runtime_export[1],
            "relu-model": runtime_export[0]}


def _step_feeds(session, rows: int, past: int, enc: int, rng) -> dict[str, np.ndarray]:
    feeds = {"input_ids": rng.integers(3, 200, (rows, 1)), "encoder_attention_mask": np.ones((rows, enc), np.int64)}
    feeds["encoder_attention_mask"][0, -2:] = 0
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            length = past if ".decoder." in i.name else enc
            feeds[i.name] = rng.standard_normal((rows, i.shape[1], length, i.shape[3])).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", ["pruned", "relu"])
def test_rewritten_step_computes_the_stored_step(dirs, name):
    """One step at several cache lengths: logits and the grown cache as the stored graph gives them (within float
    rounding: the kernel sums in another order), the new key and value written in place at past_sequence_length,
    and no Concat left on the cache. The rewrite holds the graph without its weights, which are read from the
    stored file, left as it was."""
    import onnx
    import onnxruntime as ort

    path = dirs[name] / f"{DECODER_WITH_PAST}.onnx"
    before = path.read_bytes()
    layers = len([i for i in onnx.load(str(path)).graph.input if i.name.endswith(".decoder.key")])
    done = rewritten(dirs[name])
    # the graph without its weights; they stay in the dir's weights file (onnxstore), mapped, never parsed
    assert done is not None and list(done.weights) == [WEIGHTS, WEIGHTS_FILE]
    model = onnx.load_from_string(done.model)
    assert not [t.name for t in model.graph.initializer if len(t.raw_data) >= 1024]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("DecoderMaskedMultiHeadAttention") == layers and "Concat" not in [
        n.op_type for n in model.graph.node if any(x.startswith("past_key_values.") for x in n.input)]
    assert rewrite(onnx.load(str(path))) == layers  # the rewrite of a graph with its weights inline is the same
    stored = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shared = SharedGraph(done, session_options(1))
    rng = np.random.default_rng(0)
    for rows, past in ((1, 1), (3, 4), (2, 9)):
        feeds = _step_feeds(stored, rows, past, 7, rng)
        want = dict(zip([o.name for o in stored.get_outputs()], stored.run(None, feeds), strict=True))
        got = shared.run(feeds)
        assert set(got) == set(want)
        for n, w in want.items():
            np.testing.assert_allclose(got[n], w, atol=1e-4 * (1 + np.abs(w).max()), rtol=0, err_msg=n)
            if n.startswith("present."):
                np.testing.assert_array_equal(got[n][:, :, :past], feeds[n.replace("present.", "past_key_values.")])
    assert path.read_bytes() == before


GEN = [dict(max_new_tokens=12), dict(max_new_tokens=10, min_new_tokens=6, repetition_penalty=1.3),
       dict(num_beams=4, max_new_tokens=10, length_penalty=0.7),
       dict(num_beams=3, num_return_sequences=2, no_repeat_ngram_size=2, max_new_tokens=12)]


@pytest.mark.parametrize("name", ["pruned", "relu"])
def test_runtime_on_the_shared_cache_gives_the_stored_graphs_tokens(dirs, name, monkeypatch):
    shared = load_runtime(dirs[name], threads=1)
    assert isinstance(shared.backend.decoder_with_past, SharedGraph)
    monkeypatch.setenv(ENV, "0")
    stored = load_runtime(dirs[name], threads=1)
    assert not isinstance(stored.backend.decoder_with_past, SharedGraph)
    ids, mask = inputs(5)
    ended = 0
    for gen in GEN:
        want = stored.generate(ids, mask, **gen)
        np.testing.assert_array_equal(shared.generate(ids, mask, **gen), want, err_msg=str(gen))
        ended += int((want[:, 1:-1] == 1).any(axis=1).sum())
    assert ended > 0  # rows that left early (greedy) or beams that finished: `keep` and the reorders ran


def test_beams_reorder_through_the_indirection_not_the_cache(dirs):
    """Beams share their input's cross-attention cache; reordering them moves no cache row, only the indirection."""
    rt = load_runtime(dirs["relu"], threads=1)
    ids, mask = inputs(2)
    hidden = rt.backend.encoder.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
    dec = SharedCacheDecoder(rt.backend, hidden, mask, beams=3, max_length=8)
    dec.step(np.zeros(6, dtype=np.int64))
    # the cross-attention cache and the encoder mask once per input, read by all of its beams
    assert all(v.shape[0] == 2 for v in dec.cross.values()) and dec.mask.shape == mask.shape
    dec.step(np.arange(3, 9, dtype=np.int64))
    buffers = {n: b.copy() for n, b in dec.buffers.items()}
    dec.reorder(np.array([2, 2, 0, 5, 3, 3]))
    for n, b in dec.buffers.items():
        np.testing.assert_array_equal(b, buffers[n])  # nothing moved
    # position 1 was written by each row's own step: beams read it from their parents' rows
    np.testing.assert_array_equal(dec.indirection[:, :, 1], [[2, 2, 0], [2, 0, 0]])
    dec.step(np.arange(6, dtype=np.int64))
    assert int(dec.past_len[0]) == 3


def test_graphs_the_rewrite_does_not_fit_run_as_stored(dirs, tmp_path, monkeypatch):
    from t5compress.export import stage

    inflight = tmp_path / "inflight"
    stage.run(dirs["relu-model"], stage.ExportConfig(atol=1e-2, inflight=True), inflight)
    assert open_shared(inflight, session_options(1)) is None  # the in-flight layout's masked cache
    merged = tmp_path / "merged"
    stage.run(dirs["relu-model"], stage.ExportConfig(atol=1e-2, decoders="merged"), merged)
    assert not isinstance(load_runtime(merged, threads=1).backend.decoder_with_past, SharedGraph)
    monkeypatch.setenv(ENV, "0")
    assert open_shared(dirs["relu"], session_options(1)) is None


def test_the_size_limit_counts_the_weights_in_the_shared_file(dirs, monkeypatch):
    """In a dir that stores each weight once the with-past graph file holds only structure: the limit on what is
    rewritten counts the weights it names in weights.onnx_data too."""
    from t5compress.onnxstore import weight_bytes
    from t5compress.runtime import sharedkv

    graph = dirs["relu"] / f"{DECODER_WITH_PAST}.onnx"
    assert (dirs["relu"] / "weights.onnx_data").is_file() and graph.stat().st_size < weight_bytes(graph)
    size = graph.stat().st_size + weight_bytes(graph)
    monkeypatch.setattr(sharedkv, "MAX_BYTES", size - 1)
    assert rewritten(dirs["relu"]) is None
    monkeypatch.setattr(sharedkv, "MAX_BYTES", size)
    assert rewritten(dirs["relu"]) is not None


def test_a_dir_with_external_data_and_a_damaged_one(dirs, tmp_path, caplog):
    """A with-past graph whose weights are in an external data file (how exports over 2 GB are saved) is rewritten
    too, its file handed over beside the graph's own bytes; a truncated graph runs as stored (opening it as stored
    is what says it is damaged)."""
    import shutil

    import onnx

    external = tmp_path / "external"
    shutil.copytree(dirs["relu"], external)
    graph = external / f"{DECODER_WITH_PAST}.onnx"
    onnx.save(onnx.load(str(graph)), str(graph), save_as_external_data=True, location="weights.bin",
              size_threshold=512)
    done = rewritten(external)
    assert done is not None and set(done.weights) == {WEIGHTS, "weights.bin"}
    ids, mask = inputs(3)
    want = load_runtime(dirs["relu"], threads=1).generate(ids, mask, num_beams=3, max_new_tokens=8)
    rt = load_runtime(external, threads=1)
    assert isinstance(rt.backend.decoder_with_past, SharedGraph)
    np.testing.assert_array_equal(rt.generate(ids, mask, num_beams=3, max_new_tokens=8), want)

    damaged = tmp_path / "damaged"
    shutil.copytree(dirs["relu"], damaged)
    graph = damaged / f"{DECODER_WITH_PAST}.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    with caplog.at_level("INFO", logger="t5compress.runtime.sharedkv"):
        assert rewritten(damaged) is None
    assert "not rewritten" in caplog.text


@pytest.mark.parametrize("name", ["pruned", "relu"])
def test_a_dir_that_stores_each_weight_once_is_read_from_its_files(dirs, name):
    """ONNX Runtime reads the rewritten step's weights from the dir's own files (`FOLDER`), mapping them as for a
    graph opened from its path, instead of copying them from in-memory files at load: that copy was all the graph's
    weights at once (a t5-base static int8 with-past step opened alone peaked at 351 MB, 206 from the path)."""
    from t5compress.runtime.firststep import FOLDER

    session = load_runtime(dirs[name], threads=1).backend.decoder_with_past.session
    assert session.get_session_options().get_session_config_entry(FOLDER) == str(dirs[name])
