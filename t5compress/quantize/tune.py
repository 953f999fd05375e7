"""Accuracy-aware static int8 with onnx-neural-compressor: keep nodes fp32 until the task metric is within tolerance.

    run(export) -> graphs report, graphs  # the stage's `sources.Export` of a config with eval_data and tolerance

The search is onnx-neural-compressor's own (`tuning.autotune` over a `TuningConfig` of `StaticQuantConfig`s, its
calibration and its quantizer); what it tunes is which nodes stay fp32, in growing groups (non-linear op types if
any were asked for, lm_head, FFN output `wo`, FFN input `wi`, attention output, q/k/v, embeddings, everything).
Its autotune takes one ONNX graph and a T5 export is three, so each graph is tuned in turn (decoder-with-past first:
it runs at every generated token) with an eval function that opens the candidate graph beside the graphs settled so
far, as the runtime opens the stage's result (`Pipeline`), and returns the task metric of the whole pipeline on the
eval data. Every graph's
stop threshold is the same absolute number, fp32's metric x (1 - tolerance), so the final model is within tolerance
of fp32 end to end, not per graph.

onnx-neural-compressor 1.0 declares numpy<2 but runs this path under numpy 2 (measured; see the Makefile), and it
calls exit() when no candidate meets the goal: the last candidate here is the graph all fp32, which always does.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from t5compress.errors import ConfigError, QuantizeError, first_line
from t5compress.names import DECODER, DECODER_WITH_PAST, ENCODER, GRAPHS, ONNX_SUFFIX
from t5compress.progress import Reporter
from t5compress.runtime.sessions import load_onnx

log = logging.getLogger(__name__)

TUNE_ORDER = (DECODER_WITH_PAST, DECODER, ENCODER)  # most-run graph first: it gets the first share of the budget
# Fallback groups, in the order they are kept fp32 (cumulative): most outlier-prone / least compute first.
FALLBACKS = (
    ("lm_head", ("lm_head",)),
    ("FFN output wo", ("DenseReluDense/wo/",)),
    ("FFN input wi", ("DenseReluDense/wi",)),
    ("attention output o", ("Attention/o/",)),
    ("attention q/k/v", ("Attention/q/", "Attention/k/", "Attention/v/")),
    ("embeddings", ("embed_tokens/Gather",)),
)
MAX_FEEDS = 64  # recorded calibration feeds per graph, sampled evenly over all (see `calibrate.Recorder`) ...
FEED_BYTES = 1 << 30  # ... and at most this many bytes of them (a with-past feed holds the whole cache)
METRIC, FALLBACK_METRIC = "exact_match", "rougeL"


def _onc():
    """onnx-neural-compressor's tuning and config modules, or one line saying how to install them."""
    try:
        from onnx_neural_compressor import data_reader
        from onnx_neural_compressor.quantization import config, tuning
    except ImportError as e:
        raise ConfigError(f"tolerance: tuning needs onnx-neural-compressor ({first_line(e)}); `make` installs it "
                          "(pip install -e '.[inc]' && pip install --no-deps onnx-neural-compressor==1.0)") from e
    return tuning, config, data_reader


def candidates(nodes: list[str], keep: list[str], linear: list[str]) -> list[tuple[str, list[str]]]:
    """(label, nodes kept fp32) in search order: `keep` first, then the non-linear ops (the relative-position
    arithmetic breaks in int8), then each fallback group of linear layers added, then all of `nodes`."""
    from t5compress.quantize.graphs import matching

    out, kept = [("as configured", list(keep))], list(keep)
    groups = [("other op types", [n for n in nodes if n not in set(linear)])]
    groups += [(label, matching(nodes, patterns)) for label, patterns in FALLBACKS]
    for label, group in groups:
        more = [n for n in group if n not in kept]
        if more:
            kept = kept + more
            out.append((f"+ {label}", kept))
    if len(kept) < len(nodes):
        out.append(("+ everything else", list(nodes)))
    return out


def fp32_nodes(path: Path, names: list[str]) -> list[str]:
    """Those of `names` still in the graph at `path` with an fp32 constant weight (linear layers, embeddings)."""
    import onnx

    model = load_onnx(str(path), load_external_data=False)
    floats = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    wanted = set(names)
    out = []
    for n in model.graph.node:
        if n.name in wanted and n.op_type in ("MatMul", "Gemm", "Gather"):
            weight = n.input[0] if n.op_type == "Gather" else (n.input[1] if len(n.input) > 1 else "")
            if weight in floats:
                out.append(n.name)
    return out


def _recording_sampler(state: dict):
    """onnx-neural-compressor's sequential sampler, noting which candidate is being tried (it is lazy: the index
    yielded last is the one evaluated next)."""
    tuning, _, _ = _onc()

    class Recording(tuning.SequentialSampler):
        def __iter__(self):
            for i in range(len(self.config_source)):
                state["index"] = i
                yield i

    return Recording


