"""Static int8 on gated T5s (T5 v1.1 / Flan shapes): the default's next-token agreement, greedy outputs, task metric,
size and speed, against the earlier defaults (`wo` fp32; per-token `wo` and LM head), every layer static int8, the
sensitivity-guided choice, dynamic and block-wise int8, plus the per-group sensitivity table.

The fixture: a gated-gelu, untied T5 (4+4 layers, d_model 256, the flan-t5-small layout) pre-trained by
`t5compress pretrain` on the generated toy corpus, then fine-tuned by `t5compress train` on the demo tasks to real,
not perfect, skill. The flan-t5-small shape is random weights (speed and size mean something there; agreement little).

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/int8_gated.py      # ~15-25 min on 2 busy cores

The docstring fixture of modest skill, on which the previous default (per-token `wo` and LM head only) fails the
stage's 0.9 next-token check and the smoothed per-token default passes (results/current/int8_gated_docstring150.md):

    PYTHONPATH=. .venv/bin/python benchmarks/int8_gated.py --work runs/int8-gated-doc150 --task docstring \
        --pretrain-steps 300 --finetune-steps 150 --skip-flan --heldout 1000 --name int8_gated_docstring150

The docstring fixture trained to real skill (ROUGE-L 50; results/archive/int8_gated_docstring_long.md), on which the
earlier defaults fail the check on held-out texts and the default with held-out texts keeps the fewest groups fp32:

    PYTHONPATH=. .venv/bin/python benchmarks/int8_gated.py --work runs/int8-gated-doclong --task docstring \
        --pretrain-steps 600 --finetune-steps 2400 --skip-flan --heldout 1000 --name int8_gated_docstring_long

Writes benchmarks/results/current/int8_gated.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
FIXTURE_SHAPE = {"d_model": 256, "d_ff": 768, "num_heads": 4, "d_kv": 64, "num_layers": 4, "num_decoder_layers": 4,
                 "dropout_rate": 0.0, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}


def task_data(work: Path, task: str, seed: int) -> Path:
    """Write the fixture's corpus (pretraining), train.jsonl (fine-tuning and calibration), eval.jsonl (200) and
    heldout.jsonl (greedy comparisons: 2,000 demo examples, 1,000 docstring sentences); returns the corpus.

    demo: the generated toy corpus and the demo tasks (formulaic targets: the model ends up sure of most tokens).
    docstring: human-written sentences of the standard library's docstrings, pretraining on the training ones and
    fine-tuning to put their shuffled words back in order, 1,000 sentences held out (the task of
    benchmarks/prune_recovery.py: real, imperfect skill, many near-ties between next tokens, as in the issue).
    """
    from t5compress.pretrain.toy import write_toy_corpus
    from t5compress.tasks import docstring_sentences, make_examples, word_order_examples, write_jsonl

    work.mkdir(parents=True, exist_ok=True)
    if task == "demo":
        write_jsonl(work / "train.jsonl", make_examples(2000, seed))
        write_jsonl(work / "eval.jsonl", make_examples(200, seed + 1))
        write_jsonl(work / "heldout.jsonl", make_examples(2000, 7))
        return write_toy_corpus(work / "toy.jsonl", 8000, seed=seed)
    sentences = docstring_sentences()
    held, train = sentences[:1000], sentences[1000:]
    write_jsonl(work / "train.jsonl", word_order_examples(train, seed=seed))
    write_jsonl(work / "eval.jsonl", word_order_examples(held[:200], seed=seed + 1))
    write_jsonl(work / "heldout.jsonl", word_order_examples(held, seed=seed + 1))
    docs = [{"text": " ".join(s + "." for s in train[i:i + 8])} for i in range(0, len(train), 8)]
    write_jsonl(work / "corpus.jsonl", docs)
    return work / "corpus.jsonl"


def build_fixture(work: Path, pretrain_steps: int, finetune_steps: int, seed: int = 0, task: str = "demo") -> dict:
    """pretrain + train the gated fixture into `work`; returns paths and what training measured."""
    from t5compress import artifacts, pretrain
    from t5compress.data import DataConfig
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.train import stage as training
    from t5compress.train.loop import TrainConfig

    corpus = task_data(work, task, seed)
    length = 32 if task == "demo" else 48
    t0 = time.perf_counter()
    pre = artifacts.read_json(work / "pretrained" / "report.json") if (work / "pretrained").is_dir() else None
    pre = pre or pretrain.run(str(corpus), pretrain.PretrainConfig(
        model="flan-t5-small", overrides=FIXTURE_SHAPE, vocab_size=2000, inputs_length=128, seed=seed,
        train=TrainConfig(max_steps=pretrain_steps, batch_size=16, optimizer="adamwscale", lr=2e-2,
                          warmup_steps=max(pretrain_steps // 10, 1), eval_every=pretrain_steps,
                          eval_max_examples=64, metric="loss", precision="fp32", seed=seed),
    ), work / "pretrained", force=True, progress=False)
    t1 = time.perf_counter()
    ft = training.run(str(work / "pretrained"), training.FinetuneConfig(
        train_data=str(work / "train.jsonl"), eval_data=str(work / "eval.jsonl"),
        data=DataConfig(max_source_length=length, max_target_length=length),
        train=TrainConfig(max_steps=finetune_steps, batch_size=32, lr=1e-3, eval_every=finetune_steps,
                          eval_max_examples=200, metric="exact_match", seed=seed)), work / "model", force=True,
        progress=False)
    t2 = time.perf_counter()
    export(work / "model", ExportConfig(), work / "onnx", force=True)
    return {"task": task, "pretrain_steps": pretrain_steps, "finetune_steps": finetune_steps,
            "parameters": pre["model"]["parameters"], "pretrain_loss": pre["eval"]["loss"],
            "pretrain_s": round(t1 - t0, 1), "finetune_s": round(t2 - t1, 1),
            "exact_match": ft["eval"]["exact_match"], "rougeL": ft["eval"]["rougeL"]}


def build_flan_small(work: Path, texts: int) -> None:
    """A random-weight flan-t5-small (8+8 layers, d_model 512, gated-gelu, untied), its export and generated texts."""
    import torch

    from t5compress.bench.inputs import generated_texts
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.model.load import create_model, save_model_dir
    from t5compress.model.tokenization import byte_level
    from t5compress.tasks import write_jsonl

    model = create_model("flan-t5-small", vocab_size=32128)
    with torch.no_grad():  # random init can repeat one token; a smaller embedding keeps the ops and varies output
        model.shared.weight.mul_(0.3)
    save_model_dir(model, byte_level(), work / "model")
    export(work / "model", ExportConfig(), work / "onnx", force=True)
    rows = [{"source": t, "target": t} for t in generated_texts(2 * texts, 1)]
    write_jsonl(work / "train.jsonl", rows[:texts])
    write_jsonl(work / "eval.jsonl", rows[texts:])


VARIANTS = {  # name: (what, QuantizeConfig fields)
    "before": ("static, the earlier default (gated: every wo kept fp32)",
               {"keep_fp32": "DenseReluDense/wo/", "per_token": "none"}),
    "all-int8": ("static, every group int8", {"keep_fp32": "none", "per_token": "none"}),
    "per-token-wo": ("static, the previous default (gated: wo and an untied lm_head per-token int8)",
                     {"per_token": "DenseReluDense/wo/,lm_head", "smooth_alpha": 0.0, "keep_fp32": "none"}),
    "per-token": ("static, the default without held-out texts (gated: SmoothQuant 0.5, every linear layer per-token "
                  "int8, weights rounded by GPTQ)", {"keep_fp32": "none"}),
    "nearest": ("static, the default with its weights rounded to nearest (--rounding nearest)",
                {"rounding": "nearest", "keep_fp32": "none"}),
    "after": ("static, the default with held-out texts (gated: its groups measured on the eval texts, the fewest "
              "kept fp32 for 97%; --keep-fp32 sensitive)", {"keep_fp32": "sensitive"}),
    "dynamic": ("dynamic (gated: wo kept fp32)", {"mode": "dynamic"}),
    "blockwise": ("block-wise (MatMulNBits, a scale per 32 channels), no calibration texts",
                  {"mode": "blockwise", "calib_data": None}),
    "blockwise-calibrated": ("block-wise with the calibration texts (blocks of 128, SmoothQuant 0.5, GPTQ)",
                             {"mode": "blockwise"}),
}


def quantize_all(work: Path, samples: int, eval_max: int, threads: int = 1, eval_file: str = "eval.jsonl",
                 skip: tuple[str, ...] = ()) -> dict:
    from t5compress.quantize import QuantizeConfig, run

    rows = {}
    for name, (what, fields) in VARIANTS.items():
        if name in skip:
            continue
        cfg = QuantizeConfig(**{"calib_data": str(work / "train.jsonl"), "eval_data": str(work / eval_file),
                                "samples": samples, "eval_max": eval_max, "min_agreement": 0.0, "threads": threads,
                                **fields})
        t0 = time.perf_counter()
        r = run(work / "onnx", cfg, work / name, force=True, progress=False)
        c, ev = r["check"], r["eval"]
        rows[name] = {"what": what, "seconds": round(time.perf_counter() - t0, 1),
                      "next_token_agreement": c["next_token_agreement"],
                      "greedy_identical_calib": c["greedy_agreement"],
                      "greedy_identical_heldout": ev["greedy_agreement"], "heldout": ev["examples"],
                      "exact_match": [ev["fp32"]["exact_match"], ev["int8"]["exact_match"]],
                      "rougeL": [ev["fp32"]["rougeL"], ev["int8"]["rougeL"]], "size_ratio": r["size"]["ratio"],
                      "int8_mb": round(r["size"]["int8_bytes"] / 1e6, 2),
                      "fp32_mb": round(r["size"]["fp32_bytes"] / 1e6, 2),
                      "passes_default_check": c["next_token_agreement"] >= 0.9,
                      "kept_fp32_nodes": len({n for g in r["graphs"].values() if isinstance(g, dict)
                                              for n in g.get("kept_fp32", [])})}
        if "sensitivity" in r["graphs"]:
            rows[name]["sensitivity"] = r["graphs"]["sensitivity"]
    return rows


def generate_ms(work: Path, names: list[str], texts: list[str], repeats: int = 3, batch: int = 8) -> dict:
    """Median ms to generate exactly 32 tokens for `texts` (in batches of `batch`, 1 thread) with each variant,
    interleaved. Exactly: variants whose outputs end sooner ran fewer decoder steps (on the demo fixture every layer
    static int8 ran 40 steps for these texts, the default 51), which timed their outputs, not their speed."""
    import numpy as np

    from t5compress.runtime import load_runtime

    rts = {n: load_runtime(work / n, threads=1) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats + 1):
        for n, rt in rts.items():
            t0 = time.perf_counter()
            for j in range(0, len(texts), batch):
                rt.generate_text(texts[j:j + batch], max_new_tokens=32, min_new_tokens=32)
            if i:
                times[n].append(time.perf_counter() - t0)
    return {n: round(float(np.median(t)) * 1000, 1) for n, t in times.items()}


def measure(work: Path, samples: int, eval_max: int, threads: int = 1, heldout: int = 0,
            skip: tuple[str, ...] = ()) -> dict:
    """`heldout` > 0: compare greedy outputs on the first `heldout` examples of heldout.jsonl (fresh task examples),
    not eval.jsonl's (at 200 examples one example is 0.5 points, and the share identical varies by about
    2.4 points)."""
    from t5compress.quantize.calibrate import load_texts
    from t5compress.tasks import make_examples, write_jsonl

    if heldout and not (work / "heldout.jsonl").is_file():  # a demo fixture built before heldout.jsonl was written
        write_jsonl(work / "heldout.jsonl", make_examples(2000, 7))
    rows = quantize_all(work, samples, heldout or eval_max, threads, "heldout.jsonl" if heldout else "eval.jsonl",
                        skip)
    texts = load_texts(work / "eval.jsonl", samples=16)
    names = [n for n in ("all-int8", "per-token", "per-token-wo", "after", "before", "blockwise",
                         "blockwise-calibrated") if n not in skip]
    ms, b1 = generate_ms(work, names, texts), generate_ms(work, names, texts[:4], batch=1)
    for n in names:
        rows[n].update(generate_ms=ms[n], speed_vs_all_int8=round(ms[n] / ms["all-int8"], 3),
                       generate_ms_b1=b1[n], speed_vs_all_int8_b1=round(b1[n] / b1["all-int8"], 3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("runs/int8-gated"))
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--finetune-steps", type=int, default=300)
    ap.add_argument("--flan-samples", type=int, default=16, help="calibration and held-out texts of flan-t5-small")
    ap.add_argument("--fixture-only", action="store_true")
    ap.add_argument("--skip-flan", action="store_true", help="measure the fixture only")
    ap.add_argument("--skip-fixture", action="store_true", help="keep the fixture's rows from the last run")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads while quantizing (timing: 1)")
    ap.add_argument("--heldout", type=int, default=2000, help="fixture: held-out examples the greedy outputs are "
                    "compared on (0: the 200 of eval.jsonl)")
    ap.add_argument("--task", choices=("demo", "docstring"), default="demo",
                    help="the fixture's task (see task_data); docstring: --pretrain-steps 300 --finetune-steps 1500")
    ap.add_argument("--name", default="int8_gated", help="file name of the results")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current")
    args = ap.parse_args()
    import torch

    from t5compress.bench.stamp import write_result
    from t5compress.cpu import cpu_features, saturates_int8

    torch.set_num_threads(1)
    fixture = args.work / "fixture"
    if not (fixture / "onnx").is_dir() and not args.skip_fixture:
        torch.set_num_threads(os.cpu_count() or 1)  # training: every core; measuring below: 1 thread
        info = build_fixture(fixture, args.pretrain_steps, args.finetune_steps, task=args.task)
        torch.set_num_threads(1)
        (fixture / "fixture.json").write_text(json.dumps(info, indent=1))
    if args.fixture_only:
        return
    if args.skip_fixture:  # its rows as the last run wrote them
        result = json.loads((args.out / f"{args.name}.json").read_text())
    else:
        result = {"cpu": {**cpu_features(), "int8_kernels_saturate": saturates_int8()},
                  "load_average": os.getloadavg(),
                  "fixture": {"shape": FIXTURE_SHAPE, **json.loads((fixture / "fixture.json").read_text()),
                              "rows": measure(fixture, 128, 200, args.threads, args.heldout)}}
    result = write_result(args.out / args.name, result, markdown(result))
    print(markdown(result))
    if args.skip_flan:
        return
    flan = args.work / "flan-t5-small"
    if not (flan / "onnx").is_dir():
        build_flan_small(flan, args.flan_samples)
    result["flan-t5-small"] = {"shape": "flan-t5-small, random weights (byte-level vocabulary padded to 32128)",
                               # sensitive: random weights' flat logits make every one of the 146 groups look
                               # sensitive (minutes of measuring to keep most of them fp32), so it is left out
                               "rows": measure(flan, args.flan_samples, args.flan_samples, args.threads,
                                               skip=("after",)),
                               "cpu": {**cpu_features(), "int8_kernels_saturate": saturates_int8()}}
    write_result(args.out / args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    from t5compress.quantize.describe import ranked, summary

    cpu = r["cpu"]
    flags = ", ".join(k for k in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx") if cpu.get(k))
    lines = ["# Static int8 on gated T5s: the default against the earlier ones, block-wise and dynamic", "",
             f"CPU: {cpu['model']} ({flags}; u8s8 kernels saturate full-range weights: "
             f"{cpu['int8_kernels_saturate']}). Load average {r['load_average'][0]:.1f}. Agreement: teacher-forced "
             "next token on the texts the stage checks (its eval data: the first 200 of the held-out texts the "
             "greedy outputs are compared on; --keep-fp32 sensitive measures on the same 200); greedy: identical "
             "outputs on held-out texts; speed: generate exactly 32 new tokens for 16 held-out texts, batch 8 "
             "(and 4 texts one at a time: b1), 1 thread, median of 3.", ""]
    for key in ("fixture", "flan-t5-small"):
        if key not in r:
            continue
        m = r[key]
        lines += [f"## {key}", "", _about(key, m), "",
                  "| variant | next token | greedy = fp32 (held-out) | exact match fp32 → int8 | "
                  "ROUGE-L fp32 → int8 | "
                  "size vs fp32 | generate ms b8 | vs all-int8 | b1 | vs all-int8 | fp32 nodes | passes 0.9 check |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name, row in m["rows"].items():
            em = row["exact_match"]
            lines.append(f"| {name}: {row['what']} | {row['next_token_agreement']:.2%} | "
                         f"{row['greedy_identical_heldout']:.1%} of {row['heldout']} | {em[0]} → {em[1]} | "
                         f"{' → '.join(str(x) for x in row.get('rougeL', ['', '']))} | "
                         f"{row['size_ratio']:.3f}x | {row.get('generate_ms', '')} | "
                         f"{row.get('speed_vs_all_int8', '')} | {row.get('generate_ms_b1', '')} | "
                         f"{row.get('speed_vs_all_int8_b1', '')} | "
                         f"{row['kept_fp32_nodes']} | {'yes' if row['passes_default_check'] else 'NO'} |")
        sens = m["rows"].get("after", {}).get("sensitivity")
        if sens:
            lines += ["", summary(sens), "", "| group (only it int8) | next token | mean logit error | max | kept |",
                      "|---|---:|---:|---:|---|"]
            for row in ranked(sens)[:20]:
                lines.append(f"| {row['group']} | {row['next_token_agreement']:.2%} | "
                             f"{row['mean_rel_logit_error']:.4f} | {row['max_rel_logit_error']:.4f} | "
                             f"{'fp32' if row['kept'] else 'int8'} |")
            lines.append(f"\n({len(sens['groups'])} groups; the 20 most sensitive shown, all in int8_gated.json)")
        lines.append("")
    return "\n".join(lines) + "\n"


def _about(key: str, m: dict) -> str:
    if key != "fixture":
        cpu = m.get("cpu") or {}
        where = (f" Measured on {cpu.get('model')}, {cpu.get('cpus')} cores (VNNI: "
                 f"{bool(cpu.get('avx512_vnni') or cpu.get('avx_vnni'))}; saturating u8s8 kernels: "
                 f"{cpu.get('int8_kernels_saturate')})." if cpu else "")
        return m["shape"] + ": agreement on random weights means little (flat logits); size and speed count." + where
    corpus, task = (("the docstring sentences", "restoring the order of shuffled docstring sentences")
                    if m.get("task") == "docstring" else ("the toy corpus", "the demo tasks"))
    return (f"Gated-gelu, untied T5, 4+4 layers, d_model 256 ({m['parameters']:,} parameters), `t5compress pretrain` "
            f"{m['pretrain_steps']} steps on {corpus}, then `train` {m['finetune_steps']} steps on {task}: "
            f"exact match {m['exact_match']}, ROUGE-L {m['rougeL']} (real, not perfect, skill).")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
