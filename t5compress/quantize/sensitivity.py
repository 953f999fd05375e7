"""Which layers static int8 breaks, measured, and the fewest of them to keep fp32 so that int8 keeps fp32's outputs.

    report = guide(graphs, reference, target=0.97)  # the sensitivity table, the groups kept fp32, what they cost

A *group* is one projection of one layer (`encoder.1 self q`, `decoder.0 cross o`, `decoder.3 wi_1`, `lm_head`,
`embeddings`), the same nodes in every graph that holds them (the decoder and decoder-with-past share their names).
Each group is measured alone, int8 as the stage writes it: the fp32 graphs (smoothed, when the stage smooths) with
only that group's nodes reading their inputs through the int8 graph's QuantizeLinear/DequantizeLinear pairs (`mixed`:
graph surgery, no new quantization: `graft`), or, for per-token layers (a gated model's default), rewritten per-token
(`pertoken.rewrite`); teacher-forced along fp32's greedy outputs on the stage's check texts (`check.Reference`; the
eval texts when given, else the calibration texts): next-token agreement and logit error. Encoder groups run the
encoder variant and fp32's decoder; decoder groups reuse fp32's encoder states, so the whole table costs about one
forward pass per group.

Then the fewest groups are kept fp32, most sensitive first (lowest agreement alone, then largest logit error), found by
doubling and bisection on the agreement of the all-but-kept int8 graphs. If even the least sensitive group alone stays
below the target (every group breaks the model), the quantization is refused. The table as text: `describe`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from t5compress.cpu import FULL_WEIGHT_MAX
from t5compress.errors import QuantizeError
from t5compress.names import DECODER, ENCODER, ONNX_SUFFIX
from t5compress.quantize.graft import groups, mixed
from t5compress.quantize.plan import EVERY_GROUP, Remedy

if TYPE_CHECKING:
    import onnx


log = logging.getLogger(__name__)


@dataclass
class Variants:
    """fp32 and all-int8 encoder and decoder graphs, and the files of their mixes (written to `work`). The nodes in
    `tokenwise` are per-token int8 where int8 (`quantize.pertoken`, rewritten from fp32; the int8 graph leaves them
    fp32), the others take the int8 graph's QuantizeLinear/DequantizeLinear pairs."""

    fp32: dict[str, onnx.ModelProto]
    int8: dict[str, onnx.ModelProto]
    work: Path
    quantizable: dict[str, set[str]]
    tokenwise: dict[str, set[str]] = field(default_factory=dict)
    weight_max: int = 127
    rounded: dict = field(default_factory=dict)  # {graph: per-token layers' int8 weights by node name}
    count: int = 0

    def write(self, graph: str, names: set[str]) -> Path:
        import onnx

        from t5compress.quantize.pertoken import rewrite

        self.count += 1
        dst = self.work / f"{graph}.mix{self.count}{ONNX_SUFFIX}"
        tokenwise = names & self.tokenwise.get(graph, set())
        model = mixed(self.fp32[graph], self.int8[graph], names - tokenwise, self.quantizable[graph])
        rewrite(model, tokenwise, self.weight_max, self.rounded.get(graph))
        onnx.save(model, str(dst))
        return dst

    def graphs(self, names: dict[str, set[str]], threads: int) -> dict:
        """{graph: OnnxGraph} for the graphs with any of `names` int8 (the others: None, fp32 is used)."""
        from t5compress.runtime.sessions import OnnxGraph

        out = {}
        for g in (ENCODER, DECODER):
            path = self.write(g, names[g]) if names.get(g) else None
            out[g] = OnnxGraph(path, threads) if path else None
            if path:
                path.unlink()  # the session holds it
        return out


def measure(variants: Variants, reference, names: dict[str, set[str]], threads: int) -> dict:
    """Teacher-forced agreement and logit error with the nodes `names` ({graph: names}) int8, the rest fp32."""
    g = variants.graphs(names, threads)
    return reference.compare(g[ENCODER], g[DECODER])


