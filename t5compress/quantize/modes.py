"""Static, dynamic and block-wise int8 and block-wise 4-bit as methods, found in one registry (`METHODS`, looked up
once from `QuantizeConfig.mode` by `method_for`). Each is one object holding what differs: whether it needs
calibration texts, how it resolves the `auto` choices into a plan, how it writes the graphs, and what it reports.

    method = method_for(cfg.mode)
    plan = method.resolve(cfg, gated, tied, held=bool(eval_texts))
    graphs_report, models = method.quantize(export, held)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from t5compress.config import choose
from t5compress.cpu import FULL_WEIGHT_MAX, weight_max
from t5compress.names import GRAPHS
from t5compress.quantize.plan import (
    AUTO_ALPHA,
    EVERY_GROUP,
    GPTQ,
    IF_NEEDED,
    KEEP_AUTO,
    KEEP_MEASURED,
    KEEP_NONE,
    KEEP_SENSITIVE,
    KEEP_WO,
    OFF,
    PER_TOKEN_AUTO,
    PER_TOKEN_NONE,
    WIDE_AUTO,
    WIDE_NONE,
    QuantPlan,
)


@dataclass
class Written:
    """What a method made: the node plans, the per-token layers, the feeds each graph saw, the sensitivity report, and
    the int8 graphs (in memory, by graph name)."""

    plans: dict
    tokenwise: dict[str, list[str]]
    feeds: dict[str, int]
    sensitivity: dict | None = None
    models: dict = field(default_factory=dict)


class Method:
    """One way to make int8 graphs; subclasses say what differs."""

    name = ""
    needs_texts = False  # calibration texts required
    calibrated = False  # activation ranges calibrated: per-token layers, the sensitivity search and tuning apply
    label = "int8"  # what the check and the summary call the result
    remedy = "fewer --op-types, keep more nodes fp32, or another --method"  # when the check refuses the result
    help = ""

    def resolve(self, cfg, gated: bool, tied: bool, held: bool) -> QuantPlan:
        """Every `auto` choice, decided once for this model (`held`: eval texts are given)."""
        alpha = self.smooth_alpha(cfg, gated) if cfg.smooth_alpha is None else cfg.smooth_alpha
        return QuantPlan(self.name, gated, tied, weight_max(cfg.weight_range), alpha, PER_TOKEN_NONE,
                         _keep(cfg, self.keeps_wo(cfg, gated, alpha)), OFF, "", share_table=cfg.embeddings)

    def smooth_alpha(self, cfg, gated: bool) -> float:
        """SmoothQuant's strength when not given: none unless a method says so."""
        return 0.0

    def keeps_wo(self, cfg, gated: bool, alpha: float) -> bool:
        """Whether `--keep-fp32 auto` keeps T5's FFN outputs fp32: a gated model's `wo` inputs have outliers that
        nothing else here takes (neither smoothing nor per-token scales)."""
        return gated and alpha == 0

    def settings(self, cfg, plan: QuantPlan) -> dict:
        """The report's record of the settings used."""
        return {"mode": self.name, "format": cfg.format, "per_channel": cfg.per_channel,
                "op_types": list(cfg.op_types), "embeddings": cfg.embeddings, "weight_max": plan.weight_max}

    def weights_note(self, report: dict, tokenwise: set[str]) -> str | None:
        """How the report's weights were rounded, when it is worth saying (the CLI's summary and `info`)."""
        return None

    def how(self, report: dict) -> str:
        """The method as a report of it is shown: its name and what sets the run apart."""
        return self.name

    def quantize(self, export, held: list[str] | None) -> tuple[dict, dict]:
        """The three int8 graphs (in memory) from `export` (untied, smoothed first as the plan says), and the `graphs`
        part of the report. `held`: eval texts, which a guided choice of groups is measured on."""
        plan = export.plan
        if export.cfg.embeddings:
            export.untie()
        smoothing = export.smooth() if plan.smooth_alpha > 0 else None
        plans, tokenwise = export.node_plans()
        lookups = {}
        if plan.row_lookups:  # (a tied table's lookup reads the LM head's int8 matrix instead)
            plans, lookups = export.row_lookups(plans)
        done = self.write(export, plans, tokenwise, held)
        out = {g: {"quantized_nodes": len(done.plans[g].nodes) + len(done.tokenwise[g]),
                   "kept_fp32": [n for n in done.plans[g].exclude if n not in done.tokenwise[g]],
                   "per_token": done.tokenwise[g], **({"calibration_feeds": done.feeds[g]} if done.feeds else {})}
               for g in GRAPHS}
        if any(lookups.values()):
            out["int8_row_lookups"] = lookups
        if smoothing:
            out["smooth_quant"] = smoothing
        if done.sensitivity:
            out["sensitivity"] = done.sensitivity
        return out, done.models

    def write(self, export, plans: dict, tokenwise: dict, held: list[str] | None) -> Written:
        raise NotImplementedError