def _reader(feeds: list[dict[str, np.ndarray]]):
    _, _, data_reader = _onc()

    class Reader(data_reader.CalibrationDataReader):
        def __init__(self):
            self.i = 0

        def get_next(self):
            self.i += 1
            return feeds[self.i - 1] if self.i <= len(feeds) else None

        def rewind(self):
            self.i = 0

    return Reader()


class Pipeline:
    """The generation runtime of an export dir with any of its graphs swapped: the task metric on the eval data.

    Each candidate set of graphs is written into a dir of its own under `work` and opened by `load_runtime`, as the
    stage's check and its users open the result: on the CPU the first decoder step then runs on the with-past graph
    (`runtime.firststep`), and decoder_model adds only its cross-attention cache. Swapping graph objects into the
    fp32 dir's backend instead ran the first step on the candidate decoder_model, whose int8 scales are its own: a
    tuned model that measured 71.5 exact match here scored 70.5 in the check that followed."""

    def __init__(self, export):
        """`export`: a `sources.Export`, whose fp32 graphs are scored first."""
        from t5compress.quantize.sources import copy_beside

        cfg = self.cfg = export.cfg
        self.dir = export.work / "pipeline"
        self.dir.mkdir()
        copy_beside(export.src, self.dir)
        self.given: dict = {}  # graph -> the model given since the last score, not yet in `dir`
        for g, graph in export.graphs.items():  # the fp32 graphs, one at a time
            self._write(g, graph.weights())
        self.sources = [cfg.prefix + e.source for e in export.evalset]
        self.targets = [e.target for e in export.evalset]
        self.metric: str | None = None

    def use(self, graph: str, model) -> None:
        """Score with `model` (a graph in memory, handed over: writing it into `dir` moves its weights out) as `graph`
        from now on (the tuner writes each candidate to the same file: compared by path, every trial after the
        first scored the first)."""
        self.given[graph] = model

    def _place(self) -> None:
        """Write the graphs given since the last score into `dir`, each with its weights beside it."""
        for g in list(self.given):
            self._write(g, self.given.pop(g))

    def _write(self, graph: str, model) -> None:
        from t5compress.quantize.graphs import save_graph

        dst = self.dir / f"{graph}{ONNX_SUFFIX}"
        (self.dir / f"{dst.name}_data").unlink(missing_ok=True)  # onnx appends to an existing data file
        save_graph(model, dst, external=True)

    def score(self) -> float:
        """The metric (exact match; ROUGE-L when fp32 gets no example exactly right) of greedy generation."""
        from t5compress import metrics
        from t5compress.quantize.check import greedy_outputs
        from t5compress.runtime import load_runtime

        self._place()
        runtime = load_runtime(self.dir, threads=self.cfg.threads)
        out = greedy_outputs(runtime, self.sources, max_new_tokens=self.cfg.max_new_tokens)
        del runtime
        scores = metrics.compute(out, self.targets)
        if self.metric is None:
            self.metric = METRIC if scores[METRIC] > 0 else FALLBACK_METRIC
        return float(scores[self.metric])


