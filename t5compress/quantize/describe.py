"""The sensitivity search's report as text for people (the CLI's summary and `t5compress info` print these), and the
outcomes it records."""

from __future__ import annotations

from enum import StrEnum


class Remedy(StrEnum):
    """What the search chose before keeping any group fp32 (the report's `remedy.chosen`)."""

    PER_TOKEN = "per-token int8"  # the linear layers are per-token int8: their outputs stay fp32 already
    OUTPUTS_INT8 = "linear outputs int8"
    OUTPUTS_FP32 = "linear outputs fp32"  # int8 weights and inputs, as dynamic int8 has them



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
