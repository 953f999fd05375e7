"""Generation speed and size on CPU: PyTorch fp32 `generate`, the t5compress runtime (fp32 with separate or merged
decoders, int8 static / dynamic / QAT) and the peers (optimum ORT fp32 and dynamic int8, CTranslate2 int8, OpenVINO
fp32 and 8-bit weights).

All engines run in this one process on the same random-weight models of real shapes (speed does not depend on the
weights), with pinned thread counts, exactly 32 tokens in and 32 out (every engine is forced to the length; one
that returns fewer is marked short and left out of the comparisons), warm-up calls excluded, median and p90 per
call, and each engine's model files' size on disk. Engines are a registry (`engines.py`); one whose package is
missing or whose preparation fails is skipped with a printed reason. The peers need `make bench-env`:

    make bench                                                    # full grid in .venv-bench (29 min at --repeats 3)
    .venv-bench/bin/python benchmarks/generate_speed.py --quick   # t5-small, 1 thread, fewer repeats
    .venv-bench/bin/python benchmarks/generate_speed.py --shapes t5-efficient-tiny --repeats 2 --engines ours

Writes benchmarks/results/generate_speed.json and .md (ratios to PyTorch, and per row whether the targets are hit:
our best int8 >= 1.33x the fastest int8 peer, our fp32 faster than every fp32 peer). With --profile, also where our
int8 runtime's time goes per step (encoder, first decoder step, with-past steps, lm_head, search).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import ENGINES, Shape, Skip, size_bytes  # noqa: E402
from report import write  # noqa: E402

ROOT = Path(__file__).resolve().parent
SHAPES = ["t5-small", "t5-efficient-small-el2"]
IN_TOKENS = OUT_TOKENS = 32
SUBJECTS = ["the committee", "a small startup", "the river", "our neighbour", "the new policy", "the old bridge",
            "a local farmer", "the orchestra", "the research team", "the city council", "my sister", "the museum"]
VERBS = ["announced", "rejected", "described", "welcomed", "postponed", "explained", "repaired", "questioned"]
OBJECTS = ["a plan to reduce traffic", "the results of the survey", "a festival in the spring",
           "the cost of the repairs", "a proposal for cheaper trains", "the history of the valley",
           "an exhibition of modern paintings", "the decision to close the school"]
TASKS = ["translate English to German: ", "summarize: ", "translate English to French: ", ""]


def calibration_texts(n: int, seed: int = 0) -> list[str]:
    """n plausible, varied sentences with T5 task prefixes (static int8 calibrates on what the graphs see)."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    texts = []
    for i in range(n):
        text = f"{pick(TASKS)}{pick(SUBJECTS).capitalize()} {pick(VERBS)} {pick(OBJECTS)}"
        if i % 3 == 0:
            text += f" after {pick(SUBJECTS)} {pick(VERBS)} {pick(OBJECTS)}"
        texts.append(text + ".")
    return texts


def build(arch: str, root: Path, samples: int) -> Shape:
    """Save a random-weight model of `arch`, export it with `t5compress export --onnx`, write calibration texts."""
    import torch

    from t5compress.models import create_model, save_model_dir
    from t5compress.tokenization import byte_level

    work = root / arch
    model_dir, export_dir = work / "model", work / "onnx"
    model = create_model(arch, vocab_size=32128)
    with torch.no_grad():  # random init can repeat one token; a smaller embedding keeps the ops and varies output
        model.shared.weight.mul_(0.3)
    save_model_dir(model, byte_level(), model_dir)
    cli = [sys.executable, "-m", "t5compress.cli", "export", str(model_dir), str(export_dir), "--onnx"]
    subprocess.run(cli, check=True, stdout=subprocess.DEVNULL)
    calib = work / "calib.txt"
    calib.write_text("\n".join(calibration_texts(max(samples, 48))) + "\n")
    return Shape(arch, model_dir, export_dir, work, calib, samples)


