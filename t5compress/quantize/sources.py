"""What a quantization starts from, shared by every method and by accuracy-aware tuning: the export's graphs, each one
`Graph` that parses its file once, rewritten as the plan asks (untied, smoothed, int8 row lookups), the node plan of
each, and the fp32 runtime driven over the calibration texts (`Export`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from t5compress.errors import ModelError
from t5compress.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST, ENCODER, GRAPHS, ONNX_SUFFIX
from t5compress.progress import Reporter
from t5compress.quantize.plan import KEEP_MEASURED, KEEP_NONE, KEEP_WO, PER_TOKEN_AUTO, PER_TOKEN_NONE, QuantPlan


class Graph:
    """One graph as this run has it (the export's file, or a rewritten copy): its path, and its structure parsed once
    and kept without its weights' bytes (node names, op types, shapes and types of the weights, where the weights
    are stored). The file is parsed once: the weights are read from their external data when asked for."""

    def __init__(self, name: str, path: Path, model: Any = None):
        self.name, self.path, self._model = name, Path(path), model
        self.whole = True  # every weight of the file is in `model` or in its external data (none was dropped)

    @property
    def model(self):
        if self._model is None:
            from t5compress.onnxstore import MIN_BYTES
            from t5compress.runtime.sessions import load_onnx

            model = load_onnx(str(self.path), load_external_data=False)
            for t in model.graph.initializer:  # the structure is what is kept: shapes and types stay
                if len(t.raw_data) >= MIN_BYTES:  # a large weight held inline in the file (small ones are kept)
                    t.ClearField("raw_data")
                    self.whole = False
            self._model = model if self.whole else _copy(model)  # the cleared bytes stay in `model`'s arena
        return self._model

    def weights(self):
        """The whole graph, weights included (a copy: the caller rewrites it), its structure as parsed and its
        weights read from their external data; the file is parsed again only where it held large weights inline."""
        import onnx
        from onnx.external_data_helper import load_external_data_for_model

        from t5compress.runtime.sessions import load_onnx

        structure = self.model
        if not self.whole:
            return load_onnx(str(self.path))
        model = onnx.ModelProto()
        model.CopyFrom(structure)
        try:
            load_external_data_for_model(model, str(self.path.parent))
        except Exception:  # OSError, onnx's own: a missing or cut weights file, which load_onnx names in one line
            return load_onnx(str(self.path))
        return model

    def in_scratch(self, work: Path) -> Path:
        """This graph's file at a path in `work`, for tools that write beside the graph they are given (ONNX
        Runtime's quantizer writes `<graph>-inferred.onnx` there, onnx-neural-compressor `<graph>_augment.onnx` and
        its weights), which must never write into the export dir: the file itself when it is in `work` already (a
        rewritten graph), else a copy of it and its external data in `work`/input, each file copied once (the graphs
        of an export read one weights file). Copies, not hard links: onnx refuses to read weights from a file with
        several links (or through a symlink). On a t5-base shape the copy is 891 MB, 1.9-4.5 s."""
        import shutil

        if work in self.path.parents:
            return self.path
        dst = work / "input"
        dst.mkdir(exist_ok=True)
        files = {e.value for t in self.model.graph.initializer for e in t.external_data if e.key == "location"}
        for name in (self.path.name, *sorted(files)):
            if not (dst / name).exists():
                shutil.copyfile(self.path.parent / name, dst / name)
        return dst / self.path.name

    def rewritten(self, model, path: Path) -> Graph:
        """`model` (this graph rewritten) saved to `path`, its weights apart; the new Graph keeps a copy of its
        structure, so it needs no parse. A copy, not `model`: saving clears the weights' fields, but their bytes
        stay in the message's protobuf arena as long as any part of it lives (a t5-base shape's untied graphs held
        1.2 GB that way through calibration and the check)."""
        from t5compress.quantize.graphs import save_graph

        save_graph(model, path, external=True)
        return Graph(self.name, path, _copy(model))


def _copy(model):
    """A copy of `model` in a protobuf arena of its own (a cleared field's bytes stay in the arena they were read or
    made in, as long as any part of that message lives)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def copy_beside(src: Path, dst: Path) -> None:
    """Copy what an export dir holds beside its graphs into `dst`: config, tokenizer, generation defaults,
    graphs.json; not the graphs, their weights, nor the stage's own records (`t5compress.json`, `report.json`)."""
    import shutil

    from t5compress import artifacts

    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith((ONNX_SUFFIX, ".onnx_data")) and f.name not in (
                artifacts.META_FILE, artifacts.REPORT_FILE):
            shutil.copy2(f, dst / f.name)