def _keep(cfg, wo: bool) -> str:
    if cfg.keep_fp32 == KEEP_AUTO:
        return KEEP_WO if wo else KEEP_NONE
    return cfg.keep_fp32


class Static(Method):
    name, needs_texts, calibrated = "static", True, True
    help = "calibrated activation ranges"

    def resolve(self, cfg, gated: bool, tied: bool, held: bool) -> QuantPlan:
        # per-token scales: not with --tolerance (its search measures QDQ graphs)
        tokenwise = cfg.per_token != PER_TOKEN_NONE and cfg.tolerance is None
        alpha = cfg.smooth_alpha
        if alpha is None:  # per-token scales follow each row's size but not a channel's: migrate the outlier channels
            alpha = AUTO_ALPHA if gated and cfg.per_token == PER_TOKEN_AUTO and tokenwise else 0.0
        none = not tokenwise or (cfg.per_token == PER_TOKEN_AUTO and not gated)
        per_token = PER_TOKEN_NONE if none else cfg.per_token
        # Measured when asked, and by default on a gated model given held-out texts. Not on calibration texts alone:
        # a trained model has learnt them, so int8 agrees with it there and nothing shows, and random weights have
        # flat logits that make every group look sensitive (a random flan-t5-small shape kept 105 of 146 groups
        # fp32 after 512 s of measuring).
        asked = cfg.keep_fp32 == KEEP_SENSITIVE
        guided = cfg.tolerance is None and (asked or (cfg.keep_fp32 == KEEP_AUTO and gated and held))
        keep = KEEP_MEASURED if guided else _keep(cfg, gated and alpha == 0 and not tokenwise)
        tune = cfg.tolerance is not None
        return QuantPlan(self.name, gated, tied, weight_max(cfg.weight_range), alpha, per_token, keep,
                         EVERY_GROUP if asked else IF_NEEDED if guided else OFF,
                         cfg.rounding if per_token != PER_TOKEN_NONE else "", row_lookups=not tied and not tune,
                         share_table=cfg.embeddings and not tune, tune=tune)

    def settings(self, cfg, plan: QuantPlan) -> dict:
        return {**super().settings(cfg, plan), "method": cfg.method, "samples": cfg.samples,
                "calib_data": cfg.calib_data, "per_token": cfg.per_token, "rounding": cfg.rounding,
                "target_agreement": cfg.target_agreement}

    def how(self, report: dict) -> str:
        return f"{self.name} ({report['method']}, {report['format']})"

    def weights_note(self, report: dict, tokenwise: set[str]) -> str | None:
        return "rounded by GPTQ on the calibration inputs" if tokenwise and report.get("rounding") == GPTQ else None

    def write(self, export, plans: dict, tokenwise: dict, held: list[str] | None) -> Written:
        from t5compress.quantize.static import write_static

        return Written(*write_static(export, plans, tokenwise, held))


