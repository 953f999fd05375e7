"""The engines `generate_speed.py` compares: a registry of how each one is prepared (once per shape) and loaded.

Every engine gets the same random-weight model: PyTorch and the converters read the model dir, the ONNX engines
the export dir that `t5compress export --onnx` wrote. A runner is `fn(ids, mask, new_tokens, beams) -> n`, where n
is the fewest new tokens any output row got (the benchmark forces exactly `new_tokens`; fewer is reported as short).
An engine whose packages are missing, or whose preparation fails, is skipped with its reason printed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GRAPHS = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")
WEIGHT_SUFFIXES = (".onnx", ".onnx_data", ".bin", ".xml", ".safetensors")
Runner = Callable[[np.ndarray, np.ndarray, int, int], int]


class Skip(Exception):
    """An engine that cannot run here; the message says why (printed, and written into the results)."""


@dataclass
class Shape:
    """One architecture: its model dir, fp32 export dir, calibration texts and a cache of prepared artifacts."""

    arch: str
    model_dir: Path
    export_dir: Path
    work: Path
    calib: Path
    samples: int
    prepared: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class Engine:
    name: str
    precision: str  # fp32 | int8
    owner: str  # baseline (PyTorch), ours, peer
    needs: tuple[str, ...]  # importable modules
    prepare: Callable[[Shape], Path]  # -> dir holding what this engine loads (its size is the engine's size)
    load: Callable[[Path, Shape, int], Runner]
    files: tuple[str, ...] = ()  # the files counted as its size (default: every weight file in the dir)

    def missing(self) -> list[str]:
        """'module (why)' for each needed module that does not import here."""
        return [f"{m} ({why})" for m in self.needs if (why := _import_error(m))]


def _import_error(module: str) -> str:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return "not installed"
    try:
        importlib.import_module(module)
        return ""
    except Exception as e:  # a package that is installed but broken is as missing as one that is not
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def size_bytes(path: Path, files: tuple[str, ...] = ()) -> int:
    """Bytes on disk of the model files an engine loads (tokenizer files and reports not counted)."""
    if files:
        return sum((path / f).stat().st_size for f in files if (path / f).is_file()) + sum(
            p.stat().st_size for f in files for p in path.glob(f"{Path(f).stem}*.onnx_data"))
    return sum(p.stat().st_size for p in path.rglob("*")
               if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and "tokenizer" not in p.name)


# ---------------------------------------------------------------- PyTorch and the Hugging Face style `generate`s
def hf_runner(model, extra: dict | None = None) -> Runner:
    import torch

    def run(ids, mask, n, beams):
        with torch.inference_mode():
            out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 max_new_tokens=n, min_new_tokens=n, num_beams=beams, do_sample=False,
                                 **(extra or {}))
        return int(out.shape[-1]) - 1  # the decoder start token comes first
    return run


def load_pytorch(path: Path, shape: Shape, threads: int) -> Runner:
    import torch
    from transformers import T5ForConditionalGeneration

    from t5compress.evaluation import generate_kwargs

    torch.set_num_threads(threads)
    model = T5ForConditionalGeneration.from_pretrained(path).eval()
    return hf_runner(model, generate_kwargs(model))  # dynamic_full cache: el2's decoder depth differs


# ---------------------------------------------------------------- ours
def load_ours(path: Path, shape: Shape, threads: int) -> Runner:
    from t5compress.runtime import load_runtime

    rt = load_runtime(path, threads=threads)

    def run(ids, mask, n, beams):
        return int(rt.generate(ids, mask, max_new_tokens=n, min_new_tokens=n, num_beams=beams).shape[-1]) - 1
    return run


def prepare_merged(shape: Shape) -> Path:
    """`t5compress export --onnx --decoders merged`: the encoder and one merged decoder (decoder weights once)."""
    out = shape.work / "ours-fp32-merged"
    cli = [sys.executable, "-m", "t5compress.cli", "export", str(shape.model_dir), str(out), "--onnx",
           "--decoders", "merged", "--force"]
    subprocess.run(cli, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return out


def prepare_quantized(mode: str) -> Callable[[Shape], Path]:
    def prepare(shape: Shape) -> Path:
        from t5compress.quantize import stage

        out = shape.work / f"ours-int8-{mode}"
        cfg = stage.QuantizeConfig(mode=mode, calib_data=str(shape.calib) if mode == "static" else None,
                                   samples=shape.samples, min_agreement=0.0)  # random weights: agreement is noise
        report = stage.run(shape.export_dir, cfg, out, force=True, progress=False)
        print(f"  ours int8 {mode}: {report['size']['ratio']:.3f}× the fp32 bytes, next-token agreement "
              f"{report['check'].get('next_token_agreement', float('nan')):.2f} (random weights)", flush=True)
        return out
    return prepare


def prepare_qat(shape: Shape) -> Path:
    """A few QAT steps on the calibration texts (copy task), then `t5compress export --onnx` of the QAT dir."""
    from t5compress.quantize import qat, scheme
    from t5compress.trainer import TrainConfig
    from t5compress.training import FinetuneConfig

    data = shape.work / "qat-train.jsonl"
    texts = shape.calib.read_text().splitlines()
    data.write_text("".join(json.dumps({"source": t, "target": t[:40]}) + "\n" for t in texts))
    train = TrainConfig(max_steps=2, batch_size=4, lr=1e-5, eval_every=0, eval_max_examples=4, eval_max_new_tokens=4)
    cfg = qat.QatConfig(FinetuneConfig(train_data=str(data), train=train), scheme.FakeQuantConfig(calib_batches=1))
    qat_dir, out = shape.work / "qat", shape.work / "ours-int8-qat"
    qat.run(str(shape.model_dir), cfg, qat_dir, force=True, progress=False)
    subprocess.run([sys.executable, "-m", "t5compress.cli", "export", str(qat_dir), str(out), "--onnx", "--force"],
                   check=True, stdout=subprocess.DEVNULL)
    return out


# ---------------------------------------------------------------- optimum (ONNX Runtime)
def load_optimum(path: Path, shape: Shape, threads: int) -> Runner:
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # fair: the setting ours uses
    model = ORTModelForSeq2SeqLM.from_pretrained(path, use_merged=False, use_cache=True, session_options=so)
    return hf_runner(model)


def prepare_optimum_int8(shape: Shape) -> Path:
    """optimum's own dynamic int8 of each graph (ORTQuantizer + AutoQuantizationConfig, its documented defaults)."""
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    vnni = "avx512_vnni" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    qc = (AutoQuantizationConfig.avx512_vnni if vnni else AutoQuantizationConfig.avx2)(is_static=False)
    out = shape.work / "optimum-int8"
    shutil.rmtree(out, ignore_errors=True)
    scratch = shape.work / "optimum-int8.tmp"
    for f in GRAPHS:
        ORTQuantizer.from_pretrained(shape.export_dir, file_name=f).quantize(save_dir=scratch, quantization_config=qc)
    out.mkdir()
    for f in shape.export_dir.iterdir():  # config, generation config, tokenizer
        if f.is_file() and not f.name.endswith((".onnx", ".onnx_data")):
            shutil.copy2(f, out / f.name)
    for f in GRAPHS:
        (scratch / f.replace(".onnx", "_quantized.onnx")).rename(out / f)
    shutil.rmtree(scratch)
    return out


