"""generator.onnx (`export --search-graph`): the whole search in one ONNX Runtime call, token for token the Python
search over the same graphs (which the runtime tests hold to transformers), on a trained model whose outputs end in
EOS and on a random gated one; rebuilt by quantize; settings it cannot honour refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError, ModelError
from t5compress.export import ExportConfig, run
from t5compress.export.generator import same_rows, write_generator
from t5compress.names import GENERATOR, MANIFEST_FILE, WEIGHTS_FILE
from t5compress.onnxstore import external_files, weight_bytes
from t5compress.runtime import load_runtime
from t5compress.runtime.ingraph import finish
from t5compress.runtime.settings import GenerationSettings, SpecialTokens

runner = CliRunner()


@pytest.fixture(scope="module")
def gated_export(tiny_gated_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("search-graph") / "onnx"
    run(tiny_gated_dir, ExportConfig(search_graph=True), out)
    return out


@pytest.fixture(scope="module")
def skilled_export(skilled, tmp_path_factory) -> Path:
    """The trained demo model's fp32 export with a generator built beside its graphs."""
    out = tmp_path_factory.mktemp("search-graph-skilled") / "onnx"
    shutil.copytree(skilled / "onnx", out)
    write_generator(out)
    return out


def test_export_writes_and_checks_the_generator(gated_export):
    report = json.loads((gated_export / "report.json").read_text())
    check = report["search_graph"]
    assert check["greedy"]["identical_rows"] == check["rows"] == 8
    assert check["beam2"]["identical_rows"] == 8
    entry = json.loads((gated_export / MANIFEST_FILE).read_text())[GENERATOR]
    assert entry["inputs"][0] == "input_ids" and entry["outputs"] == ["sequences"]
    assert entry["eos_token_id"] == 1 and entry["early_stopping"] is False
    # the shared embedding and the cross-attention projections are stored once, not per subgraph
    weights = {g: onnx.load(gated_export / f"{g}.onnx").graph.initializer
               for g in ("generator", "encoder_model", "decoder_with_past_model")}
    assert sum(tuple(t.dims) == (384, 32) for t in weights["generator"]) == 1  # the (vocab, d_model) table
    nbytes = {g: sum(len(t.raw_data) for t in ts) for g, ts in weights.items()}
    assert nbytes["generator"] < nbytes["encoder_model"] + nbytes["decoder_with_past_model"]


