"""What a quantization starts from, shared by the plain stage and accuracy-aware tuning: the graphs (untied, smoothed),
the node plan of each, and the fp32 runtime driven over the calibration texts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from t5compress import artifacts
from t5compress.names import GRAPHS, ONNX_SUFFIX
from t5compress.progress import Reporter

KEEP_AUTO, KEEP_NONE, KEEP_SENSITIVE = "auto", "none", "sensitive"
PER_TOKEN_AUTO, PER_TOKEN_NONE = "auto", "none"
AUTO_ALPHA = 0.5  # SmoothQuant's own default; on two trained gated fixtures 0.5, 0.7 and 0.85 did alike


def untied(path: Path, work: Path) -> Path:
    """`path` with its tied embedding table split from the LM head (a copy in `work`), or `path` if it has none."""
    from t5compress.quantize.graphs import untie_embeddings

    dst = work / f"{path.stem}.untied{ONNX_SUFFIX}"
    return dst if untie_embeddings(path, dst) else path


def plan_for(path: Path, cfg, gated: bool):
    """The nodes of one graph to quantize and to keep fp32 (see `quantize.graphs`)."""
    from t5compress.quantize.graphs import embedding_nodes, ffn_output_nodes, linear_nodes, matching
    from t5compress.quantize.methods import Plan
    from t5compress.runtime.sessions import load_onnx

    model = load_onnx(str(path), load_external_data=False)
    linear_ops = tuple(t for t in cfg.op_types if t in ("MatMul", "Gemm"))
    nodes = linear_nodes(model, linear_ops) if linear_ops else []
    nodes += [n.name for n in model.graph.node if n.op_type in cfg.op_types and n.op_type not in ("MatMul", "Gemm")]
    op_types = list(cfg.op_types)
    if cfg.embeddings:
        nodes += [n for n in embedding_nodes(model) if n not in nodes]
        op_types += ["Gather"] if "Gather" not in op_types else []
    if cfg.keep_fp32 == KEEP_AUTO:  # per-token int8 (auto) is what replaced keeping `wo` fp32 for gated models
        outliers = gated and smoothing_alpha(cfg, gated) == 0 and cfg.mode != "blockwise"  # a block scale takes them
        keep = ffn_output_nodes(nodes) if outliers and not uses_per_token(cfg) else []
    elif cfg.keep_fp32 == KEEP_NONE:
        keep = []
    else:
        keep = matching(nodes, tuple(p.strip() for p in cfg.keep_fp32.split(",") if p.strip()))
    return Plan(tuple(n for n in nodes if n not in keep), tuple(keep), tuple(op_types))


def uses_per_token(cfg) -> bool:
    """Whether static int8 gives some linear layers per-token scales (see `quantize.pertoken`): not with --tolerance
    (its search measures QDQ graphs). --keep-fp32 sensitive measures the per-token layers as per-token."""
    return cfg.mode == "static" and cfg.per_token != PER_TOKEN_NONE and cfg.tolerance is None


def smoothing_alpha(cfg, gated: bool) -> float:
    """SmoothQuant's migration strength: as given, else (auto) AUTO_ALPHA for a gated model under per-token auto.

    Per-token scales follow each row's size but not a channel's: on the trained gated fixture the few outlier
    channels of the layer-norm outputs still cost held-out outputs until migrated into the weights
    (benchmarks/results/current/int8_gated.md)."""
    if cfg.smooth_alpha is not None:
        return cfg.smooth_alpha
    if cfg.mode == "blockwise":  # a block's scale follows its largest channel: move outliers out when data is given
        return AUTO_ALPHA if gated and cfg.calib_data else 0.0
    return AUTO_ALPHA if gated and cfg.per_token == PER_TOKEN_AUTO and uses_per_token(cfg) else 0.0


def per_token_nodes(path: Path, cfg, gated: bool, tied: bool) -> list[str]:
    """The linear layers of one graph to quantize per token: for auto, every linear layer of a gated model but a tied
    LM head (which shares its int8 table with the embedding lookup, `graphs.share_lm_head_table`)."""
    from t5compress.quantize.graphs import linear_nodes, matching
    from t5compress.runtime.sessions import load_onnx

    if not uses_per_token(cfg):
        return []
    linear = linear_nodes(load_onnx(str(path), load_external_data=False), ("MatMul",))
    if cfg.per_token != PER_TOKEN_AUTO:
        return matching(linear, tuple(p.strip() for p in cfg.per_token.split(",") if p.strip()))
    if not gated:
        return []
    return [n for n in linear if not (tied and "lm_head" in n)]


def is_tied(export_dir: Path) -> bool:
    """Whether the export's LM head shares the token embedding's matrix (T5 v1.0; not T5 v1.1 / Flan)."""
    config = artifacts.read_json(export_dir / "config.json") or {}
    return bool(config.get("tie_word_embeddings", True))


def is_gated(export_dir: Path) -> bool:
    """Whether the export's model has a gated FFN (T5 v1.1 / Flan): its `wo` inputs have outliers."""
    config = artifacts.read_json(export_dir / "config.json") or {}
    return str(config.get("feed_forward_proj", "relu")).startswith("gated")