def guide(variants: Variants, reference, table: dict[str, dict[str, list[str]]], target: float, threads: int,
          status=lambda text: None, every_group: bool = True) -> dict:
    """The sensitivity table, and the fewest groups (most sensitive first) to keep fp32 for agreement >= target.
    Without `every_group`, groups are measured only when all of them int8 miss the target (else "groups" is empty).

    Returns {"target", "all_int8", "positions" (the teacher-forced positions each measure reads), "groups":
    [row...], "kept": [labels], "kept_nodes": {graph: [names]}, "kept_check", "evaluations", "seconds"}; raises
    QuantizeError when every group alone breaks the target."""
    started = time.perf_counter()
    every = {g: {n for grp in table.values() for n in grp.get(g, [])} for g in (ENCODER, DECODER)}
    whole = measure(variants, reference, every, threads)
    rows = []
    needed = every_group or whole["next_token_agreement"] < target
    for i, (label, members) in enumerate(table.items() if needed else ()):
        status(f"sensitivity {i + 1}/{len(table)}: {label}")
        m = measure(variants, reference, {g: set(members.get(g, [])) for g in (ENCODER, DECODER)}, threads)
        rows.append({"group": label, "nodes": sum(len(v) for v in members.values()), **_short(m)})
    order = sorted(rows, key=lambda r: (r["next_token_agreement"], -r["mean_rel_logit_error"]))
    report = {"target": target, "all_int8": _short(whole), "positions": whole["positions"], "groups": rows, "kept": [],
              "evaluations": len(rows) + 1}
    if whole["next_token_agreement"] < target:
        best = order[-1]
        if best["next_token_agreement"] < target:
            raise QuantizeError(
                f"every int8 group is sensitive: with only the least sensitive ({best['group']}) int8 and all else "
                f"fp32, next-token agreement is {best['next_token_agreement']:.1%}, below the target "
                f"{target:g} (all int8: {whole['next_token_agreement']:.1%}, {len(rows)} groups measured); "
                f"nothing was written (--keep-fp32 none quantizes every group without measuring)")
        k, check, evals = _fewest(variants, reference, table, [r["group"] for r in order], every, target, threads,
                                  status)
        report.update(kept=[r["group"] for r in order[:k]], kept_check=check)
        report["evaluations"] += evals
    kept_nodes: dict[str, list[str]] = {}
    for label in report["kept"]:
        for g, names in table[label].items():
            kept_nodes.setdefault(g, []).extend(names)
    report["kept_nodes"] = kept_nodes
    report["seconds"] = round(time.perf_counter() - started, 2)
    return report


def _fewest(variants: Variants, reference, table: dict, order: list[str], every: dict[str, set[str]], target: float,
            threads: int, status) -> tuple[int, dict, int]:
    """The smallest k such that keeping order[:k] fp32 reaches `target` (doubling, then bisection), its measurement,
    and the number of evaluations. k = len(order) - 1 at most (the least sensitive group alone passed)."""
    cache: dict[int, dict] = {}

    def agree(k: int) -> dict:
        if k not in cache:
            kept = {g: {n for label in order[:k] for n in table[label].get(g, [])} for g in every}
            status(f"keeping the {k} most sensitive group(s) fp32")
            cache[k] = measure(variants, reference, {g: every[g] - kept[g] for g in every}, threads)
        return cache[k]

    top = len(order) - 1
    lo, hi = 0, 1  # agree(lo) fails (all int8), agree(hi) unknown
    while hi < top and agree(hi)["next_token_agreement"] < target:
        lo, hi = hi, min(hi * 2, top)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if agree(mid)["next_token_agreement"] >= target:
            hi = mid
        else:
            lo = mid
    return hi, _short(agree(hi)), len(cache)


def _short(m: dict) -> dict:
    return {k: m[k] for k in ("next_token_agreement", "mean_rel_logit_error", "max_rel_logit_error")}