# ---------------------------------------------------------------- CTranslate2
def prepare_ct2(shape: Shape) -> Path:
    import ctranslate2

    out = shape.work / "ct2-int8"
    ctranslate2.converters.TransformersConverter(str(shape.model_dir)).convert(str(out), quantization="int8",
                                                                                force=True)
    return out


def load_ct2(path: Path, shape: Shape, threads: int) -> Runner:
    import ctranslate2

    tr = ctranslate2.Translator(str(path), device="cpu", compute_type="int8", inter_threads=1, intra_threads=threads)
    vocab = _ct2_vocab(path)

    def run(ids, mask, n, beams):
        tokens = [[vocab[i] for i in row[m.astype(bool)].tolist()] for row, m in zip(ids, mask, strict=True)]
        res = tr.translate_batch(tokens, beam_size=beams, num_hypotheses=1, max_decoding_length=n,
                                 min_decoding_length=n, max_batch_size=0)
        return min(len(r.hypotheses[0]) for r in res)
    return run


def _ct2_vocab(path: Path) -> list[str]:
    for name in ("shared_vocabulary.json", "source_vocabulary.json"):
        if (path / name).is_file():
            return json.loads((path / name).read_text())
    for name in ("shared_vocabulary.txt", "source_vocabulary.txt"):
        if (path / name).is_file():
            return (path / name).read_text(encoding="utf-8").split("\n")
    raise Skip(f"no vocabulary file in {path}")


# ---------------------------------------------------------------- OpenVINO (optimum-intel)
def prepare_openvino(int8: bool) -> Callable[[Shape], Path]:
    def prepare(shape: Shape) -> Path:
        from optimum.intel import OVModelForSeq2SeqLM

        out = shape.work / ("openvino-int8" if int8 else "openvino-fp32")
        model = OVModelForSeq2SeqLM.from_pretrained(shape.model_dir, export=True, compile=False, load_in_8bit=int8)
        model.save_pretrained(out)
        return out
    return prepare


def load_openvino(path: Path, shape: Shape, threads: int) -> Runner:
    from optimum.intel import OVModelForSeq2SeqLM

    ov_config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": ""}
    return hf_runner(OVModelForSeq2SeqLM.from_pretrained(path, ov_config=ov_config))


def _same(subdir: str) -> Callable[[Shape], Path]:
    return lambda shape: shape.model_dir if subdir == "model" else shape.export_dir


ENGINES: dict[str, Engine] = {e.name: e for e in [
    Engine("pytorch fp32", "fp32", "baseline", ("torch", "transformers"), _same("model"), load_pytorch,
           ("model.safetensors",)),
    Engine("t5compress fp32", "fp32", "ours", ("onnxruntime",), _same("export"), load_ours, GRAPHS),
    Engine("t5compress fp32 merged", "fp32", "ours", ("onnxruntime",), prepare_merged, load_ours,
           ("encoder_model.onnx", "decoder_model_merged.onnx")),
    Engine("t5compress int8 static", "int8", "ours", ("onnxruntime",), prepare_quantized("static"), load_ours,
           GRAPHS),
    Engine("t5compress int8 dynamic", "int8", "ours", ("onnxruntime",), prepare_quantized("dynamic"), load_ours,
           GRAPHS),
    Engine("t5compress int8 qat", "int8", "ours", ("torch", "t5compress.quantize.qat"), prepare_qat, load_ours,
           GRAPHS),
    Engine("optimum ort fp32", "fp32", "peer", ("optimum.onnxruntime",), _same("export"), load_optimum, GRAPHS),
    Engine("optimum ort int8 dynamic", "int8", "peer", ("optimum.onnxruntime",), prepare_optimum_int8,
           load_optimum, GRAPHS),
    Engine("ctranslate2 int8", "int8", "peer", ("ctranslate2", "transformers"), prepare_ct2, load_ct2),
    Engine("openvino fp32", "fp32", "peer", ("optimum.intel.openvino",), prepare_openvino(False), load_openvino),
    Engine("openvino int8 weights", "int8", "peer", ("optimum.intel.openvino", "nncf"), prepare_openvino(True),
           load_openvino),
]}
