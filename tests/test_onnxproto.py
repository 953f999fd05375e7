"""`onnxproto`: the messages and helpers the runtime rewrites graphs with, without importing onnx, match onnx's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.utils import Extractor

from t5compress import onnxproto


def test_the_messages_are_onnx_own_classes():
    code = ("import sys\nfrom t5compress import onnxproto\nm = onnxproto.messages()\n"
            "assert 'onnx' not in sys.modules\nimport onnx\n"
            "assert m.ModelProto is onnx.ModelProto and m.TensorProto is onnx.TensorProto\nprint('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_nodes_tensors_and_value_infos_serialise_as_onnx_helpers_make_them():
    for op, ins, outs, kw in [("Shape", ["x"], ["y"], dict(start=0, end=1)), ("Cast", ["a"], ["b"], dict(to=7)),
                              ("Transpose", ["q"], ["t"], dict(perm=[0, 2, 1, 3])),
                              ("DecoderMaskedMultiHeadAttention", ["q", "", "k"], ["o"],
                               dict(name="n", domain="com.microsoft", num_heads=8, scale=1.0, tag="s"))]:
        assert (onnxproto.make_node(op, ins, outs, **kw).SerializeToString()
                == helper.make_node(op, ins, outs, **kw).SerializeToString()), op
    for a in (np.arange(3, dtype=np.int64), np.ones((2, 3), np.float32) * 0.5, np.arange(-4, 4, dtype=np.int8),
              np.array([1.5, -2], np.float16), np.array(3, np.int32)):
        ours = onnxproto.from_array(a, "t")
        assert ours.SerializeToString() == numpy_helper.from_array(a, "t").SerializeToString()
        np.testing.assert_array_equal(onnxproto.to_array(ours), a)
        assert onnxproto.to_array(ours).dtype == a.dtype
        assert onnxproto.tensor_type(a.dtype) == helper.np_dtype_to_tensor_dtype(a.dtype)
    typed = [helper.make_tensor("i", onnx.TensorProto.INT64, [2], [5, -6]),
             helper.make_tensor("f", onnx.TensorProto.FLOAT, [2, 1], [0.25, 3.0]),
             helper.make_tensor("h", onnx.TensorProto.FLOAT16, [2], np.array([1.5, -2], np.float16)),
             helper.make_tensor("b", onnx.TensorProto.BOOL, [3], [True, False, True]),
             helper.make_tensor("s", onnx.TensorProto.STRING, [1], [b"x"])]  # numpy_helper's, through the fallback
    for t in typed:
        np.testing.assert_array_equal(onnxproto.to_array(t), numpy_helper.to_array(t), err_msg=t.name)
    shape = [1, "batch", 8]
    assert (onnxproto.make_value_info("v", 6, shape).SerializeToString()
            == helper.make_tensor_value_info("v", onnx.TensorProto.INT32, shape).SerializeToString())


def test_extract_cuts_what_onnx_extractor_cuts(tiny_export):
    model = onnx.load(str(tiny_export / "decoder_model.onnx"), load_external_data=False)
    cross = [o.name for o in model.graph.output if ".encoder." in o.name]
    ours = onnxproto.extract(model, ["encoder_hidden_states"], cross)
    theirs = Extractor(model).extract_model(["encoder_hidden_states"], cross)
    assert len(ours.graph.node) == len(theirs.graph.node) > 0 and len(ours.graph.node) < len(model.graph.node)
    for field in ("node", "input", "output", "initializer"):
        assert ([x.SerializeToString() for x in getattr(ours.graph, field)]
                == [x.SerializeToString() for x in getattr(theirs.graph, field)]), field
    assert list(ours.opset_import) == list(theirs.opset_import) and ours.ir_version == theirs.ir_version
