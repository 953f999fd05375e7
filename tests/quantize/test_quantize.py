"""Post-training int8 (static, dynamic and block-wise) on real exports: accuracy against fp32, sizes, formats, bad
inputs."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.cpu import cpu_features
from t5compress.errors import ConfigError, DataError, ModelError, QuantizeError
from t5compress.names import GRAPHS
from t5compress.quantize import QuantizeConfig, run
from t5compress.runtime import load_runtime

runner = CliRunner()


@pytest.fixture(scope="module")
def static_dir(skilled) -> Path:
    """The skilled demo's `int8` stage: the default static int8, calibrated on the training texts and checked on the
    eval texts (QuantizeConfig(calib_data=train, eval_data=eval), what this file ran again before)."""
    return skilled / "int8"


def _ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _report(d: Path) -> dict:
    return json.loads((d / "report.json").read_text())


def test_static_int8_stays_within_one_percent_of_fp32_and_shrinks(static_dir, skilled):
    r = _report(static_dir)
    fp32, int8 = r["eval"]["fp32"], r["eval"]["int8"]
    assert 50 <= fp32["exact_match"] < 100  # real, not perfect, skill: quantization loss could show
    # ROUGE-L within 1% of fp32's, exact match within two of the 200 examples (one point): the fixture trains a
    # little differently on each CPU (AMD EPYC: exact match 72.0 both; an Intel Xeon with AMX: 72.5 / 71.5, ROUGE-L
    # 93.22 / 93.21)
    assert int8["rougeL"] >= 0.99 * fp32["rougeL"] and int8["exact_match"] >= fp32["exact_match"] - 1.0, (fp32, int8)
    # x86 int8 kernels without VNNI (VPMADDUBSW) saturate full-range u8 x s8 products: on such an AVX2 CPU the same
    # model measured 96.3% on its 200 held-out eval texts (96.7% with --weight-range reduced), on VNNI CPUs 97%+
    vnni = any(cpu_features().get(f) for f in ("avx512_vnni", "avx_vnni")) or cpu_features()["arch"] != "x86_64"
    assert r["check"]["next_token_agreement"] >= (0.97 if vnni else 0.955)
    assert r["size"]["ratio"] < 0.4  # a 1M-parameter model: graph structure is a visible share of the bytes
    assert r["size"]["int8_bytes"] == sum(f.stat().st_size for f in static_dir.glob("*.onnx*"))
    for g in GRAPHS:
        ops = _ops(static_dir / f"{g}.onnx")
        assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > 0, g
        assert r["graphs"][g]["calibration_feeds"] > 0
    # Tied embedding: the decoders' lookup reads the LM head's int8 matrix, stored once (no second int8 copy).
    for g in GRAPHS[1:]:
        assert r["graphs"]["tied_table_bytes_saved"][g] == 128 * 256
        graph = onnx.load(str(static_dir / f"{g}.onnx")).graph
        assert not [t.name for t in graph.initializer if t.name.endswith("_embedding_quantized")]
        # and the lookup gathers int8 columns: no step dequantizes the whole table (that made t5-small ~6x slower)
        int8 = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.INT8}
        lookups = [n for n in graph.node if n.op_type == "Gather" and "embed_tokens" in n.name]
        assert lookups and all(n.input[0] in int8 for n in lookups), [n.input[0] for n in lookups]
    # the int8 dir is an export dir like any other: the runtime generates from it
    rt = load_runtime(static_dir)
    assert rt.generate_text(["spell sorted: 914"])[0].strip() == "one four nine"
    meta = json.loads((static_dir / "t5compress.json").read_text())  # the default static int8, as the fixture says
    default = QuantizeConfig(calib_data=str(skilled / "data" / "train.jsonl"),
                             eval_data=str(skilled / "data" / "eval.jsonl"))
    assert meta["stage"] == "quantize" and meta["config"] == json.loads(json.dumps(dataclasses.asdict(default)))


def test_the_runtime_gathers_the_tied_int8_table_by_row(static_dir, skilled, monkeypatch):
    """The runtime's with-past step (runtime.sharedkv) reads the shared table by rows (filled as looked up) instead
    of gathering its columns, and computes bit for bit what the column lookup did."""
    import t5compress.runtime.sharedkv as sharedkv

    done = sharedkv.rewritten(static_dir)
    graph = onnx.load_from_string(done.model).graph
    lookups = [n for n in graph.node if n.op_type == "Gather" and "embed_tokens" in n.name]
    assert lookups and all(n.input[0].endswith("/rows") and n.attribute[0].i == 0 for n in lookups)
    rows = {t.name: t.dims for t in graph.initializer if t.name.endswith("/rows")}
    assert list(rows.values()) == [[256, 128]]  # (vocab, d_model): the (d_model, vocab) table transposed
    by_row = load_runtime(static_dir, threads=1)
    monkeypatch.setattr(sharedkv, "row_lookups", lambda model, value, rows_of=None: {})
    by_column = load_runtime(static_dir, threads=1)
    transposes = [Counter(n.op_type for n in onnx.load_from_string(m).graph.node)["Transpose"]
                  for m in (done.model, sharedkv.rewritten(static_dir).model)]
    assert transposes[1] - transposes[0] == len(lookups)
    past = by_row.backend.decoder_with_past
    assert sharedkv.is_shared(past) and sharedkv.is_shared(by_column.backend.decoder_with_past)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 256, (3, 1)), "encoder_attention_mask": np.ones((3, 5), np.int64)}
    for i in past.session.get_inputs():
        if i.name.startswith("past_key_values."):
            length = 4 if ".decoder." in i.name else 5
            feeds[i.name] = rng.standard_normal((3, i.shape[1], length, i.shape[3])).astype(np.float32)
    want = by_column.backend.decoder_with_past.run(feeds)
    for name, got in past.run(feeds).items():
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    texts = [json.loads(line)["source"] for line in (skilled / "data" / "eval.jsonl").read_text().splitlines()[:8]]
    for gen in ({}, {"num_beams": 4}):
        assert by_row.generate_text(texts, **gen) == by_column.generate_text(texts, **gen)


def test_dynamic_int8_and_static_matches_or_beats_it(static_dir, skilled, tmp_path):
    out = tmp_path / "dyn"
    r = run(skilled / "onnx", QuantizeConfig(mode="dynamic", eval_data=str(skilled / "data" / "eval.jsonl")), out,
            progress=False)
    assert _ops(out / "decoder_with_past_model.onnx")["MatMulInteger"] > 0
    assert r["graphs"]["tied_table_bytes_saved"]["decoder_with_past_model"] == 128 * 256
    assert r["size"]["ratio"] < 0.4
    assert r["check"]["on"] == "eval texts"
    static = _report(static_dir)["eval"]["int8"]["exact_match"]
    # within two examples of 200, or better (on an AVX2 CPU without VNNI static int8 measured 71.5 vs dynamic 72.5)
    assert static >= r["eval"]["int8"]["exact_match"] - 1.0


def test_blockwise_int8_needs_no_calibration_and_keeps_fp32s_outputs(static_dir, skilled, tmp_path):
    out = tmp_path / "block"
    r = run(skilled / "onnx", QuantizeConfig(mode="blockwise", eval_data=str(skilled / "data" / "eval.jsonl")), out,
            progress=False)
    for g in GRAPHS:
        ops = _ops(out / f"{g}.onnx")
        # every linear layer block-wise (the other quantized node: the embedding lookup), nothing static or dynamic
        assert ops["MatMulNBits"] == r["graphs"][g]["quantized_nodes"] - 1 > 0, (g, ops)
        assert ops["QuantizeLinear"] == ops["MatMulInteger"] == ops["DynamicQuantizeLinear"] == 0, (g, ops)
    assert r["mode"] == "blockwise" and r["block_size"] == 32 and r["size"]["ratio"] < 0.45
    for g in ("decoder_model", "decoder_with_past_model"):  # the tied table once: the lookup reads the LM head
        names = {t.name for t in onnx.load(str(out / f"{g}.onnx")).graph.initializer}
        assert not any(n.endswith(("_int8_rows", "_embedding")) for n in names), (g, sorted(names))
        assert sum(n.endswith("nbits_w") for n in names) == _ops(out / f"{g}.onnx")["MatMulNBits"]
    static = _report(static_dir)["eval"]
    print(json.dumps({"blockwise": r["eval"]["greedy_agreement"], "static": static["greedy_agreement"]}))
    # Block scales keep more outputs than static int8's calibrated ones (measured: 96.0% vs 89.5% identical greedy
    # outputs on 200 eval examples; 98.0% vs 96.5% on an Intel Xeon), and the task metric within two examples of
    # fp32's (Xeon: 71.5 against 72.5), ROUGE-L within 1%.
    assert r["eval"]["greedy_agreement"] >= static["greedy_agreement"]
    assert r["eval"]["int8"]["exact_match"] >= r["eval"]["fp32"]["exact_match"] - 1.0
    assert r["eval"]["int8"]["rougeL"] >= 0.99 * r["eval"]["fp32"]["rougeL"]
    assert load_runtime(out).generate_text(["spell sorted: 914"])[0].strip() == "one four nine"
    shown = runner.invoke(app, ["info", str(out)]).output
    # the check read every eval text (no calibration texts), so its greedy outputs are the eval's, said once
    assert r["check"]["greedy_agreement"] == r["eval"]["greedy_agreement"]
    assert "blockwise, blocks of 32" in shown
    assert f"greedy outputs {r['eval']['greedy_agreement']:.2%}" in shown
    assert "greedy outputs = fp32" not in shown


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_histogram_methods_calibrate_on_feeds_of_every_length(method, skilled, tmp_path):
    # Calibration batches have different encoder lengths and every decoder step a longer past: ONNX Runtime's
    # histogram calibrators cannot stack such tensors; feeding them one at a time must work.
    r = run(skilled / "onnx", QuantizeConfig(calib_data=str(skilled / "data" / "train.jsonl"), samples=48,
                                             method=method), tmp_path / method, progress=False)
    assert r["method"] == method
    assert r["graphs"]["decoder_with_past_model"]["calibration_feeds"] > 3
    assert r["check"]["next_token_agreement"] >= 0.95


def test_qoperator_format_uses_int8_operators(skilled, tmp_path):
    run(skilled / "onnx", QuantizeConfig(calib_data=str(skilled / "data" / "train.jsonl"), samples=32,
                                         format="qoperator", per_channel=False), tmp_path / "qop", progress=False)
    ops = _ops(tmp_path / "qop" / "encoder_model.onnx")
    assert ops["QLinearMatMul"] > 0 and ops["MatMul"] < 6  # only the attention MatMuls stay float


def test_quantizing_every_op_type_is_refused_and_writes_nothing(skilled, tmp_path):
    # The relative-position bucket arithmetic does not survive int8: the check must catch it, not ship it.
    cfg = QuantizeConfig(calib_data=str(skilled / "data" / "train.jsonl"), samples=32,
                         op_types=("MatMul", "Add", "Mul", "Div", "Where", "Softmax", "Pow", "Sqrt", "Log"))
    with pytest.raises(QuantizeError, match="nothing was written"):
        run(skilled / "onnx", cfg, tmp_path / "broken", progress=False)
    assert not (tmp_path / "broken").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")]


def test_gated_model_gets_every_linear_layer_smoothed_and_per_token_or_wo_fp32(gated_export, gated_int8, demo_jsonl,
                                                                              tmp_path):
    from t5compress.quantize.graphs import linear_nodes

    fp32 = gated_export
    # Random weights give flat logits, where int8 flips near-ties often: the agreement floor is lowered for them.
    default_dir, default = gated_int8
    for g in ("encoder_model", "decoder_model", "decoder_with_past_model"):
        tokenwise, linear = default["graphs"][g]["per_token"], linear_nodes(onnx.load(str(fp32 / f"{g}.onnx")))
        assert default["graphs"][g]["kept_fp32"] == [] and sorted(tokenwise) == sorted(linear)
        ops = _ops(default_dir / f"{g}.onnx")
        assert ops["MatMulIntegerToFloat"] == len(tokenwise) and "MatMul" in ops  # attention's products stay fp32
        assert ops["QuantizeLinear"] < len(tokenwise)  # q, k, v (and wi_0, wi_1) share their input's quantization
        smoothed = default["graphs"]["smooth_quant"][g]
        assert smoothed["alpha"] == 0.5 and smoothed["groups"] >= 4 and smoothed["layers"] >= 10
    # the encoder's 2 layers: q|k|v, wi_0|wi_1 (after a norm) and wo (folded into wi_1): 6 groups of 12 layers
    assert default["graphs"]["smooth_quant"]["encoder_model"] | {"max_scale_ratio": 0} == {
        "alpha": 0.5, "groups": 6, "layers": 12, "max_scale_ratio": 0}
    # what the CLI and `info` print of it, and of a report from before groups were recorded
    from t5compress.quantize.modes import applied

    shown = dict(applied(default))
    every = {n for g in default["graphs"].values() if isinstance(g, dict) for n in g.get("per_token") or []}
    assert shown["per-token int8"].startswith(f"{len(every)} linear layers")
    smoothed = default["graphs"]["smooth_quant"].values()
    assert shown["SmoothQuant"] == (f"alpha 0.5: {sum(s['groups'] for s in smoothed)} inputs of "
                                    f"{sum(s['layers'] for s in smoothed)} linear layers rescaled into their weights")
    older = {"graphs": {"smooth_quant": {"encoder_model": {"alpha": 0.5, "layers": 2, "max_scale_ratio": 3.0}}}}
    assert applied(older) == [("SmoothQuant", "alpha 0.5: 2 inputs of 2 linear layers rescaled into their weights")]

    kept = run(fp32, QuantizeConfig(calib_data=str(demo_jsonl), samples=32, min_agreement=0.5, per_token="none"),
               tmp_path / "kept", progress=False)
    wo = kept["graphs"]["encoder_model"]["kept_fp32"]
    assert wo and all("DenseReluDense/wo/" in n for n in wo) and kept["graphs"]["encoder_model"]["per_token"] == []
    assert "smooth_quant" not in kept["graphs"]  # auto smooths only under per-token auto
    assert _ops(tmp_path / "kept" / "encoder_model.onnx")["MatMul"] >= len(wo)
    def fp32_matrices(path: Path) -> int:  # but the relative position bias table, a lookup kept fp32
        return sum(1 for t in onnx.load(str(path)).graph.initializer if t.data_type == onnx.TensorProto.FLOAT
                   and len(t.dims) == 2 and min(t.dims) > 1 and "relative_attention_bias" not in t.name)
    assert fp32_matrices(default_dir / "encoder_model.onnx") == 0  # wo's weights int8 too
    assert fp32_matrices(tmp_path / "kept" / "encoder_model.onnx") == len(wo)
    named = run(fp32, QuantizeConfig(calib_data=str(demo_jsonl), samples=32, min_agreement=0.5,
                                     keep_fp32="DenseReluDense/wo/"), tmp_path / "named", progress=False)
    named_dec = named["graphs"]["decoder_model"]
    assert "/lm_head/MatMul" in named_dec["per_token"] and not any("wo/" in n for n in named_dec["per_token"])
    assert named_dec["kept_fp32"] and all("DenseReluDense/wo/" in n for n in named_dec["kept_fp32"])

    smoothed = run(fp32, QuantizeConfig(calib_data=str(demo_jsonl), samples=32, smooth_alpha=0.5, per_token="none",
                                        min_agreement=0.5), tmp_path / "smoothed", progress=False)
    enc = smoothed["graphs"]["encoder_model"]
    assert enc["kept_fp32"] == [] and enc["per_token"] == []
    assert smoothed["graphs"]["smooth_quant"]["encoder_model"]["groups"] == 6


@pytest.mark.parametrize("graph", ["encoder_model", "decoder_with_past_model"])
def test_smoothing_every_group_is_exact_in_fp32(gated_export, tmp_path, graph):
    """The migration changes no output before quantization (up to float rounding), the KV cache included."""
    import onnxruntime as ort

    from t5compress.quantize.calibrate import TapGraph
    from t5compress.quantize.smooth import COLUMNS, NORM, ChannelMax, smooth, smooth_groups
    from t5compress.quantize.sources import Graph

    src = gated_export / f"{graph}.onnx"
    groups = smooth_groups(onnx.load(str(src)))
    assert {g.fold for g in groups} == {NORM, COLUMNS}
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else {"encoder_sequence_length": 7}.get(d, 2 if "batch" in d else 5)
                 for d in i.shape]
        feeds[i.name] = (rng.integers(3, 200, shape) if i.type == "tensor(int64)" and "ids" in i.name else
                         np.ones(shape, np.int64) if i.type == "tensor(int64)" else
                         rng.standard_normal(shape).astype(np.float32))
    meter = ChannelMax(groups)
    TapGraph(Graph(graph, src), [meter], tmp_path, threads=1).run(feeds)
    report = smooth(src, tmp_path / "s.onnx", groups, meter.amax, 0.7)
    assert report["groups"] == len(groups) and report["max_scale_ratio"] > 1
    a = sess.run(None, feeds)
    b = ort.InferenceSession(str(tmp_path / "s.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    for x, y in zip(a, b, strict=True):
        assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max() + 1e-6


def _parses(monkeypatch) -> Counter:
    """Every `onnx.load` from now on, counted by (file, the package file that asked: the first caller outside
    `runtime/sessions.py`'s `load_onnx`; '' for none), the loads ONNX Runtime's quantizer makes included."""
    import traceback

    seen: Counter = Counter()
    load = onnx.load

    def counted(f, *args, **kwargs):
        callers = [fr.filename for fr in traceback.extract_stack()[:-1] if "/t5compress/" in fr.filename
                   and not fr.filename.endswith("sessions.py")]
        seen[Path(str(f)).resolve(), callers[-1].rsplit("/t5compress/", 1)[1] if callers else ""] += 1
        return load(f, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", counted)
    monkeypatch.setattr(onnx, "load_model", counted)
    return seen


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_the_stage_parses_each_input_graph_once_and_never_reloads_an_output_graph(mode, skilled, tmp_path,
                                                                                 monkeypatch):
    """The stage reads each graph file of the export once (its structure, then its weights from their external
    data); the int8 graphs are rewritten in memory (per-token layers, the shared table and lookup) and written once,
    each weight stored once. ONNX Runtime's quantizer reads back what it wrote into the scratch folder, once; only
    the runtime, opening the result to check it, reads the graphs written."""
    seen = _parses(monkeypatch)
    src, out = skilled / "onnx", tmp_path / "int8"
    run(src, QuantizeConfig(mode=mode, calib_data=str(skilled / "data" / "train.jsonl"), samples=16), out,
        progress=False)
    stage = Counter()
    for (path, caller), n in seen.items():
        if not caller.startswith("runtime/"):  # the runtime opening a dir to run it (calibration, check)
            stage[path] += n
    assert {g: stage[(src / f"{g}.onnx").resolve()] for g in GRAPHS} == {g: 1 for g in GRAPHS}
    assert all(n == 1 for n in stage.values()), stage  # scratch files too: read back once
    written = {f.name for f in out.glob("*.onnx")}
    assert written >= {f"{g}.onnx" for g in GRAPHS}
    # the staging dir the stage wrote into (renamed to `out` when done): no graph of it read by the stage
    assert not [p for p in stage if p.name in written and p.parent != src.resolve()], stage
    assert _report(out)["graphs"]["weights"]["tensors"] > 0


def test_auto_choices_resolve_once_into_a_plan(static_dir):
    """Each method resolves the `auto` options from the model once; the report records the plan and says it."""
    from t5compress.quantize.modes import METHODS, applied, method_for
    from t5compress.quantize.plan import QuantPlan

    def plan(gated: bool, tied: bool = True, held: bool = False, **kw) -> QuantPlan:
        cfg = QuantizeConfig(**{"calib_data": "x.txt", **kw})
        return method_for(cfg.mode).resolve(cfg, gated, tied, held)

    assert list(METHODS) == ["static", "dynamic", "blockwise", "int4"]
    relu, gated = plan(False), plan(True, tied=False)
    assert (relu.smooth_alpha, relu.per_token, relu.keep_fp32, relu.row_lookups) == (0.0, "none", "none", False)
    assert (gated.smooth_alpha, gated.per_token, gated.keep_fp32, gated.sensitivity) == (0.5, "auto", "none", "off")
    assert gated.row_lookups and gated.rounding == "gptq"
    assert plan(True, held=True).keep_fp32 == "measured" and plan(True, held=True).sensitivity == "if needed"
    assert plan(False, keep_fp32="sensitive").sensitivity == "every group"
    assert plan(True, per_token="none").keep_fp32 == "wo"  # outliers nothing else takes
    assert plan(True, mode="dynamic", calib_data=None).keep_fp32 == "wo"
    assert plan(True, mode="dynamic", calib_data=None).per_token == "none"
    block = plan(True, mode="blockwise")
    assert (block.keep_fp32, block.smooth_alpha, block.block_size, block.rounding) == ("none", 0.5, 128, "gptq")
    assert plan(True, mode="blockwise", calib_data=None).block_size == 32
    tuned = plan(True, eval_data="e.jsonl", tolerance=0.01)
    assert tuned.tune and tuned.keep_fp32 == "wo" and not tuned.share_table and tuned.sensitivity == "off"
    report = _report(static_dir)
    assert QuantPlan(**report["plan"]).mode == "static" and dict(applied(report))["plan"].startswith("static")


def test_bad_inputs_are_one_line_and_write_nothing(skilled, static_dir, tmp_path):
    src = skilled / "onnx"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    few = tmp_path / "few.txt"
    few.write_text("one\ntwo\n")
    cases = [
        (QuantizeConfig(calib_data=str(empty)), src, DataError, "no calibration texts"),
        (QuantizeConfig(calib_data=str(few), samples=10), src, DataError, "fewer than the 10"),
        (QuantizeConfig(calib_data=str(tmp_path / "nope.jsonl")), src, DataError, "does not exist"),
        (QuantizeConfig(mode="dynamic"), static_dir, ModelError, "already quantized"),
        (QuantizeConfig(mode="dynamic"), skilled / "model", ModelError, "missing encoder_model.onnx"),
    ]
    for cfg, where, err, msg in cases:
        with pytest.raises(err, match=msg):
            run(where, cfg, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="block_size: choose one of 16, 32, 64, 128, 256, got 48"):
        QuantizeConfig(mode="blockwise", block_size=48)
    for kw, field in [({"mode": "static"}, "calib_data"), ({"method": "kl"}, "method"), ({"samples": 0}, "samples"),
                      ({"mode": "dynamic", "smooth_alpha": 0.5}, "smooth_alpha"), ({"format": "x"}, "format")]:
        with pytest.raises(ConfigError, match=field):
            QuantizeConfig(**{"calib_data": None if "mode" in kw else "x.txt", **kw})


def test_cli_happy_path_and_bad_input(skilled, tmp_path):
    out = tmp_path / "cli"
    res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(out), "--calib-data",
                              str(skilled / "data" / "train.jsonl"), "--samples", "32"])
    assert res.exit_code == 0, res.output
    assert "next token" in res.output and "int8 static (minmax, qdq)" in res.output
    assert (out / "report.json").is_file()
    res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(out), "--dynamic"])
    assert res.exit_code == 2 and "already exists" in res.output
    res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(tmp_path / "x"), "--static", "--dynamic"])
    assert res.exit_code == 2 and "choose one of" in res.output
    res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(tmp_path / "x"), "--blockwise", "--dynamic"])
    assert res.exit_code == 2 and "choose one of --static, --dynamic and --blockwise" in res.output
    res = runner.invoke(app, ["info", str(out)])
    assert res.exit_code == 0 and "int8" in res.output


def test_a_pruned_model_exports_and_quantizes_like_any_other(skilled, tmp_path):
    """Pruning and int8 compose: a global-pruned dir (per-layer sizes) goes through export and static int8."""
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.prune.stage import PruneConfig
    from t5compress.prune.stage import run as prune

    data = str(skilled / "data" / "train.jsonl")
    prune(skilled / "model", PruneConfig(calib_data=data, heads=0.5, ffn=0.5, schedule="global",
                                         decoder_layers=1, calib_examples=64, latency_examples=0),
          tmp_path / "pruned", progress=False)
    export(tmp_path / "pruned", ExportConfig(), tmp_path / "pruned-onnx")
    r = run(tmp_path / "pruned-onnx", QuantizeConfig(calib_data=data, samples=32, min_agreement=0.5),
            tmp_path / "pruned-int8", progress=False)
    assert r["size"]["ratio"] < 0.45
    assert all(r["graphs"][g]["quantized_nodes"] > 0 for g in GRAPHS)
    # The pruned fp32 export is smaller than the unpruned one, and its int8 export runs in the runtime.
    assert r["size"]["fp32_bytes"] < 0.8 * sum(f.stat().st_size for f in (skilled / "onnx").glob("*.onnx*"))
    assert len(load_runtime(tmp_path / "pruned-int8").generate_text(["spell sorted: 914", "sort words: a b"])) == 2


def test_per_token_int8_keeps_each_rows_precision_whatever_its_scale(tmp_path):
    """Rows 10^4 apart in magnitude (the spread of wo inputs) each come out within int8 error of fp32; an all-zero
    row gives zeros; the weight is stored int8 (the fp32 one is gone)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from t5compress.quantize.pertoken import rewrite

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="/decoder/block.0/layer.2/DenseReluDense/wo/MatMul")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "len", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "len", 8])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "g.onnx"
    x = rng.standard_normal((2, 3, 16)).astype(np.float32) * np.array([1e-2, 1, 1e2])[None, :, None].astype(np.float32)
    x[1, 2] = 0.0
    want = x @ w
    # 7-bit weights: x86 u8 x s8 kernels without VNNI saturate full-range products (what --weight-range reduced is for)
    assert rewrite(model, ["/decoder/block.0/layer.2/DenseReluDense/wo/MatMul"], weight_max=63) == [
        "/decoder/block.0/layer.2/DenseReluDense/wo/MatMul"]
    onnx.save(model, str(path))
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape and np.isfinite(got).all()
    scale = np.abs(want).max(axis=-1, keepdims=True) + 1e-30
    assert (np.abs(got - want) / scale).max() < 0.03  # each row relative to its own size: 1e-2 rows included
    assert np.array_equal(got[1, 2], np.zeros(8, np.float32))
    written = onnx.load(str(path))
    assert {t.name for t in written.graph.initializer}.isdisjoint({"w"})
    assert {n.op_type for n in written.graph.node} >= {"MatMulIntegerToFloat", "ReduceMax"}
    assert "MatMul" not in {n.op_type for n in written.graph.node}


