"""The scale benchmark: each stage of the chain, run from the CLI on the shapes people deploy (random weights: valid
for time and memory, not accuracy), with its wall time and peak resident memory.

    python benchmarks/scale.py                                  # t5-base shape: create, export, static int8 on 16
                                                                # and 128 texts of 512 tokens, dynamic int8
    python benchmarks/scale.py --shapes t5-small --texts 16 48  # a quick one
    python benchmarks/scale.py --rerender                       # the Markdown again from scale.json
    python benchmarks/scale.py --stages static --append         # redo some rows, keep the others

Every stage is a separate `t5compress` process; its peak RSS is the kernel's (`wait4`'s ru_maxrss), its time the
wall clock. Calibration texts are generated words, one byte a token under the byte-level tokenizer the shapes are
built with (so a 512-character text is 512 tokens), longer than `--tokens` is cut by the model's limit.
Writes benchmarks/results/current/scale/scale.{json,md}, stamped with commit, date, machine and the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "current" / "scale"
CLI = [sys.executable, "-m", "t5compress.cli"]


def machine() -> dict:
    from t5compress.cpu import cpu_features

    cpu = cpu_features()
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None)
    flags = [k for k in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx") if cpu.get(k)]
    return {"cpu": cpu["model"], "cores": os.cpu_count(), "memory_mb": mem, "flags": flags,
            "python": platform.python_version()}


def stamp() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    return {"commit": commit.stdout.strip() + ("+changes" if dirty else ""), "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine()}


def measure(argv: list[str], log: Path) -> dict:
    """Run one CLI command; its wall seconds, peak RSS (MB) and exit code."""
    started = time.perf_counter()
    with open(log, "ab") as f:
        f.write(("$ t5compress " + " ".join(argv) + "\n").encode())
        f.flush()
        proc = subprocess.Popen([*CLI, *argv], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "T5COMPRESS_PROGRESS": "lines", "T5COMPRESS_PROGRESS_EVERY": "60"})
        _, status, usage = os.wait4(proc.pid, 0)
    return {"command": "t5compress " + " ".join(argv), "seconds": round(time.perf_counter() - started, 1),
            "peak_rss_mb": usage.ru_maxrss // 1024, "rc": os.waitstatus_to_exitcode(status)}


def texts(n: int, tokens: int, path: Path) -> Path:
    """`n` texts of about `tokens` characters of generated words, one per line."""
    import numpy as np

    words = ("the of and to in a is that for it as was with be by on not this are or from at which but have an "
             "they you were her she there one all we their model river bridge policy committee").split()
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(n):
        line = ""
        while len(line) < tokens:
            line += rng.choice(words) + " "
        lines.append(line.strip())
    path.write_text("\n".join(lines) + "\n")
    return path


def run(shape: str, work: Path, text_counts: list[int], tokens: int, stages: list[str], log: Path) -> list[dict]:
    rows = []
    model, onnx = work / "model", work / "onnx"

    def stage(name: str, argv: list[str], **extra) -> None:
        print(f"[{shape}] {name} ...", flush=True)
        r = {"shape": shape, "stage": name, **extra, **measure(argv, log)}
        print(f"[{shape}] {name}: {r['seconds']} s, peak {r['peak_rss_mb']} MB, rc {r['rc']}", flush=True)
        rows.append(r)

    if "create" in stages:
        stage("create", ["create", shape, str(model), "--tokenizer", "byte", "-o", "vocab_size=32128", "--force"])
    if "export" in stages:
        stage("export", ["export", str(model), str(onnx), "--force"])
    calib = texts(max(text_counts), tokens, work / "calib.txt")
    if "static" in stages:
        for n in text_counts:
            stage("quantize --static", ["quantize", str(onnx), str(work / f"static{n}"), "--static", "--calib-data",
                                        str(calib), "--samples", str(n), "--min-agreement", "0", "--force"],
                  texts=n, tokens=tokens)
    if "dynamic" in stages:
        stage("quantize --dynamic", ["quantize", str(onnx), str(work / "dynamic"), "--dynamic", "--min-agreement",
                                     "0", "--force"])
    return rows


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Scale: each stage's time and peak memory ({result['date']}, commit {result['commit']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_mb']} MB, {' '.join(m['flags'])}; Python "
             f"{m['python']}. Random-weight shapes, byte-level tokenizer (a character is a token). Each stage is "
             "its own `t5compress` process; peak RSS is the kernel's.", "",
             "| shape | stage | texts x tokens | s | peak RSS MB | rc | commit |", "|---|---|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        tx = f"{r['texts']} x {r['tokens']}" if "texts" in r else ""
        lines.append(f"| {r['shape']} | {r['stage']} | {tx} | {r['seconds']:.1f} | {r['peak_rss_mb']:,} | {r['rc']} "
                     f"| {r.get('commit', result['commit'])} |")
    lines += [""] + [f"- {n}" for n in result.get("notes", [])] if result.get("notes") else []
    lines += ["", "Commands:", "", "```"] + [r["command"] for r in result["rows"]] + ["```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["t5-base"])
    ap.add_argument("--texts", nargs="+", type=int, default=[16, 128], help="calibration texts of each static run")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per calibration text")
    ap.add_argument("--stages", nargs="+", default=["create", "export", "static", "dynamic"])
    ap.add_argument("--work", type=Path, default=Path("runs/scale"))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rerender", action="store_true")
    ap.add_argument("--append", action="store_true", help="keep the rows of scale.json this run does not redo")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rerender:
        result = json.loads((args.out / "scale.json").read_text())
    else:
        old = json.loads((args.out / "scale.json").read_text())["rows"] if args.append else []
        result = {**stamp(), "rows": []}
        for shape in args.shapes:
            work = args.work / shape
            work.mkdir(parents=True, exist_ok=True)
            rows = [{**r, "commit": result["commit"]} for r in run(shape, work, args.texts, args.tokens, args.stages,
                                                                 work / "log.txt")]
            done = {(r["shape"], r["stage"], r.get("texts")) for r in rows}
            result["rows"] = [r for r in old if (r["shape"], r["stage"], r.get("texts")) not in done] + rows
            old = result["rows"]
            (args.out / "scale.json").write_text(json.dumps(result, indent=1))
    (args.out / "scale.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