class Dynamic(Method):
    name = "dynamic"
    help = "ranges computed per call"

    def write(self, export, plans: dict, tokenwise: dict, held: list[str] | None) -> Written:
        from t5compress.quantize.methods import dynamic_int8

        reduce = export.plan.weight_max < FULL_WEIGHT_MAX
        return Written(plans, tokenwise, {}, models={
            g: dynamic_int8(graph, export.work, plans[g], export.cfg.per_channel, reduce)
            for g, graph in export.graphs.items()})


class Blockwise(Method):
    name = "blockwise"
    help = "a scale per --block-size input channels of weights and activations"

    def resolve(self, cfg, gated: bool, tied: bool, held: bool) -> QuantPlan:
        """Block size: as asked, else 128 with calibration texts (on the two trained gated fixtures, smoothed and
        GPTQ-rounded blocks of 128 kept as many held-out outputs as the static default: 95.8% / 74.8% against
        95.9% / 73.6%) and 32 without."""
        plan = super().resolve(cfg, gated, tied, held)
        return replace(plan, rounding=cfg.rounding if cfg.calib_data else "",
                       block_size=cfg.block_size or (128 if cfg.calib_data else 32))

    def smooth_alpha(self, cfg, gated: bool) -> float:
        return AUTO_ALPHA if gated and cfg.calib_data else 0.0  # a block's scale follows its largest channel

    def keeps_wo(self, cfg, gated: bool, alpha: float) -> bool:
        return False  # a block's scale takes the outliers

    def settings(self, cfg, plan: QuantPlan) -> dict:
        s = {**super().settings(cfg, plan), "block_size": plan.block_size, "format": "MatMulNBits"}
        if cfg.calib_data:
            s.update(samples=cfg.samples, calib_data=cfg.calib_data, rounding=cfg.rounding)
        return s

    def how(self, report: dict) -> str:
        return f"{self.name}, blocks of {report['block_size']}"

    def weights_note(self, report: dict, tokenwise: set[str]) -> str | None:
        if report.get("rounding") != GPTQ:
            return None
        return f"rounded by GPTQ on the calibration inputs (a scale per {report['block_size']} input channels)"

    def write(self, export, plans: dict, tokenwise: dict, held: list[str] | None) -> Written:
        from t5compress.quantize.gptq import gram_meters
        from t5compress.quantize.graphs import matching
        from t5compress.quantize.methods import blockwise
        from t5compress.quantize.nbits import WEIGHT_MAX
        from t5compress.quantize.static import gptq

        plan = export.plan
        parts = tuple(p for p in plan.keep_8bit.split(",") if p)
        wide = {g: frozenset(matching(list(plans[g].nodes), parts)) for g in plans}  # kept 8-bit
        rounded = {}
        if export.texts and plan.rounding == GPTQ:  # the linear layers' weights rounded by GPTQ, per block
            grams = gram_meters(export.graphs, {g: list(plans[g].nodes) for g in export.graphs})
            export.drive({g: [gram] for g, gram in grams.items()}, "calibrating")
            limits = {n: WEIGHT_MAX[8] for g in wide for n in wide[g]}
            rounded = gptq(export, grams, WEIGHT_MAX[plan.bits], plan.block_size, limits)
        return Written(plans, tokenwise, {}, models={
            g: blockwise(graph, plans[g], plan.block_size, rounded.get(g), plan.bits, wide[g])
            for g, graph in export.graphs.items()})