def test_per_token_layers_reading_one_input_share_its_quantization(tmp_path):
    """q, k and v read one layer-norm output: one per-row quantization (one ReduceMax) feeds three int8 matmuls,
    each within int8 error of its fp32 product."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from t5compress.quantize.pertoken import rewrite

    rng = np.random.default_rng(1)
    names = [f"/encoder/block.0/layer.0/SelfAttention/{p}/MatMul" for p in "qkv"]
    ws = {p: rng.standard_normal((16, 8)).astype(np.float32) for p in "qkv"}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", f"w_{p}"], [f"y_{p}"], name=n) for p, n in zip("qkv", names, strict=True)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "len", 16])],
        [helper.make_tensor_value_info(f"y_{p}", TensorProto.FLOAT, ["batch", "len", 8]) for p in "qkv"],
        [numpy_helper.from_array(w, f"w_{p}") for p, w in ws.items()])
    path, model = tmp_path / "g.onnx", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert rewrite(model, names, weight_max=63) == names
    onnx.save(model, str(path))
    ops = _ops(path)
    assert ops["ReduceMax"] == 1 and ops["MatMulIntegerToFloat"] == 3 and ops["MatMul"] == 0
    written = onnx.load(str(path)).graph
    read = {i for n in written.node for i in n.input}
    assert all(t.name in read for t in written.initializer)  # ONNX Runtime warns at every load about unused ones
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for p, y in zip("qkv", got, strict=True):
        want = x @ ws[p]
        assert np.abs(y - want).max() < 0.03 * np.abs(want).max()


def _held(obj, seen=None) -> int:
    """Bytes of the numpy arrays an object holds (through its attributes, dicts, lists and tuples)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_held(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_held(v, seen) for v in obj)
    return _held(vars(obj), seen) if hasattr(obj, "__dict__") else 0


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_calibration_memory_does_not_grow_with_the_texts(method, gated_export, tmp_path, caplog):
    """Every statistic that calibration collects (ranges of each method, GPTQ's Gram matrices, SmoothQuant's channel
    maxima, the tuning's recorded feeds) folds each run into a fixed-size state: after 64 texts of the model's maximum
    length it holds what it held after 4, and the peak of what numpy allocated meanwhile stays within 10% (before,
    a recorder kept a copy of every with-past feed, whole cache included: 3.4 GB on a t5-small shape)."""
    import logging
    import tracemalloc

    from t5compress.quantize.calibrate import Recorder, drive
    from t5compress.quantize.gptq import Gram
    from t5compress.quantize.graphs import linear_nodes
    from t5compress.quantize.methods import StaticGraph
    from t5compress.quantize.modes import method_for
    from t5compress.quantize.smooth import ChannelMax, smooth_groups
    from t5compress.quantize.sources import Graph, plan_for
    from t5compress.runtime.text import input_limit

    limit = input_limit(gated_export)
    assert limit and limit <= 1024
    rng = np.random.default_rng(0)
    # byte-level tokenizer: a text of limit + 50 letters is cut to the limit
    texts = ["".join(rng.choice(list("abcdefgh "), limit + 50)) for _ in range(64)]
    graphs = {g: gated_export / f"{g}.onnx" for g in GRAPHS}

    def calibrate(n: int) -> tuple[int, int]:
        stats, opened = {}, {}
        cfg = QuantizeConfig(calib_data="x", method=method)
        plan = method_for(cfg.mode).resolve(cfg, gated=True, tied=False, held=False)
        for g, path in graphs.items():
            graph = opened[g] = Graph(g, path)
            stats[g] = [StaticGraph(graph, plan_for(graph.model, cfg, plan), method, tmp_path),
                        Gram(graph.model, linear_nodes(graph.model)), ChannelMax(smooth_groups(graph.model)),
                        Recorder(limit=8, budget=1 << 20)]
        tracemalloc.start()
        with caplog.at_level(logging.WARNING):
            feeds = drive(gated_export, opened, texts[:n], stats, batch_size=4, max_new_tokens=6, work=tmp_path,
                          threads=1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert feeds["encoder_model"] == n // 4  # every batch was seen
        assert all(r.nbytes <= 1 << 20 and len(r.feeds) <= 8 for s in stats.values() for r in s[3:])
        return peak, sum(_held(s[:3]) for s in stats.values())  # the recorders: bounded, checked above

    few, many = calibrate(4), calibrate(64)
    # what the statistics hold: the same but for histogram bins, which grow when a later run exceeds the range so far
    assert many[1] <= 1.1 * few[1], (few, many)
    assert many[0] <= 1.1 * few[0], (few, many)  # and the peak of numpy's allocations
    assert f"64 of 64 calibration texts are longer than the model's {limit}-token input limit" in caplog.text


def test_the_decoders_grams_are_summed_into_one_as_they_run(gated_export, tmp_path):
    """`gptq.gram_meters`: the with-past graph sums its X^T X into the first decoder's as calibration runs. Every
    layer both decoders hold gets one matrix, the sum over both graphs' runs (to float32 rounding), the
    cross-attention outputs too, whose inputs the two graphs name apart (before, they were measured and rounded per
    graph, and flan-t5-base's static int8 dir stored their weights twice: 7 MB); a layer of one graph keeps its own;
    and the memory held is less than measuring each graph apart."""
    from t5compress.names import DECODER, DECODER_WITH_PAST, ENCODER
    from t5compress.quantize.calibrate import drive
    from t5compress.quantize.gptq import Gram, gram_meters
    from t5compress.quantize.graphs import linear_nodes
    from t5compress.quantize.sources import Graph

    opened = {g: Graph(g, gated_export / f"{g}.onnx") for g in GRAPHS}
    nodes = {g: linear_nodes(graph.model) for g, graph in opened.items()}
    shared = gram_meters(opened, nodes)
    apart = {g: Gram(graph.model, nodes[g]) for g, graph in opened.items()}
    rng = np.random.default_rng(2)
    texts = ["".join(rng.choice(list("abcdefgh "), 40)) for _ in range(8)]
    drive(gated_export, opened, texts, {g: [shared[g], apart[g]] for g in GRAPHS}, batch_size=4, max_new_tokens=6,
          work=tmp_path, threads=1)

    def close(a: np.ndarray, b: np.ndarray) -> None:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())

    first, past = shared[DECODER].by_node(), shared[DECODER_WITH_PAST].by_node()
    both = set(first) & set(past)
    crossed = {n for n in both if apart[DECODER].inputs[n] != apart[DECODER_WITH_PAST].inputs[n]}
    assert crossed and all("EncDecAttention/o/" in n for n in crossed)  # named apart, one layer
    for n in both:
        assert first[n] is past[n]  # one matrix
        close(first[n], apart[DECODER].by_node()[n] + apart[DECODER_WITH_PAST].by_node()[n])
    for g, mine in ((DECODER, first), (DECODER_WITH_PAST, past)):
        for n in set(mine) - both:
            close(mine[n], apart[g].by_node()[n])
    assert shared[ENCODER].by_node().keys() == apart[ENCODER].by_node().keys()

    def held(grams: dict) -> int:
        return sum(a.nbytes for a in {id(a): a for m in grams.values() for a in m.gram.values()}.values())

    aliased = {apart[DECODER_WITH_PAST].inputs[n] for n in both}  # the with-past inputs summed into the first's
    assert held(shared) == held(apart) - sum(apart[DECODER_WITH_PAST].gram[x].nbytes for x in aliased)


