"""Each weight stored once in an export dir, whatever wrote it (export fp32 / fp16, every int8 mode of quantize)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from t5compress.export import ExportConfig
from t5compress.export import run as export
from t5compress.names import ONNX_SUFFIX, WEIGHTS_FILE
from t5compress.onnxstore import external_files, store_once, stored_twice
from t5compress.quantize import QuantizeConfig
from t5compress.quantize import run as quantize
from t5compress.runtime import load_runtime


def _unique_bytes(d: Path) -> int:
    """Bytes of the distinct large initializers over all graphs of `d`, whatever their names."""
    seen = {}
    for g in d.glob(f"*{ONNX_SUFFIX}"):
        for t in onnx.load(str(g)).graph.initializer:
            if len(t.raw_data) >= 1024:
                seen[t.raw_data] = len(t.raw_data)
    return sum(seen.values())


def _assert_stored_once(d: Path) -> None:
    assert stored_twice(d) == []
    # a weight the two decoders both hold, by the name the quantizer gives it after its layer, is one place in the file
    # (not two roundings of it: the cross-attention outputs once were, their inputs being named apart in the graphs)
    first, past = ({t.name: tuple(e.value for e in t.external_data if e.key in ("offset", "length"))
                    for t in onnx.load(str(d / f"{g}{ONNX_SUFFIX}"), load_external_data=False).graph.initializer
                    if t.external_data and not t.name.startswith("onnx::")}
                   for g in ("decoder_model", "decoder_with_past_model"))
    assert {n for n in first.keys() & past.keys() if first[n] != past[n]} == set()
    files = {loc for g in d.glob(f"*{ONNX_SUFFIX}") for loc in external_files(g)}
    assert files == {WEIGHTS_FILE}  # every graph points into the one file
    weights = (d / WEIGHTS_FILE).stat().st_size
    assert _unique_bytes(d) <= weights <= _unique_bytes(d) * 1.05 + (64 << 10)  # alignment padding only


def test_the_check_finds_a_weight_stored_twice(tiny_export, tmp_path):
    """optimum's layout (each graph its own weights) is what the check must catch: decoder weights in both
    decoders, the tied embedding in every graph."""
    old = tmp_path / "old"
    shutil.copytree(tiny_export, old)
    for g in old.glob(f"*{ONNX_SUFFIX}"):
        onnx.save_model(onnx.load(str(g)), str(g))  # inline, as the exports before this layout
    (old / WEIGHTS_FILE).unlink()
    twice = stored_twice(old)
    assert any(t.startswith("decoder_with_past_model.onnx") for t in twice)
    inline = sum(len(t.raw_data) for g in old.glob(f"*{ONNX_SUFFIX}") for t in onnx.load(str(g)).graph.initializer
                 if len(t.raw_data) >= 1024)
    assert inline > 1.4 * _unique_bytes(old)
    store_once(old)
    assert stored_twice(old) == [] and not any(f.name.endswith(".partial") for f in old.iterdir())


def test_fp32_export_stores_each_weight_once_and_generates_the_same(tiny_export, tiny_model_dir, tmp_path):
    _assert_stored_once(tiny_export)
    inline = tmp_path / "inline"
    shutil.copytree(tiny_export, inline)
    for g in inline.glob(f"*{ONNX_SUFFIX}"):
        onnx.save_model(onnx.load(str(g)), str(g))
    (inline / WEIGHTS_FILE).unlink()
    ids = np.array([[5, 9, 23, 7, 1], [8, 3, 1, 0, 0]])
    mask = (ids > 0).astype(np.int64)
    want = load_runtime(inline).generate(ids, mask, max_new_tokens=6)
    np.testing.assert_array_equal(load_runtime(tiny_export).generate(ids, mask, max_new_tokens=6), want)
    np.testing.assert_array_equal(load_runtime(tiny_export, decoders="separate").generate(ids, mask, num_beams=2,
                                                                                        max_new_tokens=6),
                                  load_runtime(inline).generate(ids, mask, num_beams=2, max_new_tokens=6))


def test_fp16_export_stores_each_weight_once(tiny_model_dir, tmp_path):
    export(tiny_model_dir, ExportConfig(dtype="fp16"), tmp_path / "fp16", progress=False)
    _assert_stored_once(tmp_path / "fp16")


@pytest.mark.parametrize("mode", ["static", "dynamic", "blockwise", "int4"])
def test_every_int8_flavour_stores_each_weight_once(mode, tiny_export, demo_jsonl, tmp_path):
    calib = {"calib_data": str(demo_jsonl), "samples": 16} if mode == "static" else {}
    r = quantize(tiny_export, QuantizeConfig(mode=mode, min_agreement=0.5, **calib), tmp_path / mode, progress=False)
    _assert_stored_once(tmp_path / mode)
    assert r["graphs"]["weights"]["saved_bytes"] > 0  # the two decoders' int8 weights were the same bytes
    # the weights shrink (on a tiny model the graphs' Q/DQ structure can outweigh them, so the weights file alone)
    assert (tmp_path / mode / WEIGHTS_FILE).stat().st_size < 0.5 * (tiny_export / WEIGHTS_FILE).stat().st_size
    assert r["size"]["source"]["safetensors_bytes"] > 0 and r["size"]["vs_source"] > 0
    # one int8 embedding in the dir: the encoder's lookup reads the decoder's table (its bytes, at its offsets)
    assert r["graphs"]["encoder_lookup_bytes_saved"] > 0
    vocab = json.loads((tiny_export / "config.json").read_text())["vocab_size"]
    encoder, decoder = (_offsets(tmp_path / mode / f"{g}.onnx", vocab) for g in ("encoder_model", "decoder_model"))
    assert encoder and encoder <= decoder


def test_a_gated_static_int8_smoothed_and_gptq_rounded_stores_each_decoder_weight_once(gated_export, demo_jsonl,
                                                                                        tmp_path):
    """SmoothQuant scales and GPTQ rounding come from calibration statistics. Measured per decoder graph, the same
    layer's statistics differed in their last bits between the two decoders (all positions at once against one step
    at a time), enough to round some int8 weights otherwise: a flan-t5-small shape's dir stored most decoder weights
    twice (1.50x CTranslate2's bytes; 1.03x with one statistic per layer). This tiny model rounds alike either way;
    `_assert_stored_once` checks each named decoder weight is one place."""
    r = quantize(gated_export, QuantizeConfig(mode="static", calib_data=str(demo_jsonl), samples=16, min_agreement=0),
                 tmp_path / "int8", progress=False)
    assert r["plan"]["smooth_alpha"] > 0 and r["plan"]["rounding"] == "gptq" and r["plan"]["gated"]
    _assert_stored_once(tmp_path / "int8")
    first, past = (onnx.load(str(tmp_path / "int8" / f"{g}.onnx"), load_external_data=False).graph
                   for g in ("decoder_model", "decoder_with_past_model"))
    tokenwise = {t.name for t in past.initializer if t.name.endswith("per_token_w_int8")}
    assert tokenwise and tokenwise <= {t.name for t in first.initializer}  # each one place: `_assert_stored_once`


def test_the_two_decoders_share_one_statistic_per_layer_they_both_hold():
    """SmoothQuant's maxima, joined after the runs (GPTQ's X^T X are summed as they run:
    `tests/quantize/test_quantize.py::test_the_decoders_grams_are_summed_into_one_as_they_run`)."""
    from t5compress.quantize.smooth import ChannelMax
    from t5compress.quantize.sources import join_decoders

    x, y = np.array([[1.0, -3.0], [2.0, 0.5]]), np.array([[-4.0, 1.0]])
    maxes = {}
    for g, only, rows in (("decoder_model", "cross", x), ("decoder_with_past_model", "self_only", y)):
        maxes[g] = ChannelMax([])
        maxes[g].amax = {"ln": np.abs(rows).max(axis=0), only: np.ones(2)}
    join_decoders(maxes)
    for g in maxes:
        np.testing.assert_array_equal(maxes[g].amax["ln"], [4.0, 3.0])  # the max over both
    assert "cross" not in maxes["decoder_with_past_model"].amax
    join_decoders({"decoder_model": maxes["decoder_model"]})  # one decoder graph (a merged export): nothing to join


def test_sizes_are_told_against_the_source_checkpoint(tiny_export, tiny_model_dir, tmp_path):
    """info and the export report give bytes against the source's model.safetensors, also once the dirs between
    are gone (the export's report records the source)."""
    from t5compress.info import inspect_dir
    from t5compress.lineage import source_checkpoint

    checkpoint = (tiny_model_dir / "model.safetensors").stat().st_size
    data = inspect_dir(tiny_export)
    assert data["source"]["safetensors_bytes"] == checkpoint
    report = json.loads((tiny_export / "report.json").read_text())
    assert report["source"] == {"path": str(tiny_model_dir.resolve()), "safetensors_bytes": checkpoint}
    moved = tmp_path / "moved"
    shutil.copytree(tiny_export, moved)
    meta = json.loads((moved / "t5compress.json").read_text())
    meta["parent"]["path"] = str(tmp_path / "gone")
    (moved / "t5compress.json").write_text(json.dumps(meta))
    assert source_checkpoint(moved)["safetensors_bytes"] == checkpoint


def _offsets(graph: Path, vocab: int) -> set[str]:
    """Offsets into the weights file of the graph's initializers with a vocabulary axis (tables and their scales)."""
    return {next(e.value for e in t.external_data if e.key == "offset")
            for t in onnx.load(str(graph), load_external_data=False).graph.initializer
            if vocab in t.dims and t.data_location == t.EXTERNAL}