def open_graphs(src: Path) -> dict[str, Graph]:
    """The graphs of `src`, an fp32 ONNX export with the three graphs, not quantized already: else one line saying
    what is wrong. (Whether this machine can quantize it depends on the plan: `stage._prepare` asks.)"""
    import onnx

    from t5compress.quantize.graphs import quantized_ops

    if not src.is_dir():
        raise ModelError(f"'{src}' is not a directory")
    missing = [f"{g}{ONNX_SUFFIX}" for g in GRAPHS if not (src / f"{g}{ONNX_SUFFIX}").is_file()]
    if missing and (src / f"{DECODER_MERGED}{ONNX_SUFFIX}").is_file() and (src / f"{ENCODER}{ONNX_SUFFIX}").is_file():
        raise ModelError(f"'{src}' holds only the merged decoder; quantize needs the separate decoder graphs "
                         f"(export again with them)")
    if missing:
        raise ModelError(f"'{src}' is not a complete ONNX export directory: missing {', '.join(missing)}")
    graphs = {g: Graph(g, src / f"{g}{ONNX_SUFFIX}") for g in GRAPHS}
    done = [g for g in GRAPHS if quantized_ops(graphs[g].model)]
    if done:
        raise ModelError(f"'{src}' is already quantized ({', '.join(done)} hold int8 ops); quantize its fp32 export")
    if any(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for o in graphs[ENCODER].model.graph.output):
        raise ModelError(f"'{src}' is an fp16 export (export --dtype fp16); int8 is made from fp32 graphs: quantize "
                         "an export without --dtype fp16")
    return graphs


@dataclass
class Export:
    """The export dir being quantized: its graphs as rewritten so far, the plan, the calibration texts, and the scratch
    folder rewritten graphs and tapped sessions go to."""

    src: Path
    cfg: Any
    plan: QuantPlan
    graphs: dict[str, Graph]
    texts: list[str] | None
    work: Path  # the scratch folder, once open
    progress: bool = True
    evalset: list | None = None  # held-out records with targets
    checked: tuple = (None, "")  # the texts the int8 result is checked on, and what they are (`check.check_texts`)

    def untie(self) -> None:
        """Each graph with its tied embedding table split from the LM head (a copy in `work`), if it has one."""
        from t5compress.quantize.graphs import shared_embeddings, untie_embeddings

        for g, graph in self.graphs.items():
            if not shared_embeddings(graph.model):
                continue
            model = graph.weights()
            if untie_embeddings(model):
                self.graphs[g] = graph.rewritten(model, self.work / f"{g}.untied{ONNX_SUFFIX}")

    def smooth(self) -> dict:
        """Measure the linear layers' input channels on the calibration texts, then rescale the graphs (written to
        `work`; see `quantize.smooth`); returns what was rescaled, per graph."""
        from t5compress.quantize.smooth import ChannelMax, smooth_groups, smooth_model

        groups = {g: smooth_groups(graph.model) for g, graph in self.graphs.items()}
        meters = {g: ChannelMax(groups[g]) for g in GRAPHS if groups[g]}
        self.drive({g: [m] for g, m in meters.items()}, "measuring input channels")
        join_decoders(meters)
        summary = {}
        for g, meter in meters.items():
            model = self.graphs[g].weights()
            summary[g] = smooth_model(model, groups[g], meter.amax, self.plan.smooth_alpha)
            self.graphs[g] = self.graphs[g].rewritten(model, self.work / f"{g}.smoothed{ONNX_SUFFIX}")
        return summary

    def node_plans(self) -> tuple[dict, dict[str, list[str]]]:
        """Each graph's node plan, and its linear layers given per-token int8 (left fp32 by calibration, rewritten
        after it); what --keep-fp32 names stays fp32."""
        plans = {g: plan_for(graph.model, self.cfg, self.plan) for g, graph in self.graphs.items()}
        tokenwise = {g: [n for n in per_token_nodes(graph.model, self.plan) if n not in plans[g].exclude]
                     for g, graph in self.graphs.items()}
        return {g: _without(plans[g], tokenwise[g]) for g in plans}, tokenwise

    def row_lookups(self, plans: dict) -> tuple[dict, dict[str, int]]:
        """The graphs' embedding lookups gathering int8 rows, each with its own scale (`graphs.int8_row_lookups`;
        static int8 gave an untied table one scale for all of it): the plans without those lookups, and how many each
        graph has."""
        from t5compress.quantize.graphs import int8_row_lookups

        plans, done = dict(plans), {}
        for g, graph in self.graphs.items():
            names = {n.name for n in graph.model.graph.node if n.op_type == "Gather" and n.name in plans[g].nodes}
            if not names:
                done[g] = 0
                continue
            model = graph.weights()
            done[g] = int8_row_lookups(model, names)
            self.graphs[g] = graph.rewritten(model, self.work / f"{g}.rows{ONNX_SUFFIX}")
            plans[g] = replace(plans[g], nodes=tuple(n for n in plans[g].nodes if n not in names))
        return plans, done

    def drive(self, stats: dict, what: str, texts: list[str] | None = None) -> dict[str, int]:
        """Generate on the calibration texts through the graphs (tapped by `stats`, see `calibrate.drive`)."""
        from t5compress.quantize.calibrate import drive

        texts = texts or self.texts
        cfg = self.cfg
        with Reporter("quantize", len(texts), unit="text", what=what, enabled=self.progress, transient=True) as bar:
            return drive(self.src, self.graphs, texts, stats, cfg.batch_size, cfg.max_new_tokens, self.work,
                         cfg.threads, progress=bar.update)


