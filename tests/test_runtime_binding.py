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
from t5compress.runtime.binding import GATHER_ONNX, BoundDecoder

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
    rt = load_runtime(export_dir)
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
