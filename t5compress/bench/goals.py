"""The goals of issue 9, per grid cell: measured, hit or missed -- and the honesty rules of the comparison.

- int8: our fastest unpruned int8 variant at least 1.33x faster (p50) than the fastest int8 peer.
- pruned + int8: our fastest pruned int8 variant at least 2x faster than the fastest int8 peer.
- fp32 (kept from the speed benchmark): our fastest fp32 export faster than every fp32 peer.
- size: our int8 files at most 0.27x our fp32 files.

Only cells that produced exactly the forced number of tokens count; a short or failed result is shown in the
tables but never compared. A goal with no valid result on one side is 'not measured', with the reason.
"""

from __future__ import annotations

INT8_GOAL, PRUNED_GOAL, FP32_GOAL, SIZE_GOAL = 1.33, 2.0, 1.0, 0.27

# goal -> (our variants that count, the peers they are compared with, speed-up needed, strictly faster)
GOALS = {
    "int8": (lambda e: e["owner"] == "ours" and e["precision"] == "int8" and not e["pruned"], "int8", INT8_GOAL),
    "pruned+int8": (lambda e: e["owner"] == "ours" and e["precision"] == "int8" and e["pruned"], "int8",
                    PRUNED_GOAL),
    "fp32": (lambda e: e["owner"] == "ours" and e["precision"] == "fp32" and not e["pruned"], "fp32", FP32_GOAL),
}


def valid(cell: dict | None) -> bool:
    return bool(cell) and not cell.get("short", True)


def cell_of(entry: dict, key: tuple[int, int, int]) -> dict | None:
    for c in entry.get("cells", []):
        if (c["threads"], c["batch"], c["beams"]) == key:
            return c
    return None


def _fastest(entries: list[dict], key: tuple) -> tuple[str, float] | None:
    ok = [(e["name"], cell_of(e, key)["p50_ms"]) for e in entries if valid(cell_of(e, key))]
    return min(ok, key=lambda x: x[1]) if ok else None


def per_cell(entries: list[dict], keys: list[tuple[int, int, int]]) -> list[dict]:
    """One row per grid cell: for each goal, our fastest, the fastest peer, the speed-up, and the verdict."""
    rows = []
    for key in keys:
        row = {"threads": key[0], "batch": key[1], "beams": key[2], "goals": {}}
        for goal, (ours_filter, peer_precision, need) in GOALS.items():
            ours = [e for e in entries if ours_filter(e)]
            peers = [e for e in entries if e["owner"] == "peer" and e["precision"] == peer_precision]
            a, b = _fastest(ours, key), _fastest(peers, key)
            g = {"need": need, "ours": a and {"name": a[0], "p50_ms": a[1]},
                 "peer": b and {"name": b[0], "p50_ms": b[1]}}
            if a and b:
                g["speedup"] = round(b[1] / a[1], 2)
                g["status"] = "hit" if (g["speedup"] > need if goal == "fp32" else g["speedup"] >= need) else "missed"
            else:
                why = []
                if not a:
                    why.append(f"no {goal} variant of ours" if not ours else
                               "no result of ours of exactly the forced length")
                if not b:
                    why.append(f"no {peer_precision} peer (--peers)" if not peers else
                               f"no {peer_precision} peer result of exactly the forced length")
                g.update(status="not measured", why="; ".join(why))
            row["goals"][goal] = g
        rows.append(row)
    return rows


def sizes(entries: list[dict]) -> dict:
    """Our int8 files against our smallest unpruned fp32 export: at most 0.27x."""
    fp32 = [e for e in entries if e["owner"] == "ours" and e["precision"] == "fp32" and not e["pruned"]
            and "error" not in e]
    if not fp32:
        return {"status": "not measured", "why": "no fp32 export of ours to compare with", "need": SIZE_GOAL}
    base = min(fp32, key=lambda e: e["size_bytes"])
    out = {"need": SIZE_GOAL, "fp32": base["name"], "fp32_bytes": base["size_bytes"], "int8": {}}
    for e in entries:
        if e["owner"] == "ours" and e["precision"] == "int8":
            ratio = round(e["size_bytes"] / base["size_bytes"], 3)
            out["int8"][e["name"]] = {"ratio": ratio, "status": "hit" if ratio <= SIZE_GOAL else "missed"}
    if not out["int8"]:
        out.update(status="not measured", why="no int8 variant of ours")
    return out


def summary(rows: list[dict]) -> dict:
    """Per goal: cells hit / measured."""
    out = {}
    for goal in GOALS:
        st = [r["goals"][goal]["status"] for r in rows]
        out[goal] = {"hit": st.count("hit"), "missed": st.count("missed"), "not_measured": st.count("not measured")}
    return out
