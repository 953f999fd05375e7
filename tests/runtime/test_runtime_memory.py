"""The runtime's resident memory: a tied int8 lookup table held once for the encoder and the with-past step, by the
rows looked up (`runtime.lazyrows`; the mechanism alone: `test_lazyrows`; the C heap's trim and the huge pages only
where memory is dense: `test_hugepages`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from t5compress.runtime import load_runtime, sessions, sharedkv
from t5compress.runtime.lazyrows import LazyRows
from t5compress.runtime.sessions import OnnxGraph
from tests.runtime.test_runtime import assert_light_imports, build_model, export_with, inputs


@pytest.fixture(scope="module")
def int8(tmp_path_factory, demo_jsonl) -> Path:
    """A tied random model (its LM head and embedding one table), exported and quantized static int8."""
    from t5compress.quantize import QuantizeConfig, run

    root = tmp_path_factory.mktemp("memory")
    fp32 = export_with("onnx", build_model(root / "model", seed=0), root / "onnx")
    # near-tie tokens of a random model flip in int8: agreement with fp32 is not what is tested here
    run(fp32, QuantizeConfig(mode="static", calib_data=str(demo_jsonl), samples=32, min_agreement=0.0),
        root / "int8", progress=False)
    return root / "int8"


def test_the_encoder_and_the_with_past_step_read_one_lookup_table(int8, monkeypatch):
    rt = load_runtime(int8, threads=1)
    encoder = rt.backend.encoder.session.t5compress_tables
    past = rt.backend.decoder_with_past.session.t5compress_tables
    # the encoder's lookup arrays are the with-past step's, by address: one copy in memory
    assert encoder and {v.data_ptr() for v in encoder.values()} <= {v.data_ptr() for v in past.values()}
    assert all(v.shape()[0] > v.shape()[1] for v in encoder.values() if len(v.shape()) == 2)  # (vocab, d_model)
    ids, mask = inputs(5)
    feeds = {"input_ids": ids, "attention_mask": mask}
    stored = OnnxGraph(int8 / "encoder_model.onnx", 1)  # the encoder as stored: its lookups gather columns
    assert not hasattr(stored.session, "t5compress_tables")
    np.testing.assert_array_equal(rt.backend.encoder.run(feeds)["last_hidden_state"],
                                  stored.run(feeds)["last_hidden_state"])
    monkeypatch.setattr(sharedkv, "_encoder", lambda *args: None)  # the encoder as stored, the rest as before
    plain = load_runtime(int8, threads=1)
    assert not hasattr(plain.backend.encoder.session, "t5compress_tables") and sharedkv.is_shared(
        plain.backend.decoder_with_past)
    for gen in ({}, {"num_beams": 3, "num_return_sequences": 2}):
        np.testing.assert_array_equal(rt.generate(ids, mask, max_new_tokens=10, **gen),
                                      plain.generate(ids, mask, max_new_tokens=10, **gen), err_msg=str(gen))


def test_an_int8_dir_loads_and_runs_without_importing_onnx(int8):
    assert_light_imports(int8)  # its lookups on one row table as well (the test above)


def test_every_weight_is_read_from_the_dirs_files(int8, monkeypatch):
    """The row table of the tied table (`lazyrows`, filled as ids are looked up) is declared in the graphs by the
    bytes of the column table it is filled from (each session reads the array itself), so ONNX Runtime maps every
    weight from the dir's files instead of copying them out of in-memory files (a t5-base static int8 runtime peaked
    at 313.6 MB against 470.8 at load); the tokens are those of the runtime whose tables are in-memory files."""
    from t5compress.runtime.firststep import FOLDER

    def folder(session) -> str | None:
        try:
            return session.get_session_options().get_session_config_entry(FOLDER)
        except Exception:  # onnxruntime raises when the key was never set
            return None

    rt = load_runtime(int8, threads=1)
    assert rt.backend.encoder.session.t5compress_tables  # the encoder reads the row table too
    assert [folder(rt.backend.encoder.session), folder(rt.backend.decoder_with_past.session)] == [str(int8)] * 2
    monkeypatch.setattr(sharedkv, "_file_bytes", lambda tensor: None)  # each table an in-memory file of its own
    copied = load_runtime(int8, threads=1)
    assert folder(copied.backend.decoder_with_past.session) is None
    ids, mask = inputs(5)
    for gen in ({}, {"num_beams": 3, "num_return_sequences": 2}):
        np.testing.assert_array_equal(rt.generate(ids, mask, max_new_tokens=10, **gen),
                                      copied.generate(ids, mask, max_new_tokens=10, **gen), err_msg=str(gen))


def test_an_untied_table_is_one_array_for_the_encoder_and_the_step(gated_export, monkeypatch):
    """An untied embedding is stored by rows: the encoder's lookups and the with-past step's read one array, filled
    from the file as ids are looked up (`sharedkv._row_tables`, `lazyrows`), not a mapping each, which in time each
    held the whole table (flan-t5-small after eleven batch-8 calls: 187.3 -> 172.0 MB resident int8, 445.1 -> 386.4
    fp32, with one mapped array); the tokens are those of the graphs as stored."""
    monkeypatch.setattr(sharedkv, "ROW_TABLE_BYTES", 1)  # the test model's table is a few KB
    rt = load_runtime(gated_export, threads=1)
    encoder = rt.backend.encoder.session.t5compress_tables
    past = rt.backend.decoder_with_past.session.t5compress_tables
    assert encoder and {v.data_ptr() for v in encoder.values()} <= {v.data_ptr() for v in past.values()}
    ids, mask = inputs(5)
    monkeypatch.setenv(sharedkv.ENV, "0")  # every graph as stored
    stored = load_runtime(gated_export, threads=1)
    assert not sharedkv.is_shared(stored.backend.decoder_with_past)
    for gen in ({}, {"num_beams": 3, "num_return_sequences": 2}):
        np.testing.assert_array_equal(rt.generate(ids, mask, max_new_tokens=10, **gen),
                                      stored.generate(ids, mask, max_new_tokens=10, **gen), err_msg=str(gen))


def test_the_runtime_fills_the_rows_of_the_ids_it_looks_up(int8, monkeypatch):
    """The tied table's rows are those of the ids of the inputs and of the tokens the decoder was fed, and
    every run that reads the table filled them first: the tokens are those of the runtime with the whole table
    (the encoder and the first step included, which read the table before any step does)."""
    rt = load_runtime(int8, threads=1)
    fills = rt.backend.decoder_with_past.fills
    assert rt.backend.encoder.fills is fills and [t.transposed for t in fills.tables] == [True]
    (table,) = fills.tables
    assert not table.done.any()  # none at load
    ids, mask = inputs(5)
    out = np.asarray(rt.generate(ids, mask, max_new_tokens=10))
    fed = out[:, :-1]  # the decoder's start and every token generated but the last, which no step reads
    assert set(np.flatnonzero(table.done)) == set(ids.ravel().tolist()) | set(fed.ravel().tolist())
    fresh = [load_runtime(int8, threads=1) for _ in range(2)]  # no row filled yet

    class Whole(LazyRows):  # every row filled at load: what the copy made at load held
        def __init__(self, *args):
            super().__init__(*args)
            self.fill(np.arange(self.done.size))

    monkeypatch.setattr(sharedkv, "LazyRows", Whole)
    whole = load_runtime(int8, threads=1)
    assert whole.backend.decoder_with_past.fills.tables[0].done.all()
    for lazy, gen in zip(fresh, ({}, {"num_beams": 3, "num_return_sequences": 2}), strict=True):
        np.testing.assert_array_equal(lazy.generate(ids, mask, max_new_tokens=10, **gen),
                                      whole.generate(ids, mask, max_new_tokens=10, **gen), err_msg=str(gen))


def _rss_mb(field: str = "VmRSS") -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) / 1024


def _grown_by_a_call(rt, ids: np.ndarray) -> tuple[float, float]:
    """(peak, after) of the process's resident MB over a call of `ids`, above what it held after a short call."""
    rt.generate(ids[:, :8], max_new_tokens=2)  # a short call first: what any call keeps
    before = _rss_mb()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    rt.generate(ids, max_new_tokens=2)
    return _rss_mb("VmHWM") - before, _rss_mb() - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's /proc")
