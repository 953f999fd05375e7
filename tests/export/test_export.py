"""Export to ONNX and TorchScript: parity with PyTorch, optimum compatibility, odd shapes, bad inputs (real models)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from t5compress import artifacts
from t5compress.cli import app
from t5compress.errors import ConfigError, ExportError
from t5compress.export import ExportConfig, run
from t5compress.export.graphs import graph_specs
from t5compress.export.onnx import needs_external_data, save_onnx
from t5compress.export.verify import CASES, greedy, make_batch, open_onnx
from t5compress.model.load import load_model
from t5compress.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST, ENCODER, GRAPHS, WEIGHTS_FILE, present_names
from t5compress.onnxstore import external_files, stored_twice, weight_bytes
from tests.conftest import build_tiny_t5

torch.set_num_threads(1)
runner = CliRunner()
ATOL = 1e-4


def _export(src: Path, out: Path, **cfg) -> dict:
    run(src, ExportConfig(**cfg), out)
    return json.loads((out / "report.json").read_text())


def _generate(model, ids: np.ndarray, mask: np.ndarray, new: int = 8) -> np.ndarray:
    with torch.no_grad():
        return model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                              num_beams=1, max_new_tokens=new, cache_implementation="dynamic_full").numpy()


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.endswith((".tmp", ".old"))]


@pytest.fixture(scope="module")
def relu_onnx(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    """T5 v1.0 shape (relu, tied), ONNX with the merged decoder."""
    out = tmp_path_factory.mktemp("export") / "relu-onnx"
    return out, _export(tiny_model_dir, out, merged=True)


@pytest.fixture(scope="module")
def gated_onnx(tiny_gated_dir, tmp_path_factory) -> tuple[Path, dict]:
    """T5 v1.1 / Flan shape (gated-gelu, untied), optimised, every weight in external data files."""
    out = tmp_path_factory.mktemp("export") / "gated-onnx"
    return out, _export(tiny_gated_dir, out, optimize=True, external_data_threshold=0)


@pytest.fixture(scope="module")
def pruned_dir(tmp_path_factory) -> Path:
    """Head-pruned shape (3 heads x 16 != d_model 64) with a deeper decoder than encoder, T5 v1.1 style."""
    return build_tiny_t5(tmp_path_factory.mktemp("models") / "pruned", seed=2, d_model=64, num_heads=3, d_kv=16,
                         d_ff=96, num_layers=2, num_decoder_layers=3, feed_forward_proj="gated-gelu",
                         tie_word_embeddings=False)


def test_onnx_export_matches_pytorch_and_uses_optimum_names(relu_onnx, tiny_model_dir):
    out, report = relu_onnx
    diffs = report["parity"]["max_abs_diff"]
    assert set(diffs) == {*GRAPHS, DECODER_MERGED}
    assert all(0 <= d < ATOL for d in diffs.values()), diffs
    assert report["parity"]["generation"]["identical"] and report["parity"]["cases"] == [list(c) for c in CASES]
    worst = report["parity"]["worst"]
    assert report["parity"]["rtol"] == 1e-5 and all(0 <= w["ratio"] <= 1 for w in worst.values()), worst
    assert worst[DECODER]["allowed"] == pytest.approx(1e-4 + 1e-5 * worst[DECODER]["scale"])
    for f in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx", "config.json",
              "generation_config.json", "tokenizer.json", "graphs.json", "t5compress.json"):
        assert (out / f).is_file(), f
    import onnxruntime as ort

    layers = 2
    sessions = {g: ort.InferenceSession(str(out / f"{g}.onnx")) for g in GRAPHS}
    io = {g: ([i.name for i in s.get_inputs()], [o.name for o in s.get_outputs()]) for g, s in sessions.items()}
    assert io[ENCODER] == (["input_ids", "attention_mask"], ["last_hidden_state"])
    assert io[DECODER][0] == ["encoder_attention_mask", "input_ids", "encoder_hidden_states"]
    assert io[DECODER][1] == ["logits", *present_names(layers)]
    assert io[DECODER_WITH_PAST][0][:2] == ["encoder_attention_mask", "input_ids"]
    assert io[DECODER_WITH_PAST][0][2:6] == [f"past_key_values.0.{a}.{b}" for a in ("decoder", "encoder")
                                             for b in ("key", "value")]
    assert io[DECODER_WITH_PAST][1] == ["logits", *present_names(layers, cross=False)]
    manifest = json.loads((out / "graphs.json").read_text())
    assert all(manifest[g] == {"inputs": io[g][0], "outputs": io[g][1]} for g in GRAPHS)
    meta = json.loads((out / "t5compress.json").read_text())
    assert meta["stage"] == "export" and meta["config"]["merged"] is True
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}  # JSON files were mkstemp's 0600
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), modes
    assert meta["parent"]["sha256"] == artifacts.dir_hash(tiny_model_dir)
    # No copying single-input Concat is left (the tracer put one on every cross-attention key and value).
    import onnx

    past = onnx.load(str(out / "decoder_with_past_model.onnx"))
    assert not [n.name for n in past.graph.node if n.op_type == "Concat" and len(n.input) == 1]
    feeds = {i.name: i.name for i in past.graph.input}
    cross = [n for n in past.graph.node if any(".encoder." in x for x in n.input if x in feeds)]
    assert {n.op_type for n in cross} <= {"Transpose", "MatMul", "Shape"}, {n.op_type for n in cross}


def test_graphs_take_any_batch_and_length(relu_onnx, tiny_model_dir):
    """The runtime's greedy search over the graphs on shapes never traced (batch 5, 17 tokens, 12 new) = generate."""
    out, _ = relu_onnx
    model = load_model(tiny_model_dir)
    ids, mask = make_batch(model.config.vocab_size, 5, 17, np.random.default_rng(7))
    want = _generate(model, ids, mask, new=12)
    got = greedy(open_onnx(out, list(GRAPHS)), ids, mask, start=0, eos={1}, pad=0, max_new_tokens=12)
    np.testing.assert_array_equal(got, want)


