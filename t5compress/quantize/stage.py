"""The quantize stage: an fp32 ONNX export dir in, an int8 export dir out (static, dynamic or block-wise), checked
against fp32.

    run(src, QuantizeConfig(mode="static", calib_data="train.jsonl"), out) -> report

The mode names a method (`modes`: what it needs, how it quantizes, what it reports); its `auto` choices are resolved
once into a plan (`plan.QuantPlan`), logged and recorded in the report. Static int8 calibrates every graph on the
tensors it really sees while the fp32 runtime generates from the calibration texts (see `calibrate`). The result
keeps the export dir's file and tensor names, so `t5compress generate`, optimum's `ORTModelForSeq2SeqLM` and the
Triton packaging use it like any other export dir. Nothing is written when the int8 model's next-token agreement
with fp32 falls below `min_agreement` on the check texts (the eval texts when given, else the calibration texts).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from t5compress import artifacts
from t5compress.config import option as opt
from t5compress.config import require
from t5compress.cpu import WEIGHT_RANGES
from t5compress.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST, ENCODER, GENERATOR, GRAPHS, ONNX_SUFFIX
from t5compress.quantize.methods import CALIBRATION_METHODS, FORMATS
from t5compress.quantize.modes import METHODS, applied, method_for
from t5compress.quantize.plan import (
    AUTO_ALPHA,
    GPTQ,
    KEEP_AUTO,
    KEEP_SENSITIVE,
    PER_TOKEN_AUTO,
    PER_TOKEN_NONE,
    ROUNDINGS,
    WIDE_AUTO,
)

__all__ = ["QuantizeConfig", "applied", "run"]

log = logging.getLogger(__name__)

BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits: a power of two, at least 16


@dataclass(frozen=True)
class QuantizeConfig:
    mode: str = opt("static", "; ".join(f"{m.name}: {m.help}" for m in METHODS.values()) + " (static needs "
                              "--calib-data; block-wise is fastest at batch 1).")
    calib_data: str | None = opt(None, "Calibration texts: any data file `train` reads (its source field) or a .txt "
                                       "file with one text per line. Required for static.")
    field: str = opt("source", "Field of the calibration and eval records holding the input text.")
    prefix: str = opt("", "Task prefix added to every calibration and eval text, as in `train`.")
    samples: int = opt(128, "Calibration texts used (the file must hold at least this many).")
    batch_size: int = opt(16, "Calibration texts generated together (each graph run holds at most 4096 input "
                              "tokens).")
    max_new_tokens: int = opt(32, "Tokens generated per calibration text (decoder steps calibrated).")
    method: str = opt("minmax", "Calibration method: minmax, entropy or percentile.")
    percentile: float = opt(99.999, "Percentile kept by the percentile method.")
    per_channel: bool = opt(True, "One weight scale per output channel (else one per tensor).")
    # Measured on an AVX2 CPU without VNNI: reduced weights lowered static int8's next-token agreement (0.96 vs 0.98)
    # more than the kernels' saturation did, so post-training int8 keeps the full range unless asked (QAT, which
    # trains with the range it will run with, takes `auto`).
    weight_range: str = opt("full", "int8 weight range: full (+-127), reduced (+-63, for x86 CPUs without VNNI, "
                                    "whose int8 kernels saturate at +-127) or auto (reduced on such CPUs).")
    format: str = opt("qdq", "qdq (QuantizeLinear/DequantizeLinear pairs) or qoperator (QLinear* operators).")
    op_types: tuple[str, ...] = opt(("MatMul", "Gemm"), "Op types quantized. MatMul/Gemm mean the linear layers "
                                                       "(constant weights); others are quantized wherever they occur.")
    embeddings: bool = opt(True, "Also store the token embedding (Gather) as int8.")
    keep_fp32: str = opt(KEEP_AUTO, "Nodes kept fp32: none; comma-separated name parts, e.g. 'DenseReluDense/wo/'; "
                                    "sensitive (static: keep the fewest measured layer groups that reach "
                                    "--target-agreement); auto (sensitive on gated models given --eval-data, `wo` on "
                                    "gated models without per-token or smoothing, else none).")
    target_agreement: float = opt(0.97, "Next-token agreement with fp32 the layer groups kept fp32 must reach "
                                        "(static, when groups are measured).")
    per_token: str = opt(PER_TOKEN_AUTO, "Static: linear layers whose inputs get a scale per row at run time: auto "
                                         "(every one of a gated model, none of a relu one), none, or comma-separated "
                                         "name parts.")
    smooth_alpha: float | None = opt(None, "SmoothQuant strength (0 disables, 1 moves an input channel's whole range "
                                           "into the weights). Default: "
                                           f"{AUTO_ALPHA} for gated models under per-token auto or block-wise with "
                                           "--calib-data, else 0.")
    rounding: str = opt(GPTQ, "How weights with calibration inputs are rounded (static per-token layers, block-wise "
                              "with --calib-data): gptq (errors spread over later input channels) or nearest.")
    block_size: int = opt(0, "Block-wise: input channels per scale (16, 32, 64, 128 or 256; 0: 64 for 4-bit, for "
                             "int8 128 with --calib-data, else 32). Larger blocks run faster at batch 1.")
    keep_8bit: str = opt(WIDE_AUTO, "4-bit: linear layers kept 8-bit: auto (a gated model's FFN outputs "
                                    "'DenseReluDense/wo/', and its LM head unless GPTQ rounds it; none on relu "
                                    "models), none, or "
                                    "comma-separated name parts (e.g. 'lm_head,embed_tokens').")
    eval_data: str | None = opt(None, "Held-out data with targets: task metrics of fp32 and int8 side by side; the "
                                      "agreement check and the group measuring read its texts.")
    eval_max: int = opt(200, "Evaluate on at most this many eval records.")
    min_agreement: float = opt(0.9, "Refuse the result when int8 picks fp32's next token less often than this on "
                                    "the check texts (eval texts if given, else calibration texts).")
    threads: int = opt(0, "ONNX Runtime threads while calibrating and checking (0: all cores).")
    tolerance: float | None = opt(None, "Accuracy-aware tuning (onnx-neural-compressor): keep layers fp32 until the "
                                        "task metric on --eval-data is at most this much below fp32 (0.01: 1%).")

    def __post_init__(self) -> None:
        require(self.mode in METHODS, "mode", f"choose one of {', '.join(METHODS)}")
        calibrated = METHODS[self.mode].calibrated
        require(not METHODS[self.mode].needs_texts or bool(self.calib_data), "calib_data",
                f"{self.mode} quantization needs calibration texts (--calib-data FILE), or use --dynamic")
        require(self.method in CALIBRATION_METHODS, "method", f"choose one of {', '.join(CALIBRATION_METHODS)}")
        require(self.format in FORMATS, "format", f"choose one of {', '.join(FORMATS)}")
        require(self.weight_range in WEIGHT_RANGES, "weight_range",
                f"choose one of {', '.join(WEIGHT_RANGES)}, got {self.weight_range!r}")
        for name in ("samples", "batch_size", "max_new_tokens", "eval_max"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(0 < self.percentile <= 100, "percentile", f"must be in (0, 100], got {self.percentile}")
        require(bool(self.op_types), "op_types", "give at least one op type, e.g. MatMul")
        require(self.smooth_alpha is None or 0 <= self.smooth_alpha <= 1, "smooth_alpha",
                f"must be in [0, 1], got {self.smooth_alpha}")
        require(not self.smooth_alpha or bool(self.calib_data), "smooth_alpha",
                "smoothing measures activations: give --calib-data")
        require(self.block_size in (0, *BLOCK_SIZES), "block_size",
                f"choose one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}")
        require(self.rounding in ROUNDINGS, "rounding", f"choose one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        for name in ("target_agreement", "min_agreement"):
            require(0 <= getattr(self, name) <= 1, name, f"must be in [0, 1], got {getattr(self, name)}")
        require(self.tolerance is None or 0 <= self.tolerance < 1, "tolerance",
                f"must be in [0, 1), e.g. 0.01 for 1%, got {self.tolerance}")
        require(self.keep_fp32 != KEEP_SENSITIVE or (calibrated and self.tolerance is None), "keep_fp32",
                "sensitive is measured on static int8 and replaces --tolerance's search: use --static, no --tolerance")
        require(self.per_token in (PER_TOKEN_AUTO, PER_TOKEN_NONE) or calibrated, "per_token",
                "per-token scales are a static int8 choice; dynamic int8 scales every call already")
        require(self.tolerance is None or (calibrated and bool(self.eval_data)), "tolerance",
                "tuning needs --static and --eval-data (the task metric it keeps within tolerance)")


def run(src: str | os.PathLike, cfg: QuantizeConfig, out: str | os.PathLike, *, force: bool = False,
        progress: bool = True) -> artifacts.Report:
    """Quantize the export dir `src` into `out`; returns the report (also written to out/report.json)."""
    from t5compress.lineage import source_checkpoint

    src, method = Path(src), method_for(cfg.mode)
    source = source_checkpoint(src)  # the safetensors the export was made from: the size users start with
    with artifacts.envelope("quantize", src, cfg, out, force=force) as env:
        export = _prepare(src, cfg, method, progress)  # checks and inputs, before anything is written
        with env.staging() as tmp:
            env.report = {"stage": "quantize", **_make(export, tmp, method, source)}
            env.report["seconds"] = env.seconds(2)
    log.info("%s export written to %s", method.label, out)
    return env.report


def _prepare(src: Path, cfg: QuantizeConfig, method, progress: bool):
    """The export checked, its graphs open, the calibration texts and eval records read, the plan resolved, and the
    memory it needs checked against this machine's (once, before any weight is loaded)."""
    from t5compress.data import DataConfig, load_examples
    from t5compress.quantize.calibrate import load_texts
    from t5compress.quantize.check import check_texts
    from t5compress.quantize.sources import Export, model_config, open_graphs
    from t5compress.runtime.limits import check_stage_fits, gram_bytes

    graphs = open_graphs(src)
    texts = load_texts(cfg.calib_data, cfg.field, cfg.prefix, cfg.samples) if cfg.calib_data else None
    evalset = None
    if cfg.eval_data:
        evalset = load_examples(cfg.eval_data, DataConfig(source_field=cfg.field))[: cfg.eval_max]
    plan = method.resolve(cfg, *model_config(src), held=bool(evalset))
    log.info("plan: %s", plan.describe())
    # GPTQ's X^T X come on top of what calibrating holds
    check_stage_fits("quantize", src / "config.json", f"'{src}'", extra=gram_bytes if plan.rounding == GPTQ else None)
    return Export(src, cfg, plan, graphs, texts, src, progress, evalset, check_texts(cfg, texts, evalset))


