"""The bench report: bench.json (one dict: its stamp, settings, environment, entries, speed-ups vs the peers, sizes,
and the expectations asked for) and its Markdown rendering."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
from pathlib import Path

from t5compress import metrics
from t5compress.bench import compare, expect
from t5compress.bench.config import BenchConfig
from t5compress.bench.floor import floor_lines
from t5compress.bench.inputs import Inputs, decode
from t5compress.bench.stamp import stamp, stamped_markdown
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
    """bench.json: every entry with its measurements, accuracy and agreement, the speed-ups per cell, the sizes, the
    expectations, the environment."""
    # Each output decoded with the tokenizer of its ids: the bench's, or a variant's own (another vocabulary).
    texts = {n: decode(Path(r.get("tokenizer_dir") or inputs.tokenizer_dir), r["outputs"])
             for n, r in results.items() if r.get("outputs")}
    entries = []
    for v in variants:
        e = v.as_dict()
        if v.role == "peer":  # prepared inside the staged dir: name the place it has once OUT is in place
            e["path"] = str(out / v.path.relative_to(tmp))
        r = dict(results[v.name])
        r.pop("outputs", None)
        r.pop("tokenizer_dir", None)
        e.update(r)
        if v.name in texts:
            e["accuracy"] = _accuracy(texts[v.name], texts.get(first), inputs, first)
        entries.append(e)
    cpu = cpu_features()
    return {
        "stamp": stamp(),  # commit, date, machine, command (a bench.json from before it has none)
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
        **comparisons(entries, grid(cfg), cfg.output_tokens, cfg.expectations),
        "floor": _floor(entries),
    }


def _floor(entries: list[dict]) -> dict:
    from t5compress.bench.floor import floors
    from t5compress.cpu import memory_read_gb_s

    gb_s = memory_read_gb_s()
    return {"gb_s": gb_s, "entries": floors(entries, gb_s)}


def comparisons(entries: list[dict], keys: list[tuple[int, int, int]], output_tokens: int,
                expectations: dict[str, float]) -> dict:
    """The report's computed part: speed-ups per cell vs the fastest peer, sizes vs our fp32, the expectations."""
    rows, size = compare.speedups(entries, keys, output_tokens), compare.sizes(entries)
    return {"speedups": rows, "sizes": size, "expectations": expect.check(entries, rows, size, expectations)}


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
    r = upgrade(r)
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
    lines += speedup_lines(r) + size_lines(r) + expectation_lines(r) + floor_lines(r)
    lines += _peers(r)
    if r.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in r["plots"]] + [""]
    return stamped_markdown("\n".join(lines), r.get("stamp"))


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
        cells = [compare.cell_of(x, (t, b, 1)) for t in r["settings"]["threads"]]
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
        cells = [compare.cell_of(x, k) for k in keys]
        last, first = cells[-1], cells[0]
        lines.append(f"| {x['name']} | " + " | ".join(cell_text(c, n) for c in cells) +
                     f" | {last['tokens_per_s'] if last else '–'} | {first['ttft_ms'] if first else '–'} |")
    return lines + [""]


def grid_of(r: dict) -> list[tuple[int, int, int]]:
    s = r["settings"]
    return [(t, b, k) for t in s["threads"] for b in s["batch_sizes"] for k in s["beams"]]


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _cell_key(row: dict) -> str:
    return f"| {row['threads']} | {row['batch']} | {decode_name(row['beams'])} | "