def test_a_long_batch_runs_its_encoder_a_few_rows_at_a_time(tiny_export, monkeypatch):
    """On the CPU the encoder runs a batch in runs of at most `ENCODER_TOKENS_PER_RUN` tokens, and the first step
    writes the cross-attention cache into arrays of ours: a call of 8 x 512 tokens, whose attention scores would be
    33.5 MB a tensor in one run, peaks at most 40 MB above a short call's (19 MB measured) and keeps as much, where
    with the whole batch in one run the arenas keep 100 MB or more (151 MB); the encoder's states are equal within
    float rounding."""
    ids = np.random.default_rng(0).integers(3, 200, size=(8, 512))
    grown = {}
    for per_run in (None, sessions.ENCODER_TOKENS_PER_RUN):
        monkeypatch.setattr(sessions, "ENCODER_TOKENS_PER_RUN", per_run)
        rt = load_runtime(tiny_export, threads=1)
        assert rt.backend.encoder.tokens_per_run == per_run
        grown[per_run] = _grown_by_a_call(rt, ids)
        del rt
    assert max(grown[sessions.ENCODER_TOKENS_PER_RUN]) < 40 and grown[None][1] > 100, grown
    whole = OnnxGraph(tiny_export / "encoder_model.onnx", 1)
    rows = OnnxGraph(tiny_export / "encoder_model.onnx", 1, tokens_per_run=1024)  # two rows a run
    feeds = {"input_ids": ids[:5], "attention_mask": np.ones_like(ids[:5])}
    np.testing.assert_allclose(rows.run(feeds)["last_hidden_state"], whole.run(feeds)["last_hidden_state"],
                               rtol=0, atol=1e-5)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's /proc")
