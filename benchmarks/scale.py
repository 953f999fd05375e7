"""The scale benchmark: each stage of the chain, run from the CLI on the shapes people deploy (random weights: valid
for time and memory, not accuracy), with its wall time and peak resident memory.

    python benchmarks/scale.py                                  # t5-base shape: create, export, static int8 on 16
                                                                # and 128 texts of 512 tokens, dynamic, block-wise
                                                                # and 4-bit (without data, GPTQ on 16 texts), ...
    python benchmarks/scale.py --shapes t5-small --texts 16 48  # a quick one
    python benchmarks/scale.py --rerender                       # the Markdown again from scale.json
    python benchmarks/scale.py --stages static --append         # redo some rows, keep the others

Every stage is a separate `t5compress` process; its peak RSS is the kernel's (`wait4`'s ru_maxrss), its time the
wall clock; a stage that writes a dir also gets the dir's bytes. Calibration texts are generated words, one byte a
token under the byte-level tokenizer the shapes are built with (so a 512-character text is 512 tokens), longer than
`--tokens` is cut by the model's limit.
Writes benchmarks/results/current/scale/scale.{json,md}, stamped with commit, date, machine and the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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


def data(n: int, tokens: int, path: Path) -> Path:
    """`n` JSON Lines records: a source of about `tokens` characters, a target of about 64 (prune's data)."""
    lines = texts(n, tokens, path.with_suffix(".txt")).read_text().splitlines()
    path.write_text("".join(json.dumps({"source": s, "target": s[:64]}) + "\n" for s in lines))
    return path


def served(argv: list[str], log: Path, text: str, port: int) -> dict:
    """Start `t5compress serve`, wait until the model answers, send one request of `text` (64 new tokens), stop the
    server: the wall time to the answer, the request's seconds, the server tree's RSS after it, and the kernel's
    peak RSS of the largest process."""
    from t5compress.triton.client import ClientError, generate, server_rss_mb

    started = time.perf_counter()
    with open(log, "ab") as f:
        f.write(("$ t5compress " + " ".join(argv) + "\n").encode())
        f.flush()
        proc = subprocess.Popen([*CLI, *argv], stdout=f, stderr=subprocess.STDOUT)
        url, answer, request_s = f"127.0.0.1:{port}", None, None
        while answer is None and proc.poll() is None and time.perf_counter() - started < 1800:
            try:
                t = time.perf_counter()
                answer = generate(url, "t5", [text], max_new_tokens=64)
                request_s = time.perf_counter() - t
            except (ClientError, OSError, Exception):  # not up yet
                time.sleep(5)
        tree = server_rss_mb(f"http://{url}")
        proc.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(proc.pid, 0)
    return {"command": "t5compress " + " ".join(argv), "seconds": round(time.perf_counter() - started, 1),
            "peak_rss_mb": usage.ru_maxrss // 1024, "rc": 0 if answer else os.waitstatus_to_exitcode(status) or 1,
            "request_s": request_s and round(request_s, 1), "server_tree_rss_mb": tree}


def run(shape: str, work: Path, text_counts: list[int], tokens: int, stages: list[str], log: Path,
        save: Callable[[dict], None]) -> None:
    model, onnx = work / "model", work / "onnx"
    quantized = work / "dynamic"  # the int8 export generate, triton and bench use

    def stage(name: str, argv: list[str], how: Callable = measure, out: Path | None = None, **extra) -> None:
        print(f"[{shape}] {name} ...", flush=True)
        r = {"shape": shape, "stage": name, **extra, **how(argv, log)}
        if out is not None and out.is_dir():  # what a stage that writes a dir wrote, in bytes
            r["out_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"[{shape}] {name}: {r['seconds']} s, peak {r['peak_rss_mb']} MB, rc {r['rc']}", flush=True)
        save(r)

    calib = texts(max(text_counts), tokens, work / "calib.txt")
    plans = {
        "create": lambda: stage("create", ["create", shape, str(model), "--tokenizer", "byte", "-o",
                                           "vocab_size=32128", "--force"], out=model),
        "export": lambda: stage("export", ["export", str(model), str(onnx), "--force"], out=onnx),
        "dynamic": lambda: stage("quantize --dynamic", ["quantize", str(onnx), str(quantized), "--dynamic",
                                                        "--min-agreement", "0", "--force"], out=quantized),
        "static": lambda: [stage("quantize --static", [
            "quantize", str(onnx), str(work / f"static{n}"), "--static", "--calib-data", str(calib), "--samples",
            str(n), "--min-agreement", "0", "--force"], out=work / f"static{n}", texts=n, tokens=tokens)
            for n in text_counts],
        "blockwise": lambda: stage("quantize --blockwise", ["quantize", str(onnx), str(work / "blockwise"),
                                                            "--blockwise", "--min-agreement", "0", "--force"],
                                   out=work / "blockwise"),
        "bits4": lambda: stage("quantize --bits 4", ["quantize", str(onnx), str(work / "bits4"), "--bits", "4",
                                                     "--min-agreement", "0", "--force"], out=work / "bits4"),
        "bits4-gptq": lambda: stage("quantize --bits 4 --calib-data (GPTQ)", [
            "quantize", str(onnx), str(work / "bits4_gptq"), "--bits", "4", "--calib-data", str(calib), "--samples",
            str(min(text_counts)), "--min-agreement", "0", "--force"], out=work / "bits4_gptq",
            texts=min(text_counts), tokens=tokens),
        "generate": lambda: [stage(f"generate b{b}", [
            "generate", str(quantized), "-i", str(texts(8, tokens, work / "inputs.txt")), "--batch-size", str(b),
            "--max-new-tokens", "64", "--min-new-tokens", "64"], texts=8, tokens=tokens) for b in (1, 8)],
        "triton": lambda: stage("triton", ["triton", str(quantized), str(work / "repo"), "--max-batch-size", "8",
                                           "--force"]),
        "serve": lambda: stage("serve + a request", ["serve", str(work / "repo"), "--http-port", "8790",
                                                     "--grpc-port", "8791", "--metrics-port", "8792"],
                               how=lambda argv, log: served(argv, log, calib.read_text().splitlines()[0], 8790),
                               texts=1, tokens=tokens),
        "bench": lambda: stage("bench", [
            "bench", f"fp32={onnx}", f"int8={quantized}", "-o", str(work / "bench"), "--input-tokens", str(tokens),
            "--output-tokens", "64", "--batch-sizes", "1,8", "--beams", "1", "--repeats", "1", "--eval-max", "8",
            "--no-plots", "--force"], tokens=tokens),
        "prune": lambda: stage("prune 50% heads + 50% FFN, recovery", [
            "prune", str(model), str(work / "pruned"), "--heads", "0.5", "--ffn", "0.5", "--calib-data",
            str(data(16, tokens, work / "data.jsonl")), "--recover-data", str(work / "data.jsonl"),
            "--calib-examples", "4", "--calib-batch-size", "2", "--recover-steps", "4", "--batch-size", "2",
            "--eval-max-examples", "4", "--latency-examples", "0", "--force"], tokens=tokens),
    }
    for name in stages:
        plans[name]()


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Scale: each stage's time and peak memory ({result['date']}, commit {result['commit']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_mb']} MB, {' '.join(m['flags'])}; Python "
             f"{m['python']}. Random-weight shapes, byte-level tokenizer (a character is a token). Each stage is "
             "its own `t5compress` process; peak RSS is the kernel's.", "",
             "| shape | stage | texts x tokens | s | peak RSS MiB | rc | commit | also |",
             "|---|---|---|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        tx = f"{r['texts']} x {r['tokens']}" if "texts" in r else ""
        lines.append(f"| {r['shape']} | {r['stage']} | {tx} | {r['seconds']:.1f} | {r['peak_rss_mb']:,} | {r['rc']} "
                     f"| {r.get('commit', result['commit'])} | {_also(r)} |")
    lines += [""] + [f"- {n}" for n in result.get("notes", [])] if result.get("notes") else []
    lines += ["", "Commands:", "", "```"] + [r["command"] for r in result["rows"]] + ["```", ""]
    return "\n".join(lines)