def speedup_lines(r: dict, level: int = 2) -> list[str]:
    """Per grid cell and variant of ours: p50, the speed-up over the fastest peer of its precision, and that peer."""
    rows, h = r["speedups"], "#" * level
    names = list(rows[0]["variants"]) if rows else []
    lines = [f"{h} Speed-up vs the fastest peer", ""]
    if not names:
        return lines + ["No variant of ours (an ONNX or TorchScript export, a served model) to compare.", ""]
    if not any(x["owner"] == "peer" for x in r["entries"]):
        return lines + ["No peer was measured" + (" (see Skipped peers)" if r["skipped"] else
                                                  " (give --peers, e.g. --peers all)") + ": nothing to compare.", ""]
    lines += ["Per grid cell, each variant of ours: its p50 ms and its speed-up = the p50 of the fastest peer of the "
              "same precision / ours (int8 vs int8 peers, fp32 vs fp32 peers, 4-bit vs int8 peers; a pruned "
              "variant vs the same unpruned peers), and which peer that was. Only results of exactly the forced "
              "length count.", "",
              "| threads | batch | decode | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for row in rows:
        cells = []
        for x in row["variants"].values():
            if x["speedup"] is not None:
                cells.append(f"{_ms(x['p50_ms'])} ms, **{x['speedup']:.2f}x** vs {x['peer']['name']} "
                             f"({_ms(x['peer']['p50_ms'])} ms)")
            else:
                cells.append((f"{_ms(x['p50_ms'])} ms; " if x["p50_ms"] else "") + x["why"])
        lines.append(_cell_key(row) + " | ".join(cells) + " |")
    return lines + [""]


def size_lines(r: dict, level: int = 2) -> list[str]:
    size = r["sizes"]
    lines = [f"{'#' * level} Size", ""]
    if size.get("bytes"):  # reports made before sizes in bytes have ratios to our fp32 only
        source = size.get("checkpoint")
        lines += ([f"Files each variant loads, in bytes, against the source checkpoint's `model.safetensors` "
                   f"({source['safetensors_bytes']:,} bytes, `{source['path']}`) and our fp32 export:", ""]
                  if source else ["Files each variant loads, in bytes (no source checkpoint known):", ""])
        lines += ["| variant | bytes | vs checkpoint | vs our fp32 |", "|---|---:|---:|---:|"]
        for n, b in size["bytes"].items():
            vs_ck = size.get("vs_checkpoint", {}).get(n)
            vs_fp32 = 1.0 if n == size.get("fp32") else size["ratios"].get(n)
            lines.append(f"| {n} | {b:,} | {f'{vs_ck:.3f}x' if vs_ck else '-'} | "
                         f"{f'{vs_fp32:.3f}x' if vs_fp32 else '-'} |")
        return lines + [""]
    if not size.get("fp32"):
        return lines + [f"Not compared: {size['why']}.", ""]
    return lines + [f"Files on disk against `{size['fp32']}`'s ({mb(size['fp32_bytes'])} MB): " + ", ".join(
        f"{n} {v:.3f}x" for n, v in size["ratios"].items()) + ".", ""]


def expectation_lines(r: dict, level: int = 2) -> list[str]:
    """The expectations asked for (--expect), per cell and in sum; nothing when none was asked."""
    x = r.get("expectations")
    if not x:
        return []
    asked = x["asked"]
    speed = [k for k in asked if k in expect.SPEED]
    lines = [f"{'#' * level} Expectations", "",
             "Expected (--expect): " + ", ".join(expect.need(k, v) for k, v in asked.items()) + ". Speed: per grid "
             "cell, our fastest variant of that kind over the fastest peer of its precision (as above); size: each "
             "int8 variant of ours against our fp32 export's files.", ""]
    if speed:
        lines += ["| threads | batch | decode | " + " | ".join(expect.need(k, asked[k]) for k in speed) + " |",
                  "|---|---|---|" + "---|" * len(speed)]
        for row in x["cells"]:
            cells = []
            for k in speed:
                g = row["results"][k]
                cells.append(f"not measured ({g['why']})" if g["status"] == "not measured" else
                             f"**{g['status']}** {g['speedup']:.2f}x: {g['ours']['name']} {_ms(g['ours']['p50_ms'])} "
                             f"vs {g['peer']['name']} {_ms(g['peer']['p50_ms'])} ms")
            lines.append(_cell_key(row) + " | ".join(cells) + " |")
        lines += ["", "; ".join(f"{expect.need(k, asked[k])}: met in {v['met']} of {v['met'] + v['missed']} "
                                "measured cells" + (f", {v['not_measured']} not measured" if v["not_measured"] else "")
                                for k, v in x["summary"].items() if k != "size") + ".", ""]
    if "size" in x:
        size, need = x["size"], expect.need("size", asked["size"])
        lines += [f"{need}: not measured ({size['why']})." if size.get("status") == "not measured" else
                  f"{need} of `{size['fp32']}`'s files: " + ", ".join(
                      f"{n} {v['ratio']:.3f}x **{v['status']}**" for n, v in size["variants"].items()) + ".", ""]
    lines += [("**Missed**: " + "; ".join(x["missed"]) + ".") if x["missed"] else
              "No expectation missed.", ""]
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
    retried = [x for x in r["entries"] if "retried" in x]
    if retried:
        lines += ["## Measured on a second try", ""] + [f"- {x['name']}: {x['retried']}" for x in retried] + [""]
    return lines


def recompute(r: dict, expect_items: list[str] | None = None) -> dict:
    """`r` with its speed-ups, sizes and expectations computed again from its entries (the expectations of
    `expect_items` when given, else its own); a bench.json from before --expect has its goals as the expectations."""
    r = dict(r)
    old = r.pop("goals", None)
    settings = dict(r["settings"])
    if expect_items is not None:
        settings["expect"] = list(expect_items)
    elif "expect" not in settings:
        settings["expect"] = _goals_asked(old)
    r["settings"] = settings
    return {**r, **comparisons(r["entries"], grid_of(r), settings["output_tokens"], expect.parse(settings["expect"]))}


def _goals_asked(old: dict | None) -> list[str]:
    """The KEY=RATIO items equal to an old bench.json's goals (the thresholds its 'need' fields recorded)."""
    if not old:
        return []
    needs = {k: g["need"] for k, g in (old["cells"][0]["goals"] if old.get("cells") else {}).items()}
    if "need" in old.get("size", {}):
        needs["size"] = old["size"]["need"]
    return [f"{k}={v:g}" for k, v in needs.items()]


def upgrade(r: dict) -> dict:
    """A bench.json of any version in today's shape (an old one recomputed; today's as it is)."""
    return r if "speedups" in r and "goals" not in r else recompute(r)


def rerender(bench_json: Path, expect_items: list[str] | None = None) -> str:
    """Recompute a bench.json's speed-ups and expectations (`expect_items` instead of its own when given) and rewrite
    it and its report.md; an old bench.json (with 'goals') comes out in today's format."""
    import json

    from t5compress.artifacts import write_json

    r = recompute(json.loads(Path(bench_json).read_text()), expect_items)
    write_json(bench_json, r)
    md = markdown(r)
    Path(bench_json).with_name("report.md").write_text(md)
    return md


if __name__ == "__main__":  # python -m t5compress.bench.report OUT/bench.json [KEY=RATIO ...]
    import sys

    rerender(Path(sys.argv[1]), sys.argv[2:] or None)