def row_lookups(sources: dict[str, Path], plans: dict, work: Path) -> tuple[dict[str, Path], dict, dict[str, int]]:
    """The graphs with the embedding lookups of their plans gathering int8 rows, each with its own scale (written to
    `work`; see `graphs.int8_row_lookups`), the plans without those lookups, and how many each graph has. Static int8
    gave an untied table one scale for all of it."""
    import onnx

    from t5compress.quantize.graphs import int8_row_lookups
    from t5compress.runtime.sessions import load_onnx

    out, plans, done = dict(sources), dict(plans), {}
    for g, path in sources.items():
        model = load_onnx(str(path))
        names = {n.name for n in model.graph.node if n.op_type == "Gather" and n.name in plans[g].nodes}
        done[g] = int8_row_lookups(model, names)
        if done[g]:
            out[g] = work / f"{g}.rows{ONNX_SUFFIX}"
            onnx.save(model, str(out[g]))
            plans[g] = replace(plans[g], nodes=tuple(n for n in plans[g].nodes if n not in names))
    return out, plans, done


def smoothed(src: Path, sources: dict[str, Path], alpha: float, cfg, texts: list[str], work: Path, progress: bool):
    """Measure the linear layers' input channels on the calibration texts, then write rescaled fp32 graphs into
    `work` (see `quantize.smooth`)."""
    from t5compress.quantize.smooth import ChannelMax, smooth, smooth_groups
    from t5compress.runtime.sessions import load_onnx

    groups = {g: smooth_groups(load_onnx(str(p), load_external_data=False)) for g, p in sources.items()}
    meters = {g: ChannelMax(groups[g]) for g in GRAPHS if groups[g]}
    drive_texts(src, sources, texts, {g: [m] for g, m in meters.items()}, cfg, work, progress,
                "measuring input channels")
    smoothed, summary = dict(sources), {}
    for g, meter in meters.items():
        smoothed[g] = work / f"{g}.smoothed{ONNX_SUFFIX}"
        summary[g] = smooth(sources[g], smoothed[g], groups[g], meter.amax, alpha)
    return smoothed, summary


def drive_texts(src: Path, graphs: dict[str, Path], texts: list[str], stats: dict, cfg, work: Path, progress: bool,
                what: str) -> dict[str, int]:
    """Generate on `texts` through `graphs` (tapped by `stats`, see `calibrate.drive`), showing progress."""
    from t5compress.quantize.calibrate import drive

    with Reporter("quantize", len(texts), unit="text", what=what, enabled=progress, transient=True) as bar:
        return drive(src, graphs, texts, stats, cfg.batch_size, cfg.max_new_tokens, work, cfg.threads,
                     progress=bar.update)