def _without(plan, names: list[str]):
    """`plan` with `names` moved from its quantized nodes to those the calibration leaves fp32."""
    return replace(plan, nodes=tuple(n for n in plan.nodes if n not in names),
                   exclude=tuple(dict.fromkeys((*plan.exclude, *names))))


def plan_for(model, cfg, plan: QuantPlan):
    """The nodes of one graph (its structure) to quantize and to keep fp32 (see `quantize.graphs`)."""
    from t5compress.quantize.graphs import embedding_nodes, ffn_output_nodes, linear_nodes, matching
    from t5compress.quantize.methods import Plan

    linear_ops = tuple(t for t in cfg.op_types if t in ("MatMul", "Gemm"))
    nodes = linear_nodes(model, linear_ops) if linear_ops else []
    nodes += [n.name for n in model.graph.node if n.op_type in cfg.op_types and n.op_type not in ("MatMul", "Gemm")]
    op_types = list(cfg.op_types)
    if cfg.embeddings:
        nodes += [n for n in embedding_nodes(model) if n not in nodes]
        op_types += ["Gather"] if "Gather" not in op_types else []
    if plan.keep_fp32 in (KEEP_NONE, KEEP_MEASURED):
        keep = []
    elif plan.keep_fp32 == KEEP_WO:
        keep = ffn_output_nodes(nodes)
    else:
        keep = matching(nodes, _parts(plan.keep_fp32))
    return Plan(tuple(n for n in nodes if n not in keep), tuple(keep), tuple(op_types))


def per_token_nodes(model, plan: QuantPlan) -> list[str]:
    """The linear layers of one graph to quantize per token: for auto, every linear layer of a gated model but a tied
    LM head (which shares its int8 table with the embedding lookup, `graphs.share_lm_head_table`)."""
    from t5compress.quantize.graphs import linear_nodes, matching

    if plan.per_token == PER_TOKEN_NONE:
        return []
    linear = linear_nodes(model, ("MatMul",))
    if plan.per_token != PER_TOKEN_AUTO:
        return matching(linear, _parts(plan.per_token))
    return [n for n in linear if not (plan.tied and "lm_head" in n)]


def _parts(names: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in names.split(",") if p.strip())


def model_config(export_dir: Path) -> tuple[bool, bool]:
    """(gated, tied) from the export's config.json: a gated FFN (T5 v1.1 / Flan, whose `wo` inputs have outliers),
    and an LM head sharing the token embedding's matrix (T5 v1.0; not T5 v1.1 / Flan)."""
    from t5compress import artifacts

    config = artifacts.read_json(export_dir / "config.json") or {}
    return (str(config.get("feed_forward_proj", "relu")).startswith("gated"),
            bool(config.get("tie_word_embeddings", True)))


def join_decoders(meters: dict) -> None:
    """Give a layer both decoder graphs hold one calibration statistic, measured over both graphs' runs (`meters`: by
    graph name, each with `join`, e.g. `smooth.ChannelMax`; GPTQ's X^T X is summed into one as the graphs run,
    `gptq.gram_meters`). The weights rewritten from it (smoothed, GPTQ-rounded) are then byte-identical in the two
    graphs, so the dir stores them once (`onnxstore`). Measured per graph, the statistics differed in their last
    bits (all positions at once against one step at a time) and some weights rounded otherwise: a flan-t5-small
    shape's static int8 dir was 1.50x CTranslate2's bytes, 1.03x joined."""
    first, past = meters.get(DECODER), meters.get(DECODER_WITH_PAST)
    if first is not None and past is not None:
        first.join(past)