def test_a_long_call_gives_its_working_memory_back_when_asked(tiny_export, monkeypatch):
    """T5COMPRESS_WORKING_MEMORY=release: the graphs run once per call (the encoder, the first step's cross-attention
    graph) hand their arenas' regions back as each run ends (`sessions.releasing`) and the C heap is trimmed after
    the call: a row of 2,048 tokens, whose attention scores alone are 67 MB a tensor on this model, leaves the
    process at most 12 MB larger, where by default (`keep`) the encoder's arena holds 60 MB or more; the self-attention
    cache's and the logits' buffers are kept for the next call only by `keep`; calls of other lengths give the same
    tokens either way, and any other value is refused in one line."""
    from t5compress.errors import ConfigError
    from t5compress.runtime.sessions import WORKING_MEMORY

    ids = np.random.default_rng(0).integers(3, 200, size=(1, 2048))
    grown, tokens = {}, {}
    for mode in ("release", "keep"):
        monkeypatch.setenv(WORKING_MEMORY, mode)
        rt = load_runtime(tiny_export, threads=1)
        grown[mode] = _grown_by_a_call(rt, ids)
        tokens[mode] = [rt.generate(np.tile(ids[:, :n], (3, 1)), max_new_tokens=6) for n in (5, 40, 17, 40)]
        kept = rt.backend.decoder_with_past.pool.free  # (shapes, arrays) of each set of buffers kept
        assert bool(kept) == (mode == "keep"), [shapes for shapes, _ in kept]
        del rt
    assert min(grown["release"][0], grown["keep"][0]) > 60, grown  # the call did need its working memory
    assert grown["release"][1] < 12 and grown["keep"][1] > 60, grown
    for a, b in zip(tokens["release"], tokens["keep"], strict=True):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv(WORKING_MEMORY, "lean")
    with pytest.raises(ConfigError, match="T5COMPRESS_WORKING_MEMORY='lean'"):
        load_runtime(tiny_export, threads=1)
