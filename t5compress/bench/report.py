"""The bench report: bench.json (one dict: settings, environment, entries, goals) and its Markdown rendering."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
from pathlib import Path

from t5compress import metrics
from t5compress.bench import goals
from t5compress.bench.config import BenchConfig
from t5compress.bench.inputs import Inputs, decode
from t5compress.bench.variants import Variant
from t5compress.cpu import ARM64_PRESET, cpu_features, int8_note

VERSIONS = ("torch", "transformers", "onnxruntime", "optimum", "optimum-onnx", "optimum-intel", "openvino",
            "ctranslate2", "numpy")
SAMPLES = 3


def versions() -> dict:
    out = {}
    for pkg in VERSIONS:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def grid(cfg: BenchConfig) -> list[tuple[int, int, int]]:
    return [(t, b, k) for t in cfg.threads for b in cfg.batch_sizes for k in cfg.beams]


def assemble(cfg: BenchConfig, variants: list[Variant], results: dict, inputs: Inputs, skipped: dict,
             first: str, out: Path, tmp: Path) -> dict:
    """bench.json: every entry with its measurements, accuracy and agreement, the goals per cell, the environment."""
    texts = {n: decode(inputs.tokenizer_dir, r["outputs"]) for n, r in results.items() if r.get("outputs")}
    entries = []
    for v in variants:
        e = v.as_dict()
        if v.role == "peer":  # prepared inside the staged dir: name the place it has once OUT is in place
            e["path"] = str(out / v.path.relative_to(tmp))
        r = dict(results[v.name])
        r.pop("outputs", None)
        e.update(r)
        if v.name in texts:
            e["accuracy"] = _accuracy(texts[v.name], texts.get(first), inputs, first)
        entries.append(e)
    keys = grid(cfg)
    rows = goals.per_cell(entries, keys)
    cpu = cpu_features()
    return {
        "stage": "bench",
        "settings": {**dataclasses.asdict(cfg), "peers": list(cfg.peer_names)},
        "inputs": {"source": inputs.source, "eval_examples": len(inputs.texts), "tokenizer": str(inputs.tokenizer_dir),
                   "latency": f"{cfg.input_tokens} tokens in (cut from the eval texts' token stream, EOS last), "
                              f"exactly {cfg.output_tokens} out (forced), warm-up {cfg.warmup} untimed call(s), "
                              f"{cfg.repeats} timed", "accuracy": f"greedy, free length (at most "
                                                                  f"{cfg.max_new_tokens} new tokens)"},
        "first": first,
        "environment": {"python": platform.python_version(), "machine": platform.machine(), "cpu": cpu,
                        "versions": versions()},
        "edge": {"cpu": cpu, "int8": int8_note(cpu), "arm64_preset": ARM64_PRESET} if cfg.edge else None,
        "entries": entries,
        "skipped": skipped,
        "goals": {"cells": rows, "summary": goals.summary(rows), "size": goals.sizes(entries)},
    }


def _accuracy(preds: list[str], ref_preds: list[str] | None, inputs: Inputs, first: str) -> dict:
    acc: dict = {"examples": len(preds)}
    if inputs.references is not None:
        acc.update(metrics.compute(preds, inputs.references))
    if ref_preds is not None:
        acc["agreement"] = round(sum(a == b for a, b in zip(preds, ref_preds, strict=True)) / len(preds), 4)
        acc["agreement_with"] = first
    acc["samples"] = [{"input": t, "output": p} for t, p in zip(inputs.texts[:SAMPLES], preds[:SAMPLES],
                                                                strict=False)]
    return acc


def cell_text(c: dict | None, n: int) -> str:
    if c is None:
        return "–"
    if c.get("short"):
        return f"short ({c['new_tokens_min']}-{c['new_tokens_max']} of {n} tokens)"
    return f"{c['p50_ms']:.1f} ({c['p90_ms']:.1f} / {c['p99_ms']:.1f})"


def decode_name(beams: int) -> str:
    return "greedy" if beams == 1 else f"beam {beams}"


def mb(b: int | None) -> str:
    return "–" if b is None else f"{b / 1e6:.2f}"


def markdown(r: dict) -> str:
    s, n = r["settings"], r["settings"]["output_tokens"]
    env = r["environment"]
    vers = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    cpu = env["cpu"]
    lines = ["# t5compress bench", "",
             f"Grid: threads {s['threads']}, batch sizes {s['batch_sizes']}, beams {s['beams']}; "
             f"{r['inputs']['latency']}. Latency is p50 (p90 / p99) ms per generate call. Accuracy: "
             f"{r['inputs']['accuracy']} on {r['inputs']['eval_examples']} texts from {r['inputs']['source']}; "
             f"agreement = share of outputs identical to `{r['first']}`'s.", "",
             f"Environment: {cpu.get('model') or env['machine']}, {cpu['cpus']} CPUs, Python {env['python']}; "
             f"{vers}. Whole run {r.get('seconds', '?')} s.", ""]
    if r.get("edge"):
        lines += _edge(r)
    lines += _entries(r)
    for t in s["threads"]:
        lines += _latency(r, t, n)
    lines += _goals(r)
    lines += _peers(r)
    if r.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in r["plots"]] + [""]
    return "\n".join(lines)


def _edge(r: dict) -> list[str]:
    e, cpu = r["edge"], r["edge"]["cpu"]
    feats = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu.items() if isinstance(v, bool))
    lines = ["## Edge profile", "", f"CPU: {cpu['arch']}, {cpu.get('model') or 'model unknown'}: {feats}. "
             f"{e['int8']}.", "", f"Quantization preset for arm64 CPUs: {e['arm64_preset']}", "",
             "| variant | precision | cold start s (load + first token) | peak RSS MB | size MB | "
             + " | ".join(f"b1 greedy {t}t ms" for t in r["settings"]["threads"]) + " |",
             "|---|---|---|---|---|" + "---|" * len(r["settings"]["threads"])]
    b = min(r["settings"]["batch_sizes"])
    for x in r["entries"]:
        cells = [goals.cell_of(x, (t, b, 1)) for t in r["settings"]["threads"]]
        lines.append(f"| {x['name']} | {x['precision']} | {x.get('cold_start_s', '–')} | {x.get('peak_rss_mb', '–')} "
                     f"| {mb(x['size_bytes'])} | " + " | ".join(cell_text(c, r['settings']['output_tokens'])
                                                          for c in cells) + " |")
    return lines + [""]


def _entries(r: dict) -> list[str]:
    lines = ["## Variants", "", "| name | what | size MB | cold start s | peak RSS MB | exact match | ROUGE-L | BLEU "
             "| agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["entries"]:
        a = x.get("accuracy", {})
        if "error" in x:
            lines.append(f"| {x['name']} | {x['label']} | {mb(x['size_bytes'])} | fails: {x['error'][:120]} "
                         "| | | | | |")
            continue
        lines.append(f"| {x['name']} | {x['label']} | {mb(x['size_bytes'])} | {x['cold_start_s']} | "
                     f"{x['peak_rss_mb']} | {a.get('exact_match', '–')} | {a.get('rougeL', '–')} | "
                     f"{a.get('bleu', '–')} | {a.get('agreement', '–')} |")
    return lines + [""]


def _latency(r: dict, threads: int, n: int) -> list[str]:
    keys = [k for k in grid_of(r) if k[0] == threads]
    lines = [f"## Latency, {threads} thread{'s' if threads > 1 else ''}", "",
             "| name | " + " | ".join(f"b{b} {decode_name(k)}" for _, b, k in keys) + " | tokens/s (b"
             f"{keys[-1][1]} {decode_name(keys[-1][2])}) | first token ms (b{keys[0][1]} greedy) |",
             "|---|" + "---|" * (len(keys) + 2)]
    for x in r["entries"]:
        cells = [goals.cell_of(x, k) for k in keys]
        last, first = cells[-1], cells[0]
        lines.append(f"| {x['name']} | " + " | ".join(cell_text(c, n) for c in cells) +
                     f" | {last['tokens_per_s'] if last else '–'} | {first['ttft_ms'] if first else '–'} |")
    return lines + [""]


def grid_of(r: dict) -> list[tuple[int, int, int]]:
    s = r["settings"]
    return [(t, b, k) for t in s["threads"] for b in s["batch_sizes"] for k in s["beams"]]


def _goals(r: dict) -> list[str]:
    g = r["goals"]
    lines = ["## Goals", "", f"Speed-up = the fastest peer's p50 / ours, per cell; only results of exactly the forced "
             f"length count. int8: ours >= {goals.INT8_GOAL}x the fastest int8 peer; pruned+int8: >= "
             f"{goals.PRUNED_GOAL}x it; fp32: our fp32 export faster than every fp32 peer.", "",
             "| threads | batch | decode | " + " | ".join(g["summary"]) + " |", "|---|---|---|" + "---|" * len(
                 g["summary"])]
    for row in g["cells"]:
        cells = []
        for goal in g["summary"]:
            x = row["goals"][goal]
            if x["status"] == "not measured":
                cells.append(f"not measured ({x['why']})")
            else:
                cells.append(f"**{x['status']}** {x['speedup']:.2f}x: {x['ours']['name']} {x['ours']['p50_ms']:.0f} "
                             f"vs {x['peer']['name']} {x['peer']['p50_ms']:.0f} ms")
        lines.append(f"| {row['threads']} | {row['batch']} | {decode_name(row['beams'])} | "
                     + " | ".join(cells) + " |")
    lines += ["", "; ".join(f"{k}: hit on {v['hit']} of {v['hit'] + v['missed']} measured cells"
                            + (f", {v['not_measured']} not measured" if v["not_measured"] else "")
                            for k, v in g["summary"].items()) + ".", ""]
    size = g["size"]
    if size.get("status") == "not measured":
        lines += [f"Size goal (int8 files <= {goals.SIZE_GOAL}x our fp32 files): not measured ({size['why']}).", ""]
    else:
        lines += [f"Size goal (int8 files <= {goals.SIZE_GOAL}x `{size['fp32']}`'s fp32 files): " + ", ".join(
            f"{n} {v['ratio']}x **{v['status']}**" for n, v in size["int8"].items()) + ".", ""]
    return lines


def _peers(r: dict) -> list[str]:
    lines = []
    peers = [x for x in r["entries"] if x["role"] == "peer" or "engine" in x.get("settings", {})]
    if peers:
        lines += ["## Peer settings", "", "Every peer runs the same inputs with the same thread count, beams and "
                  "forced output length:", ""]
        for x in peers:
            st = ", ".join(f"{k}={v}" for k, v in x["settings"].items())
            lines.append(f"- **{x['name']}** ({x['label']}): {st}" + (f"; python {x['python']}" if x.get("python")
                                                                       else ""))
        lines.append("")
    if r["skipped"]:
        lines += ["## Skipped peers", ""] + [f"- {k}: {v}" for k, v in r["skipped"].items()] + [""]
    errors = [x for x in r["entries"] if "error" in x]
    if errors:
        lines += ["## Failed", ""] + [f"- {x['name']}: {x['error']}" for x in errors] + [""]
    return lines


def rerender(bench_json: Path) -> str:
    """Recompute the goals of a bench.json and rewrite it and its report.md (after the goal rules changed)."""
    import json

    from t5compress.artifacts import write_json

    r = json.loads(Path(bench_json).read_text())
    rows = goals.per_cell(r["entries"], grid_of(r))
    r["goals"] = {"cells": rows, "summary": goals.summary(rows), "size": goals.sizes(r["entries"])}
    write_json(bench_json, r)
    md = markdown(r)
    Path(bench_json).with_name("report.md").write_text(md)
    return md


if __name__ == "__main__":  # python -m t5compress.bench.report OUT/bench.json
    import sys

    rerender(Path(sys.argv[1]))
