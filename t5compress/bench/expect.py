"""Expectations a user asks `t5compress bench` to check (`--expect int8=1.33`): met, missed or not measured.

KEY=RATIO, KEY one of (speed-up = the fastest peer's p50 / ours, per grid cell, as in the report):

- int8: our fastest unpruned int8 variant at least RATIO x as fast as the fastest int8 peer;
- pruned+int8: our fastest pruned int8 variant at least RATIO x the fastest int8 peer;
- fp32: our fastest unpruned fp32 export at least RATIO x the fastest fp32 peer (1.0: not slower than any);
- size: every int8 variant of ours at most RATIO x the files of our fp32 export.

Checking records; it never raises: the CLI turns a miss into its exit code, a script reads `missed`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from t5compress.errors import ConfigError

MISSED_EXIT = 3  # `t5compress bench` exit code when an expectation is missed (2 is a usage error)


@dataclass(frozen=True)
class Speed:
    """Which variants of ours a speed expectation takes (the fastest of them per cell, against the fastest peer of
    the same precision)."""

    precision: str
    pruned: bool


SPEED = {"int8": Speed("int8", False), "pruned+int8": Speed("int8", True), "fp32": Speed("fp32", False)}
KEYS = (*SPEED, "size")


def parse(items: Iterable[str]) -> dict[str, float]:
    """['int8=1.33', ...] -> {'int8': 1.33}; a ConfigError naming the bad item otherwise."""
    out: dict[str, float] = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(f"expect: give KEY=RATIO, e.g. int8=1.33; got {item!r}")
        if key not in KEYS:
            raise ConfigError(f"expect: unknown key {key!r} in {item!r}; choose from {', '.join(KEYS)}")
        try:
            ratio = float(value)
        except ValueError:
            ratio = math.nan
        if not math.isfinite(ratio) or ratio <= 0:
            raise ConfigError(f"expect: {item!r}: RATIO must be a number > 0, e.g. {key}=1.33")
        if key in out:
            raise ConfigError(f"expect: {key} given twice")
        out[key] = ratio
    return out


def need(key: str, ratio: float) -> str:
    return f"{key} {'<=' if key == 'size' else '>='} {ratio:g}x"


def check(entries: list[dict], rows: list[dict], sizes: dict, expect: dict[str, float]) -> dict | None:
    """Each expectation per cell (size: per int8 variant of ours) as met / missed / not measured, a summary, and one
    line per missed expectation; None when none was asked. `rows` and `sizes`: `compare.speedups` and `.sizes`."""
    if not expect:
        return None
    cells = [{"threads": r["threads"], "batch": r["batch"], "beams": r["beams"],
              "results": {k: _cell(r, k, ratio) for k, ratio in expect.items() if k in SPEED}} for r in rows]
    out: dict = {"asked": dict(expect), "cells": cells, "summary": {}, "missed": []}
    for key, ratio in expect.items():
        if key == "size":
            continue
        st = [c["results"][key]["status"] for c in cells]
        s = out["summary"][key] = {"met": st.count("met"), "missed": st.count("missed"),
                                   "not_measured": st.count("not measured")}
        if s["missed"]:
            out["missed"].append(f"{need(key, ratio)} (missed in {s['missed']} of {s['met'] + s['missed']} "
                                 "measured cells)")
    if "size" in expect:
        int8 = [e["name"] for e in entries if e["owner"] == "ours" and e["precision"] == "int8"]
        out["size"] = _size(sizes, int8, expect["size"])
        bad = [n for n, v in out["size"].get("variants", {}).items() if v["status"] == "missed"]
        out["summary"]["size"] = _count(out["size"])
        if bad:
            out["missed"].append(f"{need('size', expect['size'])} ({', '.join(bad)})")
    return out


def exit_code(checked: dict | None) -> int:
    """What `t5compress bench` exits with once the report is written: MISSED_EXIT when an expectation was missed."""
    return MISSED_EXIT if checked and checked["missed"] else 0


def _cell(row: dict, key: str, ratio: float) -> dict:
    rule = SPEED[key]
    mine = {n: v for n, v in row["variants"].items() if v["precision"] == rule.precision
            and bool(v["pruned"]) == rule.pruned}
    ok = {n: v for n, v in mine.items() if v["p50_ms"]}
    peer = row["fastest_peer"].get(rule.precision, {"why": f"no {rule.precision} peer (--peers)"})
    g: dict = {"need": ratio}
    if ok and "name" in peer:
        name, v = min(ok.items(), key=lambda x: x[1]["p50_ms"])
        g.update(ours={"name": name, "p50_ms": v["p50_ms"]}, peer=peer, speedup=v["speedup"],
                 status="met" if v["speedup"] >= ratio else "missed")  # the speed-up as shown decides
        return g
    why = []
    if not ok:
        why.append(f"no {key} variant of ours" if not mine else "no result of ours of exactly the forced length")
    if "name" not in peer:
        why.append(peer["why"])
    return {**g, "status": "not measured", "why": "; ".join(why)}


def _size(sizes: dict, int8_names: list[str], ratio: float) -> dict:
    if not sizes.get("fp32"):
        return {"need": ratio, "status": "not measured", "why": sizes.get("why", "no fp32 export of ours")}
    int8 = {n: sizes["ratios"][n] for n in int8_names if n in sizes["ratios"]}
    if not int8:
        return {"need": ratio, "fp32": sizes["fp32"], "status": "not measured", "why": "no int8 variant of ours"}
    return {"need": ratio, "fp32": sizes["fp32"],
            "variants": {n: {"ratio": r, "status": "met" if r <= ratio else "missed"} for n, r in int8.items()}}


def _count(size: dict) -> dict:
    st = [v["status"] for v in size.get("variants", {}).values()]
    return {"met": st.count("met"), "missed": st.count("missed"), "not_measured": 0 if st else 1}
