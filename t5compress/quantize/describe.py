"""A quantize report told to people: (what, value) rows, the key numbers first (`t5compress.describe.quantize`), and
the sensitivity search's report as text (the CLI's summary and `t5compress info` print these), with the outcomes it
records."""

from __future__ import annotations

from t5compress.quantize.plan import Remedy


def ranked(report: dict) -> list[dict]:
    """The sensitivity rows, most sensitive first, each with `kept` (whether the group stayed fp32)."""
    kept = set(report.get("kept", []))
    rows = sorted(report["groups"], key=lambda r: (r["next_token_agreement"], -r["mean_rel_logit_error"]))
    return [{**r, "kept": r["group"] in kept} for r in rows]


def summary(report: dict) -> str:
    """One line: all-int8 agreement, what was kept fp32 and what that cost (size, with-past step time)."""
    whole = report["all_int8"]["next_token_agreement"]
    remedy = report.get("remedy", {}).get("chosen")
    how = " (linear layers per-token)" if remedy == Remedy.PER_TOKEN else ""
    measured = f"of {len(report['groups'])} layer groups " if report["groups"] else ""
    head = (f"sensitivity {measured}({report['seconds']:.1f} s): all int8{how} picks fp32's next token at "
            f"{whole:.2%}, target {report['target']:.1%}")
    if remedy == Remedy.OUTPUTS_FP32:
        fixed = report["remedy"]["linear_outputs_fp32"]["next_token_agreement"]
        head += f" with the linear layers' outputs int8, {fixed:.2%} with them fp32 (kept so)"
    if not report["kept"]:
        return head + "; nothing kept fp32"
    step = report.get("step_ms")
    speed = f", decoder step {step['ratio']:.2f}x the all-int8 one" if step else ""
    return (head + f"; kept fp32: {', '.join(report['kept'])} (+{report['kept_fp32_bytes'] / 1e6:.2f} MB{speed}) "
            f"-> {report['kept_check']['next_token_agreement']:.2%}")


def describe(r: dict) -> list[tuple[str, str]]:
    """Mode and size against fp32, agreement with fp32, task metrics side by side, then what was tuned, measured and
    kept fp32, and what was done beyond calibrated int8."""
    from t5compress.lineage import vs_source
    from t5compress.quantize.modes import applied, how, label

    size, check, name = r["size"], r["check"], label(r)
    rows = [(f"{name} {how(r)}", f"{size['fp32_bytes'] / 1e6:.2f} MB → {size['int8_bytes'] / 1e6:.2f} MB "
                            f"({size['ratio']:.2f}x), next token {check['next_token_agreement']:.2%} on "
                            f"{check['texts']} {check['on']}"),
            *vs_source(size["int8_bytes"], size.get("source")),
            ("agreement with fp32", f"next token {check['next_token_agreement']:.2%}, greedy outputs "
                                    f"{check['greedy_agreement']:.2%} identical ({check['texts']} {check['on']})"
                                    + _logits(check))]
    ev = r.get("eval")
    if ev:
        checked_all = check["on"] == "eval texts" and check["texts"] == ev["examples"]  # said in the row above
        if "greedy_agreement" in ev and not checked_all:  # older reports have only the metrics
            rows.append(("greedy outputs = fp32", f"{ev['greedy_agreement']:.1%} of {ev['examples']} eval examples"))
        for k in ("exact_match", "rougeL", "bleu"):
            rows.append((f"{k} fp32 → {name}", f"{ev['fp32'][k]} → {ev['int8'][k]} ({ev['examples']} examples)"))
    return rows + _searched(r) + applied(r)


def _logits(check: dict) -> str:
    if "mean_rel_logit_error" not in check:  # older reports
        return ""
    return (f"; logit error {check['mean_rel_logit_error']:.3f} of the logit range on average, "
            f"{check['max_rel_logit_error']:.3f} at worst")


def _searched(r: dict) -> list[tuple[str, str]]:
    """Tuning, the sensitivity search (or the hint to run it when the target was missed), the nodes kept fp32."""
    graphs, check, rows = r.get("graphs") or {}, r["check"], []
    tuned, sens, target = graphs.get("tuning"), graphs.get("sensitivity"), r.get("target_agreement")
    if tuned:
        rows.append(("tuned by onnx-neural-compressor", f"{len(tuned['trials'])} trial(s), {tuned['metric']} "
                                                        f"{tuned['int8']:g} vs fp32 {tuned['fp32']:g} (goal "
                                                        f"{tuned['goal']:g})"))
    if not sens and not tuned and target and check["next_token_agreement"] < target:
        rows.append(("target", f"next token {check['next_token_agreement']:.2%} is below the target {target:.1%}: "
                               "--keep-fp32 sensitive measures each layer group and keeps the fewest fp32 that "
                               "reach it"))
    if sens:
        rows.append(("sensitivity", summary(sens)))
        if sens["groups"]:  # the default measures them only when all int8 misses the target
            top = ", ".join(f"{g['group']} {g['next_token_agreement']:.1%}" for g in ranked(sens)[:5])
            rows.append(("most sensitive alone", f"(only that group int8) {top}; every group: `t5compress info`"))
    kept = sorted({n for g in graphs.values() if isinstance(g, dict) for n in g.get("kept_fp32", [])})
    if kept:
        rows.append(("kept fp32", f"{len(kept)} node(s), e.g. {kept[0]}"))
    return rows