def _also(row: dict) -> str:
    """A stage's dir in MB; the serve row's extra measures: the request's seconds and the whole server's RSS after
    it."""
    if "out_bytes" in row:
        return f"writes {row['out_bytes'] / 1e6:,.1f} MB"
    if "request_s" not in row:
        return ""
    return f"request {row['request_s']} s; server tree {row['server_tree_rss_mb']} MiB after it"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["t5-base"])
    ap.add_argument("--texts", nargs="+", type=int, default=[16, 128], help="calibration texts of each static run")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per calibration text")
    ap.add_argument("--stages", nargs="+", default=["create", "export", "dynamic", "static", "blockwise", "bits4",
                                                    "bits4-gptq", "generate", "triton", "serve", "bench", "prune"],
                    help="run in this order")
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
        result = {**stamp(), "rows": old}

        def save(row: dict) -> None:  # after every stage, so a long run keeps what it measured
            row = {**row, "commit": result["commit"]}
            key = (row["shape"], row["stage"], row.get("texts"))
            result["rows"] = [r for r in result["rows"] if (r["shape"], r["stage"], r.get("texts")) != key] + [row]
            (args.out / "scale.json").write_text(json.dumps(result, indent=1))
            (args.out / "scale.md").write_text(render(result))

        for shape in args.shapes:
            work = args.work / shape
            work.mkdir(parents=True, exist_ok=True)
            run(shape, work, args.texts, args.tokens, args.stages, work / "log.txt", save)
    (args.out / "scale.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
