"""The key numbers of each stage's report, one line for the results table of `t5compress run`."""

from __future__ import annotations

from typing import Any


def data_summary(r: dict) -> str:
    ex = r.get("examples", {})
    if r.get("generated"):
        return f"{ex.get('train')} train / {ex.get('eval')} eval examples ({r['generated']})"
    return f"train {ex.get('train')}, eval {ex.get('eval') or 'held out'}"


def params(r: dict) -> str:
    n = (r.get("model") or {}).get("parameters")
    return f"{n:,} parameters" if isinstance(n, int) else ""


def metric(ev: dict | None) -> str:
    ev = ev or {}
    parts = [f"{k} {ev[k]}" for k in ("exact_match", "rougeL") if k in ev]
    return ", ".join(parts)


def train_summary(r: dict) -> str:
    steps = (r.get("train") or {}).get("steps")
    return "; ".join(p for p in (metric(r.get("eval")), f"{steps} steps" if steps else "") if p)


def prune_summary(r: dict) -> str:
    before = (r.get("before") or {}).get("parameters")
    after = (r.get("model") or {}).get("parameters")
    size = f"{before:,} → {after:,} parameters" if isinstance(before, int) and isinstance(after, int) else ""
    return "; ".join(p for p in (size, metric(r.get("eval"))) if p)


def mb(n: Any) -> str:
    return f"{n / 1e6:.2f} MB" if isinstance(n, (int, float)) else "?"


def export_summary(r: dict) -> str:
    onnx = sum(v for k, v in (r.get("files") or {}).items() if k.endswith((".onnx", ".onnx_data", ".pt")))
    diff = (r.get("parity") or {}).get("max_abs_diff")
    worst = max(diff.values()) if isinstance(diff, dict) and diff else diff
    return f"{mb(onnx)}" + (f", max |Δ| vs PyTorch {worst:.1e}" if isinstance(worst, float) else "")


def quantize_summary(r: dict) -> str:
    size, check = r.get("size") or {}, r.get("check") or {}
    agree = check.get("next_token_agreement")
    text = f"{mb(size.get('fp32_bytes'))} → {mb(size.get('int8_bytes'))}"
    on = f" on {check['texts']} {check['on']}" if "texts" in check and "on" in check else ""
    return text + (f", next-token agreement {agree:.1%}{on}" if isinstance(agree, float) else "")


def bench_summary(r: dict) -> str:
    entries = r.get("entries") or []
    failed = sum("error" in e for e in entries)
    missed = len((r.get("expectations") or {}).get("missed") or [])
    return (f"{len(entries)} variants measured" + (f", {failed} failed" if failed else "")
            + (f", {missed} expectation(s) missed" if missed else "") + " → report.md")
