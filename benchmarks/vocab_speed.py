"""Vocabulary trimming (`prune --vocab`) on a t5-small shape: sizes and generation speed against CTranslate2 int8.

A random-weight t5-small (embedding scaled by 0.3 after init, so greedy decoding varies) with a SentencePiece unigram
tokenizer of up to 32k pieces trained here on a generated corpus (pseudo-words of a made-up language, Zipf-distributed;
no network), and a generated task ("reverse: w1 ... wn" -> "wn ... w1") whose texts use about 8k of those pieces.
Variants: unpruned fp32 and int8 static, and 50% heads + 50% FFN pruned int8 static, each untrimmed and trimmed to the
task's pieces (`prune --vocab`; structural pruning by magnitude, so the pruned pair differs only in the vocabulary),
the PyTorch model the peers are prepared from, and the CTranslate2 int8 peer, all in ONE `t5compress bench` run: 1
thread, batch 1 and 8, greedy, 32 tokens in, exactly 32 out.

    .venv/bin/python benchmarks/vocab_speed.py               # ~8 min on 2 cores (3 timed repeats per cell)
    .venv/bin/python benchmarks/vocab_speed.py --repeats 5

Writes benchmarks/results/current/vocab_speed.json (the build facts and the whole bench report) and vocab_speed.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CONSONANTS = list("bdfghklmnprstvz") + ["ch", "sh", "th", "qu", "tr", "st"]
VOWELS = list("aeiou") + ["ai", "ou", "ea"]
PIECES_WANTED = 32000
TASK_PIECES = 8000
STARTED = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {msg}", flush=True)


def lexicon(n: int, rng: random.Random) -> list[str]:
    """`n` distinct pseudo-words of 1-5 syllables (with an occasional ending), most frequent first."""
    endings = ["", "", "", "s", "n", "r", "ing", "ed", "ly", "ness"]
    words, seen = [], set()
    while len(words) < n:
        stem = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 5)))
        w = stem + rng.choice(endings)
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def corpus(words: list[str], sentences: int, rng: random.Random) -> list[str]:
    """Sentences of 6-20 words drawn with Zipf weights (rank r has weight 1 / r)."""
    cum = list(itertools.accumulate(1.0 / (r + 1) for r in range(len(words))))
    return [" ".join(rng.choices(words, cum_weights=cum, k=rng.randint(6, 20))) for _ in range(sentences)]


def train_tokenizer(texts: list[str], vocab_size: int):
    from t5compress.model.tokenization import new_tokenizer

    return new_tokenizer("unigram", texts, vocab_size=vocab_size)


def task(words: list[str], rng: random.Random) -> tuple[list[dict], list[dict]]:
    """Train examples that use every word of `words` (each one twice), eval examples from the same words."""
    def example(ws: list[str]) -> dict:
        return {"source": "reverse: " + " ".join(ws), "target": " ".join(reversed(ws))}

    pool = words + words
    rng.shuffle(pool)
    train, i = [], 0
    while i < len(pool):
        n = rng.randint(4, 12)
        train.append(example(pool[i:i + n]))
        i += n
    evals = [example(rng.sample(words, rng.randint(4, 12))) for _ in range(64)]
    return train, evals


def task_for_pieces(tok, words: list[str], target: int, rng_seed: int) -> tuple[list[dict], list[dict], int]:
    """The task over the most frequent words whose texts use about `target` pieces (a bisection on the word count)."""
    from t5compress.data import Example
    from t5compress.prune.vocab import pieces_used

    lo, hi, best = 100, len(words), None
    while lo < hi:
        mid = (lo + hi) // 2
        train, evals = task(words[:mid], random.Random(rng_seed))
        used = len(pieces_used(tok, [Example(e["source"], e["target"]) for e in train]))
        best = (train, evals, used) if best is None or abs(used - target) < abs(best[2] - target) else best
        if used < target:
            lo = mid + 1
        else:
            hi = mid
    return best


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_model(root: Path, tok) -> Path:
    import torch

    from t5compress.model.load import create_model, save_model_dir

    model = create_model("t5-small", vocab_size=len(tok))
    with torch.no_grad():  # random init can repeat one token; a smaller embedding keeps the ops and varies output
        model.shared.weight.mul_(0.3)
    save_model_dir(model, tok, root / "model")
    return root / "model"


def prune_dir(src: Path, dest: Path, train: Path, *, structural: bool, vocab: bool) -> dict:
    from t5compress.prune.stage import PruneConfig
    from t5compress.prune.stage import run as prune

    kw = {"heads": 0.5, "ffn": 0.5, "criterion": "magnitude", "calib_examples": 8} if structural else {}
    cfg = PruneConfig(calib_data=str(train), vocab=str(train) if vocab else None, eval_max_examples=2,
                      latency_examples=0, **kw)
    return prune(src, cfg, dest, force=True, progress=False)


def export_int8(src: Path, root: Path, name: str, train: Path, samples: int, int8: bool = True) -> Path:
    """`src`'s ONNX export (parity-checked), and with `int8` its static int8 calibrated on the task's sources."""
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    onnx = root / f"{name}-onnx"
    export(src, ExportConfig(), onnx, force=True)
    if not int8:
        return onnx
    out = root / f"{name}-int8"
    quantize(onnx, QuantizeConfig(calib_data=str(train), samples=samples, min_agreement=0.0), out, force=True,
             progress=False)
    return out


def build_variants(root: Path, args) -> tuple[list[str], dict]:
    """The tokenizer, the task, the model and every variant; the facts the report states about them."""
    rng = random.Random(0)
    words = lexicon(args.words, rng)
    say(f"corpus: {args.sentences} sentences over {len(words)} pseudo-words; training the unigram tokenizer")
    tok = train_tokenizer(corpus(words, args.sentences, rng), PIECES_WANTED)
    pieces = len(tok) - 100  # without the 100 sentinels
    say(f"tokenizer: {pieces} pieces (+100 sentinels; {PIECES_WANTED} asked)")
    train_rows, eval_rows, used = task_for_pieces(tok, words, TASK_PIECES, 1)
    train, evals = write_jsonl(root / "train.jsonl", train_rows), write_jsonl(root / "eval.jsonl", eval_rows)
    say(f"task: {len(train_rows)} train / {len(eval_rows)} eval examples using {used} pieces; building t5-small")
    model = build_model(root, tok)
    variants, facts = [f"pytorch={model}"], {"pieces": pieces, "task_pieces": used, "train": len(train_rows)}
    vocab_reports = {}
    for name, structural, trim in (("trimmed", False, True), ("pruned", True, False), ("pruned-trimmed", True, True)):
        report = prune_dir(model, root / name, train, structural=structural, vocab=trim)
        if trim:
            vocab_reports[name] = {k: report["vocab"][k] for k in ("before", "after", "segmentation_changed")}
        say(f"prune {name}: {report['before']['parameters']:,} -> {report['model']['parameters']:,} parameters")
    builds = (("fp32", model, False), ("fp32-trimmed", root / "trimmed", False), ("int8", model, True),
              ("int8-trimmed", root / "trimmed", True), ("pruned-int8", root / "pruned", True),
              ("pruned-int8-trimmed", root / "pruned-trimmed", True))
    for name, src, int8 in builds:
        say(f"export{' + int8 static' if int8 else ''}: {name}")
        variants.append(f"{name}={export_int8(src, root, name, train, args.calib_samples, int8)}")
    facts["vocab"] = vocab_reports
    facts["eval"] = str(evals)
    return variants, facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per grid cell (after 1 warm-up)")
    ap.add_argument("--words", type=int, default=60000, help="pseudo-words of the corpus")
    ap.add_argument("--sentences", type=int, default=60000, help="corpus sentences the tokenizer is trained on")
    ap.add_argument("--calib-samples", type=int, default=16, help="texts each static int8 is calibrated on")
    ap.add_argument("--peer-python", default=None, help="interpreter for the CTranslate2 peer if not importable here")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current")
    args = ap.parse_args()
    from t5compress.bench import BenchConfig
    from t5compress.bench import run as bench

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        variants, facts = build_variants(root, args)
        cfg = BenchConfig(data=facts["eval"], batch_sizes=(1, 8), threads=(1,), beams=(1,), input_tokens=32,
                          output_tokens=32, repeats=args.repeats, warmup=1, eval_max=16, max_new_tokens=32,
                          peers=("ctranslate2-int8",), peer_python=args.peer_python, plots=False)
        say(f"bench: {len(variants)} variants + the ctranslate2-int8 peer, 1 thread, batch 1 and 8, greedy")
        report = bench(variants, cfg, root / "bench", force=True, progress=True)
        shutil.rmtree(root / "bench" / "peers", ignore_errors=True)
    facts["eval"] = "generated (64 examples, 16 scored)"
    write(facts, report, args, args.out, round(time.perf_counter() - STARTED))


def summary(report: dict) -> dict:
    """Sizes, p50 per batch, the speed-ups of pruned + trimmed + int8, and the trimmed int8 sizes against fp32."""
    e = {x["name"]: x for x in report["entries"]}
    rows = {r["batch"]: r for r in report["speedups"] if r["threads"] == 1 and r["beams"] == 1}
    p50 = {n: {b: next((c["p50_ms"] for c in x.get("cells", []) if c["batch"] == b), None) for b in rows}
           for n, x in e.items()}
    speedup = {b: {"ours_ms": r["variants"]["pruned-int8-trimmed"]["p50_ms"],
                   "peer": r["fastest_peer"]["int8"].get("name"), "peer_ms": r["fastest_peer"]["int8"].get("p50_ms"),
                   "speedup": r["variants"]["pruned-int8-trimmed"]["speedup"],
                   "untrimmed_speedup": r["variants"]["pruned-int8"]["speedup"]} for b, r in rows.items()}
    fp32 = e["fp32"]["size_bytes"]
    ratios = {n: round(e[n]["size_bytes"] / fp32, 3) for n in e if e[n].get("size_bytes")}
    return {"p50_ms": p50, "speedup_vs_fastest_int8_peer": speedup, "size_vs_untrimmed_fp32": ratios,
            "sizes_bytes": {n: x.get("size_bytes") for n, x in e.items()},
            "labels": {n: x["label"] for n, x in e.items()},
            "exact_match": {n: (x.get("accuracy") or {}).get("exact_match") for n, x in e.items()},
            "vocabulary": {n: x["vocabulary"] for n, x in e.items() if "vocabulary" in x},
            "errors": {n: x["error"] for n, x in e.items() if "error" in x}}


def write(facts: dict, report: dict, args, out: Path, seconds: int) -> None:
    from t5compress.bench.stamp import write_result

    s = summary(report)
    batches = sorted(next(iter(s["p50_ms"].values())))
    lines = [f"# Vocabulary trimming on a t5-small shape ({seconds} s, {args.repeats} timed repeats per cell)", "",
             f"Tokenizer: unigram, {facts['pieces']:,} pieces (+100 sentinels) trained on the generated corpus; the "
             f"task's texts use {facts['task_pieces']:,} of them. One `t5compress bench` run, 1 thread, greedy, 32 "
             "tokens in, exactly 32 out; p50 per call.", "",
             "| variant | what | MB | × fp32 size | " + " | ".join(f"b{b} p50 ms" for b in batches) + " |",
             "|---|---|---|---|" + "---|" * len(batches)]
    for n, size in s["sizes_bytes"].items():
        cells = " | ".join(f"{s['p50_ms'][n][b]:.0f}" if s["p50_ms"][n][b] else "—" for b in batches)
        ratio = s["size_vs_untrimmed_fp32"].get(n)
        lines.append(f"| {n} | {s['labels'][n]} | {size / 1e6:.1f} | {ratio:.3f}× | {cells} |" if size else
                     f"| {n} | {s['labels'][n]} | — | — | {cells} |")
    lines += ["", "\"(pruned)\" in bench's label means the prune stage made the dir: fp32-trimmed and int8-trimmed "
              "have only their vocabulary trimmed.", "",
              "Pruned (50% heads + 50% FFN) + trimmed + int8 static against the fastest unpruned int8 peer "
              "(target ≥ 2×):", ""]
    for b, x in s["speedup_vs_fastest_int8_peer"].items():
        lines.append(f"- batch {b}: {x['ours_ms']} ms vs {x['peer']} {x['peer_ms']} ms: **{x['speedup']}×** "
                     f"(untrimmed pruned int8: {x['untrimmed_speedup']}×)")
    lines += ["", "Trimmed int8 files against our untrimmed fp32 export (target ≤ 0.2×): " + ", ".join(
        f"{n} **{s['size_vs_untrimmed_fp32'][n]}×**" for n in ("int8-trimmed", "pruned-int8-trimmed")
        if n in s["size_vs_untrimmed_fp32"]) + f" (untrimmed: int8 {s['size_vs_untrimmed_fp32'].get('int8')}×, "
        f"pruned-int8 {s['size_vs_untrimmed_fp32'].get('pruned-int8')}×).", ""]
    for n, v in facts["vocab"].items():
        lines.append(f"- prune --vocab ({n}): {v['before']['pieces']:,} → {v['after']['pieces']:,} pieces, "
                     f"{v['before']['parameters']:,} → {v['after']['parameters']:,} parameters, task tokens "
                     f"segmented differently: {v['segmentation_changed']['changed']}")
    if s["errors"]:
        lines.append("\nErrors: " + "; ".join(f"{n}: {m}" for n, m in s["errors"].items()))
    md = "\n".join(lines) + "\n"
    write_result(out / "vocab_speed", {"seconds": seconds, "repeats": args.repeats, "facts": facts, "summary": s,
                                       "bench": report}, md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
