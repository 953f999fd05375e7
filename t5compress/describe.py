"""Each stage's report told to people, one function per stage (the stage registry names it): (what, value) rows, the
key numbers first. The CLI prints them after a stage ran, `info` shows them for a directory, and a recipe's results
table shows the first row's value. A row whose numbers a report lacks (older versions wrote fewer keys) is left
out where the stage's report allows it.

    rows = stage("train").describe(json.loads(Path("runs/ft/report.json").read_text()))
    # [("eval", "exact_match 61.5, rougeL 80.2, bleu 55.1, loss 0.412 (step 400, 200 examples)"), ("trained", ...)]
"""

from __future__ import annotations

from typing import Any

Rows = list[tuple[str, str]]
METRICS = ("exact_match", "rougeL", "bleu", "loss")


def mb(n: Any) -> str:
    return f"{n / 1e6:.2f} MB" if isinstance(n, (int, float)) else "?"


def metrics(ev: dict | None, keys: tuple[str, ...] = METRICS) -> str:
    """'exact_match 61.5, rougeL 80.2, ...' of the metrics an evaluation holds."""
    ev = ev or {}
    return ", ".join(f"{k} {ev[k]}" for k in keys if k in ev)


def _eval(ev: dict | None) -> str:
    """An evaluation's metrics, with the step it was taken at and how many examples it read."""
    ev = ev or {}
    where = ", ".join(p for p in (f"step {ev['step']}" if "step" in ev else "",
                                  f"{ev['examples']} examples" if "examples" in ev else "") if p)
    return metrics(ev) + (f" ({where})" if where else "")


def _trained(tr: dict | None, speed: str = "") -> Rows:
    if not tr or "steps" not in tr:
        return []
    return [("trained", f"{tr['steps']} steps in {tr.get('seconds', '?')} s" + (f" ({speed})" if speed else ""))]


def _model(m: dict | None) -> str:
    m = m or {}
    n = m.get("parameters")
    if not isinstance(n, int):
        return ""
    return f"{n:,} parameters ({n / 1e6:.2f}M)" + (f", vocabulary {m['vocab_size']}" if "vocab_size" in m else "")


# --- the stages, in chain order ------------------------------------------------------------------------------------


def data(r: dict) -> Rows:
    ex = r.get("examples", {})
    if r.get("generated"):
        return [("examples", f"{ex.get('train')} train / {ex.get('eval')} eval examples ({r['generated']})")]
    return [("examples", f"train {ex.get('train')}, eval {ex.get('eval') or 'held out'}")]


def create(r: dict) -> Rows:
    return [("model", _model(r.get("model")))]


def load(r: dict) -> Rows:
    return [("model", _model(r.get("model"))), ("from", str(r.get("source")))]


def pretrain(r: dict) -> Rows:
    ev, before = r.get("eval") or {}, (r.get("eval_before") or {}).get("loss", "-")
    where = f" (step {ev.get('step')}, {ev.get('examples')} examples)" if "step" in ev else ""
    tr, n = r.get("train") or {}, (r.get("model") or {}).get("parameters")
    speed = f"{tr['tokens_per_second']:,.0f} tokens/s" if isinstance(tr.get("tokens_per_second"), float | int) else ""
    trained = [(label, f"{n / 1e6:.2f}M parameters, {text}" if isinstance(n, int) else text)
               for label, text in _trained(tr, speed)]
    return [("held-out span-corruption loss", f"{before} → {ev.get('loss', '-')}{where}"), *trained]


def train(r: dict) -> Rows:
    tr = r.get("train") or {}
    speed = f"{tr['examples_per_second']} examples/s" if "examples_per_second" in tr else ""
    return ([("eval", _eval(r["eval"]))] if r.get("eval") else []) + _trained(tr, speed)


QAT_ROWS = (("int8_qat", "int8 fake-quant, after QAT"), ("fp32_start", "fp32 (start)"),
            ("int8_calibrated", "int8 fake-quant, calibrated"), ("fp32_after_qat", "fp32 weights after QAT"))