def prepare(shape: Shape, names: list[str], skipped: dict[str, str]) -> dict[str, dict]:
    """Prepare each engine once per shape; -> name -> {path, size_bytes, prepare_s}. Failures become skip reasons."""
    ready = {}
    for name in names:
        eng = ENGINES[name]
        if missing := eng.missing():
            skipped[name] = f"not importable: {', '.join(missing)}"
            print(f"  skip {name}: {skipped[name]}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            path = eng.prepare(shape)
        except Exception as e:  # a peer's converter bug is a result, not a crash of the benchmark
            skipped[name] = f"preparation failed: {_err(e)}"
            print(f"  skip {name}: {skipped[name]}", flush=True)
            continue
        ready[name] = {"path": path, "size_bytes": size_bytes(path, eng.files),
                       "prepare_s": round(time.perf_counter() - t0, 1)}
        print(f"  ready {name}: {ready[name]['size_bytes'] / 1e6:.1f} MB ({ready[name]['prepare_s']} s)", flush=True)
    return ready


def timed(fn, args: tuple, warmup: int, repeat: int) -> dict:
    for _ in range(warmup):
        fn(*args)
    times, got = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got.append(fn(*args))
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"median_ms": round(statistics.median(times), 1),
            "p90_ms": round(times[min(len(times) - 1, int(0.9 * len(times)))], 1), "new_tokens": min(got)}


def _err(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:120] if lines else ''}"


def inputs(batch: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(3, 250, size=(batch, IN_TOKENS)).astype(np.int64)  # byte tokens of the tokenizer
    ids[:, -1] = 1  # </s>
    return ids, np.ones_like(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="t5-small, 1 thread, 2 repeats, 16 calibration texts")
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="architectures (any `t5compress create` name)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--beams", nargs="+", type=int, default=[1, 4], help="1 = greedy")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES),
                    help=f"engine names, or 'ours' / 'peers' (default all: {', '.join(ENGINES)})")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--calib-samples", type=int, default=32, help="texts our static int8 is calibrated on")
    ap.add_argument("--profile", action="store_true", help="per-step profile of our int8 runtime (see profile.py)")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.threads, args.repeats, args.calib_samples = SHAPES[:1], [1], 2, 16
    names = _engine_names(args.engines)
    rows, shapes_info, skipped_all = [], {}, {}
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.shapes:
            print(f"{arch}: building and preparing engines", flush=True)
            shape = build(arch, Path(tmp), args.calib_samples)
            skipped: dict[str, str] = {}
            ready = prepare(shape, names, skipped)
            skipped_all[arch] = skipped
            shapes_info[arch] = {n: {"size_mb": round(r["size_bytes"] / 1e6, 1), "prepare_s": r["prepare_s"]}
                                 for n, r in ready.items()}
            for threads in args.threads:
                runners = _load(ready, shape, threads, skipped)
                for batch in args.batches:
                    ids, mask = inputs(batch, rng)
                    for beams in args.beams:
                        row = {"shape": arch, "threads": threads, "batch": batch,
                               "decode": "greedy" if beams == 1 else f"beam {beams}", "engines": {}}
                        for name, fn in runners.items():
                            try:
                                row["engines"][name] = timed(fn, (ids, mask, OUT_TOKENS, beams), args.warmup,
                                                             args.repeats)
                            except Exception as e:
                                row["engines"][name] = {"error": _err(e)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                del runners
                gc.collect()
            if args.profile and "t5compress int8 static" in ready:
                from profile_steps import profile

                shapes_info[arch]["profile"] = profile(ready, shape, lambda b: inputs(b, rng), OUT_TOKENS)
                print(json.dumps(shapes_info[arch]["profile"], indent=1), flush=True)
    meta = {"in_tokens": IN_TOKENS, "out_tokens": OUT_TOKENS, "repeats": args.repeats, "warmup": args.warmup,
            "calib_samples": args.calib_samples, "seconds": round(time.perf_counter() - started),
            "skipped": skipped_all}
    write(rows, shapes_info, meta, args.out)


def _engine_names(chosen: list[str]) -> list[str]:
    groups = {"ours": [n for n, e in ENGINES.items() if e.owner != "peer"],
              "peers": [n for n, e in ENGINES.items() if e.owner != "ours"]}
    names = []
    for c in chosen:
        for n in groups.get(c, [c]):
            if n not in ENGINES:
                raise SystemExit(f"unknown engine {n!r}; choose from: {', '.join(ENGINES)}, ours, peers")
            if n not in names:
                names.append(n)
    return [n for n in ENGINES if n in names]  # registry order: PyTorch first (the base of the ratios)


def _load(ready: dict, shape: Shape, threads: int, skipped: dict[str, str]) -> dict:
    runners = {}
    for name, r in ready.items():
        try:
            runners[name] = ENGINES[name].load(r["path"], shape, threads)
        except (Skip, Exception) as e:
            skipped[f"{name} @ {threads} threads"] = f"load failed: {_err(e)}"
            print(f"  skip {name} at {threads} threads: load failed: {_err(e)}", flush=True)
    return runners


if __name__ == "__main__":
    main()