class Int4(Blockwise):
    name, label = "int4", "4-bit"
    remedy = "--calib-data for GPTQ rounding, more layers 8-bit with --keep-8bit, a smaller --block-size, or int8"
    help = ("4-bit weights, a scale per --block-size input channels (MatMulNBits, int8 arithmetic), rounded by GPTQ "
            "with --calib-data; a gated model's FFN outputs stay 8-bit, its LM head too without GPTQ")

    def resolve(self, cfg, gated: bool, tied: bool, held: bool) -> QuantPlan:
        """Blocks of 64 unless asked (on the t5-small shape the one size both under 0.6x static int8's bytes and
        within 2% of fp32's ROUGE-L on the relu fixture: 32 is 0.62x, 128 -2.6%; docs/quantize.md), GPTQ with
        calibration texts, and what stays 8-bit: `--keep-8bit`, or on gated models the FFN outputs, and the LM head
        unless GPTQ rounds it. Measured on the trained gated docstring fixture at blocks of 32 (held-out next token;
        docs/quantize.md): rounded to nearest, every layer 4-bit 54.0%, `wo` 8-bit 53.7%, the LM head 8-bit 68.1%,
        both 70.0%; by GPTQ (smoothed), every layer 65.8%, `wo` 8-bit 67.8%, both 68.1% (block-wise int8 95.6%)."""
        from t5compress.quantize.graphs import FFN_OUTPUT
        from t5compress.quantize.nbits import WEIGHT_MAX

        plan = super().resolve(cfg, gated, tied, held)
        wide = cfg.keep_8bit
        if wide == WIDE_AUTO:
            wide = "" if not gated else FFN_OUTPUT if plan.rounding == GPTQ else f"lm_head,{FFN_OUTPUT}"
        return replace(plan, weight_max=WEIGHT_MAX[4], block_size=cfg.block_size or 64, bits=4,
                       keep_8bit="" if wide == WIDE_NONE else wide)

    def settings(self, cfg, plan: QuantPlan) -> dict:
        return {**super().settings(cfg, plan), "bits": 4, "kept_8bit": plan.keep_8bit}

    def how(self, report: dict) -> str:
        kept = f", {report['kept_8bit']} 8-bit" if report.get("kept_8bit") else ""
        return f"block-wise, blocks of {report['block_size']}{kept}"


METHODS: dict[str, Method] = {m.name: m for m in (Static(), Dynamic(), Blockwise(), Int4())}


def method_for(mode: str) -> Method:
    """The method registered as `mode`; an unknown one is a ConfigError listing the valid ones."""
    return choose(METHODS, mode, "mode")


def how(report: dict) -> str:
    """The method of a quantize report and what sets it apart: 'static (minmax, qdq)', 'blockwise, blocks of 32'."""
    method = METHODS.get(report.get("mode", ""))
    return method.how(report) if method else str(report.get("mode"))


def label(report: dict) -> str:
    """What a quantize report's result is called: 'int8', or '4-bit'."""
    method = METHODS.get(report.get("mode", ""))
    return method.label if method else "int8"


def applied(report: dict) -> list[tuple[str, str]]:
    """What a quantize report says was done beyond calibrated int8: the plan, per-token layers, GPTQ and SmoothQuant,
    as (label, text) for the CLI's summary and `info` (reports before 2026-12-05 smoothed `wo` only and record no
    groups; before 2026-12-06, no plan)."""
    graphs = report.get("graphs") or {}
    out = [("plan", QuantPlan(**report["plan"]).describe())] if report.get("plan") else []
    tokenwise = {n for g in graphs.values() if isinstance(g, dict) for n in g.get("per_token") or []}
    if tokenwise:
        out.append(("per-token int8", f"{len(tokenwise)} linear layers (a scale per input row)"))
    method = METHODS.get(report.get("mode", ""))
    rounded = method.weights_note(report, tokenwise) if method else None
    if rounded:
        out.append(("weights", rounded))
    smoothed = graphs.get("smooth_quant") or {}
    if smoothed:
        alpha = next(iter(smoothed.values()))["alpha"]
        inputs = sum(s.get("groups", s["layers"]) for s in smoothed.values())
        layers = sum(s["layers"] for s in smoothed.values())
        out.append(("SmoothQuant", f"alpha {alpha:g}: {inputs} inputs of {layers} linear layers rescaled into their "
                                   "weights"))
    return out
