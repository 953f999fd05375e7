"""How far each engine is from the hardware: ms per decode step beside a floor, the weight bytes one step reads
divided by the memory bandwidth measured on the same machine in the same run.

A decoder step reads every decoder weight and the LM head once (the input embedding only one row), so no engine on
this machine can take less time per step than those bytes take to stream from memory. Our ONNX variants' bytes are
counted from their decoder-with-past graph's initializers (int8 as 1 byte, fp32 as 4); a peer reads what our
unpruned variant of its precision reads (the same model, the same weight precision).
"""

from __future__ import annotations

from pathlib import Path

from t5compress.bench.compare import cell_of, valid
from t5compress.names import DECODER_MERGED, DECODER_WITH_PAST, ONNX_SUFFIX

_ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2}  # onnx TensorProto data types


def step_weight_bytes(export_dir: Path) -> int | None:
    """Bytes of weights one decoder step reads in an ONNX export dir (None: not an ONNX dir we can read)."""
    from t5compress.runtime.sessions import load_onnx

    for stem in (DECODER_WITH_PAST, DECODER_MERGED):
        path = export_dir / f"{stem}{ONNX_SUFFIX}"
        if path.is_file():
            model = load_onnx(path, load_external_data=False)
            break
    else:
        return None
    tables = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}  # embedding: one row per step
    used = {i for n in model.graph.node if n.op_type != "Gather" for i in n.input}
    total = 0
    for t in model.graph.initializer:
        if t.name in tables and t.name not in used:
            continue
        count = 1
        for d in t.dims:
            count *= d
        total += count * _ELEMENT_BYTES.get(t.data_type, 4)
    return total


def floors(entries: list[dict], gb_s: float) -> dict:
    """{name: {'weight_mb', 'floor_ms'}} per entry whose step bytes are known (ours counted, peers borrowed)."""
    known = {}
    for e in entries:
        if e["kind"] == "onnx" and e["owner"] == "ours" and "error" not in e:
            b = step_weight_bytes(Path(e["path"]))
            if b:
                known[e["name"]] = b
    borrowed = {e["precision"]: known[e["name"]] for e in entries
                if e["name"] in known and not e.get("pruned")}
    out = {}
    for e in entries:
        b = known.get(e["name"]) or (borrowed.get(e["precision"]) if not e.get("pruned") else None)
        if b:
            out[e["name"]] = {"weight_mb": float(f"{b / 1e6:.3g}"), "floor_ms": float(f"{b / (gb_s * 1e6):.3g}")}
    return out


def floor_lines(r: dict, level: int = 2) -> list[str]:
    """The Markdown section: per entry and grid cell, ms per decode step and its multiple of the floor."""
    f = r.get("floor")
    if not f or not f.get("entries"):
        return []
    n = r["settings"]["output_tokens"]
    keys = [(t, b, k) for t in r["settings"]["threads"] for b in r["settings"]["batch_sizes"]
            for k in r["settings"]["beams"]]
    lines = [f"{'#' * level} Distance from the hardware", "",
             f"ms per decode step (p50 of a call / {n} steps, the encoder included) beside the floor: the weight "
             f"bytes one step reads / this machine's memory read bandwidth, {f['gb_s']} GB/s (numpy, measured in this "
             "run). × = how many floors one step takes.", "",
             "| name | MB read per step | floor ms | " + " | ".join(
                 f"{t}t b{b} {'greedy' if k == 1 else f'beam {k}'}" for t, b, k in keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for e in r["entries"]:
        x = f["entries"].get(e["name"])
        if not x:
            continue
        cells = []
        for key in keys:
            c = cell_of(e, key)
            step = c["p50_ms"] / n if valid(c) else None
            cells.append(f"{step:.2f} ({step / x['floor_ms']:.1f}×)" if step and x["floor_ms"] else "–")
        lines.append(f"| {e['name']} | {x['weight_mb']} | {x['floor_ms']} | " + " | ".join(cells) + " |")
    return lines + [""]