def guided(fp32_runtime, export, plans: dict, tokenwise: dict[str, list[str]], calibrators: dict, texts: list[str],
           rounded: dict | None = None, status=lambda text: None) -> tuple[dict, dict, dict]:
    """Measure every group's sensitivity on the calibrated graphs of `export` (a `sources.Export`) and keep the fewest
    fp32 for its target agreement.

    `plans` quantize everything but the `tokenwise` nodes (per-token int8 with the `rounded` weights, measured as
    such); returns the plans and the per-token nodes with the kept groups excluded, and the `sensitivity` report."""
    from t5compress.quantize.check import CHECK_TEXTS, Reference
    from t5compress.quantize.methods import Plan

    cfg, work, wmax = export.cfg, export.work, export.plan.weight_max
    measured = (ENCODER, DECODER)
    status("sensitivity: fp32 reference outputs")
    reference = Reference(fp32_runtime, texts[:CHECK_TEXTS], cfg.batch_size, cfg.max_new_tokens, store=work)
    if any(tokenwise.get(g) for g in measured):  # per-token layers: their outputs are fp32 already
        outputs, remedy = True, {"chosen": Remedy.PER_TOKEN}
        for g in measured:
            calibrators[g].write(work / f"{g}.all-int8{ONNX_SUFFIX}", "qdq", cfg.per_channel, wmax < FULL_WEIGHT_MAX)
    else:
        outputs, remedy = _outputs_remedy(calibrators, cfg, reference, work, wmax < FULL_WEIGHT_MAX)
    int8 = {g: work / f"{g}.all-int8{'' if outputs else '.fp32-outputs'}{ONNX_SUFFIX}" for g in measured}
    variants = Variants({g: export.graphs[g].weights() for g in measured}, {g: _load(int8[g]) for g in measured},
                        work, {g: set(plans[g].nodes) | set(plans[g].exclude) for g in measured},
                        {g: set(tokenwise.get(g, [])) for g in measured}, wmax, rounded or {})
    table = groups({g: [*p.nodes, *tokenwise.get(g, [])] for g, p in plans.items()})
    # asked for (sensitive): the whole table; the default (auto): only what reaching the target needs
    report = guide(variants, reference, table, cfg.target_agreement, cfg.threads, status,
                   every_group=export.plan.sensitivity == EVERY_GROUP)
    report["remedy"] = remedy
    kept = {g: set(report["kept_nodes"].get(g, [])) for g in plans}
    out = {g: Plan(tuple(n for n in p.nodes if n not in kept[g]), tuple(dict.fromkeys((*p.exclude, *sorted(kept[g])))),
                   p.op_types) for g, p in plans.items()}
    fp32_bytes = sum(_weight_bytes(export.graphs[g].model, kept[g]) for g in plans)
    report["kept_fp32_bytes"] = fp32_bytes * 3 // 4  # fp32 - int8
    return out, {g: [n for n in tokenwise.get(g, []) if n not in kept[g]] for g in plans}, report


def _load(path: Path):
    from t5compress.runtime.sessions import load_onnx

    return load_onnx(str(path))


def _outputs_remedy(calibrators: dict, cfg, reference, work: Path, reduce: bool) -> tuple[bool, dict]:
    """The first remedy, tried before any group is kept fp32: the linear layers' outputs left fp32 (int8 weights
    and inputs, as dynamic int8 has them). Writes both all-int8 encoder/decoder pairs into `work` (QDQ: the mixes
    are cut from them); returns whether outputs stay int8 (the better of the two) and both measurements."""
    from t5compress.runtime.sessions import OnnxGraph

    got = {}
    for outputs, tag in ((True, ""), (False, ".fp32-outputs")):
        paths = {g: work / f"{g}.all-int8{tag}{ONNX_SUFFIX}" for g in (ENCODER, DECODER)}
        for g, path in paths.items():
            calibrators[g].write(path, "qdq", cfg.per_channel, reduce, outputs=outputs)
        got[outputs] = _short(reference.compare(*(OnnxGraph(paths[g], cfg.threads) for g in (ENCODER, DECODER))))
    int8_outputs = got[False]["next_token_agreement"] <= got[True]["next_token_agreement"]
    return int8_outputs, {"linear_outputs_int8": got[True], "linear_outputs_fp32": got[False],
                          "chosen": Remedy.OUTPUTS_INT8 if int8_outputs else Remedy.OUTPUTS_FP32}


def _weight_bytes(model, names: set[str]) -> int:
    """fp32 bytes of the constant weights the nodes `names` read (from the graph's structure: their shapes)."""
    import numpy as np

    inits = {t.name: t for t in model.graph.initializer}
    weights = {x for n in model.graph.node if n.name in names for x in n.input if x in inits}
    return sum(int(np.prod(inits[w].dims)) * 4 for w in weights)


def step_ms(path: Path, feed: dict, threads: int = 1, repeats: int = 30) -> float:
    """Median ms of one run of the graph at `path` on `feed` (after two warm-up runs)."""
    import numpy as np

    from t5compress.runtime.sessions import OnnxGraph

    graph = OnnxGraph(path, threads)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        graph.run(feed)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1000, 3)