@pytest.mark.parametrize("gen", [
    dict(num_beams=1, max_new_tokens=24),
    dict(num_beams=4, max_new_tokens=24),
    dict(num_beams=4, num_return_sequences=2, length_penalty=0.6, max_new_tokens=24),
    dict(num_beams=3, min_new_tokens=6, repetition_penalty=1.3, max_new_tokens=24),
])
def test_tokens_match_the_python_search_on_a_trained_model(skilled_export, skilled, gen):
    records = [json.loads(line) for line in (skilled / "data" / "eval.jsonl").read_text().splitlines()[:12]]
    python = load_runtime(skilled_export)
    graph = load_runtime(skilled_export, search="graph")
    ids, mask = python.encode([r["source"] for r in records])
    want = python.generate(ids, mask, **gen)
    got = graph.generate(ids, mask, **gen)
    rows = want.shape[0]
    assert (want[:, 1:] == 1).any(axis=1).sum() >= rows // 2  # the EOS path is exercised: outputs end early
    same = same_rows(want, got, python.tokens, gen["num_beams"])
    if gen["num_beams"] == 1:  # greedy: every token
        assert got.shape == want.shape and same == rows
    else:  # the operator's stopping rule (transformers' earlier one) may keep another hypothesis now and then
        assert same >= rows - max(1, rows // 8), (same, rows)
    assert graph.generate_text([records[0]["source"]], **gen) == python.generate_text([records[0]["source"]], **gen)


def test_info_shows_the_search_graph_check(gated_export):
    result = runner.invoke(app, ["info", str(gated_export)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "generator.onnx: greedy 8/8, beam 2 8/8 rows as the Python search" in result.output


def test_generate_cli_search_graph(gated_export):
    args = ["generate", str(gated_export), "translate: hello", "a longer second input", "--max-new-tokens", "6"]
    python = runner.invoke(app, args)
    graph = runner.invoke(app, [*args, "--search", "graph", "--num-beams", "1"])
    assert python.exit_code == 0 and graph.exit_code == 0, (python.output, graph.output)
    assert graph.stdout == python.stdout and len(graph.stdout.splitlines()) == 2


def test_quantize_rebuilds_the_generator_in_int8(skilled_export, skilled, tmp_path):
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    out = tmp_path / "int8"
    report = quantize(skilled_export, QuantizeConfig(mode="dynamic", min_agreement=0), out, progress=False)
    assert (out / "generator.onnx").is_file()
    assert weight_bytes(out / "generator.onnx") < 0.5 * weight_bytes(skilled_export / "generator.onnx")
    check = report["graphs"]["search_graph"]
    assert check["greedy"]["identical_rows"] >= 6  # int8's first step is decoder_with_past's, not decoder_model's
    records = [json.loads(line) for line in (skilled / "data" / "eval.jsonl").read_text().splitlines()[:16]]
    texts = [r["source"] for r in records]
    graph = load_runtime(out, search="graph").generate_text(texts, num_beams=1, max_new_tokens=24)
    python = load_runtime(out).generate_text(texts, num_beams=1, max_new_tokens=24)
    assert sum(a == b for a, b in zip(graph, python, strict=True)) >= 14


def test_finish_pads_after_eos_and_crops():
    tok = SpecialTokens(decoder_start=0, eos=(1,), pad=0)
    seqs = np.array([[0, 5, 0, 0, 0, 0], [0, 5, 6, 7, 0, 0]])  # the operator leaves EOS out and pads after
    out = finish(seqs, GenerationSettings(num_beams=1), tok)
    assert out.tolist() == [[0, 5, 1, 0, 0], [0, 5, 6, 7, 1]]
    beam = finish(seqs, GenerationSettings(num_beams=2), tok)
    assert beam.tolist() == [[0, 5, 1, 1, 1], [0, 5, 6, 7, 1]]  # transformers' fill for T5: pad 0 -> the EOS id
    full = finish(np.array([[0, 5, 6, 7], [0, 5, 0, 0]]), GenerationSettings(num_beams=1), tok)
    assert full.tolist() == [[0, 5, 6, 7], [0, 5, 1, 0]]  # a row that ran to max_length has no EOS


def test_greedy_runs_the_operator_without_length_penalty(gated_export):
    """The operator's one beam applies the length penalty greedy does not have: with it, a continuation past the EOS
    greedy picks can score higher per token and be returned (measured on a near-tie docstring model: 2 of 8 rows
    differed from the Python search; with 0, 64 of 64 identical). The real graph runs; its feeds are recorded."""
    from t5compress.runtime.ingraph import GraphSearch

    rt = load_runtime(gated_export, search="graph")
    search = rt.graph_search
    assert isinstance(search, GraphSearch)
    seen = []
    real = search.graph.run
    search.graph.run = lambda feeds: seen.append(feeds["length_penalty"].item()) or real(feeds)
    python = load_runtime(gated_export)
    ids, mask = python.encode(["spell sorted: 914", "sort words: b a"])
    assert np.array_equal(rt.generate(ids, mask, num_beams=1, max_new_tokens=12, length_penalty=0.6),
                          python.generate(ids, mask, num_beams=1, max_new_tokens=12))
    rt.generate(ids, mask, num_beams=2, max_new_tokens=12, length_penalty=0.6)
    assert seen == [0.0, pytest.approx(0.6)]


def test_settings_the_graph_cannot_honour_are_one_line(gated_export, tiny_gated_dir, tmp_path):
    graph = load_runtime(gated_export, search="graph")
    ids = np.array([[5, 6, 7, 1]])
    with pytest.raises(ConfigError, match="early_stopping True asked"):
        graph.generate(ids, num_beams=2, early_stopping=True)
    with pytest.raises(ConfigError, match="no_repeat_ngram_size 2 asked"):
        graph.generate(ids, no_repeat_ngram_size=2)
    plain = tmp_path / "plain"
    shutil.copytree(gated_export, plain)
    (plain / "generator.onnx").unlink()
    result = runner.invoke(app, ["generate", str(plain), "hello", "--search", "graph"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "has no generator.onnx" in lines[0], result.output
    with pytest.raises(ModelError, match="has no generator.onnx"):
        load_runtime(plain, search="graph")
    with pytest.raises(ConfigError, match="search_graph"):
        ExportConfig(search_graph=True, inflight=True)
    with pytest.raises(ConfigError, match="search_graph"):
        ExportConfig(search_graph=True, dtype="fp16")
    with pytest.raises(ConfigError, match="choose one of python, graph"):
        load_runtime(gated_export, search="loop")


def test_external_data_and_both_decoder_layouts(tiny_model_dir, tmp_path):
    """A relu, tied model exported with both decoder layouts and its weights in external data files: the generator
    keeps its weights beside it too, and loads and matches greedy search."""
    out = tmp_path / "onnx"
    report = run(tiny_model_dir, ExportConfig(search_graph=True, decoders="both", external_data_threshold=0), out)
    assert report["search_graph"]["greedy"]["identical_rows"] == 8
    assert external_files(out / "generator.onnx") == [WEIGHTS_FILE]  # the dir's one data file, weights shared
    proto = onnx.load(str(out / "generator.onnx"), load_external_data=False)
    big = [t for t in proto.graph.initializer if np.prod(t.dims) >= 256]
    assert big and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)  # the weights are in the data file
    ids = np.array([[5, 6, 7, 8, 1], [9, 10, 1, 0, 0]])
    graph = load_runtime(out, search="graph").generate(ids, max_new_tokens=6)
    assert (graph == load_runtime(out, decoders="separate").generate(ids, max_new_tokens=6)).all()


def test_a_blockwise_int8_generator_runs_its_matmulnbits_graphs(gated_export, tmp_path):
    """quantize --blockwise rebuilds the generator over MatMulNBits graphs (com.microsoft ops inside subgraphs)."""
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    out = tmp_path / "blockwise"
    report = quantize(gated_export, QuantizeConfig(mode="blockwise", min_agreement=0), out, progress=False)
    proto = onnx.load(str(out / "generator.onnx"))
    subgraphs = [a.g for a in proto.graph.node[0].attribute if a.type == onnx.AttributeProto.GRAPH]
    assert any(n.op_type == "MatMulNBits" for g in subgraphs for n in g.node)
    assert report["graphs"]["search_graph"]["greedy"]["identical_rows"] >= 6
    ids = np.array([[5, 6, 7, 8, 1], [9, 10, 1, 0, 0]])
    assert load_runtime(out, search="graph").generate(ids, max_new_tokens=6).shape[0] == 2
