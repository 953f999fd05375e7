"""The quantize stage: an fp32 ONNX export dir in, an int8 export dir out (static or dynamic), checked against fp32.

    run(src, QuantizeConfig(mode="static", calib_data="train.jsonl"), out) -> report

Static int8 calibrates every graph on the tensors it really sees while the fp32 runtime generates from the
calibration texts (see `calibrate`). The result keeps the export dir's file and tensor names, so `t5compress
generate`, optimum's `ORTModelForSeq2SeqLM` and the Triton packaging use it like any other export dir. Nothing is
written when the int8 model's next-token agreement with fp32 falls below `min_agreement` on the check texts (the
eval texts when given, else the calibration texts).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from t5compress import artifacts
from t5compress.config import option as opt
from t5compress.config import require
from t5compress.cpu import FULL_WEIGHT_MAX, WEIGHT_RANGES, weight_max
from t5compress.errors import ModelError, QuantizeError, first_line
from t5compress.names import DECODER_MERGED, DECODER_WITH_PAST, ENCODER, GENERATOR, GRAPHS, ONNX_SUFFIX
from t5compress.quantize.methods import CALIBRATION_METHODS, FORMATS
from t5compress.quantize.sources import (
    AUTO_ALPHA,
    KEEP_AUTO,
    KEEP_NONE,
    KEEP_SENSITIVE,
    PER_TOKEN_AUTO,
    PER_TOKEN_NONE,
    drive_texts,
    is_gated,
    is_tied,
    per_token_nodes,
    plan_for,
    row_lookups,
    smoothed,
    smoothing_alpha,
    untied,
)
from t5compress.runtime.limits import check_stage_fits

log = logging.getLogger(__name__)

MODES = ("static", "dynamic", "blockwise")
BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits: a power of two, at least 16
GPTQ, NEAREST = "gptq", "nearest"
ROUNDINGS = (GPTQ, NEAREST)



@dataclass(frozen=True)
class QuantizeConfig:
    mode: str = opt("static", "static (calibrated activation ranges), dynamic (ranges computed per call) or "
                              "blockwise (a scale per --block-size input channels of weights and activations; "
                              "fastest at batch 1, slower at batch; calibration texts optional).")
    calib_data: str | None = opt(None, "Calibration texts: any data file `train` reads (its source field) or a .txt "
                                       "file with one text per line. Required for static.")
    field: str = opt("source", "Field of the calibration and eval records holding the input text.")
    prefix: str = opt("", "Task prefix added to every calibration and eval text, as in `train`.")
    samples: int = opt(128, "Calibration texts used (the file must hold at least this many).")
    batch_size: int = opt(16, "Calibration texts generated together (each graph run is split to hold at most 4096 "
                              "input tokens).")
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
    keep_fp32: str = opt(KEEP_AUTO, "Nodes kept fp32: auto (gated-gelu models, static, with --eval-data: if "
                                    "every group int8 misses --target-agreement on the eval texts, as sensitive; "
                                    "otherwise none, or T5's FFN output `wo` for gated-gelu models without "
                                    "per-token or smoothing), sensitive (static: "
                                    "measure each layer group's sensitivity as it is quantized, per-token and "
                                    "smoothed on gated models, keep the fewest groups fp32 that reach "
                                    "--target-agreement), none, or comma-separated name parts, e.g. "
                                    "'DenseReluDense/wo/'.")
    target_agreement: float = opt(0.97, "Static, groups measured (--keep-fp32 sensitive, or auto with --eval-data on "
                                        "a gated model): the next-token agreement with fp32 the kept groups must "
                                        "reach on the eval texts (--eval-data), else on the calibration texts.")
    per_token: str = opt(PER_TOKEN_AUTO, "Static: linear layers given per-token int8 (a scale per input row, computed "
                                         "at run time; int8 weights as elsewhere) instead of a calibrated scale: "
                                         "auto (gated-gelu models: every linear layer, whose inputs vary by orders "
                                         "of magnitude from token to token; none for relu models), none, or "
                                         "comma-separated name parts.")
    smooth_alpha: float | None = opt(None, "SmoothQuant migration strength (0 disables, 1 moves all of an input "
                                           "channel's range into the weights): outlier channels of the layer-norm "
                                           "outputs and FFN inputs of `wo` are scaled into the weights, exactly. "
                                           f"Default: {AUTO_ALPHA} for gated-gelu models under --per-token auto "
                                           "or block-wise with --calib-data, else 0.")
    rounding: str = opt(GPTQ, "Static (per-token layers, a scale per output channel) and block-wise with "
                              "--calib-data (a scale per block): how weights are rounded to int8: gptq (each rounding "
                              "error spread over the input channels not yet rounded, weighted by the calibration "
                              "inputs; GPTQ) or nearest.")
    block_size: int = opt(0, "Block-wise: input channels per scale of weights and activations (16, 32, 64, 128 or "
                             "256; 0: 128 with --calib-data, whose smoothing and GPTQ rounding make up for the "
                             "coarser blocks, else 32). Larger blocks run faster at batch 1.")
    eval_data: str | None = opt(None, "Held-out data with targets: task metrics of fp32 and int8 side by side; the "
                                      "agreement check and --keep-fp32 sensitive read its texts (calibration texts "
                                      "a model was trained on overstate agreement).")
    eval_max: int = opt(200, "Evaluate on at most this many eval records.")
    min_agreement: float = opt(0.9, "Refuse the result when int8 picks fp32's next token less often than this (on "
                                    "the eval texts when given, else on the calibration texts).")
    threads: int = opt(0, "ONNX Runtime threads while calibrating and checking (0: all cores).")
    tolerance: float | None = opt(None, "Accuracy-aware tuning (onnx-neural-compressor): keep layers fp32 until the "
                                        "task metric on --eval-data is at most this much below fp32, relative "
                                        "(0.01: 1%).")

    def __post_init__(self) -> None:
        require(self.mode in MODES, "mode", f"choose one of {', '.join(MODES)}")
        require(self.mode != "static" or bool(self.calib_data), "calib_data",
                "static quantization needs calibration texts (--calib-data FILE), or use --dynamic")
        require(self.method in CALIBRATION_METHODS, "method", f"choose one of {', '.join(CALIBRATION_METHODS)}")
        require(self.format in FORMATS, "format", f"choose one of {', '.join(FORMATS)}")
        require(self.weight_range in WEIGHT_RANGES, "weight_range",
                f"choose one of {', '.join(WEIGHT_RANGES)}, got {self.weight_range!r}")
        require(self.samples >= 1, "samples", f"must be >= 1, got {self.samples}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(0 < self.percentile <= 100, "percentile", f"must be in (0, 100], got {self.percentile}")
        require(bool(self.op_types), "op_types", "give at least one op type, e.g. MatMul")
        require(self.smooth_alpha is None or 0 <= self.smooth_alpha <= 1, "smooth_alpha",
                f"must be in [0, 1], got {self.smooth_alpha}")
        require(not self.smooth_alpha or bool(self.calib_data), "smooth_alpha",
                "smoothing measures activations: give --calib-data")
        require(self.block_size in (0, *BLOCK_SIZES), "block_size",
                f"choose one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}")
        require(self.rounding in ROUNDINGS, "rounding", f"choose one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        require(0 <= self.target_agreement <= 1, "target_agreement",
                f"must be in [0, 1], got {self.target_agreement}")
        require(0 <= self.min_agreement <= 1, "min_agreement", f"must be in [0, 1], got {self.min_agreement}")
        require(self.eval_max >= 1, "eval_max", f"must be >= 1, got {self.eval_max}")
        require(self.tolerance is None or 0 <= self.tolerance < 1, "tolerance",
                f"must be in [0, 1), e.g. 0.01 for 1%, got {self.tolerance}")
        require(self.keep_fp32 != KEEP_SENSITIVE or (self.mode == "static" and self.tolerance is None), "keep_fp32",
                "sensitive is measured on static int8 and replaces --tolerance's search: use --static, no --tolerance")
        require(self.per_token in (PER_TOKEN_AUTO, PER_TOKEN_NONE) or self.mode == "static", "per_token",
                "per-token scales are a static int8 choice; dynamic int8 scales every call already")
        require(self.tolerance is None or (self.mode == "static" and bool(self.eval_data)), "tolerance",
                "tuning needs --static and --eval-data (the task metric it keeps within tolerance)")


def block_size(cfg: QuantizeConfig) -> int:
    """Block-wise: the block size asked for, else 128 with calibration texts (on the two trained gated fixtures,
    smoothed and GPTQ-rounded blocks of 128 kept as many held-out outputs as the static default: 95.8% / 74.8%
    against 95.9% / 73.6%) and 32 without."""
    return cfg.block_size or (128 if cfg.calib_data else 32)


def check_export_dir(src: Path) -> None:
    """An fp32 ONNX export with the three graphs, not quantized already: else one line saying what is wrong."""
    from t5compress.quantize.graphs import is_quantized

    if not src.is_dir():
        raise ModelError(f"'{src}' is not a directory")
    missing = [f"{g}{ONNX_SUFFIX}" for g in GRAPHS if not (src / f"{g}{ONNX_SUFFIX}").is_file()]
    if missing and (src / f"{DECODER_MERGED}{ONNX_SUFFIX}").is_file() and (src / f"{ENCODER}{ONNX_SUFFIX}").is_file():
        raise ModelError(f"'{src}' holds only the merged decoder; quantize needs the separate decoder graphs "
                         f"(export again with them)")
    if missing:
        raise ModelError(f"'{src}' is not a complete ONNX export directory: missing {', '.join(missing)}")
    done = [g for g in GRAPHS if is_quantized(src / f"{g}{ONNX_SUFFIX}")]
    if done:
        raise ModelError(f"'{src}' is already quantized ({', '.join(done)} hold int8 ops); quantize its fp32 export")
    if _half_precision(src / f"{ENCODER}{ONNX_SUFFIX}"):
        raise ModelError(f"'{src}' is an fp16 export (export --dtype fp16); int8 is made from fp32 graphs: quantize "
                         "an export without --dtype fp16")


def _half_precision(graph: Path) -> bool:
    """Whether the graph returns float16 tensors (read without its weights)."""
    import onnx

    outputs = onnx.load(str(graph), load_external_data=False).graph.output
    return any(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for o in outputs)


@artifacts.claims_output
def run(src: str | os.PathLike, cfg: QuantizeConfig, out: str | os.PathLike, *, force: bool = False,
        progress: bool = True) -> artifacts.Report:
    """Quantize the export dir `src` into `out`; returns the report (also written to out/report.json)."""
    from t5compress.quantize.calibrate import load_texts

    out = artifacts.check_output(out, force, inputs=[src, cfg])
    src = Path(src)
    check_export_dir(src)
    check_stage_fits("quantize", src / "config.json", f"'{src}'")
    texts = load_texts(cfg.calib_data, cfg.field, cfg.prefix, cfg.samples) if cfg.calib_data else None
    evalset = _eval_examples(cfg) if cfg.eval_data else None
    checked = _check_texts(cfg, texts, evalset)
    started = time.perf_counter()
    with artifacts.staged_output(out, force, inputs=[src, cfg]) as tmp:
        for f in sorted(src.iterdir()):  # config, tokenizer, graphs.json: everything but the graphs and old reports
            if f.is_file() and not f.name.endswith((ONNX_SUFFIX, ".onnx_data")) and f.name not in (
                    artifacts.META_FILE, artifacts.REPORT_FILE):
                shutil.copy2(f, tmp / f.name)
        if cfg.tolerance is not None:  # onnx-neural-compressor's accuracy-aware tuning picks the fp32 nodes
            from t5compress.quantize import tune

            graphs = tune.run(src, tmp, cfg, texts, evalset, progress)
        else:
            graphs = _quantize_graphs(src, tmp, cfg, texts, checked[0] if evalset else None, progress)
        _finish(src, tmp, cfg, graphs)
        report = {"stage": "quantize", **_settings(cfg), "graphs": graphs, "size": _sizes(src, tmp)}
        report.update(_check(src, tmp, cfg, checked, evalset))
        report["seconds"] = round(time.perf_counter() - started, 2)
        artifacts.write_meta(tmp, "quantize", asdict(cfg), parent=src)
        artifacts.write_report(tmp, report)
    log.info("int8 export written to %s", out)
    return report


def _finish(src: Path, tmp: Path, cfg: QuantizeConfig, graphs: dict) -> None:
    """Store a tied embedding once (in the LM head's int8 matrix), then re-merge the decoders and rebuild
    generator.onnx if `src` had them.

    Not after tuning: the tuning's metric was measured on the graphs as they are, and its guarantee is about those.
    """
    if cfg.embeddings and cfg.tolerance is None:
        from t5compress.quantize.graphs import share_lm_head_table

        saved = {g: share_lm_head_table(tmp / f"{g}{ONNX_SUFFIX}") for g in GRAPHS}
        if any(saved.values()):
            graphs["tied_table_bytes_saved"] = saved
    if (src / f"{DECODER_MERGED}{ONNX_SUFFIX}").is_file():
        from t5compress.export.onnx import write_merged

        write_merged(tmp, external=False)
    if (src / f"{GENERATOR}{ONNX_SUFFIX}").is_file():  # the export carried the in-graph search: rebuild it in int8
        from t5compress.export.generator import check_generator, write_generator

        write_generator(tmp)
        graphs["search_graph"] = check_generator(tmp, cfg.max_new_tokens, strict=False)


def applied(report: dict) -> list[tuple[str, str]]:
    """What a quantize report says was done beyond calibrated int8: per-token layers and SmoothQuant, as (label, text)
    for the CLI's summary and `info` (reports before 2026-12-05 smoothed `wo` only and record no groups)."""
    graphs = report.get("graphs") or {}
    out = []
    tokenwise = {n for g in graphs.values() if isinstance(g, dict) for n in g.get("per_token") or []}
    if tokenwise:
        out.append(("per-token int8", f"{len(tokenwise)} linear layers (a scale per input row)"))
    if (tokenwise or report.get("mode") == "blockwise") and report.get("rounding") == GPTQ:
        per = f"a scale per {report['block_size']} input channels" if report.get("mode") == "blockwise" else ""
        out.append(("weights", "rounded by GPTQ on the calibration inputs" + (f" ({per})" if per else "")))
    smoothed = graphs.get("smooth_quant") or {}
    if smoothed:
        alpha = next(iter(smoothed.values()))["alpha"]
        inputs = sum(s.get("groups", s["layers"]) for s in smoothed.values())
        layers = sum(s["layers"] for s in smoothed.values())
        out.append(("SmoothQuant", f"alpha {alpha:g}: {inputs} inputs of {layers} linear layers rescaled into their "
                                   "weights"))
    return out


def _settings(cfg: QuantizeConfig) -> dict:
    s = {"mode": cfg.mode, "format": cfg.format, "per_channel": cfg.per_channel, "op_types": list(cfg.op_types),
         "embeddings": cfg.embeddings, "weight_max": weight_max(cfg.weight_range)}
    if cfg.mode == "static":
        s.update(method=cfg.method, samples=cfg.samples, calib_data=cfg.calib_data, per_token=cfg.per_token,
                 rounding=cfg.rounding, target_agreement=cfg.target_agreement)
    if cfg.mode == "blockwise":
        s.update(block_size=block_size(cfg), format="MatMulNBits")
        if cfg.calib_data:
            s.update(samples=cfg.samples, calib_data=cfg.calib_data, rounding=cfg.rounding)
    return s


def _quantize_graphs(src: Path, tmp: Path, cfg: QuantizeConfig, texts: list[str] | None, held: list[str] | None,
                     progress: bool) -> dict:
    """Quantize the three graphs (smoothing first on request) into `tmp`, calibrated on `texts` (a guided choice of
    groups measured on the `held`-out eval texts if any, else on `texts`); re-merge the decoders if `src` had it."""
    from t5compress.quantize.methods import scratch_dir, write_blockwise, write_dynamic

    with scratch_dir(tmp.parent) as scratch:
        work = Path(scratch)
        sources = {g: src / f"{g}{ONNX_SUFFIX}" for g in GRAPHS}
        if cfg.embeddings:
            sources = {g: untied(p, work) for g, p in sources.items()}
        gated = is_gated(src)
        smoothing, alpha = None, smoothing_alpha(cfg, gated)
        if alpha > 0:
            sources, smoothing = smoothed(src, sources, alpha, cfg, texts, work, progress)
        # Measured when asked, and by default on a gated model given held-out texts. Not on calibration texts alone:
        # a trained model has learnt them, so int8 agrees with it there and nothing shows, and random weights have
        # flat logits that make every group look sensitive (a random flan-t5-small shape kept 105 of 146 groups
        # fp32 after 512 s of measuring).
        guided = cfg.mode == "static" and (cfg.keep_fp32 == KEEP_SENSITIVE or (
            cfg.keep_fp32 == KEEP_AUTO and gated and held is not None))
        plan_cfg = replace(cfg, keep_fp32=KEEP_NONE) if guided else cfg  # the sensitivity decides
        plans = {g: plan_for(sources[g], plan_cfg, gated) for g in GRAPHS}
        tokenwise = {g: [n for n in per_token_nodes(sources[g], cfg, gated, is_tied(src)) if n not in plans[g].exclude]
                     for g in GRAPHS}  # what --keep-fp32 names stays fp32
        plans = {g: _without(plans[g], tokenwise[g]) for g in GRAPHS}  # left fp32 by calibration, rewritten after
        lookups = {}
        if cfg.mode == "static" and not is_tied(src):  # (a tied table's lookup reads the LM head's int8 matrix)
            sources, plans, lookups = row_lookups(sources, plans, work)
        feeds: dict[str, int] = {}
        sensitivity = None
        if cfg.mode == "static":
            plans, tokenwise, feeds, sensitivity = _static(src, tmp, work, sources, plans, tokenwise, cfg, texts,
                                                           (held or texts) if guided else None, progress)
        elif cfg.mode == "blockwise":
            rounded = _blockwise_gptq(src, sources, plans, cfg, texts, work, progress) if texts else {}
            for g in GRAPHS:
                write_blockwise(sources[g], tmp / f"{g}{ONNX_SUFFIX}", plans[g], block_size(cfg), rounded.get(g))
        else:
            reduce = weight_max(cfg.weight_range) < FULL_WEIGHT_MAX
            for g in GRAPHS:
                write_dynamic(sources[g], tmp / f"{g}{ONNX_SUFFIX}", plans[g], cfg.per_channel, reduce)
    out = {g: {"quantized_nodes": len(plans[g].nodes) + len(tokenwise[g]),
               "kept_fp32": [n for n in plans[g].exclude if n not in tokenwise[g]], "per_token": tokenwise[g],
               **({"calibration_feeds": feeds[g]} if feeds else {})} for g in GRAPHS}
    if any(lookups.values()):
        out["int8_row_lookups"] = lookups
    if smoothing:
        out["smooth_quant"] = smoothing
    if sensitivity:
        out["sensitivity"] = sensitivity
    return out


def _without(plan, names: list[str]):
    """`plan` with `names` moved from its quantized nodes to those the calibration leaves fp32."""
    return replace(plan, nodes=tuple(n for n in plan.nodes if n not in names),
                   exclude=tuple(dict.fromkeys((*plan.exclude, *names))))


def _static(src: Path, tmp: Path, work: Path, sources: dict, plans: dict, tokenwise: dict, cfg: QuantizeConfig,
            texts: list[str], guided: list[str] | None, progress: bool) -> tuple[dict, dict, dict, dict | None]:
    """Calibrate on `texts`, (guided: on those texts) measure each group's sensitivity and keep the fewest fp32,
    write the graphs into `tmp` (the `tokenwise` nodes rewritten per-token after calibration).

    Returns the plans written, the per-token nodes, the feeds each graph saw, and the sensitivity report (None unless
    guided)."""
    from t5compress.progress import Reporter
    from t5compress.quantize import sensitivity as sens
    from t5compress.quantize.calibrate import Snapshot
    from t5compress.quantize.gptq import Gram
    from t5compress.quantize.methods import StaticGraph
    from t5compress.quantize.pertoken import per_token_int8
    from t5compress.runtime import load_runtime

    reduce, wmax = weight_max(cfg.weight_range) < FULL_WEIGHT_MAX, weight_max(cfg.weight_range)
    calibrators = {g: StaticGraph(sources[g], plans[g], cfg.method, work, cfg.percentile) for g in GRAPHS}
    stats = {g: [c] for g, c in calibrators.items()}
    probe = Snapshot(at=cfg.max_new_tokens // 2)  # a mid-generation with-past step, to time what kept groups cost
    if guided:
        stats[DECODER_WITH_PAST].append(probe)
    grams = {g: Gram(sources[g], tokenwise[g]) for g in GRAPHS if cfg.rounding == GPTQ and tokenwise[g]}
    for g, gram in grams.items():
        stats[g].append(gram)
    feeds = drive_texts(src, sources, texts, stats, cfg, work, progress, "calibrating")
    rounded = _gptq(sources, grams, wmax, progress)
    report, every = None, dict(tokenwise)
    if guided:
        fp32 = load_runtime(src, threads=cfg.threads)
        with Reporter("quantize", what="sensitivity", enabled=progress, transient=True) as bar:
            plans, tokenwise, report = sens.guided(fp32, sources, plans, tokenwise, calibrators, cfg, guided, work,
                                                   rounded, status=lambda text: bar.update(0, what=text))
    outputs = report is None or report["remedy"]["chosen"] != "linear outputs fp32"
    for g in GRAPHS:
        calibrators[g].write(tmp / f"{g}{ONNX_SUFFIX}", cfg.format, cfg.per_channel, reduce, plans[g], outputs)
        tokenwise[g] = per_token_int8(tmp / f"{g}{ONNX_SUFFIX}", tokenwise[g], wmax, rounded.get(g))
    if report is not None and (report["kept"] or not outputs) and probe.feeds is not None:
        dwp, path = plans[DECODER_WITH_PAST], work / f"all-int8.{DECODER_WITH_PAST}{ONNX_SUFFIX}"
        static = tuple(n for n in dwp.exclude if n not in every[DECODER_WITH_PAST])  # kept fp32 by the measuring
        calibrators[DECODER_WITH_PAST].write(path, cfg.format, cfg.per_channel, reduce,
                                             replace(dwp, nodes=dwp.nodes + static, exclude=()))
        per_token_int8(path, every[DECODER_WITH_PAST], wmax, rounded.get(DECODER_WITH_PAST))
        all_ms = sens.step_ms(path, probe.feeds)
        kept_ms = sens.step_ms(tmp / f"{DECODER_WITH_PAST}{ONNX_SUFFIX}", probe.feeds)
        report["step_ms"] = {"all_int8": all_ms, "kept": kept_ms, "ratio": round(kept_ms / all_ms, 3)}
    return plans, tokenwise, feeds, report


def _blockwise_gptq(src: Path, sources: dict, plans: dict, cfg: QuantizeConfig, texts: list[str], work: Path,
                    progress: bool) -> dict:
    """Block-wise with calibration texts: the linear layers' weights rounded by GPTQ, a scale per block (`--rounding
    nearest`: none rounded here)."""
    from t5compress.quantize.gptq import Gram

    if cfg.rounding != GPTQ:
        return {}
    grams = {g: Gram(sources[g], list(plans[g].nodes)) for g in GRAPHS}
    drive_texts(src, sources, texts, {g: [gram] for g, gram in grams.items()}, cfg, work, progress, "calibrating")
    return _gptq(sources, grams, FULL_WEIGHT_MAX, progress, block_size(cfg))


def _gptq(sources: dict[str, Path], grams: dict, weight_max: int, progress: bool, group: int | None = None) -> dict:
    """`gptq.round_graphs` with a progress bar."""
    from t5compress.progress import Reporter
    from t5compress.quantize.gptq import round_graphs

    with Reporter("quantize", sum(len(g.inputs) for g in grams.values()), unit="layer", what="GPTQ rounding",
                  enabled=progress, transient=True) as bar:
        return round_graphs(sources, grams, weight_max, step=lambda: bar.update(1), group=group)


def _sizes(src: Path, out: Path) -> dict:
    def total(d: Path) -> int:
        return sum(f.stat().st_size for f in d.iterdir() if f.name.endswith((ONNX_SUFFIX, ".onnx_data")))

    before, after = total(src), total(out)
    files = {f.name: [f.stat().st_size, (out / f.name).stat().st_size] for f in sorted(src.iterdir())
             if f.name.endswith(ONNX_SUFFIX) and (out / f.name).is_file()}
    return {"fp32_bytes": before, "int8_bytes": after, "ratio": round(after / before, 4), "files": files}


def _eval_examples(cfg: QuantizeConfig):
    from t5compress.data import DataConfig, load_examples

    return load_examples(cfg.eval_data, DataConfig(source_field=cfg.field))[: cfg.eval_max]


def _check_texts(cfg: QuantizeConfig, texts: list[str] | None, evalset) -> tuple[list[str] | None, str]:
    """What int8 is checked on (and, guided, its groups measured on), and what to call them: the eval texts when
    there are some, else the calibration texts.

    Held-out texts first: calibration texts usually come from the training data, which a trained model has learnt,
    and on them int8 agrees with fp32 far more than on inputs it has not seen (a gated d256 model trained on
    docstring sentences: the default's next token 99.9% on training texts, 94.2% on 800 held-out ones)."""
    if evalset:
        return [cfg.prefix + e.source for e in evalset], "eval texts"
    return texts, "calibration texts"


def _check(src: Path, out: Path, cfg: QuantizeConfig, checked: tuple[list[str] | None, str], evalset) -> dict:
    """Teacher-forced agreement (thresholded) and greedy agreement on the `checked` texts, and task metrics, of
    fp32 vs int8. fp32's side is computed first and kept on disk, so the two runtimes are never loaded together."""
    from t5compress import metrics
    from t5compress.quantize.check import CHECK_TEXTS, Reference, agreement, greedy_outputs
    from t5compress.quantize.methods import scratch_dir
    from t5compress.runtime import load_runtime
    from t5compress.runtime.limits import release_memory

    release_memory()  # the quantizer's freed buffers (1.4 GB resident after writing a t5-base shape's graphs)
    fp32 = load_runtime(src, threads=cfg.threads)
    check_texts, on = checked
    if check_texts is None:
        check_texts, on = _probe_texts(fp32), "generated probe texts"
    check_texts = check_texts[:CHECK_TEXTS]
    sources = checked[0] if evalset else None  # the eval texts (see _check_texts)
    every = sources is not None and len(sources) == len(check_texts)  # the check reads every eval text
    a = greedy_outputs(fp32, check_texts, max_new_tokens=cfg.max_new_tokens)
    p32 = a if every else greedy_outputs(fp32, sources, max_new_tokens=cfg.max_new_tokens) if evalset else None
    with scratch_dir(out.parent) as scratch:
        reference = Reference(fp32, check_texts, cfg.batch_size, cfg.max_new_tokens, store=Path(scratch))
        reference.fp32 = fp32 = None  # on disk now; compare is given both int8 graphs
        release_memory()
        int8 = load_runtime(out, threads=cfg.threads)
        try:
            tf = reference.compare(int8.backend.encoder, int8.backend.decoder)
            b = greedy_outputs(int8, check_texts, max_new_tokens=cfg.max_new_tokens)
        except Exception as e:  # onnxruntime's own types: an int8 graph that cannot even run is a broken quantization
            raise QuantizeError(f"the int8 graphs fail to run ({first_line(e)}); quantize fewer --op-types; "
                                "nothing was written") from e
    result = {"check": {**tf, "greedy_agreement": agreement(a, b), "texts": len(check_texts), "on": on,
                        "min_agreement": cfg.min_agreement}}
    if tf["next_token_agreement"] < cfg.min_agreement:
        raise QuantizeError(
            f"int8 picks fp32's next token at {tf['next_token_agreement']:.1%} of positions on the {on}, below "
            f"--min-agreement {cfg.min_agreement:g}: the quantization is broken (fewer --op-types, keep more "
            f"nodes fp32, or another --method); nothing was written"
        )
    if evalset:
        targets = [e.target for e in evalset]
        p8 = b if every else greedy_outputs(int8, sources, max_new_tokens=cfg.max_new_tokens)
        result["eval"] = {"fp32": metrics.compute(p32, targets), "int8": metrics.compute(p8, targets),
                          "greedy_agreement": agreement(p32, p8), "examples": len(evalset), "data": cfg.eval_data}
    return result


def _probe_texts(rt, n: int = 32) -> list[str]:
    """Without any data (dynamic, no --eval-data): texts decoded from random token ids of the model's vocabulary."""
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = int((artifacts.read_json(rt.path / "config.json") or {}).get("vocab_size", 256))
    texts = [rt.decode(rng.integers(3, vocab, (1, int(rng.integers(4, 24)))))[0] for _ in range(n)]
    return [t for t in texts if t.strip()] or ["hello"]
