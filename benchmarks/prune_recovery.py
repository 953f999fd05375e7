"""Recovery after 50% head + 50% FFN pruning, on a task the unpruned model does well but not perfectly.

The task is human-written English offline: sentences from the docstrings of the interpreter's standard library
(`t5compress.tasks.docstring_sentences`), the model asked to put their shuffled words back in order
(`restore order: <words shuffled>` -> the sentence). A small T5 trained a few minutes reaches real, imperfect skill
(ROUGE-L well below 100), so what pruning loses and what recovery wins back both show. Then, through the public
API a user runs (`t5compress.prune.run`, `t5compress.prune.recover.run`), every recovery method below at each
step count, all from the same trained model, scored on the same held-out sentences:

  none            pruned, no recovery
  ce              fine-tune on the references (cross-entropy), lr 5e-4: the old default
  ce-lr2e-3       ce at a 4x higher peak learning rate
  kd              + logit distillation from the unpruned model (KL, T=2, alpha 0.5), lr 5e-4: the old `--distill`
  kd-lr2e-3       kd at lr 2e-3 (kd-lr4e-3: at 4e-3)
  kd-layers       kd + every block's output matched to the teacher's (layer-wise distillation), lr 5e-4
  kd-layers-lr    kd-layers at lr 2e-3: the default of `prune --recover-data` and `recover` up to d_model 128
  kd-layers-lr1e-3  kd-layers at lr 1e-3: the old default at d_model 256 (at 256 the default is now kd-layers)
  iter2           two pruning steps (25% then to 50%), each followed by half the recovery steps (kd-layers-lr)
  iter2-lr1e-3    iter2 at d256's old default rate; iter3-lr1e-3: three steps, a third of the recovery steps each
  kd-layers-a0.9-lr1e-3  kd-layers-lr1e-3 with the KL term weighted 0.9 (cross-entropy 0.1) at temperature 1
  kd-layers-h4-lr1e-3    kd-layers-lr1e-3 with the layer-wise term weighted 4
  control-M       not pruned: the unpruned model given method M's recovery (e.g. control-kd-layers), the yardstick
                  for a pruned row when the base may still be under-trained
  seqkd-lr1e-3    kd-layers-lr1e-3 on the unpruned model's greedy outputs as targets (sequence-level KD, Kim & Rush
                  2016); seqkd-mix-lr1e-3: on those and the references together

    .venv/bin/python benchmarks/prune_recovery.py --out runs/prune-recovery --steps 300
    .venv/bin/python benchmarks/prune_recovery.py --out runs/prune-recovery --methods kd-layers-lr --steps 600 \
        --name more            # reuses OUT's trained model
    .venv/bin/python benchmarks/prune_recovery.py --merge runs/prune-recovery/prune_recovery.json,...
    .venv/bin/python benchmarks/prune_recovery.py --out runs/pr256 --d-model 256 --train-steps 8000 --train-lr 1e-3 \
        --train-evals 8 --methods kd-layers --steps 2400,4800 --long control-kd-layers:2400 \
        --name prune_recovery_d256_converged   # the trained base of docs/prune.md (~32 min, then ~9 min per 2,400)

Training the base model takes ~9 min on 2 cores (once: OUT/base is reused), each row 1-4 min (more on a busy
machine; iter2 evaluates after every step). Writes OUT/NAME.json and .md and copies them to
benchmarks/results/current/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# name -> (recovery keyword arguments, pruning steps)
METHODS: dict[str, tuple[dict, int]] = {
    "ce": ({"distill": False, "lr": 5e-4}, 1),
    "ce-lr2e-3": ({"distill": False, "lr": 2e-3}, 1),
    "kd": ({"distill": True, "lr": 5e-4}, 1),
    "kd-lr2e-3": ({"distill": True, "lr": 2e-3}, 1),
    "kd-lr4e-3": ({"distill": True, "lr": 4e-3}, 1),
    "kd-layers": ({"distill": True, "lr": 5e-4, "hidden_layers": "all", "hidden_weight": 1.0}, 1),
    "kd-layers-lr": ({"distill": True, "lr": 2e-3, "hidden_layers": "all", "hidden_weight": 1.0}, 1),
    "kd-layers-lr1e-3": ({"distill": True, "lr": 1e-3, "hidden_layers": "all", "hidden_weight": 1.0}, 1),
    "iter2": ({"distill": True, "lr": 2e-3, "hidden_layers": "all", "hidden_weight": 1.0}, 2),
    "iter2-lr1e-3": ({"distill": True, "lr": 1e-3, "hidden_layers": "all", "hidden_weight": 1.0}, 2),
    "iter3-lr1e-3": ({"distill": True, "lr": 1e-3, "hidden_layers": "all", "hidden_weight": 1.0}, 3),
    "kd-layers-a0.9-lr1e-3": ({"distill": True, "lr": 1e-3, "hidden_layers": "all", "hidden_weight": 1.0,
                               "alpha": 0.9, "temperature": 1.0}, 1),
    "kd-layers-h4-lr1e-3": ({"distill": True, "lr": 1e-3, "hidden_layers": "all", "hidden_weight": 4.0}, 1),
    "seqkd-lr1e-3": ({"distill": True, "lr": 1e-3, "hidden_layers": "all", "hidden_weight": 1.0,
                      "targets": "teacher"}, 1),
    "seqkd-mix-lr1e-3": ({"distill": True, "lr": 1e-3, "hidden_layers": "all", "hidden_weight": 1.0,
                          "targets": "mix"}, 1),
}


def build_data(out: Path, n_eval: int) -> tuple[Path, Path]:
    from t5compress.tasks import docstring_sentences, word_order_examples, write_jsonl

    sentences = docstring_sentences()
    train, test = out / "data" / "train.jsonl", out / "data" / "test.jsonl"
    train.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, word_order_examples(sentences[n_eval:], seed=0))
    write_jsonl(test, word_order_examples(sentences[:n_eval], seed=1))
    return train, test


def train_base(out: Path, train: Path, test: Path, args) -> Path:
    from t5compress.data import DataConfig
    from t5compress.model import create
    from t5compress.train import stage as training
    from t5compress.train.loop import TrainConfig

    d = args.d_model
    overrides = {"d_model": d, "d_ff": 4 * d, "d_kv": d // 4, "num_heads": 4, "num_layers": 4,
                 "num_decoder_layers": 4}
    if not (out / "init").is_dir():
        create.run(None, create.CreateConfig(arch="t5-efficient-tiny", text=str(train), vocab_size=2000,
                                             overrides=overrides, seed=args.seed), out / "init")
    if not (out / "base").is_dir():
        cfg = training.FinetuneConfig(
            train_data=str(train), eval_data=str(test), data=DataConfig(max_source_length=48, max_target_length=48),
            train=TrainConfig(max_steps=args.train_steps, batch_size=32, lr=args.train_lr, metric="loss",
                              eval_every=args.train_steps // args.train_evals, eval_max_examples=args.eval_examples,
                              seed=args.seed))
        training.run(str(out / "init"), cfg, out / "base", progress=False)
    return out / "base"


def base_curve(base: Path) -> list[dict]:
    """The base model's held-out evaluations during its training (one per --train-evals), to show how far it got."""
    report = json.loads((base / "report.json").read_text())
    keep = ("step", "loss", "rougeL", "exact_match")
    return [{k: e[k] for k in keep if k in e} for e in report.get("train", {}).get("history", [])]


