"""The peers: the tools a user would pick instead, prepared once from the first PyTorch variant into OUT/peers/.

Each peer is prepared the way that tool's documentation says (optimum's own ONNX exporter and its `ORTQuantizer`
dynamic int8 preset for this CPU, CTranslate2's `TransformersConverter` with int8, optimum-intel's OpenVINO export,
fp32 and 8-bit weights), inside a worker process (`python -m t5compress.bench.worker prepare ...`), so a peer whose
packages live in another venv runs under that venv's interpreter. `settings` records what the peer runs with.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from t5compress.bench.config import PEERS


@dataclass(frozen=True)
class Peer:
    name: str
    kind: str  # the engine that runs it (bench.engines.LOADERS)
    precision: str
    label: str
    needs: tuple[str, ...]  # modules that must import where it runs
    prepare: Callable[[Path, Path], dict]  # (model_dir, out) -> {"files": [...], "settings": {...}, "note": ...}
    settings: dict = field(default_factory=dict)


def _weights(out: Path, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.is_file() and p.name.endswith(suffixes))


def prepare_optimum_fp32(model_dir: Path, out: Path) -> dict:
    """optimum's own exporter (`export=True`); our export (optimum's file and tensor names) when it fails."""
    note = "exported by optimum (ORTModelForSeq2SeqLM.from_pretrained(export=True))"
    try:
        from optimum.onnxruntime import ORTModelForSeq2SeqLM

        ORTModelForSeq2SeqLM.from_pretrained(model_dir, export=True, use_merged=False, use_cache=True
                                             ).save_pretrained(out)
    except Exception as e:  # noqa: BLE001 -- e.g. optimum's merged/cache assumptions on some shapes
        from t5compress.errors import first_line
        from t5compress.export import ExportConfig
        from t5compress.export import run as export

        shutil.rmtree(out, ignore_errors=True)
        export(model_dir, ExportConfig(), out)
        note = f"optimum's exporter failed ({type(e).__name__}: {first_line(e)[:100]}); t5compress export used"
    from t5compress.bench.variants import onnx_files

    return {"files": onnx_files(out, ["encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"]),
            "note": note}


def prepare_optimum_int8(model_dir: Path, out: Path) -> dict:
    """optimum's dynamic int8 of each graph (ORTQuantizer + AutoQuantizationConfig, the preset for this CPU)."""
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    from t5compress.cpu import cpu_features

    fp32 = out.parent / "optimum-fp32"
    if not fp32.is_dir():
        prepare_optimum_fp32(model_dir, fp32)
    feats = cpu_features()
    preset = "arm64" if feats["arch"] == "arm64" else ("avx512_vnni" if feats.get("avx512_vnni") else
                                                      ("avx512" if feats.get("avx512f") else "avx2"))
    qc = getattr(AutoQuantizationConfig, preset)(is_static=False)
    scratch = out.with_name(out.name + ".tmp")
    graphs = ["encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"]
    for g in graphs:
        ORTQuantizer.from_pretrained(fp32, file_name=g).quantize(save_dir=scratch, quantization_config=qc)
    out.mkdir(parents=True, exist_ok=True)
    for f in fp32.iterdir():  # config, generation config
        if f.is_file() and not f.name.endswith((".onnx", ".onnx_data")):
            shutil.copy2(f, out / f.name)
    for g in graphs:
        (scratch / g.replace(".onnx", "_quantized.onnx")).rename(out / g)
    shutil.rmtree(scratch, ignore_errors=True)
    from t5compress.bench.variants import onnx_files

    return {"files": onnx_files(out, graphs), "settings": {"preset": f"AutoQuantizationConfig.{preset}"
                                                           "(is_static=False)"}}


def prepare_ctranslate2(model_dir: Path, out: Path) -> dict:
    import ctranslate2

    ctranslate2.converters.TransformersConverter(str(model_dir)).convert(str(out), quantization="int8", force=True)
    return {"files": ["model.bin"]}


def prepare_openvino(int8: bool) -> Callable[[Path, Path], dict]:
    def prepare(model_dir: Path, out: Path) -> dict:
        from optimum.intel import OVModelForSeq2SeqLM

        model = OVModelForSeq2SeqLM.from_pretrained(model_dir, export=True, compile=False, load_in_8bit=int8)
        model.save_pretrained(out)
        return {"files": [f for x in _weights(out, (".xml",)) for f in (x, x[:-4] + ".bin") if (out / f).is_file()]}
    return prepare


def _nothing(model_dir: Path, out: Path) -> dict:
    return {"files": []}


ORT_SPIN = "while a run lasts at 2+ threads, as ours (runtime.threads)"
LOCKED = {"lengths": "min_new_tokens = max_new_tokens (forced)", "do_sample": False}
REGISTRY: dict[str, Peer] = {p.name: p for p in [
    Peer("pytorch", "pytorch", "fp32", "PyTorch fp32 generate", ("torch", "transformers"), _nothing,
         {"engine": "transformers generate", "torch.set_num_threads": "threads"}),
    Peer("optimum-fp32", "optimum", "fp32", "optimum ORT fp32", ("optimum.onnxruntime",), prepare_optimum_fp32,
         {"engine": "ORTModelForSeq2SeqLM(use_merged=False, use_cache=True)", "intra_op_num_threads": "threads",
          "inter_op_num_threads": 1, "spinning": ORT_SPIN, "torch.set_num_threads": "threads"}),
    Peer("optimum-int8", "optimum", "int8", "optimum ORT int8 dynamic", ("optimum.onnxruntime",),
         prepare_optimum_int8, {"engine": "ORTModelForSeq2SeqLM(use_merged=False, use_cache=True)",
                                "intra_op_num_threads": "threads", "inter_op_num_threads": 1, "spinning": ORT_SPIN,
                                "torch.set_num_threads": "threads"}),
    Peer("ctranslate2-int8", "ctranslate2", "int8", "CTranslate2 int8", ("ctranslate2", "transformers"),
         prepare_ctranslate2, {"engine": "ctranslate2.Translator", "compute_type": "int8", "intra_threads": "threads",
                               "inter_threads": 1, "max_batch_size": 0}),
    # OpenVINO computes an fp32 model in bf16 by default on CPUs with AVX512_BF16 or AMX: the fp32 peer asks for f32,
    # the precision its name and the fp32 goal are about (its int8 peer keeps the default, what its users get).
    Peer("openvino-fp32", "openvino", "fp32", "OpenVINO fp32", ("optimum.intel.openvino",), prepare_openvino(False),
         {"engine": "OVModelForSeq2SeqLM", "INFERENCE_NUM_THREADS": "threads", "PERFORMANCE_HINT": "LATENCY",
          "INFERENCE_PRECISION_HINT": "f32", "torch.set_num_threads": "threads"}),
    Peer("openvino-int8", "openvino", "int8", "OpenVINO int8 weights", ("optimum.intel.openvino", "nncf"),
         prepare_openvino(True), {"engine": "OVModelForSeq2SeqLM(load_in_8bit=True)",
                                  "INFERENCE_NUM_THREADS": "threads", "PERFORMANCE_HINT": "LATENCY",
                                  "torch.set_num_threads": "threads"}),
]}
assert tuple(REGISTRY) == PEERS, "bench.config.PEERS and the peer registry must list the same peers"
