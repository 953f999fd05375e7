"""One variant measured in its own process, so its peak memory and cold start are its own.

    python -m t5compress.bench.worker measure JOB.json RESULT.json
    python -m t5compress.bench.worker prepare PEER MODEL_DIR OUT RESULT.json

Progress goes to the parent as JSON lines on the original stdout; everything libraries print goes to stderr (the
parent keeps it as the variant's log). The result is written to RESULT.json; a crash leaves none, and the parent
turns that into an error entry.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before any heavy import: cold start counts the engine's imports too

import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

MISSING_EXIT = 3  # `prepare`: the peer's packages do not import with this interpreter


class Events:
    """JSON lines to the parent on a private copy of stdout; fd 1 itself now points at stderr."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, **event) -> None:
        self.out.write(json.dumps(event) + "\n")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: VmHWM of its own address space.

    Not `getrusage(...).ru_maxrss` alone: on Linux it also carries the peak of the address space the process was
    forked from (the parent's, at fork time), which would charge the bench's own memory to every variant.
    """
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)  # kB
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def _stats(times_ms: list[float]) -> dict:
    p50, p90, p99 = np.percentile(np.asarray(times_ms), [50, 90, 99])
    return {"p50_ms": round(float(p50), 2), "p90_ms": round(float(p90), 2), "p99_ms": round(float(p99), 2),
            "mean_ms": round(float(np.mean(times_ms)), 2)}


def measure_cell(generate, ids, mask, job: dict, beams: int) -> dict:
    """Forced-length latency of one (batch, beams) cell, then time to first token (1-new-token calls)."""
    n, repeats = job["output_tokens"], job["repeats"]
    for _ in range(job["warmup"]):
        generate(ids, mask, n, n, beams)
    times, lengths = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows = generate(ids, mask, n, n, beams)
        times.append((time.perf_counter() - t0) * 1000)
        lengths += [len(r) for r in rows]
    first = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(ids, mask, 1, 1, beams)
        first.append((time.perf_counter() - t0) * 1000)
    cell = _stats(times)
    cell.update(new_tokens_min=min(lengths), new_tokens_max=max(lengths),
                short=min(lengths) != n or max(lengths) != n,
                ttft_ms=round(float(np.median(first)), 2),
                tokens_per_s=round(ids.shape[0] * n / (cell["p50_ms"] / 1000), 1))
    return cell


def accuracy_outputs(generate, ids, mask, job: dict) -> list[list[int]]:
    """Free-length greedy outputs (stop at EOS, at most max_new_tokens) for every eval input, in order."""
    out, size = [], job["eval_batch"]
    for i in range(0, len(ids), size):
        width = int(mask[i:i + size].sum(axis=1).max())  # no all-padding columns: each batch as a user would send it
        out += generate(np.ascontiguousarray(ids[i:i + size, :width]), np.ascontiguousarray(mask[i:i + size, :width]),
                        job["max_new_tokens"], 0, 1)
    return out


def measure(job: dict, events: Events) -> dict:
    from t5compress.bench.engines import LOADERS

    v = job["variant"]
    data = np.load(job["inputs"])
    ids, mask = data["latency_ids"], data["latency_mask"]
    cells_total = len(job["threads"]) * len(job["batch_sizes"]) * len(job["beams"])
    done, result = 0, {"cells": [], "threads": {}}
    events.send(event="start", total=cells_total + 1)
    for i, threads in enumerate(job["threads"]):
        t0 = time.perf_counter()
        generate = LOADERS[v["kind"]](Path(v["path"]), threads, {**v["settings"], "eos": job["eos"]})
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        generate(ids[:1], mask[:1], 1, 1, 1)
        first_s = time.perf_counter() - t1
        if i == 0:
            result.update(cold_start_s=round(time.perf_counter() - STARTED, 3), load_s=round(load_s, 3),
                          import_and_load_s=round(t1 - STARTED, 3), first_call_ms=round(first_s * 1000, 2),
                          rss_after_load_mb=peak_rss_mb())
        result["threads"][str(threads)] = {"load_s": round(load_s, 3)}
        for batch in job["batch_sizes"]:
            for beams in job["beams"]:
                events.send(event="progress", done=done, what=f"{threads}t b{batch} beam{beams}")
                cell = measure_cell(generate, ids[:batch], mask[:batch], job, beams)
                result["cells"].append({"threads": threads, "batch": batch, "beams": beams, **cell})
                done += 1
        if i == 0:
            events.send(event="progress", done=done, what="accuracy")
            if "eval_ids" in data:
                result["outputs"] = accuracy_outputs(generate, data["eval_ids"], data["eval_mask"], job)
        del generate
        gc.collect()
    result["peak_rss_mb"] = peak_rss_mb()
    events.send(event="progress", done=cells_total + 1, what="done")
    return result


def prepare(peer_name: str, model_dir: Path, out: Path) -> dict:
    import importlib

    from t5compress.bench.peers import REGISTRY

    peer = REGISTRY[peer_name]
    for module in peer.needs:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 -- installed but broken is as missing as not installed
            from t5compress.errors import first_line

            return {"missing": f"{module} does not import ({type(e).__name__}: {first_line(e)[:120]})"}
    t0 = time.perf_counter()
    info = peer.prepare(model_dir, out)
    info["prepare_s"] = round(time.perf_counter() - t0, 2)
    return info


def main(argv: list[str]) -> int:
    events = Events()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv[0] == "measure":
        job = json.loads(Path(argv[1]).read_text())
        result, dest = measure(job, events), Path(argv[2])
    elif argv[0] == "prepare":
        result, dest = prepare(argv[1], Path(argv[2]), Path(argv[3])), Path(argv[4])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(dest)
    return MISSING_EXIT if "missing" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
