"""JSON + Markdown results of `generate_speed.py`: per-engine tables, ratios to PyTorch, the targets hit or missed.

Targets (issue 9): on every row our best int8 engine is >= 1.33x faster than the fastest int8 peer, our fp32 runtime
is faster than every fp32 peer, and our int8 files are at most 0.27x our fp32 files. Only results that produced
exactly the forced number of tokens count; a short or failed result is shown but never compared.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path

from engines import ENGINES

INT8_TARGET, SIZE_TARGET = 1.33, 0.27
OUR_FP32 = "t5compress fp32"
BASE = "pytorch fp32"
VERSIONS = ("torch", "transformers", "onnxruntime", "optimum", "optimum-onnx", "optimum-intel", "openvino",
            "ctranslate2", "numpy")


def valid(v: dict | None, out_tokens: int) -> bool:
    return bool(v) and "error" not in v and v.get("new_tokens") == out_tokens


def _fastest(row: dict, names: list[str], out_tokens: int) -> tuple[str, float] | None:
    ok = [(n, row["engines"][n]["median_ms"]) for n in names if valid(row["engines"].get(n), out_tokens)]
    return min(ok, key=lambda x: x[1]) if ok else None


def targets(row: dict, out_tokens: int) -> dict:
    """Our best int8 vs the fastest int8 peer, our fp32 vs the fastest fp32 peer (speed-up = their ms / ours)."""
    group = lambda prec, owner: [n for n, e in ENGINES.items() if e.precision == prec and e.owner == owner]  # noqa
    out = {}
    for prec, need in (("int8", INT8_TARGET), ("fp32", 1.0)):
        ours = _fastest(row, group(prec, "ours"), out_tokens)
        peer = _fastest(row, group(prec, "peer"), out_tokens)
        t = {"ours": ours and {"engine": ours[0], "ms": ours[1]}, "peer": peer and {"engine": peer[0], "ms": peer[1]}}
        if ours and peer:
            t["speedup"] = round(peer[1] / ours[1], 2)
            t["hit"] = t["speedup"] >= need if prec == "int8" else t["speedup"] > need
        out[prec] = t
    return out


def _versions() -> dict:
    v = {}
    for pkg in VERSIONS:
        try:
            v[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            v[pkg] = None
    return v


def write(rows: list[dict], shapes: dict, meta: dict, out: Path) -> None:
    n = meta["out_tokens"]
    for r in rows:
        r["targets"] = targets(r, n)
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "versions": _versions(), **meta}
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate_speed.json").write_text(json.dumps({"env": env, "shapes": shapes, "rows": rows}, indent=1))
    md = markdown(rows, shapes, env)
    (out / "generate_speed.md").write_text(md)
    print(md)


def markdown(rows: list[dict], shapes: dict, env: dict) -> str:
    n = env["out_tokens"]
    vers = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    lines = [f"{env['in_tokens']} tokens in, exactly {n} out; median ms per generate call of {env['repeats']} "
             f"after {env['warmup']} warm-up (p90 in brackets), ×PT = speed-up over PyTorch fp32 in the same run. "
             f"{env['cpus']} CPUs, Python {env['python']}; {vers}. Whole run {env['seconds']} s.", ""]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for threads in dict.fromkeys(r["threads"] for r in rows if r["shape"] == shape):
            sub = [r for r in rows if r["shape"] == shape and r["threads"] == threads]
            lines += _engine_table(shape, threads, sub, shapes.get(shape, {}), n)
    lines += _targets_table(rows)
    lines += _size_table(shapes)
    lines += _profile_table(shapes)
    skipped = {f"{s}: {e}": why for s, d in env["skipped"].items() for e, why in d.items()}
    if skipped:
        lines += ["Skipped:", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    return "\n".join(lines)


def _engine_table(shape: str, threads: int, rows: list[dict], sizes: dict, n: int) -> list[str]:
    cols = [f"b{r['batch']} {r['decode']}" for r in rows]
    names = [e for e in ENGINES if any(e in r["engines"] for r in rows)]
    lines = [f"### {shape}, {threads} thread{'s' if threads > 1 else ''}", "",
             "| engine | " + " | ".join(cols) + " | size MB |", "|---|" + "---|" * (len(cols) + 1)]
    for e in names:
        cells = []
        for r in rows:
            v, base = r["engines"].get(e), r["engines"].get(BASE)
            if v is None:
                cells.append("–")
            elif "error" in v:
                cells.append(f"fails: {v['error'][:60]}")
            elif v["new_tokens"] != n:
                cells.append(f"short ({v['new_tokens']} tokens)")
            else:
                ratio = f", {base['median_ms'] / v['median_ms']:.2f}×" if valid(base, n) else ""
                cells.append(f"{v['median_ms']:.0f} ({v['p90_ms']:.0f}{ratio})")
        size = sizes.get(e, {}).get("size_mb")
        lines.append(f"| {e} | " + " | ".join(cells) + f" | {size if size is not None else '–'} |")
    return lines + [""]


def _targets_table(rows: list[dict]) -> list[str]:
    lines = ["### Targets", "",
             f"int8: our best int8 at least {INT8_TARGET}× faster than the fastest int8 peer; fp32: our best fp32 "
             "runtime faster than every fp32 peer (speed-up = peer ms / our ms).", "",
             "| shape | threads | batch | decode | our best int8 | fastest int8 peer | speed-up | int8 target "
             "| our best fp32 | fastest fp32 peer | speed-up | fp32 target |", "|---" * 12 + "|"]
    hits = {"int8": [0, 0], "fp32": [0, 0]}
    for r in rows:
        t = r["targets"]
        cells = []
        for prec in ("int8", "fp32"):
            x = t[prec]
            if prec == "int8":
                cells.append(f"{x['ours']['engine'].replace('t5compress int8 ', '')} {x['ours']['ms']:.0f}"
                             if x["ours"] else "–")
            else:
                cells.append(f"{x['ours']['engine'].replace('t5compress ', '')} {x['ours']['ms']:.0f}"
                             if x["ours"] else "–")
            cells.append(f"{x['peer']['engine']} {x['peer']['ms']:.0f}" if x["peer"] else "–")
            if "hit" in x:
                hits[prec][0] += x["hit"]
                hits[prec][1] += 1
                cells += [f"{x['speedup']:.2f}×", "hit" if x["hit"] else "missed"]
            else:
                cells += ["–", "n/a"]
        lines.append(f"| {r['shape']} | {r['threads']} | {r['batch']} | {r['decode']} | " + " | ".join(cells) + " |")
    lines += ["", f"int8 target hit on {hits['int8'][0]} of {hits['int8'][1]} rows; fp32 target hit on "
              f"{hits['fp32'][0]} of {hits['fp32'][1]} rows.", ""]
    return lines


def _size_table(shapes: dict) -> list[str]:
    lines = ["### Size on disk", "", f"Model files each engine loads (tokenizers not counted); int8 target: at most "
             f"{SIZE_TARGET}× our fp32 files.", "", "| shape | engine | MB | × our fp32 | int8 size target |",
             "|---|---|---|---|---|"]
    for shape, sizes in shapes.items():
        ours = sizes.get(OUR_FP32, {}).get("size_mb")
        for e, s in sizes.items():
            if e not in ENGINES:
                continue
            ratio = s["size_mb"] / ours if ours else None
            target = ("hit" if ratio <= SIZE_TARGET else "missed") if (
                ratio is not None and ENGINES[e].owner == "ours" and ENGINES[e].precision == "int8") else ""
            lines.append(f"| {shape} | {e} | {s['size_mb']} | {f'{ratio:.2f}' if ratio else '–'} | {target} |")
    return lines + [""]


def _profile_table(shapes: dict) -> list[str]:
    """Where our runtime's time goes per generate call (--profile), 1 thread, ms."""
    keys = ("total_ms", "encoder_ms", "first_step_ms", "with_past_ms", "with_past_ms_per_step",
            "lm_head_ms (inside the decoder steps)", "search_and_python_ms")
    heads = ("total", "encoder", "first decoder step", "31 with-past steps", "per with-past step",
             "lm_head (inside the steps)", "search + Python", "top ops in with-past (% of kernel time)")
    rows = [(shape, e, case, v) for shape, info in shapes.items() for e, cases in info.get("profile", {}).items()
            for case, v in cases.items()]
    if not rows:
        return []
    lines = ["### Where our runtime's time goes (--profile, 1 thread, ms per call)", "",
             "| shape | engine | case | " + " | ".join(heads) + " |", "|---" * (len(heads) + 3) + "|"]
    for shape, e, case, v in rows:
        ops = ", ".join(f"{k} {p:g}" for k, p in v["top_ops_with_past_%"].items())
        lines.append(f"| {shape} | {e} | {case} | " + " | ".join(f"{v[k]:g}" for k in keys) + f" | {ops} |")
    return lines + [""]


if __name__ == "__main__":  # re-render the Markdown from a results JSON: python benchmarks/report.py RESULTS.json
    import sys

    data = json.loads(Path(sys.argv[1]).read_text())
    md = markdown(data["rows"], data["shapes"], data["env"])
    Path(sys.argv[1]).with_suffix(".md").write_text(md)
    print(md)