def run(export) -> tuple[dict, dict]:
    """Tune the three int8 graphs of `export` (a `sources.Export`); returns the `graphs` part of the quantize report,
    and the graphs (in memory)."""
    from t5compress.quantize.calibrate import Recorder

    _onc()
    cfg, evalset = export.cfg, export.evalset
    if not evalset:
        raise ConfigError("tolerance: tuning needs --eval-data with targets (the task metric it keeps)")
    pipe = Pipeline(export)
    fp32 = pipe.score()
    if fp32 <= 0:
        raise QuantizeError(f"the fp32 model scores 0 {pipe.metric} on {cfg.eval_data}: no tolerance can be kept")
    goal = fp32 * (1 - cfg.tolerance)
    recorders = {g: Recorder(MAX_FEEDS, FEED_BYTES) for g in GRAPHS}
    report, models = {}, {}
    trials: list[dict] = []
    # Its INFO lines per trial are reported here instead; transformers warns each time it reads our config.json.
    quiet = [logging.getLogger(n) for n in ("onnx_neural_compressor", "transformers.configuration_utils")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        with _status(export.progress) as status:
            feeds = export.drive({g: [r] for g, r in recorders.items()}, "recording calibration feeds")
            if cfg.embeddings:  # the same untied, smoothed fp32 graphs as untuned static int8 starts from
                export.untie()
            if export.plan.smooth_alpha > 0:
                report["smooth_quant"] = export.smooth()
            for g in TUNE_ORDER:
                status(f"tuning {g}")
                report[g], models[g] = tune_graph(export.graphs[g], export, pipe, goal, recorders[g].feeds, trials,
                                                  status)
                report[g]["seen_feeds"] = feeds[g]
                pipe.use(g, _copy(models[g]))
    finally:
        for q, lv in zip(quiet, levels, strict=True):
            q.setLevel(lv)
    report["tuning"] = {"tool": "onnx-neural-compressor autotune", "metric": pipe.metric, "fp32": fp32,
                        "tolerance": cfg.tolerance, "goal": round(goal, 4), "int8": pipe.score(), "trials": trials}
    return report, models


def tune_graph(graph, export, pipe: Pipeline, goal: float, feeds: list, trials: list,
               status=lambda text: None) -> tuple[dict, object]:
    """onnx-neural-compressor's autotune on `graph` (a `sources.Graph`; the other graphs as `pipe` has them): what it
    kept, and the int8 graph (in memory). Appends one record per trial to `trials` and shows each result through
    `status(text)`."""
    import onnxruntime as ort

    from t5compress.quantize.sources import plan_for

    tuning, config, _ = _onc()
    g, path, cfg = graph.name, graph.in_scratch(export.work), export.cfg  # it writes beside the graph
    plan = plan_for(graph.model, cfg, export.plan)
    nodes = list(plan.nodes) + list(plan.exclude)
    cands = candidates(nodes, list(plan.exclude), _linear(graph.model))
    state: dict = {"index": 0}
    pipe.use(g, graph.weights())
    baseline = pipe.score()  # this graph fp32, the ones tuned before it int8

    def evaluate(model_path: str) -> float:
        if Path(model_path) == path:  # autotune's own baseline call
            return baseline
        pipe.use(g, load_onnx(model_path))
        value = pipe.score()
        label, kept = cands[state["index"]]
        trials.append({"graph": g, "candidate": state["index"], "fp32": label, "kept_fp32": len(kept),
                       pipe.metric: value, "meets_goal": value >= goal - 1e-9})
        line = f"tuning {g}: {label} ({len(kept)} node(s) fp32) -> {pipe.metric} {value:g}, goal {goal:g}"
        log.info(line)
        status(line)
        return value

    # autotune stops at baseline x (1 - tolerable_loss): make that the end-to-end goal, fp32 x (1 - tolerance)
    tolerable = max(0.0, 1 - goal / baseline) + 1e-9 if baseline > 0 else 0.0
    configs = _configs(config, cfg, graph.model, plan, cands, len(feeds))
    tune_cfg = tuning.TuningConfig(config_set=configs, sampler=_recording_sampler(state), tolerable_loss=tolerable,
                                   max_trials=len(configs))
    try:
        best = tuning.autotune(str(path), tune_cfg, eval_fn=evaluate, calibration_data_reader=_reader(feeds),
                               optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    except SystemExit as e:  # onnx-neural-compressor exits when no candidate meets the goal
        raise QuantizeError(f"tuning {g}: no candidate reached {pipe.metric} {goal:.2f}; nothing was written") from e
    _check(best, g)
    kept = cands[state["index"]][1]
    return {"quantized_nodes": len(nodes) - len(kept), "kept_fp32": kept, "calibration_feeds": len(feeds),
            "candidates": [label for label, _ in cands]}, best


@contextmanager
def _status(show: bool):
    """A one-line status (what is being tuned, the last trial's result): `status(text)` shows `text`."""
    with Reporter("quantize", what="tuning", enabled=show, transient=True) as bar:
        yield lambda text: bar.update(0, what=text)


def _linear(model) -> list[str]:
    from t5compress.quantize.graphs import embedding_nodes, linear_nodes

    return linear_nodes(model) + embedding_nodes(model)


def _configs(config, cfg, model, plan, cands: list[tuple[str, list[str]]], feeds: int) -> list:
    """One onnx-neural-compressor StaticQuantConfig per candidate. What is not quantized is excluded by name: every
    node of the op types outside the plan or kept fp32 (an empty nodes_to_quantize would mean all of them)."""
    import onnxruntime as ort

    methods = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
    fmt = {"qdq": "QDQ", "qoperator": "QOperator"}[cfg.format]
    typed = [n.name for n in model.graph.node if n.op_type in plan.op_types]
    planned = set(plan.nodes) | set(plan.exclude)
    try:
        return [config.StaticQuantConfig(
            calibrate_method=getattr(ort.quantization.CalibrationMethod, methods[cfg.method]),
            quant_format=getattr(ort.quantization.QuantFormat, fmt), per_channel=cfg.per_channel,
            op_types_to_quantize=list(plan.op_types),
            nodes_to_exclude=[n for n in typed if n in set(kept) or n not in planned],
            calibration_sampling_size=feeds, execution_provider="CPUExecutionProvider",
            extra_options={"ActivationSymmetric": False, "WeightSymmetric": True},
        ) for _, kept in cands]
    except ValueError as e:  # e.g. an op type its CPU static quantizer does not know
        raise ConfigError(f"op_types: onnx-neural-compressor refuses them: {first_line(e)}") from e


def _check(model, g: str) -> None:
    """A QuantizeError unless the tuner's result is a graph whose weights are all in memory."""
    import onnx

    if model is None:
        raise QuantizeError(f"tuning {g}: onnx-neural-compressor returned no model; nothing was written")
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            raise QuantizeError(f"tuning {g}: weights left in external data; nothing was written")


def _copy(model):
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