def test_optimum_loads_the_dir_and_generates_the_same_tokens(relu_onnx, tiny_model_dir):
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    out, _ = relu_onnx
    model = load_model(tiny_model_dir)
    ids, mask = make_batch(model.config.vocab_size, 3, 11, np.random.default_rng(3))
    want = _generate(model, ids, mask)
    for merged in (False, True):  # optimum's own merged path works here: head size == d_model / heads
        ort_model = ORTModelForSeq2SeqLM.from_pretrained(out, use_merged=merged)
        got = ort_model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 do_sample=False, num_beams=1, max_new_tokens=8).numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"use_merged={merged}")


def test_merged_decoder_is_one_if_with_shared_weights(relu_onnx):
    import onnx

    out, report = relu_onnx
    merged = onnx.load(str(out / "decoder_model_merged.onnx"))
    assert [n.op_type for n in merged.graph.node] == ["If"]
    inputs = {i.name: i for i in merged.graph.input}
    assert inputs["use_cache_branch"].type.tensor_type.elem_type == onnx.TensorProto.BOOL
    assert [o.name for o in merged.graph.output] == ["logits", *present_names(2)]
    size = {g: weight_bytes(out / f"{g}.onnx") for g in (DECODER, DECODER_WITH_PAST, DECODER_MERGED)}
    # Identical weights are stored once: well under the two decoders side by side.
    assert size[DECODER_MERGED] < 0.8 * (size[DECODER] + size[DECODER_WITH_PAST])


def test_gated_untied_optimised_external_data(gated_onnx):
    import onnx

    out, report = gated_onnx
    assert report["external_data"] is True
    for g in GRAPHS:  # every graph's weights in the dir's one data file (onnxstore)
        assert external_files(out / f"{g}.onnx") == [WEIGHTS_FILE]
        assert (out / f"{g}.onnx").stat().st_size < weight_bytes(out / f"{g}.onnx")
    assert all(d < ATOL for d in report["parity"]["max_abs_diff"].values())
    assert all(d < ATOL for d in report["parity_unoptimized"]["max_abs_diff"].values())
    assert report["parity"]["generation"]["identical"]
    ops = {n.op_type for n in onnx.load(str(out / "decoder_model.onnx")).graph.node}
    assert "SimplifiedLayerNormalization" in ops, "ONNX Runtime's fusions should be in the optimised graph"