def _make(export, tmp: Path, method, source: dict | None) -> dict:
    """The int8 export dir in `tmp`, checked against fp32; returns the report (but the envelope's parts). `source`:
    the checkpoint the export was made from (`lineage.source_checkpoint`), which the sizes are compared with."""
    from t5compress.quantize.check import check_int8
    from t5compress.quantize.sources import copy_beside

    src, cfg, plan = export.src, export.cfg, export.plan
    copy_beside(src, tmp)
    graphs, models = _quantize(export, tmp, method)
    _finish(src, tmp, cfg, plan, graphs, models)
    del models  # stored: the check opens the dir, and both runtimes come on top of what this run still holds
    return {**method.settings(cfg, plan), "graphs": graphs, "size": _sizes(src, tmp, source), "plan": asdict(plan),
            **check_int8(src, tmp, cfg, export.checked, export.evalset, method, export.progress)}


def _quantize(export, tmp: Path, method) -> tuple[dict, dict]:
    """The int8 graphs (in memory) made by the method, or by onnx-neural-compressor's accuracy-aware tuning when the
    plan says so (it picks the fp32 nodes), and the report's `graphs`."""
    from t5compress.quantize.methods import scratch_dir

    with scratch_dir(tmp.parent) as scratch:
        export.work = Path(scratch)
        if export.plan.tune:
            from t5compress.quantize import tune

            return tune.run(export)
        return method.quantize(export, export.checked[0] if export.evalset else None)


