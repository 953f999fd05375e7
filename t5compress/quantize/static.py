"""Static int8, the `static` method's work: calibrate every graph on what it sees while generating, round the
per-token layers' weights by GPTQ, measure which groups to keep fp32 when the plan says so (`sensitivity`), then
write the graphs (the per-token layers rewritten after calibration, `pertoken`)."""

from __future__ import annotations

from dataclasses import replace

from t5compress.cpu import FULL_WEIGHT_MAX
from t5compress.names import DECODER_WITH_PAST, GRAPHS, ONNX_SUFFIX
from t5compress.quantize.plan import GPTQ, OFF


def write_static(export, plans: dict, tokenwise: dict, held: list[str] | None):
    """Calibrate on the calibration texts, (guided: on `held`, else those texts) measure each group's sensitivity and
    keep the fewest fp32, make the int8 graphs (in memory); returns the plans written, the per-token nodes, the feeds
    each graph saw, the sensitivity report (None unless measured) and the graphs."""
    from t5compress.progress import Reporter
    from t5compress.quantize import sensitivity as sens
    from t5compress.quantize.calibrate import Snapshot
    from t5compress.quantize.gptq import gram_meters
    from t5compress.quantize.methods import StaticGraph
    from t5compress.quantize.pertoken import rewrite
    from t5compress.quantize.plan import Remedy
    from t5compress.runtime import load_runtime

    cfg, plan, work = export.cfg, export.plan, export.work
    guided = plan.sensitivity != OFF
    calibrators = {g: StaticGraph(graph, plans[g], cfg.method, work, cfg.percentile)
                   for g, graph in export.graphs.items()}
    stats = {g: [c] for g, c in calibrators.items()}
    probe = Snapshot(at=cfg.max_new_tokens // 2)  # a mid-generation with-past step, to time what kept groups cost
    if guided:
        stats[DECODER_WITH_PAST].append(probe)
    gptq_nodes = {g: tokenwise[g] for g in export.graphs if plan.rounding == GPTQ and tokenwise[g]}
    grams = gram_meters(export.graphs, gptq_nodes)
    for g, gram in grams.items():
        stats[g].append(gram)
    feeds = export.drive(stats, "calibrating")
    rounded = gptq(export, grams, plan.weight_max)
    report, every = None, dict(tokenwise)
    if guided:
        fp32 = load_runtime(export.src, threads=cfg.threads)
        with Reporter("quantize", what="sensitivity", enabled=export.progress, transient=True) as bar:
            plans, tokenwise, report = sens.guided(fp32, export, plans, tokenwise, calibrators, held or export.texts,
                                                   rounded, status=lambda text: bar.update(0, what=text))
    outputs = report is None or report["remedy"]["chosen"] != Remedy.OUTPUTS_FP32
    reduce, models = plan.weight_max < FULL_WEIGHT_MAX, {}
    for g in GRAPHS:
        models[g] = calibrators[g].quantized(cfg.format, cfg.per_channel, reduce, plans[g], outputs)
        tokenwise[g] = rewrite(models[g], tokenwise[g], plan.weight_max, rounded.get(g))
    if report is not None and (report["kept"] or not outputs) and probe.feeds is not None:
        report["step_ms"] = _step_cost(export, calibrators[DECODER_WITH_PAST], plans[DECODER_WITH_PAST],
                                       every[DECODER_WITH_PAST], rounded.get(DECODER_WITH_PAST), probe.feeds,
                                       models[DECODER_WITH_PAST])
    return plans, tokenwise, feeds, report, models


def _step_cost(export, calibrator, plan, tokenwise: list[str], rounded: dict | None, feeds: dict, written) -> dict:
    """What the groups kept fp32 cost a decoder-with-past step: its time all int8 and as `written`, on one real
    feed."""
    import onnx

    from t5compress.quantize.pertoken import rewrite
    from t5compress.quantize.sensitivity import step_ms

    cfg, work = export.cfg, export.work
    static = tuple(n for n in plan.exclude if n not in tokenwise)  # kept fp32 by the measuring
    every = calibrator.quantized(cfg.format, cfg.per_channel, export.plan.weight_max < FULL_WEIGHT_MAX,
                                 replace(plan, nodes=plan.nodes + static, exclude=()))
    rewrite(every, tokenwise, export.plan.weight_max, rounded)
    ms = {}
    for name, model in (("all_int8", every), ("kept", written)):
        path = work / f"{name}.{DECODER_WITH_PAST}{ONNX_SUFFIX}"
        onnx.save_model(model, str(path))
        ms[name] = step_ms(path, feeds)
    return {**ms, "ratio": round(ms["kept"] / ms["all_int8"], 3)}


def gptq(export, grams: dict, weight_max: int, group: int | None = None, limits: dict[str, int] | None = None) -> dict:
    """`gptq.round_graphs` on the export's graphs, with a progress bar."""
    from t5compress.progress import Reporter
    from t5compress.quantize.gptq import round_graphs

    with Reporter("quantize", sum(len(g.inputs) for g in grams.values()), unit="layer", what="GPTQ rounding",
                  enabled=export.progress, transient=True) as bar:
        return round_graphs(export.graphs, grams, weight_max, step=lambda: bar.update(1), group=group, limits=limits)
