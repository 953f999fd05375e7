"""IO binding (`runtime.binding.BoundDecoder`): the KV cache kept as OrtValues between steps gives exactly the tokens
and logits of the numpy path, on fp32 and fp16 exports, through beam expansion, reordering and dropped rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ModelError
from t5compress.export import ExportConfig, run
from t5compress.runtime import CachedDecoder, load_runtime
from t5compress.runtime.binding import BEAM_TOP_ONNX, GATHER_ONNX, BoundDecoder

runner = CliRunner()


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def export_dir(request, tiny_gated_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("binding") / request.param
    run(tiny_gated_dir, ExportConfig(dtype=request.param, decoders="both"), out)
    return out


def test_generate_with_io_binding_gives_the_same_tokens(export_dir):
    plain, bound = load_runtime(export_dir), load_runtime(export_dir, io_binding=True)
    ids = np.random.default_rng(1).integers(3, 250, (7, 13))
    for beams in (1, 4):
        for n in (1, 9):
            np.testing.assert_array_equal(bound.generate(ids, max_new_tokens=n, num_beams=beams),
                                          plain.generate(ids, max_new_tokens=n, num_beams=beams))


def test_step_reorder_and_keep_match_the_numpy_cache(export_dir):
    rt = load_runtime(export_dir, io_binding=True)  # the stored with-past graph, which both decoders run
    ids = np.random.default_rng(2).integers(3, 250, (3, 8))
    mask = np.ones_like(ids)
    hidden = rt.backend.encoder.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
    plain = CachedDecoder(rt.backend, hidden, mask, beams=2)
    bound = BoundDecoder(rt.backend, hidden, mask, beams=2, device="cpu")
    tokens = np.zeros(6, dtype=np.int64)
    moves = [("reorder", np.array([1, 1, 2, 3, 5, 4])), ("keep", np.array([0, 2, 3, 5])),
             ("reorder", np.array([1, 0, 2, 2])), ("keep", np.array([3]))]
    for step in range(5):
        np.testing.assert_array_equal(bound.step(tokens), plain.step(tokens))
        if step < len(moves):
            what, rows = moves[step]
            getattr(plain, what)(rows)
            getattr(bound, what)(rows)
            tokens = np.random.default_rng(step).integers(3, 250, rows.shape[0])


def test_beam_search_ranks_on_the_device_and_keeps_the_host_processors(export_dir):
    """The device-side beam step (BEAM_TOP_ONNX) gives the numpy path's tokens with the min-length ban it applies
    itself, and steps back to host scores for the processors it does not (repetition penalty, no-repeat n-grams)."""
    plain, bound = load_runtime(export_dir), load_runtime(export_dir, io_binding=True)
    ids = np.random.default_rng(3).integers(3, 250, (5, 11))
    calls = {"top": 0, "step": 0}
    real_top, real_step = BoundDecoder.step_top, BoundDecoder.step

    def count(name, fn):
        def wrapped(self, *args):
            calls[name] += 1
            return fn(self, *args)
        return wrapped

    settings = ({"min_new_tokens": 6}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2},
                {"length_penalty": 0.5, "num_return_sequences": 2})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BoundDecoder, "step_top", count("top", real_top))
        mp.setattr(BoundDecoder, "step", count("step", real_step))
        for extra in settings:
            calls.update(top=0, step=0)
            kw = dict(max_new_tokens=8, num_beams=3, **extra)
            np.testing.assert_array_equal(bound.generate(ids, **kw), plain.generate(ids, **kw))
            on_host = "repetition_penalty" in extra or "no_repeat_ngram_size" in extra
            # the first step's logits always come to the host; every later one is ranked on the device unless a
            # host-only processor is on
            if on_host:
                assert calls["top"] == 0 and calls["step"] >= 4, (extra, calls)
            else:
                assert calls["step"] == 1 and calls["top"] >= 4, (extra, calls)


def test_beam_top_graph_is_what_onnx_helper_builds():
    import onnx
    from onnx import TensorProto, helper

    def const(name, vals):
        dims = [len(vals)] if isinstance(vals, list) else []
        value = helper.make_tensor(name, TensorProto.INT64, dims, vals if isinstance(vals, list) else [vals])
        return helper.make_node("Constant", [], [name], value=value)

    nodes = [
        const("last_i", -1), const("minus1", [-1]), const("axes2", [2]), const("zero1", [0]), const("one1", [1]),
        helper.make_node("Gather", ["logits", "last_i"], ["last"], axis=1),
        helper.make_node("LogSoftmax", ["last"], ["logp"], axis=-1),
        helper.make_node("Add", ["logp", "bias"], ["biased"]),
        helper.make_node("Shape", ["scores"], ["bs"]),
        helper.make_node("Concat", ["bs", "minus1"], ["s3"], axis=0),
        helper.make_node("Reshape", ["biased", "s3"], ["r3"]),
        helper.make_node("Unsqueeze", ["scores", "axes2"], ["su"]),
        helper.make_node("Add", ["r3", "su"], ["total"]),
        helper.make_node("Slice", ["bs", "zero1", "one1"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1"], ["s2"], axis=0),
        helper.make_node("Reshape", ["total", "s2"], ["flat"]),
        helper.make_node("TopK", ["flat", "k"], ["values", "indices"], axis=-1, largest=1, sorted=1),
    ]
    f, i = TensorProto.FLOAT, TensorProto.INT64
    graph = helper.make_graph(nodes, "beam_top", [
        helper.make_tensor_value_info("logits", f, ["rows", "len", "vocab"]),
        helper.make_tensor_value_info("scores", f, ["batch", "beams"]),
        helper.make_tensor_value_info("bias", f, [1, "vocab"]),
        helper.make_tensor_value_info("k", i, [1])], [
        helper.make_tensor_value_info("values", f, ["batch", "k2"]),
        helper.make_tensor_value_info("indices", i, ["batch", "k2"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="t5compress")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    assert model.SerializeToString() == BEAM_TOP_ONNX


def test_beam_top_ranks_like_the_numpy_search_ties_included():
    import onnxruntime as ort

    from t5compress.runtime.search import log_softmax, topk

    session = ort.InferenceSession(BEAM_TOP_ONNX, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 1, 1000)).astype(np.float32)
    logits[0, 0, :] = 0.0  # a row of ties: lower index first, like topk
    scores, bias = rng.standard_normal((2, 4)).astype(np.float32), np.zeros((1, 1000), np.float32)
    bias[0, 1] = -np.inf
    values, indices = session.run(None, {"logits": logits, "scores": scores, "bias": bias, "k": np.array([8])})
    want = (log_softmax(logits[:, -1]) + bias).reshape(2, 4, 1000) + scores[:, :, None]
    want = want.reshape(2, -1)
    np.testing.assert_array_equal(indices, topk(want, 8))
    np.testing.assert_array_equal(values, np.take_along_axis(want, indices, axis=1))


def test_io_binding_is_on_by_default_where_the_graphs_run_on_cuda(export_dir, monkeypatch):
    from t5compress.runtime import model

    assert load_runtime(export_dir).io_binding is False  # the CPU: numpy cache (as fast, no binding overhead)
    assert load_runtime(export_dir, decoders="merged").io_binding is False
    opened = model.open_on_device
    monkeypatch.setattr(model, "open_on_device", lambda *a, **k: (opened(*a, **k)[0], "cuda:0"))  # as if on a GPU
    # device auto, as a GPU user runs it: the graphs as stored (the CPU's shared-cache rewrite, and its first step on
    # the with-past graph, are for device cpu only)
    assert load_runtime(export_dir, device="auto").io_binding is True
    assert load_runtime(export_dir, device="auto", io_binding=False).io_binding is False
    assert load_runtime(export_dir, device="auto", decoders="merged").io_binding is False  # merged: no binding path


def test_io_binding_needs_the_separate_onnx_decoders(export_dir):
    with pytest.raises(ModelError, match="IO binding runs the separate ONNX decoder graphs"):
        load_runtime(export_dir, decoders="merged", io_binding=True)
    result = runner.invoke(app, ["generate", str(export_dir), "hello", "--io-binding", "--decoders", "merged"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    result = runner.invoke(app, ["generate", str(export_dir), "hello", "--io-binding", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output


def test_gather_graphs_are_what_onnx_helper_builds():
    import onnx
    from onnx import TensorProto, helper

    for name, elem in (("float32", TensorProto.FLOAT), ("float16", TensorProto.FLOAT16)):
        x = helper.make_tensor_value_info("x", elem, ["n", "heads", "len", "d_kv"])
        i = helper.make_tensor_value_info("i", TensorProto.INT64, ["rows"])
        y = helper.make_tensor_value_info("y", elem, ["rows", "heads", "len", "d_kv"])
        graph = helper.make_graph([helper.make_node("Gather", ["x", "i"], ["y"], axis=0)], "gather_rows", [x, i], [y])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="t5compress")
        model.ir_version = 8
        onnx.checker.check_model(model)
        assert model.SerializeToString() == GATHER_ONNX[name]
