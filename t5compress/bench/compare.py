"""Ours against the peers, per grid cell: each variant of ours, its p50 and its speed-up over the fastest peer of its
precision (and which peer that was); and every variant's files against our fp32 export.

int8 variants are compared with int8 peers, fp32 with fp32 peers, 4-bit ones (`quantize --bits 4`) with the int8
peers (none of the peers writes a 4-bit T5: 8 bits is the fewest a peer offers); a pruned variant of ours is compared
with the same (unpruned) peers of its precision. Only cells that produced exactly the forced number of tokens count:
a short or failed result is shown in the tables but never compared, and a speed-up missing one side says why.
"""

from __future__ import annotations

Key = tuple[int, int, int]  # (threads, batch, beams)


def valid(cell: dict | None) -> bool:
    return bool(cell) and not cell.get("short", True)


def cell_of(entry: dict, key: Key) -> dict | None:
    for c in entry.get("cells", []):
        if (c["threads"], c["batch"], c["beams"]) == key:
            return c
    return None


def ours(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e["owner"] == "ours"]


PEER_PRECISION = {"int4": "int8"}  # a precision no peer has -> the peers it is measured against


def fastest_peer(entries: list[dict], precision: str, key: Key) -> dict:
    """{'name', 'p50_ms'} of the fastest peer of `precision` in cell `key`, else {'why': ...}."""
    precision = PEER_PRECISION.get(precision, precision)
    peers = [e for e in entries if e["owner"] == "peer" and e["precision"] == precision and not e.get("pruned")]
    ok = [(e["name"], cell_of(e, key)["p50_ms"]) for e in peers if valid(cell_of(e, key))]
    if ok:
        name, p50 = min(ok, key=lambda x: x[1])
        return {"name": name, "p50_ms": p50}
    if precision not in ("fp32", "int8"):
        return {"why": f"no peer has a known precision to match ({precision})"}
    return {"why": f"no {precision} peer (--peers)" if not peers else
            f"no {precision} peer result of exactly the forced length"}


def _ours_why(e: dict, c: dict | None, n: int | None) -> str:
    if "error" in e:
        return "failed"
    if c is None:
        return "not measured"
    return f"short ({c['new_tokens_min']}-{c['new_tokens_max']}" + (f" of {n}" if n else "") + " tokens)"


def speedups(entries: list[dict], keys: list[Key], output_tokens: int | None = None) -> list[dict]:
    """One row per grid cell: the fastest peer of each precision of ours, and for each variant of ours its p50 and
    speed-up (the fastest peer's p50 / ours, 2 decimals) with that peer; `speedup` None with `why` when one side has no
    result of exactly the forced length."""
    mine = ours(entries)
    precisions = dict.fromkeys(["int8", "fp32", *(e["precision"] for e in mine)])
    rows = []
    for key in keys:
        best = {p: fastest_peer(entries, p, key) for p in precisions}
        row = {"threads": key[0], "batch": key[1], "beams": key[2], "fastest_peer": best, "variants": {}}
        for e in mine:
            c, peer = cell_of(e, key), best[e["precision"]]
            x = {"precision": e["precision"], "pruned": e.get("pruned", False),
                 "p50_ms": c["p50_ms"] if valid(c) else None, "peer": peer if "name" in peer else None,
                 "speedup": None}
            if x["p50_ms"] and x["peer"]:
                x["speedup"] = round(peer["p50_ms"] / x["p50_ms"], 2)
            else:
                x["why"] = "; ".join(w for w in (None if valid(c) else _ours_why(e, c, output_tokens),
                                                 peer.get("why")) if w)
            row["variants"][e["name"]] = x
        rows.append(row)
    return rows


def sizes(entries: list[dict]) -> dict:
    """Each variant's files (ours, the baseline's, the peers') in bytes, against the source checkpoint's safetensors
    (the first variant whose lineage names one) and against our smallest unpruned fp32 export."""
    sized = [e for e in entries if e.get("size_bytes")]
    out: dict = {"bytes": {e["name"]: e["size_bytes"] for e in sized}}
    source = next((e["source"] for e in entries if e.get("source")), None)
    if source:
        st = source["safetensors_bytes"]
        out |= {"checkpoint": source, "vs_checkpoint": {e["name"]: round(e["size_bytes"] / st, 3) for e in sized}}
    fp32 = [e for e in ours(entries) if e["precision"] == "fp32" and not e.get("pruned") and "error" not in e
            and e.get("size_bytes")]
    if not fp32:
        return {**out, "fp32": None, "why": "no fp32 export of ours to compare with", "ratios": {}}
    base = min(fp32, key=lambda e: e["size_bytes"])
    return {**out, "fp32": base["name"], "fp32_bytes": base["size_bytes"],
            "ratios": {e["name"]: round(e["size_bytes"] / base["size_bytes"], 3) for e in sized if e is not base}}