def test_static_stage_memory_does_not_grow_with_the_texts(gated_export, tmp_path):
    """The whole static stage (calibration, GPTQ statistics, the sensitivity probe, the check on fixed eval texts):
    the peak of numpy's allocations with 64 texts of the maximum length is within 10% of that with 16 (before, a probe
    kept a copy of the first 16 with-past feeds, whole cache included: 5 of them with 16 texts here, 16 with 64)."""
    import tracemalloc

    from t5compress.runtime.text import input_limit
    from t5compress.tasks import make_examples, write_jsonl

    limit = input_limit(gated_export)
    rng = np.random.default_rng(1)
    calib = tmp_path / "calib.txt"
    calib.write_text("".join("".join(rng.choice(list("abcdefgh "), limit)) + "\n" for _ in range(64)))
    held_out = tmp_path / "eval.jsonl"
    write_jsonl(held_out, make_examples(8, seed=3))
    peaks = {}
    for n in (16, 64):
        cfg = QuantizeConfig(calib_data=str(calib), samples=n, batch_size=16, max_new_tokens=6,
                             eval_data=str(held_out), min_agreement=0, threads=1)
        tracemalloc.start()
        r = run(gated_export, cfg, tmp_path / f"q{n}", progress=False)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert r["graphs"]["encoder_model"]["calibration_feeds"] == n // 16
    assert peaks[64] <= 1.1 * peaks[16], peaks


