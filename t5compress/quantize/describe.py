"""A quantize report told to people: (what, value) rows, the key numbers first (`t5compress.describe.quantize`)."""

from __future__ import annotations


def describe(r: dict) -> list[tuple[str, str]]:
    """Mode and size against fp32, agreement with fp32, task metrics side by side, then what was tuned, measured and
    kept fp32, and what was done beyond calibrated int8."""
    from t5compress.quantize.stage import applied

    size, check = r["size"], r["check"]
    how = r["mode"] + (f" ({r['method']}, {r['format']})" if r["mode"] == "static" else
                       f", blocks of {r['block_size']}" if r["mode"] == "blockwise" else "")
    rows = [(f"int8 {how}", f"{size['fp32_bytes'] / 1e6:.2f} MB → {size['int8_bytes'] / 1e6:.2f} MB "
                            f"({size['ratio']:.2f}x), next token {check['next_token_agreement']:.2%} on "
                            f"{check['texts']} {check['on']}"),
            ("agreement with fp32", f"next token {check['next_token_agreement']:.2%}, greedy outputs "
                                    f"{check['greedy_agreement']:.2%} identical ({check['texts']} {check['on']})"
                                    + _logits(check))]
    ev = r.get("eval")
    if ev:
        checked_all = check["on"] == "eval texts" and check["texts"] == ev["examples"]  # said in the row above
        if "greedy_agreement" in ev and not checked_all:  # older reports have only the metrics
            rows.append(("greedy outputs = fp32", f"{ev['greedy_agreement']:.1%} of {ev['examples']} eval examples"))
        for k in ("exact_match", "rougeL", "bleu"):
            rows.append((f"{k} fp32 → int8", f"{ev['fp32'][k]} → {ev['int8'][k]} ({ev['examples']} examples)"))
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
        from t5compress.quantize.sensitivity import ranked, summary

        rows.append(("sensitivity", summary(sens)))
        if sens["groups"]:  # the default measures them only when all int8 misses the target
            top = ", ".join(f"{g['group']} {g['next_token_agreement']:.1%}" for g in ranked(sens)[:5])
            rows.append(("most sensitive alone", f"(only that group int8) {top}; every group: `t5compress info`"))
    kept = sorted({n for g in graphs.values() if isinstance(g, dict) for n in g.get("kept_fp32", [])})
    if kept:
        rows.append(("kept fp32", f"{len(kept)} node(s), e.g. {kept[0]}"))
    return rows
