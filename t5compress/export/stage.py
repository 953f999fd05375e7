"""The export stage: model dir in, verified export dir out (ONNX or TorchScript graphs, config, tokenizer, report).

    run(src, ExportConfig(format="onnx"), out) -> report

An export dir uses Hugging Face optimum's seq2seq file and tensor names, so `ORTModelForSeq2SeqLM` loads it
unchanged; `graphs.json` lists each graph's input and output names in positional order. Nothing is written unless
every graph matches PyTorch within `atol` and greedy decoding over the graphs reproduces `model.generate`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from t5compress import artifacts
from t5compress.config import choose, option, require
from t5compress.errors import ModelError
from t5compress.export.onnx import DEFAULT_OPSET, EXTERNAL_DATA_THRESHOLD, OPT_LEVELS, USE_CACHE_BRANCH
from t5compress.names import DECODER, DECODER_MERGED, MANIFEST_FILE, ONNX_SUFFIX, past_names

if TYPE_CHECKING:
    from t5compress.export.graphs import GraphSpec

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ExportConfig:
    format: str = option("onnx", help="Graph format: onnx or torchscript.")
    opset: int = option(DEFAULT_OPSET, help="ONNX opset version (14 or later; 17 is tested).")
    merged: bool = option(False, help="Also write decoder_model_merged.onnx (one decoder, If on use_cache_branch).")
    optimize: bool = option(False, help="Replace the ONNX graphs by ONNX Runtime's offline-optimised ones (CPU).")
    optimize_level: str = option("extended", help="ONNX Runtime optimisation level: basic or extended.")
    atol: float = option(1e-4, help="Largest absolute difference to PyTorch accepted in logits and cache outputs.")
    max_new_tokens: int = option(8, help="Tokens generated in the greedy check against model.generate.")
    int8_rtol: float = option(
        0.1, help="QAT dirs (int8 graphs): largest difference to the fake-quant model, relative to the logits' scale."
    )
    external_data_threshold: int = option(
        EXTERNAL_DATA_THRESHOLD, help="Parameter bytes above which ONNX weights are saved as external data files."
    )

    def __post_init__(self) -> None:
        choose(EXPORTERS, self.format, "export format")
        require(self.opset >= 14, "opset", f"must be 14 or later (T5's causal mask needs Trilu), got {self.opset}")
        require(self.optimize_level in OPT_LEVELS, "optimize_level", f"choose one of {', '.join(OPT_LEVELS)}")
        require(self.atol >= 0 and self.atol == self.atol, "atol", f"must be a number >= 0, got {self.atol}")
        require(self.int8_rtol > 0, "int8_rtol", f"must be > 0, got {self.int8_rtol}")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        require(self.external_data_threshold >= 0, "external_data_threshold", "must be >= 0")
        onnx_only = self.format == "onnx" or not (self.merged or self.optimize)
        require(onnx_only, "format", "--merged and --optimize apply to ONNX exports only")


def export_onnx_dir(model, specs: dict[str, GraphSpec], out: Path, cfg: ExportConfig) -> dict:
    """Write and verify the ONNX graphs (merged and optimised on request); returns the report section."""
    from t5compress.export.onnx import export_onnx, needs_external_data, optimize_onnx, parameter_bytes, write_merged
    from t5compress.export.verify import open_onnx, verify

    external = needs_external_data(parameter_bytes(model), cfg.external_data_threshold)
    export_onnx(model, specs, out, cfg.opset, external)
    names = list(specs)
    if cfg.merged:
        write_merged(out, external)
        names.append(DECODER_MERGED)
    section: dict = {"opset": cfg.opset, "external_data": external, "graphs": names}
    section["parity"] = verify(model, open_onnx(out, names), cfg.atol, cfg.max_new_tokens, "ONNX export")
    if cfg.optimize:
        for name in names:
            optimize_onnx(out / f"{name}{ONNX_SUFFIX}", cfg.optimize_level, external)
        section["parity_unoptimized"] = section["parity"]
        section["parity"] = verify(
            model, open_onnx(out, names), cfg.atol, cfg.max_new_tokens, f"ONNX export optimised ({cfg.optimize_level})"
        )
    return section


def export_torchscript_dir(model, specs: dict[str, GraphSpec], out: Path, cfg: ExportConfig) -> dict:
    """Write and verify the TorchScript graphs; returns the report section."""
    from t5compress.export.torchscript import export_torchscript
    from t5compress.export.verify import open_torchscript, verify

    export_torchscript(model, specs, out)
    parity = verify(model, open_torchscript(out, specs), cfg.atol, cfg.max_new_tokens, "TorchScript export")
    return {"graphs": list(specs), "parity": parity}


EXPORTERS: dict[str, Callable[..., dict]] = {"onnx": export_onnx_dir, "torchscript": export_torchscript_dir}


def run(src: str | os.PathLike, cfg: ExportConfig, out: str | os.PathLike, force: bool = False) -> dict:
    """Export `src` to `out` as `cfg` says, verify it against PyTorch, and return the report (also in report.json)."""
    from t5compress.export.graphs import graph_specs, manifest

    out = artifacts.check_output(out, force)  # before loading anything heavy
    model, tokenizer = _load(src)
    exporter = EXPORTERS[cfg.format]
    from t5compress.quantize.scheme import is_qat_dir

    if is_qat_dir(src):  # learned int8 scales beside the weights: Q/DQ graphs, checked against the fake-quant model
        from t5compress.quantize.fakequant import load_fake_quant
        from t5compress.quantize.qdq import export_qdq_dir

        model, exporter = load_fake_quant(src, model), export_qdq_dir
    specs = graph_specs(model.config)
    started = time.perf_counter()
    with artifacts.staged_output(out, force) as tmp:
        section = exporter(model, specs, tmp, cfg)
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        graphs = manifest(specs)
        if cfg.merged:
            graphs[DECODER_MERGED] = _merged_io(specs)
        artifacts.write_json(tmp / MANIFEST_FILE, graphs)
        from t5compress.models import describe

        report = {
            "stage": "export",
            "format": cfg.format,
            **section,
            "model": describe(model),
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
            "seconds": round(time.perf_counter() - started, 2),
        }
        artifacts.write_meta(tmp, "export", asdict(cfg), parent=src)
        artifacts.write_report(tmp, report)
    log.info("export written to %s", out)
    return report


def _load(src: str | os.PathLike):
    """The fp32 model and a fast tokenizer (an export dir must carry tokenizer.json for the torch-free runtime)."""
    import torch

    from t5compress.models import check_model_dir, is_local, load_model, load_tokenizer

    if is_local(src):
        check_model_dir(src)  # a non-T5 or weightless dir is named as such, not as a tokenizer problem
    tokenizer = load_tokenizer(src)  # cheap, and fails early for a dir without tokenizer files
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(f"the tokenizer of {str(src)!r} has no fast version: an export needs a tokenizer.json")
    return load_model(src, dtype=torch.float32), tokenizer


def _merged_io(specs: dict[str, GraphSpec]) -> dict[str, list[str]]:
    decoder = specs[DECODER]
    layers = sum(1 for n in decoder.outputs if n.endswith(".decoder.key"))
    return {"inputs": [*decoder.inputs, *past_names(layers), USE_CACHE_BRANCH], "outputs": list(decoder.outputs)}
