"""The export stage: model dir in, verified export dir out (ONNX or TorchScript graphs, config, tokenizer, report).

    run(src, ExportConfig(format="onnx"), out) -> report

An export dir uses Hugging Face optimum's seq2seq file and tensor names, so `ORTModelForSeq2SeqLM` loads it
unchanged; `graphs.json` lists each graph's input and output names in positional order. Nothing is written unless
every graph matches PyTorch within `atol + rtol * max|tensor|` and greedy decoding over the graphs reproduces
`model.generate`. `decoders` chooses optimum's two decoder graphs, the merged decoder alone (weights once), or both.
The tokenizer's `model_max_length` becomes the input length the model was trained with, when the source records it:
the runtime truncates longer inputs to it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from t5compress import artifacts, kinds
from t5compress.config import choose, option, require
from t5compress.errors import ConfigError, ModelError
from t5compress.export.onnx import DEFAULT_OPSET, EXTERNAL_DATA_THRESHOLD, OPT_LEVELS, USE_CACHE_BRANCH
from t5compress.export.precision import BF16_REFUSED, DTYPES
from t5compress.names import (
    DECODER,
    DECODER_MERGED,
    DECODER_WITH_PAST,
    ENCODER,
    GRAPHS,
    MANIFEST_FILE,
    ONNX_SUFFIX,
    past_names,
)
from t5compress.runtime.limits import check_model_fits

if TYPE_CHECKING:
    from t5compress.export.graphs import GraphSpec

log = logging.getLogger(__name__)



# Graph files per decoder layout: optimum's two decoders, the merged one alone, or all three.
DECODER_LAYOUTS: dict[str, tuple[str, ...]] = {
    "separate": GRAPHS,
    "merged": (ENCODER, DECODER_MERGED),
    "both": (*GRAPHS, DECODER_MERGED),
}


@dataclass(frozen=True)
class ExportConfig:
    format: str = option("onnx", help="Graph format: onnx or torchscript.")
    dtype: str = option(
        "fp32",
        help="Precision of the ONNX graphs: fp32, or fp16 (half the size; T5's wo projections, the residual sums and"
        " layer-norm variances stay fp32 as in transformers, logits are fp32; checked against the fp32 model within"
        " --half-atol/--half-rtol). bf16 is refused: ONNX Runtime's CPU provider has no bf16 kernels to check it.",
    )
    opset: int = option(DEFAULT_OPSET, help="ONNX opset version (14 or later; 17 is tested).")
    decoders: str = option(
        "separate",
        help="Decoder graphs (ONNX): separate (decoder_model + decoder_with_past_model, what optimum loads), merged"
        " (decoder_model_merged alone: one graph switching on use_cache_branch, decoder weights on disk and in memory"
        " once), or both.",
    )
    merged: bool = option(False, help="Also write decoder_model_merged.onnx (the same as decoders='both').")
    inflight: bool = option(
        False,
        help="decoder_with_past_model also takes the decoder's attention_mask (batch, past + 1), so requests at"
        " different decoder positions can share a step (in-flight batching in Triton); ONNX, separate decoders.",
    )
    search_graph: bool = option(
        False,
        help="Also write generator.onnx: the three graphs under ONNX Runtime's BeamSearch operator, so one ONNX"
        " Runtime call generates (greedy or beam; `generate --search graph`, any ONNX Runtime server). fp32 ONNX,"
        " separate decoders, not --inflight; quantize rebuilds it from its int8 graphs.",
    )
    optimize: bool = option(False, help="Replace the ONNX graphs by ONNX Runtime's offline-optimised ones (CPU).")
    optimize_level: str = option("extended", help="ONNX Runtime optimisation level: basic or extended.")
    atol: float = option(1e-4, help="Absolute part of the parity tolerance: each output tensor (logits, cache) must be"
                         " within atol + rtol * max|PyTorch tensor| of PyTorch.")
    rtol: float = option(1e-5, help="Relative part of the parity tolerance, times the tensor's largest magnitude (fp32"
                         " rounding grows with the values: Flan-T5 logits reach ~100).")
    half_atol: float = option(0.01, help="fp16 exports: absolute part of the tolerance against the fp32 PyTorch"
                              " model, per output tensor (atol + rtol * max|PyTorch tensor|).")
    half_rtol: float = option(0.02, help="fp16 exports: relative part of that tolerance, times the tensor's largest"
                              " magnitude (fp16 keeps 11 significant bits; errors grow through the layers).")
    max_new_tokens: int = option(8, help="Tokens generated in the greedy check against model.generate.")
    int8_rtol: float = option(
        0.1, help="QAT dirs (int8 graphs): largest difference to the fake-quant model, relative to the logits' scale."
    )
    external_data_threshold: int = option(
        EXTERNAL_DATA_THRESHOLD, help="Parameter bytes above which the exporter's own graph files keep their weights"
        " apart while it works (the export dir always stores each weight once, in weights.onnx_data)."
    )

    def __post_init__(self) -> None:
        choose(EXPORTERS, self.format, "export format")
        require(self.opset >= 14, "opset", f"must be 14 or later (T5's causal mask needs Trilu), got {self.opset}")
        require(self.optimize_level in OPT_LEVELS, "optimize_level", f"choose one of {', '.join(OPT_LEVELS)}")
        require(self.decoders in DECODER_LAYOUTS, "decoders", f"choose one of {', '.join(DECODER_LAYOUTS)}")
        require(self.atol >= 0 and self.atol == self.atol, "atol", f"must be a number >= 0, got {self.atol}")
        require(self.rtol >= 0 and self.rtol == self.rtol, "rtol", f"must be a number >= 0, got {self.rtol}")
        require(self.int8_rtol > 0, "int8_rtol", f"must be > 0, got {self.int8_rtol}")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        require(self.external_data_threshold >= 0, "external_data_threshold", "must be >= 0")
        choose(DTYPES, self.dtype, "dtype")
        require(self.dtype != "bf16", "dtype", BF16_REFUSED.removeprefix("--dtype bf16: "))
        require(self.format == "onnx" or self.dtype == "fp32", "dtype",
                f"--dtype {self.dtype} applies to ONNX exports; TorchScript graphs are traced and checked in fp32"
                " only")
        for name in ("half_atol", "half_rtol"):
            value = getattr(self, name)
            require(value >= 0 and value == value, name, f"must be a number >= 0, got {value}")
        onnx_only = self.format == "onnx" or not (self.layout != "separate" or self.optimize)
        require(onnx_only, "format", "--merged, --decoders and --optimize apply to ONNX exports only")
        require(not self.inflight or (self.format == "onnx" and self.layout == "separate"), "inflight",
                "needs an ONNX export with separate decoders (the merged decoder has no attention_mask input)")
        require(not self.search_graph or (self.format == "onnx" and self.layout != "merged" and not self.inflight
                                          and self.dtype == "fp32"), "search_graph",
                "builds on fp32 ONNX graphs with the separate decoders: drop --torchscript, --decoders merged, "
                "--inflight or --dtype")

    @property
    def layout(self) -> str:
        """The decoder layout written: `decoders`, with the older `merged=True` meaning 'both'."""
        return "both" if self.merged and self.decoders == "separate" else self.decoders

    @property
    def graphs(self) -> tuple[str, ...]:
        """The graph file stems the export dir holds."""
        return DECODER_LAYOUTS[self.layout]


def export_onnx_dir(model, specs: dict[str, GraphSpec], out: Path, cfg: ExportConfig) -> dict:
    """Write and verify the ONNX graphs (merged and optimised on request); returns the report section."""
    from t5compress.export.onnx import (
        export_onnx,
        needs_external_data,
        optimize_onnx,
        parameter_bytes,
        remove_graph,
        write_merged,
    )
    from t5compress.export.precision import half_model
    from t5compress.onnxstore import store_once

    traced = model if cfg.dtype == "fp32" else half_model(model, cfg.dtype)
    external = needs_external_data(parameter_bytes(traced), cfg.external_data_threshold)
    export_onnx(traced, specs, out, cfg.opset, external)
    del traced
    if DECODER_MERGED in cfg.graphs:
        write_merged(out, external)
    for name in (DECODER, DECODER_WITH_PAST):
        if name not in cfg.graphs:  # merged alone: the two decoders were only its parts
            remove_graph(out, name)
    names = list(cfg.graphs)
    section: dict = {"opset": cfg.opset, "external_data": external, "decoders": cfg.layout, "graphs": names,
                     "inflight": cfg.inflight, "dtype": cfg.dtype}
    section["weights"] = store_once(out)  # checked below as stored: every graph reads the one weights file
    section["parity"] = check_onnx_dir(model, out, names, cfg, "ONNX export")
    if cfg.optimize:
        for name in names:
            optimize_onnx(out / f"{name}{ONNX_SUFFIX}", cfg.optimize_level, external)
        section["weights"] = store_once(out)
        section["parity_unoptimized"] = section["parity"]
        section["parity"] = check_onnx_dir(model, out, names, cfg, f"ONNX export optimised ({cfg.optimize_level})")
    return section


def check_onnx_dir(model, out: Path, names: list[str], cfg: ExportConfig, what: str) -> dict:
    """The graphs in `out` against the fp32 PyTorch `model`: exact-greedy fp32 parity, or the half-precision check."""
    from t5compress.export.precision import check_half
    from t5compress.export.verify import open_onnx, verify

    graphs = open_onnx(out, names)
    if cfg.dtype == "fp32":
        return verify(model, graphs, cfg.atol, cfg.max_new_tokens, what, cfg.rtol)
    return check_half(model, graphs, cfg.half_atol, cfg.half_rtol, cfg.max_new_tokens, f"{what} ({cfg.dtype})")


def export_torchscript_dir(model, specs: dict[str, GraphSpec], out: Path, cfg: ExportConfig) -> dict:
    """Write and verify the TorchScript graphs; returns the report section."""
    from t5compress.export.torchscript import export_torchscript
    from t5compress.export.verify import open_torchscript, verify

    export_torchscript(model, specs, out)
    parity = verify(model, open_torchscript(out, specs), cfg.atol, cfg.max_new_tokens, "TorchScript export", cfg.rtol)
    return {"graphs": list(specs), "parity": parity}


EXPORTERS: dict[str, Callable[..., dict]] = {"onnx": export_onnx_dir, "torchscript": export_torchscript_dir}


def run(src: str | os.PathLike, cfg: ExportConfig, out: str | os.PathLike, *, force: bool = False,
        progress: bool = True) -> artifacts.Report:
    """Export `src` to `out` as `cfg` says, verify it against PyTorch, and return the report (also in report.json)."""
    with artifacts.envelope("export", src, cfg, out, force=force) as env:  # claimed before loading anything heavy
        from t5compress.export.graphs import graph_specs, manifest  # torch: not for a refusal

        check_model_fits("export", src)
        hook = kinds.export_hook(src)  # a QAT dir: Q/DQ graphs, checked against the fake-quant model
        if hook is not None and cfg.dtype != "fp32":
            raise ConfigError(f"--dtype {cfg.dtype}: '{src}' is a QAT model dir, whose export is int8 Q/DQ graphs "
                              "with its learned scales; export it without --dtype")
        model, tokenizer = _load(src)
        exporter = EXPORTERS[cfg.format]
        if hook is not None:
            model, exporter = hook(src, model)
        specs = graph_specs(model.config, masked_past=cfg.inflight)
        with env.staging() as tmp:
            section = exporter(model, specs, tmp, cfg)
            model.config.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            limits = _record_input_limit(src, tmp)
            graphs = {name: io for name, io in manifest(specs).items() if name in cfg.graphs}
            if DECODER_MERGED in cfg.graphs:
                graphs[DECODER_MERGED] = _merged_io(specs)
            artifacts.write_json(tmp / MANIFEST_FILE, graphs)
            if cfg.search_graph:  # needs the config, tokenizer and graphs.json the runtime reads
                from t5compress.export.generator import check_generator, write_generator

                write_generator(tmp, section["external_data"])
                section["search_graph"] = check_generator(tmp, cfg.max_new_tokens, strict=True)
            if cfg.format == "onnx" and (cfg.search_graph or "weights" not in section):  # the generator, a QAT dir
                from t5compress.onnxstore import store_once

                section["weights"] = store_once(tmp)
            from t5compress.lineage import source_checkpoint
            from t5compress.model.load import describe

            env.report = {
                "stage": "export",
                "format": cfg.format,
                **section,
                "model": describe(model),
                "max_input_tokens": limits,
                "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
                "source": source_checkpoint(src) if Path(src).is_dir() else None,  # sizes against it (info, bench)
                "seconds": env.seconds(2),
            }
    log.info("export written to %s", out)
    return env.report


def _load(src: str | os.PathLike):
    """The fp32 model and a fast tokenizer (an export dir must carry tokenizer.json for the torch-free runtime)."""
    import torch

    from t5compress.model.load import check_model_dir, is_local, load_model, load_tokenizer
    from t5compress.runtime.text import BYTE_TOKENIZERS

    if is_local(src):
        check_model_dir(src)  # a non-T5 or weightless dir is named as such, not as a tokenizer problem
    tokenizer = load_tokenizer(src)  # cheap, and fails early for a dir without tokenizer files
    if not getattr(tokenizer, "is_fast", False) and type(tokenizer).__name__ not in BYTE_TOKENIZERS:
        raise ModelError(
            f"the tokenizer of {str(src)!r} ({type(tokenizer).__name__}) has no fast version: an export needs a "
            f"tokenizer.json, or a byte-level tokenizer ({', '.join(BYTE_TOKENIZERS)}) that the runtime provides"
        )
    return load_model(src, dtype=torch.float32), tokenizer


def _record_input_limit(src: str | os.PathLike, out: Path) -> dict:
    """Make the export's tokenizer_config.json `model_max_length` the length the model was trained with, if the
    source dir records it (the runtime truncates to it); returns the limit and where it came from."""
    from t5compress.runtime.text import TOKENIZER_CONFIG, input_limit

    config = artifacts.read_json(out / TOKENIZER_CONFIG) or {}
    trained = artifacts.trained_input_length(src)
    if trained is not None and config:
        config["model_max_length"] = trained
        artifacts.write_json(out / TOKENIZER_CONFIG, config)
        return {"value": trained, "from": "training (data.max_source_length)"}
    return {"value": input_limit(out), "from": "tokenizer (model_max_length)"}


def _merged_io(specs: dict[str, GraphSpec]) -> dict[str, list[str]]:
    decoder = specs[DECODER]
    layers = sum(1 for n in decoder.outputs if n.endswith(".decoder.key"))
    return {"inputs": [*decoder.inputs, *past_names(layers), USE_CACHE_BRANCH], "outputs": list(decoder.outputs)}