def qat(r: dict) -> Rows:
    """The int8 result after training first, then fp32 at the start, calibrated int8 and the fp32 weights after."""
    got = r.get("metrics") or {}
    rows = [(label, metrics(got[key])) for key, label in QAT_ROWS if got.get(key)]
    s, sc = r.get("sizes"), r.get("scales")
    if s and sc:
        kept = ", ".join(sc["kept_fp32"]) or "none"
        rows.append(("weights", f"{s['fp32_weight_bytes'] / 1e6:.2f} MB fp32 -> {s['int8_weight_bytes'] / 1e6:.2f} MB "
                                f"int8 ({s['ratio']:.2f}x); {sc['quantized_linear']} Linear layers int8, kept fp32: "
                                f"{kept}"))
    return rows + _trained(r.get("train"))


PRUNE_ROWS = {"parameters": "parameters", "block_parameters": "block parameters", "bytes": "MB (fp32)",
              "latency_ms": "generate ms (b1)", "loss": "eval loss", "exact_match": "exact match", "rougeL": "rougeL",
              "bleu": "bleu"}


def _cell(r: dict, key: str) -> str:
    value = r.get(key, (r.get("eval") or {}).get(key))
    if value is None:
        return "-"
    if key == "bytes":
        return f"{value / 2**20:.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def prune(r: dict) -> Rows:
    """Parameters before → after and the final metrics; what was pruned; each measure before pruning → right after
    it → after recovery; the vocabulary trim; the layout written."""
    cols = [("before", r.get("before")), ("pruned", r.get("after_pruning")), ("recovered", r.get("after_recovery"))]
    cols = [(name, c) for name, c in cols if c]
    before, after = (r.get("before") or {}).get("parameters"), (r.get("model") or {}).get("parameters")
    size = f"{before:,} → {after:,} parameters" if isinstance(before, int) and isinstance(after, int) else ""
    how = [r["schedule"], r["criterion"]] if r.get("kept") else []
    how += ["vocabulary"] if r.get("vocab") else []
    final = metrics(r.get("eval"), METRICS[:2])
    rows = [("pruned", "; ".join(p for p in (size, final) if p)), ("how", ", ".join(how))]
    if cols:
        rows.append(("measured", " → ".join(name for name, _ in cols)))
        rows += [(label, " → ".join(_cell(c, key) for _, c in cols)) for key, label in PRUNE_ROWS.items()]
    if r.get("vocab"):
        rows.append(("vocabulary", vocab(r["vocab"])))
    if "plain" in r:
        rows.append(("written as", "plain Hugging Face dir" if r["plain"] else
                     "per-layer sizes in config.json (load with t5compress)"))
    return rows


def vocab(v: dict) -> str:
    """The vocabulary trim: pieces, parameters and MB around it, and how much segmentation changed."""
    b, a, seg = v["before"], v["after"], v["segmentation_changed"]
    return (f"{b['pieces']:,} → {a['pieces']:,} pieces ({v['kept']['used_by_data']:,} used by the data); "
            f"parameters {b['parameters']:,} → {a['parameters']:,}, MB {b['bytes'] / 2**20:.2f} → "
            f"{a['bytes'] / 2**20:.2f}; data tokens segmented differently: {seg['changed']:,} of {seg['tokens']:,} "
            f"({100 * seg['share']:.2f}%)")


def recover(r: dict) -> Rows:
    rows = [(label, metrics(r[key])) for key, label in (("eval_after", "after recovery"),
                                                        ("eval_before", "before recovery")) if r.get(key)]
    return rows + _trained(r.get("train"))


