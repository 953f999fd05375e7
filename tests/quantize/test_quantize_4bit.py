"""Block-wise 4-bit weights (`quantize --bits 4`): MatMulNBits with bits=4 on a trained model, its size against
block-wise and static int8, the same first tokens as fp32, the packing checked against ONNX Runtime, and the
refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from t5compress.bench.variants import resolve
from t5compress.cli import app
from t5compress.names import GRAPHS, WEIGHTS_FILE
from t5compress.onnxstore import stored_twice
from t5compress.quantize import QuantizeConfig, run
from t5compress.runtime import load_runtime

runner = CliRunner()
# 4-bit / 8-bit block-wise bytes. Weights cost 0.5 + 4 / 64 bytes each against 1 + 4 / 32 (0.5x): the weights file
# (each weight once, onnxstore) within WEIGHTS_SMALLER; the whole dir within SMALLER, as graph structure is a visible
# share of this 1M-parameter model's bytes. Against static int8 (1 byte a weight and a scale per output channel) the
# weights file within STATIC_SMALLER, issue 41's bound: 0.55x here at the default blocks of 64 (0.61x at 32), as the
# t5-small shape's dir (0.556x; 0.617x at 32; docs/quantize.md).
SMALLER, WEIGHTS_SMALLER, STATIC_SMALLER = 0.65, 0.6, 0.6


@pytest.fixture(scope="module")
def four(skilled, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the 8-bit block-wise dir, the 4-bit one written by the CLI, its report) of the trained demo model."""
    root = tmp_path_factory.mktemp("four")
    data = skilled / "data" / "eval.jsonl"
    run(skilled / "onnx", QuantizeConfig(mode="blockwise", eval_data=str(data), eval_max=50), root / "int8",
        progress=False)
    res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(root / "int4"), "--blockwise", "--bits", "4",
                              "--eval-data", str(data), "--eval-max", "50"])
    assert res.exit_code == 0, res.output
    return root / "int8", root / "int4", json.loads((root / "int4" / "report.json").read_text()) | {
        "output": res.output}


def _bytes(d: Path) -> int:
    """The graphs and the weights they point into (`WEIGHTS_FILE`)."""
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file() and f.suffix in (".onnx", ".onnx_data"))


def test_4bit_dir_holds_4bit_matmuls_generates_as_fp32_and_is_smaller_than_int8(four, skilled):
    int8, int4, r = four
    for g in GRAPHS:
        graph = onnx.load(str(int4 / f"{g}.onnx")).graph
        fp32 = onnx.load(str(skilled / "onnx" / f"{g}.onnx")).graph
        weights = {t.name for t in fp32.initializer}
        linear = [n for n in fp32.node if n.op_type == "MatMul" and n.input[1] in weights]
        nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
        # every linear layer 4-bit (a relu model keeps nothing 8-bit), int8 arithmetic, blocks of 64
        assert len(nbits) == len(linear) > 0, g
        for key, want in (("bits", 4), ("accuracy_level", 4), ("block_size", 64)):
            assert {a.i for n in nbits for a in n.attribute if a.name == key} == {want}, (g, key)
        assert not any(n.op_type == "MatMul" and n.input[1] in {t.name for t in graph.initializer}
                       for n in graph.node)
    # the tied table once, in the LM head's 4-bit matrix: the decoders' lookups read it
    for g in GRAPHS[1:]:
        graph = onnx.load(str(int4 / f"{g}.onnx")).graph
        lookup = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
        assert len(lookup) == 1 and lookup[0].input[0] == "/lm_head/nbits_w", g
    assert (r["mode"], r["bits"], r["block_size"]) == ("int4", 4, 64)
    ratio = _bytes(int4) / _bytes(int8)
    assert ratio < SMALLER, ratio
    weights = (int4 / WEIGHTS_FILE).stat().st_size / (int8 / WEIGHTS_FILE).stat().st_size
    assert weights < WEIGHTS_SMALLER, weights  # the encoder's lookup reads the decoders' 4-bit table: stored once
    static = skilled / "int8"  # the demo's int8 stage: static int8
    assert json.loads((static / "report.json").read_text())["mode"] == "static"
    against_static = (int4 / WEIGHTS_FILE).stat().st_size / (static / WEIGHTS_FILE).stat().st_size
    assert against_static < STATIC_SMALLER, against_static
    assert stored_twice(int4) == [] and r["graphs"]["encoder_lookup_bytes_saved"] > 0
    texts = [json.loads(line)["source"] for line in (skilled / "data" / "eval.jsonl").read_text().splitlines()[:8]]
    fp32, q4 = load_runtime(skilled / "onnx"), load_runtime(int4)
    ids, mask = fp32.encode(texts)
    a = fp32.generate(ids, mask, max_new_tokens=4, num_beams=1)
    b = q4.generate(ids, mask, max_new_tokens=4, num_beams=1)
    assert np.array_equal(a[:, :3], b[:, :3]), (a, b)  # the first two generated tokens of every text
    assert r["check"]["next_token_agreement"] >= 0.9 and r["check"]["on"] == "eval texts"
    assert "4-bit block-wise, blocks of 64" in r["output"] and "4-bit export →" in r["output"]
    # bench names it for what it is (not "int8") and compares it with the int8 peers
    v = resolve(str(int4))
    assert (v.precision, v.label, v.owner) == ("int4", "ONNX int4 (4-bit weights)", "ours")


