"""Quantization-aware training: fake-quant math, the qat stage, and int8 Q/DQ ONNX export of a QAT dir."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

from t5compress.data import DataConfig
from t5compress.errors import ExportError, ModelError
from t5compress.export import stage as export
from t5compress.model.load import load_model
from t5compress.names import WEIGHTS_FILE
from t5compress.onnxstore import stored_twice, weight_bytes
from t5compress.qat import fakequant as fq
from t5compress.qat import stage as qat
from t5compress.qat.scheme import FakeQuantConfig
from t5compress.train.loop import TrainConfig
from t5compress.train.stage import FinetuneConfig

# Int8 graphs vs the fake-quant model they were written from: same integers and scales, only float order differs.
RTOL = 1e-3  # of the logits' (encoder: hidden states') max |value|; the stage's default refusal threshold is 0.1


def _cfg(data, **train) -> qat.QatConfig:
    base = dict(max_steps=6, batch_size=16, lr=1e-3, eval_every=0, save_every=3, eval_max_examples=12,
                eval_max_new_tokens=8, metric="loss")
    base.update(train)
    return qat.QatConfig(FinetuneConfig(train_data=str(data), data=DataConfig(max_target_length=48),
                                        train=TrainConfig(**base)), FakeQuantConfig(calib_batches=4))


@pytest.fixture(scope="module")
def qat_run(tiny_model_dir, demo_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("qat") / "qat"
    return out, qat.run(str(tiny_model_dir), _cfg(demo_jsonl), out, progress=False)


def test_fake_quant_matches_a_hand_computation():
    # Activations: uint8, zero point 128, scale 0.1; ONNX rounding (half to even) and saturation.
    x = torch.tensor([0.26, -0.05, 13.0, -20.0, 0.15], requires_grad=True)
    y = fq.fake_quant_act(x, torch.tensor(0.1), torch.tensor(128.0))
    assert torch.allclose(y, torch.tensor([0.3, 0.0, 12.7, -12.8, 0.2]), atol=1e-6)
    y.sum().backward()  # straight-through inside the range, no gradient where clipped
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    unsigned = fq.fake_quant_act(torch.tensor([0.26, -0.05, 30.0]), torch.tensor(0.1), torch.tensor(0.0))
    assert torch.allclose(unsigned, torch.tensor([0.3, 0.0, 25.5]), atol=1e-6)
    # Weights: per output row, scale max|row| / 127.
    w = torch.tensor([[0.5, -1.27, 0.013], [2.54, 0.3, -0.71]])
    q, s = fq.quantize_weight(w)
    assert torch.allclose(s, torch.tensor([0.01, 0.02])) and q.dtype == torch.int8
    assert q.tolist() == [[50, -127, 1], [127, 15, -36]]  # -0.71 / 0.02 = -35.5 -> -36 (half to even)
    assert torch.allclose(fq.fake_quant_weight(w), q.float() * s[:, None])
    # LSQ: the learned scale gets a gradient; the layer still exposes the original Parameter as .weight.
    lin = nn.Linear(3, 2, bias=False)
    lin.weight.data.copy_(w)
    act = fq.ActQuant("lsq")
    act.zero_point.fill_(128.0)
    act.set_scale(0.1)
    layer = fq.QuantLinear.wrap(lin, act)
    assert layer.weight is lin.weight
    inp = torch.tensor([[0.26, -0.04, 13.0]])
    out = layer(inp)
    want = torch.tensor([[0.3, 0.0, 12.7]]) @ (q.float() * s[:, None]).T
    assert torch.allclose(out, want, atol=1e-6)
    out.sum().backward()
    assert act.log_scale.grad is not None and act.log_scale.grad.abs() > 0


def test_prepare_groups_layers_keeps_gated_wo_and_strip_restores(tiny_model_dir, tiny_gated_dir):
    gated = fq.prepare(load_model(tiny_gated_dir), FakeQuantConfig())
    ffn = gated.decoder.block[0].layer[2].DenseReluDense
    assert type(ffn.wo) is nn.Linear and isinstance(ffn.wi_0, fq.QuantLinear)
    assert ffn.wi_0.act is ffn.wi_1.act  # same input tensor, one quantizer
    attn = gated.decoder.block[0].layer[0].SelfAttention
    assert attn.q.act is attn.k.act is attn.v.act and attn.o.act is not attn.q.act
    cross = gated.decoder.block[0].layer[1].EncDecAttention
    assert cross.k.act is cross.v.act and cross.q.act is not cross.k.act
    assert isinstance(gated.lm_head, fq.QuantLinear) and isinstance(gated.encoder.embed_tokens, fq.QuantEmbedding)
    assert fq.kept_fp32(gated) == [f"{s}.block.{i}.layer.{j}.DenseReluDense.wo"
                                   for s, j in (("decoder", 2), ("encoder", 1)) for i in range(2)]
    relu = load_model(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 1]])
    with torch.no_grad():
        before = relu(input_ids=ids, decoder_input_ids=ids).logits
        fq.prepare(relu, FakeQuantConfig())
        assert fq.kept_fp32(relu) == [] and relu.lm_head.weight is relu.shared.weight  # tied stays tied
        quantized = relu(input_ids=ids, decoder_input_ids=ids).logits
        fq.strip(relu)
        after = relu(input_ids=ids, decoder_input_ids=ids).logits
    assert not any(isinstance(m, fq.QuantLinear | fq.QuantEmbedding) for m in relu.modules())
    assert torch.equal(before, after) and not torch.equal(before, quantized)
    with pytest.raises(Exception, match="unknown activation scale mode 'minmax'; choose one of: ema, lsq"):
        FakeQuantConfig(act_scale="minmax")


def test_qat_keeps_the_metric_and_the_dir_loads_as_plain_fp32(qat_run):
    out, report = qat_run
    m = report["metrics"]
    # Calibrated int8 starts within 2% of fp32; QAT training then lowers the fake-quant loss below the fp32 start.
    assert m["int8_calibrated"]["loss"] <= 1.02 * m["fp32_start"]["loss"]
    assert m["int8_qat"]["loss"] < m["fp32_start"]["loss"]
    assert report["sizes"]["ratio"] < 0.3 and report["scales"]["quantized_linear"] == 33
    from transformers import T5ForConditionalGeneration

    plain = T5ForConditionalGeneration.from_pretrained(out)  # no t5compress code, no quantization keys
    assert set(load_file(str(out / "model.safetensors"))) <= set(plain.state_dict())
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    info = json.loads((out / "quantization.json").read_text())
    scales = load_file(str(out / "quantization.safetensors"))
    assert info["format"] == fq.FORMAT and len(info["layers"]) == 34
    reloaded = fq.load_fake_quant(out, load_model(out))
    attn = reloaded.encoder.block[0].layer[0].SelfAttention
    saved = scales["encoder.block.0.layer.0.SelfAttention.q.act_scale"]
    assert float(attn.q.act.scale().detach()) == pytest.approx(float(saved))
    assert not (out.parent / "qat.partial").exists()
    from t5compress.describe import qat as described

    rows = dict(described(report))  # what `t5compress info` and the CLI show: fp32 and int8 before and after QAT
    assert f"loss {m['int8_qat']['loss']}" in rows["int8 fake-quant, after QAT"]
    assert f"loss {m['fp32_start']['loss']}" in rows["fp32 (start)"]


def test_export_of_a_qat_dir_writes_int8_qdq_graphs_that_ort_runs_with_int8_kernels(qat_run, tiny_export, tmp_path):
    out, _ = qat_run
    fp32 = json.loads((tiny_export / "report.json").read_text())  # the fp32 export of the model QAT started from
    report = export.run(str(out), export.ExportConfig(), tmp_path / "int8")
    for name in ("encoder_model", "decoder_model", "decoder_with_past_model"):
        proto = onnx.load(str(tmp_path / "int8" / f"{name}.onnx"))
        ops = [n.op_type for n in proto.graph.node]
        int8 = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2]
        rewritten = report["int8"]["rewritten"][name]
        assert ops.count("QuantizeLinear") == rewritten["activation_qdq"] > 0
        assert len(int8) == rewritten["matmul_int8"] + rewritten["gather_int8"]  # every weight matrix int8
        kernels = report["int8"]["ort_kernels"][name]
        assert kernels.get("MatMulIntegerToFloat", 0) + kernels.get("QLinearMatMul", 0) == rewritten["matmul_int8"]
        # The weights each graph names (in weights.onnx_data; the .onnx files hold structure, which Q/DQ makes larger).
        # Tiny model: 4-byte per-channel scales weigh 1/8 of a 32-wide int8 row, and the fp32 decoders store the tied
        # embedding once where the int8 ones keep a lookup table beside the LM head (measured 0.26-0.36x).
        int8_bytes, fp32_bytes = (weight_bytes(d / f"{name}.onnx") for d in (tmp_path / "int8", tiny_export))
        assert int8_bytes < 0.5 * fp32_bytes, name
    assert report["files"][WEIGHTS_FILE] < 0.5 * fp32["files"][WEIGHTS_FILE]  # each stored once, in both dirs
    assert stored_twice(tmp_path / "int8") == []
    parity = report["parity"]
    assert max(parity["max_rel_diff"].values()) <= RTOL
    assert parity["token_agreement"]["agreement"] == 1.0


def test_a_broken_int8_graph_is_refused(qat_run, tmp_path, monkeypatch):
    out, _ = qat_run
    real = fq.quantize_weight
    monkeypatch.setattr(fq, "quantize_weight", lambda w, m: (real(w, m)[0], 1.5 * real(w, m)[1]))  # wrong scales
    refused = "differs from the fake-quantized PyTorch model by .* nothing was written"
    with pytest.raises(ExportError, match=refused) as e:
        export.run(str(out), export.ExportConfig(), tmp_path / "broken")
    assert float(str(e.value).split(" by ")[1].split(" ")[0]) > 0.3  # far from the default threshold (0.1)
    assert not (tmp_path / "broken").exists()


def test_qat_refuses_a_non_t5_dir_and_writes_nothing(tmp_path, demo_jsonl):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelError, match="holds a 'bert' model"):
        qat.run(str(tmp_path / "bert"), _cfg(demo_jsonl), tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


class _Killed(Exception):
    pass


@pytest.mark.slow
def test_qat_resumes_after_a_kill_and_ends_where_a_clean_run_ends(qat_run, tiny_model_dir, demo_jsonl, tmp_path):
    clean, _ = qat_run
    out = tmp_path / "qat"

    def kill(state):
        if state["step"] == 3:  # after the step-3 checkpoint is written
            raise _Killed()

    with pytest.raises(_Killed):
        qat.run(str(tiny_model_dir), _cfg(demo_jsonl), out, progress=False, on_step=kill)
    assert not out.exists() and (tmp_path / "qat.partial").is_dir()
    report = qat.run(str(tiny_model_dir), _cfg(demo_jsonl), out, resume=True, progress=False)
    assert report["train"]["resumed_from_step"] == 3 and report["train"]["steps"] == 6
    for name in ("model.safetensors", "quantization.safetensors"):
        got, want = load_file(str(out / name)), load_file(str(clean / name))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name


@pytest.mark.slow
def test_cli_qat_then_export_happy_path_and_bad_input(tiny_gated_dir, demo_jsonl, tmp_path):
    from t5compress.cli.app import app

    runner = CliRunner()
    out = tmp_path / "q"
    r = runner.invoke(app, ["qat", str(tiny_gated_dir), str(demo_jsonl), str(out), "--max-steps", "4",
                            "--eval-every", "0", "--eval-max-examples", "8", "--act-scale", "ema",
                            "--calib-batches", "2"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # rich wraps at the runner's terminal width
    assert "int8 fake-quant, after QAT" in text and "kept fp32: decoder.block.0.layer.2.DenseReluDense.wo" in text
    assert json.loads((out / "t5compress.json").read_text())["config"]["quant"]["act_scale"] == "ema"
    r = runner.invoke(app, ["export", str(out), str(tmp_path / "x"), "--onnx", "--merged", "--optimize"])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "x" / "report.json").read_text())
    assert "decoder_model_merged" in report["parity"]["max_rel_diff"] and "parity_unoptimized" in report
    assert max(report["parity"]["max_rel_diff"].values()) <= RTOL
    text = " ".join(r.output.split())
    assert "int8 Q/DQ ONNX graphs" in text and "greedy token agreement 100.0%" in text
    r = runner.invoke(app, ["qat", str(tiny_gated_dir), str(demo_jsonl), str(tmp_path / "bad"), "--keep-wo", "maybe"])
    assert r.exit_code == 2 and "keep_wo: choose one of auto, yes, no" in " ".join(r.output.split())
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()
    np.testing.assert_equal(sorted(p.name for p in tmp_path.iterdir()), ["q", "x"])


def test_a_qat_dir_exports_its_int8_graphs_with_the_search_graph(qat_run, tmp_path):
    """The in-graph search over Q/DQ graphs: both decoders carry the same learned scales, so greedy search through
    generator.onnx gives the Python search's tokens (the export checks every row, strictly)."""
    from t5compress.runtime import load_runtime

    out, _ = qat_run
    report = export.run(str(out), export.ExportConfig(search_graph=True), tmp_path / "int8")
    check = report["search_graph"]
    assert check["greedy"]["identical_rows"] == check["rows"]
    texts = ["sort words: tree moon apple", "spell sorted: 5031"]
    graph = load_runtime(tmp_path / "int8", search="graph").generate_text(texts, max_new_tokens=8)
    assert graph == load_runtime(tmp_path / "int8").generate_text(texts, max_new_tokens=8)