def _finish(src: Path, tmp: Path, cfg: QuantizeConfig, plan, graphs: dict, models: dict) -> None:
    """Store a tied embedding once (in the LM head's int8 matrix, which the encoder's lookup reads too), re-merge
    the decoders and rebuild generator.onnx if `src` had them, then write every graph into `tmp` at once, each
    weight stored once (`onnxstore`): the int8 decoders' weights are byte-identical.

    Not after tuning: the tuning's metric was measured on the graphs as they are, and its guarantee is about those.
    """
    from t5compress.onnxstore import store_once

    if plan.share_table:
        from t5compress.quantize.graphs import share_lm_head_table
        from t5compress.quantize.lookup import share_lookup  # the encoder's lookup on that table: one in the dir

        saved = {g: share_lm_head_table(models[g]) for g in GRAPHS}
        if any(saved.values()):
            graphs["tied_table_bytes_saved"] = saved
        graphs["encoder_lookup_bytes_saved"] = share_lookup(models[ENCODER], models[DECODER])
    files = {f"{g}{ONNX_SUFFIX}": models[g] for g in GRAPHS}
    merged, search = (f"{g}{ONNX_SUFFIX}" for g in (DECODER_MERGED, GENERATOR))
    if (src / merged).is_file():
        from t5compress.export.onnx import merge_decoders

        files[merged] = merge_decoders(models[DECODER], models[DECODER_WITH_PAST])
    if (src / search).is_file():  # the export carried the in-graph search: rebuild it in int8
        from t5compress.export.generator import generator_model

        files[search] = generator_model(tmp, *(models[g] for g in (ENCODER, DECODER, DECODER_WITH_PAST)))
    stored = store_once(tmp, files)
    if merged in files:
        from t5compress.export.onnx import check_merged

        check_merged(tmp / merged)
    if search in files:
        from t5compress.export.generator import check_generator

        graphs["search_graph"] = check_generator(tmp, cfg.max_new_tokens, strict=False)
    graphs["weights"] = stored  # checked as stored: every graph reads the one weights file


def _sizes(src: Path, out: Path, source: dict | None) -> dict:
    def total(d: Path) -> int:
        return sum(f.stat().st_size for f in d.iterdir() if f.name.endswith((ONNX_SUFFIX, ".onnx_data")))

    before, after = total(src), total(out)
    files = {f.name: [f.stat().st_size, (out / f.name).stat().st_size] for f in sorted(src.iterdir())
             if f.name.endswith(ONNX_SUFFIX) and (out / f.name).is_file()}
    sizes = {"fp32_bytes": before, "int8_bytes": after, "ratio": round(after / before, 4), "files": files}
    if source:
        sizes |= {"source": source, "vs_source": round(after / source["safetensors_bytes"], 4)}
    return sizes