def test_4bit_packing_computes_the_rounded_weights_in_onnx_runtime():
    """Two weights a byte, each + 8, the even input channel in the low nibble: MatMulNBits (fp32 arithmetic) and
    GatherBlockQuantized give back exactly the rounded weights times their blocks' scales."""
    from t5compress.quantize.methods import nearest_blocks
    from t5compress.quantize.nbits import pack_blocks4

    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    for block in (32, 64):  # 96 = three blocks of 32, or one and a half of 64 (the last one padded)
        q, scales = nearest_blocks(w, block, 7)
        assert np.abs(q).max() == 7 and scales.shape == (-(-96 // block), 40)
        deq = q * np.repeat(scales, block, axis=0)[:96]
        packed, flat = pack_blocks4(q, scales, block)
        assert packed.shape == (40, -(-96 // block), block // 2) and packed.dtype == np.uint8
        node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=96, N=40, bits=4,
                                block_size=block, accuracy_level=0)
        x = rng.standard_normal((5, 96)).astype(np.float32)
        y = _run(node, {"b": packed, "s": flat}, "x", x, TensorProto.FLOAT)
        np.testing.assert_allclose(y, x @ deq, rtol=1e-4, atol=1e-3)
        if 96 % block == 0:  # GatherBlockQuantized takes whole blocks only
            ids = np.array([[3, 0, 39]], np.int64)
            node = helper.make_node("GatherBlockQuantized", ["b", "ids", "s"], ["y"], domain="com.microsoft",
                                    gather_axis=0, quantize_axis=2, block_size=block, bits=4)
            rows = _run(node, {"b": packed, "s": flat.reshape(40, -1, 1)}, "ids", ids, TensorProto.INT64)
            np.testing.assert_array_equal(rows.reshape(1, 3, 96), deq.T[ids])


def _run(node, inits: dict, name: str, value: np.ndarray, kind: int) -> np.ndarray:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(name, kind, list(value.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {name: value})[0]


def test_4bit_plan_blocks_of_64_and_what_a_gated_model_keeps_8bit():
    from t5compress.quantize.modes import method_for

    def plan(gated: bool, **kw):
        cfg = QuantizeConfig(mode="int4", **kw)
        return method_for(cfg.mode).resolve(cfg, gated, not gated, False)

    relu, gated, rounded = plan(False), plan(True), plan(True, calib_data="x.txt")
    assert (relu.bits, relu.block_size, relu.weight_max, relu.keep_8bit, relu.rounding) == (4, 64, 7, "", "")
    assert gated.keep_8bit == "lm_head,DenseReluDense/wo/"  # rounded to nearest, the LM head breaks at 4 bits
    assert (rounded.keep_8bit, rounded.rounding, rounded.block_size) == ("DenseReluDense/wo/", "gptq", 64)
    assert plan(True, keep_8bit="none").keep_8bit == "" and plan(False, block_size=32).block_size == 32
    assert "4-bit weights, 8-bit: lm_head,DenseReluDense/wo/" in gated.describe()


def test_bits_other_than_4_or_8_is_one_line_and_exit_2(skilled, tmp_path):
    for args in (["--bits", "3"], ["--bits", "4", "--dynamic"]):
        res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(tmp_path / "x"), *args])
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
        assert "--bits" in res.output and not (tmp_path / "x").exists()


def test_a_4bit_result_that_breaks_the_model_is_refused(gated_export, tmp_path):
    """A random d_model-32 gated model has one block per row (of 64, half of it padding) and near-tied logits: 4-bit
    weights pick fp32's next token at about 40% of the positions (36% at blocks of 32), and nothing is written."""
    res = runner.invoke(app, ["--progress", "off", "quantize", str(gated_export), str(tmp_path / "q"), "--bits", "4"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output  # the check's progress off
    assert "4-bit picks fp32's next token at" in res.output and "below --min-agreement 0.9" in res.output
    assert "--keep-8bit" in res.output and not (tmp_path / "q").exists()