def export(r: dict) -> Rows:
    """Size and parity first; then the graphs, their precision, the tolerance used and the generation check."""
    if "int8" in r:  # a QAT dir: int8 Q/DQ graphs, checked against the fake-quantized model
        return _qat_export(r)
    from t5compress.lineage import vs_source

    parity, dtype = r.get("parity") or {}, r.get("dtype", "fp32")  # exports made before --dtype are fp32
    size = sum(v for k, v in (r.get("files") or {}).items() if k.endswith((".onnx", ".onnx_data", ".pt")))
    diff = parity.get("max_abs_diff")
    worst = max(diff.values()) if isinstance(diff, dict) and diff else diff
    rows = [("size, parity", mb(size) + (f", max |Δ| vs PyTorch {worst:.1e}" if isinstance(worst, float) else "")),
            *vs_source(size, r.get("source")), (f"{r.get('format', 'onnx')} graphs", ", ".join(r.get("graphs") or []))]
    if r.get("format") == "onnx":
        rows.append(("dtype", _dtype(r)))
    reference = "PyTorch" if dtype == "fp32" else "fp32 PyTorch"
    if isinstance(diff, dict):
        rows.append((f"max |export - {reference}|", ", ".join(f"{g.removesuffix('_model')} {d:.2e}"
                                                              for g, d in diff.items()) + " (logits, cache)"))
    if parity.get("worst"):
        rows.append(("tolerance per tensor", f"atol {parity['atol']:g} + rtol {parity['rtol']:g} x max|PyTorch "
                     f"tensor|; worst use of it: {max(w['ratio'] for w in parity['worst'].values()):.0%}"))
    if "token_agreement" in parity:  # half precision: agreement with fp32 greedy, not identity
        agree = parity["token_agreement"]
        rows.append(("greedy agreement with fp32", f"{agree['agreement']:.1%} ({agree['identical_rows']}/"
                                                   f"{agree['rows']} rows identical); no NaN or inf in any output"))
    elif "generation" in parity:
        gen = parity["generation"]
        rows.append(("greedy == generate", f"yes, tokens identical ({gen.get('max_new_tokens')} new, batch "
                                           f"{gen.get('batch')})" if gen.get("identical") else "NO"))
    return rows + search_graph(r)


def _qat_export(r: dict) -> Rows:
    parity, kernels = r["parity"], r["int8"]["ort_kernels"]
    rel = ", ".join(f"{name} {d:.2e}" for name, d in parity["max_rel_diff"].items())
    agree = parity["token_agreement"]
    fused = sum(n for k in kernels.values() for op, n in k.items() if op != "MatMul" and "Quantize" not in op)
    return [("agreement", f"greedy token agreement {agree['agreement']:.1%} ({agree['identical_rows']}/"
                          f"{agree['rows']} rows identical); ONNX Runtime int8 kernels: {fused}"),
            ("graphs", "int8 Q/DQ ONNX graphs (learned QAT scales): " + ", ".join(r.get("graphs") or [])),
            ("max |export - fake-quant PyTorch| / logits scale", f"{rel} (rtol {parity['rtol']:g})")]


def _dtype(r: dict) -> str:
    """An export's precision: fp32, or e.g. 'fp16 (wo, residual sums, logits fp32; cache float16)'."""
    dtype = r.get("dtype", "fp32")
    if dtype == "fp32":
        return dtype
    cache = ((r.get("parity") or {}).get("dtypes") or {}).get("decoder_with_past_model", {}).get("cache", "?")
    return f"{dtype} (wo, residual sums, logits fp32; cache {cache})"


def search_graph(r: dict) -> Rows:
    """generator.onnx (export / quantize --search-graph): how its search matched the Python search's tokens."""
    graphs = r.get("graphs")  # quantize: a dict per graph; export: the graph names
    check = r.get("search_graph") or (graphs.get("search_graph") if isinstance(graphs, dict) else None)
    if not isinstance(check, dict) or "greedy" not in check:
        return []
    rows = check["rows"]
    return [("search graph", f"generator.onnx: greedy {check['greedy']['identical_rows']}/{rows}, beam 2 "
                             f"{check['beam2']['identical_rows']}/{rows} rows as the Python search (--search graph)")]


def quantize(r: dict) -> Rows:
    """Told by `t5compress.quantize.describe`, beside the stage it describes."""
    from t5compress.quantize.describe import describe

    return describe(r) + search_graph(r)


def triton(r: dict) -> Rows:
    models = r.get("models") or {}
    rows = [("repository", f"{len(models)} models, {mb(r.get('bytes'))} ({r.get('flavour')}, {r.get('kind')}); "
                           "configs checked against Triton's schema")]
    return rows + [(name, f"{m['backend']}, max batch {m['max_batch_size']}, {', '.join(m['instances'])}, "
                          f"{len(m['inputs'])} inputs, {m['outputs']} outputs") for name, m in models.items()]


def bench(r: dict) -> Rows:
    entries = r.get("entries") or []
    failed = sum("error" in e for e in entries)
    missed = len((r.get("expectations") or {}).get("missed") or [])
    return [("variants", f"{len(entries)} variants measured" + (f", {failed} failed" if failed else "")
             + (f", {missed} expectation(s) missed" if missed else "") + " → report.md")]