def teacher_data(base: Path, train: Path, targets: str) -> Path:
    """Recovery data for sequence-level KD: `train`'s sources with the unpruned model's greedy outputs as targets
    ('teacher'), or those followed by `train` itself ('mix'); written once next to `train`."""
    import torch

    from t5compress.model.load import load_model, load_tokenizer

    greedy = train.with_name("teacher_greedy.jsonl")
    if not greedy.exists():
        model, tok = load_model(base).eval(), load_tokenizer(base)
        rows = [json.loads(line) for line in train.read_text().splitlines()]
        outs = []
        for i in range(0, len(rows), 64):
            enc = tok([r["source"] for r in rows[i:i + 64]], return_tensors="pt", padding=True, truncation=True,
                      max_length=48)
            with torch.inference_mode():
                outs += tok.batch_decode(model.generate(**enc, max_new_tokens=48), skip_special_tokens=True)
        greedy.write_text("".join(json.dumps({"source": r["source"], "target": o}) + "\n"
                                  for r, o in zip(rows, outs, strict=True)))
    if targets == "teacher":
        return greedy
    mixed = train.with_name("teacher_greedy_mix.jsonl")
    mixed.write_text(greedy.read_text() + train.read_text())
    return mixed


def recover_cfg(train: Path, steps: int, kw: dict, seed: int):
    from t5compress.data import DataConfig
    from t5compress.prune.recover import RecoverConfig
    from t5compress.train.distill import DistillConfig
    from t5compress.train.loop import TrainConfig

    kd = DistillConfig(hidden_weight=kw.get("hidden_weight", 0.0), hidden_layers=kw.get("hidden_layers", "last"),
                       alpha=kw.get("alpha", 0.5), temperature=kw.get("temperature", 2.0))
    t = TrainConfig(max_steps=steps, batch_size=32, lr=kw["lr"], metric="loss", eval_every=max(1, steps // 3),
                    eval_max_examples=100, seed=seed)
    return RecoverConfig(data=str(train), distill=kw["distill"], kd=kd, train=t, lr_per_width=False,
                         data_cfg=DataConfig(max_source_length=48, max_target_length=48))


def prune_cfg(train: Path, test: Path, ratio: float, args, recover=None):
    from t5compress.data import DataConfig
    from t5compress.prune import PruneConfig

    return PruneConfig(calib_data=str(train), eval_data=str(test), heads=ratio, ffn=ratio, latency_examples=0,
                       schedule=args.schedule, criterion=args.criterion,
                       eval_max_examples=args.eval_examples, calib_examples=args.calib_examples,
                       data=DataConfig(max_source_length=48, max_target_length=48), recover=recover)


def one_shot(base: Path, train: Path, test: Path, dst: Path, steps: int, kw: dict, args) -> dict:
    from t5compress.prune import run

    data = teacher_data(base, train, kw["targets"]) if kw.get("targets") else train
    cfg = prune_cfg(train, test, args.ratio, args, recover_cfg(data, steps, kw, args.seed) if steps else None)
    r = run(str(base), cfg, dst, force=True, progress=False)
    return {"before": r["before"]["eval"], "pruned": r["after_pruning"]["eval"],
            "after": (r["after_recovery"] or r["after_pruning"])["eval"], "model": r["model"]}


def iterative(base: Path, train: Path, test: Path, dst: Path, steps: int, kw: dict, n: int, args) -> dict:
    """n pruning steps to the same final size, each followed by steps/n of recovery from the unpruned teacher."""
    from t5compress.prune import run
    from t5compress.prune.recover import run as recover

    src, kept, per_step = base, 1.0, []
    rec = dataclasses.replace(recover_cfg(train, max(1, steps // n), kw, args.seed), teacher=str(base))
    for k in range(1, n + 1):
        want = 1 - args.ratio * k / n  # share of the original units left after step k
        ratio = 1 - want / kept
        p = run(str(src), prune_cfg(train, test, ratio, args), dst / f"p{k}", force=True, progress=False)
        r = recover(str(dst / f"p{k}"), rec, dst / f"r{k}", force=True, progress=False)
        per_step.append({"ratio": round(ratio, 4), "pruned": p["after_pruning"]["eval"], "after": None})
        src, kept = dst / f"r{k}", want
    final = held_out(src, test, args)
    per_step[-1]["after"] = final
    return {"pruned": per_step[0]["pruned"], "after": final, "steps": per_step, "model": r["model"]}


def control(base: Path, train: Path, test: Path, dst: Path, steps: int, kw: dict, args) -> dict:
    """The unpruned model given the same recovery (distilling from itself): what the training alone is worth, so a
    pruned row is not credited with what more steps on an under-trained base would have won anyway."""
    from t5compress.prune.recover import run as recover

    r = recover(str(base), dataclasses.replace(recover_cfg(train, steps, kw, args.seed), teacher=str(base)), dst,
                force=True, progress=False)
    return {"after": held_out(dst, test, args), "model": r["model"]}


def held_out(model_dir: Path, test: Path, args) -> dict:
    """The model dir's metrics on the held-out sentences every row is scored on."""
    from t5compress.data import DataConfig, load_examples
    from t5compress.model.load import load_model, load_tokenizer
    from t5compress.prune.measure import measure_eval

    ex = load_examples(test, DataConfig())[: args.eval_examples]
    return measure_eval(load_model(model_dir), load_tokenizer(model_dir), ex,
                        DataConfig(max_source_length=48, max_target_length=48))


def table(rows: list[dict], before: dict, ratio: float) -> list[str]:
    md = ["| ratio | method | recovery steps | ROUGE-L | exact match | loss | ROUGE-L drop vs unpruned | "
          "seconds | run |", "|---|---|---|---|---|---|---|---|---|",
          f"| 0 | unpruned | - | {before['rougeL']} | {before['exact_match']} | {before['loss']} | - | - | - |"]
    for r in rows:
        a = r["after"]
        md.append(f"| {ratio} | {r['method']} | {r['steps']} | {a['rougeL']} | {a['exact_match']} | {a['loss']} | "
                  f"{r['drop_pct']:.1f}% | {r['seconds']} | {r.get('run', 1)} |")
    return md


def write(summary: dict, md: list[str], out: Path, name: str) -> None:
    """OUT/NAME.json and .md, stamped, and their copies in results/current/."""
    from t5compress.bench.stamp import write_result

    write_result(out / name, summary, "\n".join(md) + "\n")
    (ROOT / "results" / "current").mkdir(parents=True, exist_ok=True)
    for ext in ("json", "md"):
        shutil.copy(out / f"{name}.{ext}", ROOT / "results" / "current" / f"{name}.{ext}")
    print("\n".join(md))


def merge(paths: list[Path], name: str) -> None:
    """One table from several runs: same data, same trained model (its unpruned metric must agree), other rows."""
    runs = [json.loads(p.read_text()) for p in paths]
    base = runs[0]["unpruned"]
    if any(r["unpruned"] != base for r in runs):
        raise SystemExit("the runs measured different unpruned models; merge only runs on the same base")
    rows, seen = [], set()
    for i, r in enumerate(runs):
        for row in r["rows"]:
            if (row["method"], row["steps"]) not in seen:
                seen.add((row["method"], row["steps"]))
                rows.append({**row, "run": i + 1})
    done = [{"file": str(p), "stamp": r.get("stamp"), "setup": r["setup"], "seconds": r["seconds"]}
            for p, r in zip(paths, runs, strict=True)]
    summary = {"runs": done,
               "task": runs[0]["task"], "unpruned": base, "pruned_model": runs[0]["pruned_model"], "rows": rows}
    write(summary, table(rows, base, runs[0]["setup"]["ratio"]), paths[0].parent, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/prune-recovery"))
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=1500)
    ap.add_argument("--train-lr", type=float, default=2e-3)
    ap.add_argument("--train-evals", type=int, default=1,
                    help="held-out evaluations during the base model's training (its curve goes in the results)")
    ap.add_argument("--ratio", type=float, default=0.5, help="share of heads and of FFN channels removed")
    ap.add_argument("--steps", default="300", help="recovery step counts, comma-separated")
    ap.add_argument("--methods", default=",".join(METHODS), help="recovery methods, comma-separated")
    ap.add_argument("--long", default="", help="method:steps pairs run in addition, e.g. kd-layers-lr:900")
    ap.add_argument("--eval-examples", type=int, default=400)
    ap.add_argument("--calib-examples", type=int, default=256)
    ap.add_argument("--schedule", choices=("uniform", "global"), default="uniform", help="prune's --schedule")
    ap.add_argument("--criterion", choices=("taylor", "activation", "magnitude"), default="taylor",
                    help="prune's --criterion")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of recovery (and of the base model where OUT/base is not there yet)")
    ap.add_argument("--name", default="prune_recovery", help="file name of the results")
    ap.add_argument("--merge", default="", help="comma-separated result JSONs of runs on the same base model: "
                                                "write their rows as one table (--name) and exit")
    args = ap.parse_args()
    if args.merge:
        return merge([Path(p) for p in args.merge.split(",")], args.name)

    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = args.out
    train, test = build_data(out, args.eval_examples)
    base = train_base(out, train, test, args)
    runs = [(m, int(s)) for m in args.methods.split(",") for s in args.steps.split(",")]
    runs += [(p.split(":")[0], int(p.split(":")[1])) for p in args.long.split(",") if p]
    t = time.perf_counter()
    first = one_shot(base, train, test, out / "none", 0, {}, args)
    before = first["before"]
    rows = [{"method": "none", "steps": 0, "after": first["after"], "seconds": round(time.perf_counter() - t, 1)}]
    for method, steps in runs:
        kw, n = METHODS[method.removeprefix("control-")]
        t = time.perf_counter()
        dst = out / f"{method}-{steps}"
        r = (control(base, train, test, dst, steps, kw, args) if method.startswith("control-")
             else iterative(base, train, test, dst, steps, kw, n, args) if n > 1
             else one_shot(base, train, test, dst, steps, kw, args))
        rows.append({"method": method, "steps": steps, "after": r["after"], "per_step": r.get("steps"),
                     "seconds": round(time.perf_counter() - t, 1)})
        print(method, steps, r["after"]["rougeL"], flush=True)
        shutil.rmtree(dst, ignore_errors=True)
    for r in rows:
        r["after"] = {k: v for k, v in r["after"].items() if k != "samples"}
        r["drop_pct"] = round(100 * (before["rougeL"] - r["after"]["rougeL"]) / before["rougeL"], 2)
    md = table(rows, before, args.ratio)
    summary = {"setup": vars(args) | {"out": str(out)}, "task": "restore order (stdlib docstring sentences)",
               "unpruned": {k: v for k, v in before.items() if k != "samples"}, "base_curve": base_curve(base),
               "pruned_model": first["model"],
               "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
    write(summary, md, out, args.name)


if __name__ == "__main__":
    main()