def test_the_check_opened_for_one_pass_computes_the_same_numbers(tiny_export):
    """The check opens its runtimes for one pass (`sessions.one_pass`: sessions without an arena), which takes its
    peak memory down and must change no number: fp32's references (greedy sequences, encoder states, teacher-forced
    logits; the decoder that computes them opened inside the block too) and greedy outputs are those of a runtime
    opened as usual, so the agreement and logit errors are too."""
    from t5compress.quantize.check import Reference, greedy_outputs
    from t5compress.runtime import load_runtime
    from t5compress.runtime.sessions import one_pass

    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefgh "), int(rng.integers(20, 400)))) for _ in range(12)]
    with one_pass():
        lean = load_runtime(tiny_export, threads=2)
        lean_ref = Reference(lean, texts, batch_size=5, max_new_tokens=8)
    assert not lean.backend.encoder.session.get_session_options().enable_cpu_mem_arena
    assert not lean.backend.decoder.stored.session.get_session_options().enable_cpu_mem_arena  # opened inside
    plain = load_runtime(tiny_export, threads=2)
    assert plain.backend.encoder.session.get_session_options().enable_cpu_mem_arena
    plain_ref = Reference(plain, texts, batch_size=5, max_new_tokens=8)
    assert len(plain_ref.chunks) == len(lean_ref.chunks) == 3
    for a, b in zip(plain_ref.chunks, lean_ref.chunks, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert greedy_outputs(lean, texts, max_new_tokens=8) == greedy_outputs(plain, texts, max_new_tokens=8)
    # the check's fp32 greedy outputs are the reference's sequences (a pass of their own before); another runtime's
    # are generated on the same batches (a near-tie in this untrained model's logits flips with the batch's rows)
    assert lean_ref.greedy(plain) == lean_ref.outputs  # in the order of `texts`:
    first = lean_ref.rows[0]
    assert [lean_ref.outputs[j] for j in first] == [t.strip() for t in plain.generate_text([texts[j] for j in first],
                                                                                          max_new_tokens=8)]
    same = plain_ref.compare(lean.backend.encoder, lean.backend.decoder)
    assert same["next_token_agreement"] == 1.0 and same["max_rel_logit_error"] == 0.0, same


def test_the_check_generates_each_text_with_fp32_once_and_shows_its_progress(tiny_export, tmp_path, monkeypatch,
                                                                            capsys):
    """fp32's greedy outputs in the check are the reference's sequences, so fp32 generates each checked text once
    (twice before: about 12 of the 100 minutes of flan-t5-large's static stage on 128 texts of 512 tokens), and the
    check, the stage's longest silence at that size, reports its progress."""
    import t5compress.runtime as runtime_pkg
    from t5compress.runtime.model import Seq2SeqRuntime

    rows: Counter = Counter()
    generate, load_runtime = Seq2SeqRuntime.generate, runtime_pkg.load_runtime

    def counted(self, input_ids, *args, **kwargs):
        rows[getattr(self, "opened_from", None)] += len(input_ids)
        return generate(self, input_ids, *args, **kwargs)

    def opened(path, *args, **kwargs):
        rt = load_runtime(path, *args, **kwargs)
        rt.opened_from = Path(path).resolve()
        return rt

    monkeypatch.setattr(Seq2SeqRuntime, "generate", counted)
    monkeypatch.setattr(runtime_pkg, "load_runtime", opened)
    monkeypatch.setenv("T5COMPRESS_PROGRESS", "lines")
    rng = np.random.default_rng(1)
    calib = tmp_path / "calib.txt"
    calib.write_text("".join("".join(rng.choice(list("abcdefgh "), 40)) + "\n" for _ in range(12)))
    out = tmp_path / "int8"
    r = run(tiny_export, QuantizeConfig(calib_data=str(calib), samples=12, batch_size=5, min_agreement=0), out)
    assert r["check"]["texts"] == 12
    assert rows[tiny_export.resolve()] == 12  # the check's fp32 runtime: each text once
    assert rows[out.resolve()] == 0 and rows[None] > 0  # int8's opened in the scratch dir; calibration's own
    err = capsys.readouterr().err
    assert "checking: fp32" in err and "checking: int8" in err


def test_a_rewritten_graph_keeps_a_copy_of_its_structure(tiny_export, tmp_path):
    """`Graph.rewritten` keeps a copy of the saved graph's structure, not the message it saved: saving clears the
    weights' fields, but their bytes stay in that message's protobuf arena while any part of it is referenced (a
    t5-base shape's three untied graphs kept 1.2 GB resident that way through calibration and the check)."""
    from t5compress.quantize.sources import Graph

    graph = Graph("encoder_model", tiny_export / "encoder_model.onnx")
    model = graph.weights()
    new = graph.rewritten(model, tmp_path / "encoder_model.onnx")
    assert new.model is not model
    assert new.model == onnx.load(str(tmp_path / "encoder_model.onnx"), load_external_data=False)
    assert not any(t.raw_data for t in new.model.graph.initializer if t.data_location == t.EXTERNAL)
    assert new.weights() == onnx.load(str(tmp_path / "encoder_model.onnx"))