def test_save_onnx_switches_to_external_data_above_the_threshold(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(1024, dtype=np.float32).reshape(32, 32)  # 4 KiB
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], [numpy_helper.from_array(w, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert not needs_external_data(w.nbytes, threshold=w.nbytes) and needs_external_data(w.nbytes, threshold=1000)
    files = save_onnx(proto, tmp_path / "m.onnx", external=needs_external_data(w.nbytes, threshold=1000))
    assert [f.name for f in files] == ["m.onnx", "m.onnx_data"]
    assert (tmp_path / "m.onnx").stat().st_size < 1000 <= (tmp_path / "m.onnx_data").stat().st_size
    y = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": np.ones((1, 32), np.float32)})[0]
    np.testing.assert_allclose(y, w.sum(0, keepdims=True))
    assert save_onnx(onnx.load(str(tmp_path / "m.onnx")), tmp_path / "n.onnx", external=False) == [tmp_path / "n.onnx"]


def test_pruned_heads_and_uneven_depths(pruned_dir, tmp_path):
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    report = _export(pruned_dir, tmp_path / "onnx", merged=True)
    assert all(d < ATOL for d in report["parity"]["max_abs_diff"].values()), report["parity"]["max_abs_diff"]
    assert report["parity"]["generation"]["identical"]
    assert report["model"]["decoder_layers"] == 3 and report["model"]["num_heads"] * report["model"]["d_kv"] == 48
    graphs = open_onnx(tmp_path / "onnx", [DECODER])
    model = load_model(pruned_dir)
    ids, mask = make_batch(model.config.vocab_size, 2, 6, np.random.default_rng(0))
    hidden = model.encoder(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))[0].detach().numpy()
    feeds = {"encoder_attention_mask": mask, "input_ids": ids[:, :3], "encoder_hidden_states": hidden}
    out = graphs[DECODER].run(feeds)
    assert out["present.2.decoder.key"].shape == (2, 3, 3, 16) and out["present.2.encoder.key"].shape == (2, 3, 6, 16)
    ort_model = ORTModelForSeq2SeqLM.from_pretrained(tmp_path / "onnx", use_merged=False)
    got = ort_model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                             num_beams=1, max_new_tokens=8).numpy()
    np.testing.assert_array_equal(got, _generate(model, ids, mask))
    ts = _export(pruned_dir, tmp_path / "ts", format="torchscript")
    assert all(d < ATOL for d in ts["parity"]["max_abs_diff"].values()) and ts["parity"]["generation"]["identical"]


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.load` is deprecated:DeprecationWarning")
def test_cli_torchscript_happy_path_and_positional_order(tiny_model_dir, tmp_path):
    out = tmp_path / "ts"
    result = runner.invoke(app, ["export", str(tiny_model_dir), str(out), "--torchscript"])
    assert result.exit_code == 0, result.output
    assert str(out) in result.output and "decoder_with_past_model" in result.output and "identical" in result.output
    report = json.loads((out / "report.json").read_text())
    assert report["format"] == "torchscript" and report["parity"]["generation"]["identical"]
    assert all(d < ATOL for d in report["parity"]["max_abs_diff"].values())
    shown = runner.invoke(app, ["info", str(out)])
    assert shown.exit_code == 0 and "greedy == generate" in shown.output
    info = json.loads(runner.invoke(app, ["info", str(out), "--json"]).output)
    assert info["kind"] == "torchscript export" and info["parameters"] == report["model"]["parameters"]
    model = load_model(tiny_model_dir)
    specs = graph_specs(model.config)
    manifest = json.loads((out / "graphs.json").read_text())
    for g in GRAPHS:
        module = torch.jit.load(str(out / f"{g}.pt"))
        args = specs[g].dummy_inputs(model.config)
        with torch.no_grad():
            got, want = module(*args), specs[g].wrap(model)(*args)
        want = want if isinstance(want, tuple) else (want,)
        assert isinstance(got, tuple) and len(got) == len(manifest[g]["outputs"]) == len(want)
        assert manifest[g]["inputs"] == list(specs[g].inputs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_cli_tolerance_failure_is_one_line_and_leaves_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "strict"
    result = runner.invoke(app, ["export", str(tiny_model_dir), str(out), "--atol", "1e-12", "--rtol", "0"])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "differs from PyTorch" in lines[0] and "Traceback" not in result.output, result.output
    assert not out.exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("case", ["not_t5", "no_weights", "exists"])
def test_cli_bad_inputs_are_one_line_and_write_nothing(case, tiny_model_dir, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    needle = {"not_t5": "'bert' model", "no_weights": "no model.safetensors", "exists": "already exists"}[case]
    if case == "not_t5":
        (src / "config.json").write_text(json.dumps({"model_type": "bert"}))
    elif case == "no_weights":
        (src / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    else:
        src = tiny_model_dir
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["export", str(src), str(out)])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.output
    if case == "exists":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not _leftovers(tmp_path)


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ConfigError, match="export format 'tflite'.*onnx, torchscript"):
        ExportConfig(format="tflite")
    with pytest.raises(ConfigError, match="^format: .*ONNX exports only"):
        ExportConfig(format="torchscript", merged=True)
    with pytest.raises(ConfigError, match="^opset"):
        ExportConfig(opset=11)
    with pytest.raises(ConfigError, match="^atol"):
        ExportConfig(atol=-1)
    with pytest.raises(ConfigError, match="^rtol"):
        ExportConfig(rtol=float("nan"))


def test_a_real_mismatch_raises_export_error(relu_onnx, tmp_path):
    """Verification is not a formality: the same graphs checked against a different model fail it."""
    from t5compress.export.verify import verify

    out, _ = relu_onnx
    other = load_model(build_tiny_t5(tmp_path / "other", seed=5))
    with pytest.raises(ExportError, match="encoder_model differs from PyTorch"):
        verify(other, open_onnx(out, list(GRAPHS)), ATOL, 8, "ONNX export")


@pytest.mark.slow
def test_flan_t5_small_shape_passes_by_default_where_an_absolute_tolerance_fails(tmp_path):
    """flan-t5-small's shape (random weights): logits ~100 put fp32 rounding above 1e-4 absolute, not relative."""
    from t5compress.export.verify import verify
    from t5compress.model.create import CreateConfig
    from t5compress.model.create import run as create

    src = tmp_path / "flan"
    create(None, CreateConfig(arch="flan-t5-small", tokenizer="byte", overrides={"vocab_size": 32128}), src)
    report = _export(src, tmp_path / "onnx")  # default tolerance
    parity = report["parity"]
    assert parity["generation"]["identical"] and all(w["ratio"] <= 1 for w in parity["worst"].values())
    assert parity["worst"][DECODER]["scale"] > 10  # large logits: the case the relative part exists for
    model = load_model(src)
    graphs = open_onnx(tmp_path / "onnx", list(GRAPHS))
    strict = max(parity["max_abs_diff"].values()) / 2  # an absolute-only tolerance below the real error is refused
    with pytest.raises(ExportError, match=r"differs from PyTorch by .* rtol 0 x max\|ref\|"):
        verify(model, graphs, strict, 4, "ONNX export", rtol=0.0)


def _vocab_matrices(path: Path, vocab: int) -> list[tuple[int, ...]]:
    """Shapes of the (vocab, d) / (d, vocab) initializers of a graph (If branches hoist theirs to the top)."""
    import onnx

    return [tuple(t.dims) for t in onnx.load(str(path)).graph.initializer if vocab in t.dims and len(t.dims) == 2]


def test_tied_embedding_is_stored_once_per_graph(relu_onnx, gated_onnx, tiny_model_dir):
    """Tied (T5 v1.0): embedding lookups (encoder and decoder) and LM head read one (d, vocab) matrix; untied (v1.1)
    keeps both."""
    import onnx

    out, report = relu_onnx
    config = json.loads((tiny_model_dir / "config.json").read_text())
    vocab, d = config["vocab_size"], config["d_model"]
    for g in (DECODER, DECODER_WITH_PAST, DECODER_MERGED):
        assert _vocab_matrices(out / f"{g}.onnx", vocab) == [(d, vocab)], g
    graph = onnx.load(str(out / f"{DECODER}.onnx")).graph
    table = next(t.name for t in graph.initializer if tuple(t.dims) == (d, vocab))
    lookups = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == table]
    assert len(lookups) == 1 and [(a.name, a.i) for a in lookups[0].attribute] == [("axis", 1)]
    assert any(n.op_type == "MatMul" and n.input[1] == table for n in graph.node)
    # the encoder's lookup reads the same (d, vocab) bytes, stored once in the dir (tied.share_with_decoder)
    assert _vocab_matrices(out / f"{ENCODER}.onnx", vocab) == [(d, vocab)]
    assert stored_twice(out) == []
    gated_out, _ = gated_onnx
    assert sorted(_vocab_matrices(gated_out / f"{DECODER}.onnx", vocab)) == [(d, vocab), (vocab, d)]


def _random_feeds(session, sizes: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Feeds for every input of `session`: symbolic dims from `sizes`; ids below 50, masks with their last column
    zero in row 0 (padding), float inputs normal."""
    feeds = {}
    for i in session.get_inputs():
        shape = [sizes[d] if isinstance(d, str) else d for d in i.shape]
        if "mask" in i.name:
            feeds[i.name] = np.ones(shape, np.int64)
            feeds[i.name][0, -1] = 0
        elif i.type == "tensor(int64)":
            feeds[i.name] = rng.integers(3, 50, shape).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def test_graph_passes_are_exact_and_take_the_shape_arithmetic_out(pruned_dir, tmp_path, monkeypatch):
    """`export.simplify` on the tracer's graphs (exported here with it switched off): outputs bit-identical on
    shapes never traced (ONNX Runtime's own optimisations off, so each graph runs as written); in the with-past step
    every layer's Reshape has a constant target and the only Transposes left are the keys' and the position bias's
    (they move more than a length-1 axis)."""
    import onnx
    import onnxruntime as ort

    from t5compress.export import onnx as onnx_export
    from t5compress.export.simplify import simplify

    monkeypatch.setattr(onnx_export, "simplify", lambda proto: {})
    _export(pruned_dir, tmp_path / "raw")
    monkeypatch.undo()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sizes = {"batch_size": 3, "encoder_sequence_length": 7, "decoder_sequence_length": 4,
             "past_decoder_sequence_length": 5}
    counts = {}
    for name in (ENCODER, DECODER, DECODER_WITH_PAST):
        model = onnx.load(str(tmp_path / "raw" / f"{name}.onnx"))
        raw = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        counts[name] = simplify(model)
        new = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        for batch in (1, 3):
            feeds = _random_feeds(raw, {**sizes, "batch_size": batch}, np.random.default_rng(batch))
            for want, got in zip(raw.run(None, feeds), new.run(None, feeds), strict=True):
                np.testing.assert_array_equal(got, want, err_msg=name)
        if name == DECODER_WITH_PAST:
            made = {o for n in model.graph.node for o in n.output}
            assert not [n.name for n in model.graph.node  # in the layers; the mask's and bias's, once per step, stay
                        if n.op_type == "Reshape" and n.input[1] in made and "/block." in n.name]
            perms = [tuple(a.ints) for n in model.graph.node if n.op_type == "Transpose" for a in n.attribute]
            # traced without T5Stack's causal mask (all zeros for one token over a full cache): none of its nodes
            assert not [n.name for n in model.graph.node if n.op_type in ("ScatterND", "Expand", "Greater")]
            # the keys of 3 decoder layers' self- and cross-attention, and the position bias (once per step)
            assert sorted(perms) == [(0, 1, 3, 2)] * 6 + [(2, 0, 1)], perms
    assert counts[DECODER_WITH_PAST]["transposes"] == 3 * 4 + 3 * 2, counts  # q, k, v, out; cross q, out
    assert all(c["reshapes"] > 0 for c in counts.values()), counts
