"""The bench stage: every variant (and the peers) measured on one grid, each in its own process; one report.

    run(["pt=runs/model", "int8=runs/int8"], BenchConfig(data="eval.jsonl", peers=("all",)), "runs/bench")

Writes OUT/bench.json (returned as a dict), OUT/report.md, OUT/pareto.png, OUT/sizes.png, OUT/latency_vs_batch.png,
OUT/peers/ (the peers prepared from the first PyTorch variant) and OUT/logs/ (each worker's stderr).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import t5compress
from t5compress import artifacts
from t5compress.bench.config import BenchConfig
from t5compress.bench.inputs import Inputs, VocabMap, build, vocab_map
from t5compress.bench.variants import Variant, resolve_all
from t5compress.errors import ConfigError, first_line
from t5compress.progress import Reporter

log = logging.getLogger(__name__)
WORKER = "t5compress.bench.worker"
EVAL_BATCH = 16


def effective(cfg: BenchConfig) -> BenchConfig:
    """The edge profile's grid: 1 and 2 threads (whatever --threads said)."""
    return dataclasses.replace(cfg, threads=(1, 2)) if cfg.edge else cfg


def _paths(variants: list[str]) -> list[str]:
    """The local paths among `variants` (NAME=PATH or PATH; URLs are not paths)."""
    return [str(v).split("=", 1)[-1] for v in variants]


def run(src: list[str], cfg: BenchConfig, out: str | Path, *, force: bool = False,
        progress: bool = True) -> artifacts.Report:
    """Measure the variants `src` (paths, NAME=PATH or Triton URLs) as `cfg` says; write OUT atomically; return the
    report."""
    from t5compress.bench import report as reporting

    variants = src
    record = {"variants": list(variants), **dataclasses.asdict(cfg)}
    with artifacts.envelope("bench", src, cfg, out, force=force, inputs=[_paths(variants), cfg], record=record,
                            parent=None) as env:
        cfg = effective(cfg)
        entries = resolve_all([str(v) for v in variants])
        base = next((v for v in entries if v.kind == "pytorch"), None)
        clash = [v.name for v in entries if v.name in cfg.peer_names and v.name != "pytorch"]  # that peer is a variant
        if clash:
            raise ConfigError(f"variant name {clash[0]!r} is also a peer's name; name it otherwise (NAME=PATH)")
        if cfg.peer_names and base is None:
            raise ConfigError("--peers are prepared from a PyTorch model dir, and no variant is one; add the model "
                              "dir the exports came from")
        first = entries[0].name  # agreement is against the first variant given, even when --edge puts int8 first
        for v in entries:
            if v.kind == "ctranslate2":
                v.settings.setdefault("compute_type", "int8" if v.precision == "int8" else "default")
            if v.kind == "onnx" and cfg.device != "cpu":
                v.settings["device"] = cfg.device
        if cfg.device != "cpu" and any(v.kind == "onnx" for v in entries):
            from t5compress.runtime.device import providers_for

            providers_for(cfg.device)  # no CUDA provider: one line now, not a failed variant after minutes
        with env.staging() as tmp:
            report = _measure_all(cfg, entries, base, first, env.out, tmp, progress)
            report["seconds"] = env.seconds()
            if cfg.plots:
                from t5compress.bench.plots import write_plots

                report["plots"] = write_plots(report, tmp)
            artifacts.write_json(tmp / "bench.json", report)  # the name users and scripts know
            env.report = {"stage": "bench", **report}  # every stage's report.json
            (tmp / "report.md").write_text(reporting.markdown(report))
    log.info("bench written to %s", out)
    return report


def _measure_all(cfg: BenchConfig, entries: list[Variant], base: Variant | None, first: str, out: Path, tmp: Path,
                 progress: bool) -> dict:
    """Every variant and peer measured on one set of inputs (saved in `tmp` while the workers run); the report."""
    from t5compress.bench import report as reporting

    local = [v.path for v in entries if v.kind != "triton"]
    if not local:
        raise ConfigError("a Triton URL is measured with the tokenizer of a local variant: add the export or "
                          "model dir the repository was built from")
    inputs = build(cfg, local)
    for v in entries:
        if v.kind == "triton":
            v.settings["tokenizer"] = str(inputs.tokenizer_dir)
    (tmp / "logs").mkdir()
    inputs.save(tmp / "inputs.npz")
    peers, skipped = prepare_peers(cfg, base, tmp, progress) if base else ([], {})
    measured = [*entries, *peers]
    if cfg.edge:
        measured.sort(key=lambda v: v.precision != "int8")
    maps = vocab_maps(measured, base, inputs)
    results = {v.name: measure(v, cfg, inputs, tmp, progress, maps.get(v.name)) for v in measured}
    (tmp / "inputs.npz").unlink()
    return reporting.assemble(cfg, measured, results, inputs, skipped, first, out, tmp)


def prepare_peers(cfg: BenchConfig, base: Variant, tmp: Path, progress: bool = True
                  ) -> tuple[list[Variant], dict[str, str]]:
    """Each asked-for peer prepared into tmp/peers/NAME (here, else under cfg.peer_python); reasons for the rest."""
    from t5compress.bench.peers import REGISTRY

    peers, skipped = [], {}
    (tmp / "peers").mkdir()
    with Reporter("bench", len(cfg.peer_names), unit="peer", what="preparing peers", enabled=progress) as bar:
        for name in cfg.peer_names:
            peer = REGISTRY[name]
            settings = {**peer.settings, **locked_settings(cfg)}
            if name == "pytorch":  # the baseline is the first PyTorch variant itself, run with transformers' generate
                base.settings.update(settings)
                base.label = f"{base.label} (peer: transformers generate)"
                bar.update(info=name)
                continue
            dest, info, why = tmp / "peers" / name, None, []
            for python in dict.fromkeys(p for p in (sys.executable, cfg.peer_python) if p):
                rc, timed_out, info = _spawn(python, ["prepare", name, str(base.path), str(dest)], tmp,
                                             f"prepare-{name}", cfg.timeout_s, lambda e: None)
                if info and "missing" not in info and rc == 0:
                    break
                why.append(f"{Path(python).parent.parent.name or python}: " + (
                    info["missing"] if info and "missing" in info else
                    f"timed out after {cfg.timeout_s} s" if timed_out else
                    f"preparation failed: {_last_error(tmp / 'logs' / f'prepare-{name}.log')}"))
                info = None
            bar.update(info=name)
            if info is None:
                skipped[name] = "; ".join(why) + ("" if cfg.peer_python else " (give --peer-python, e.g. "
                                                                              ".venv-bench/bin/python)")
                continue
            if info.get("settings"):
                settings.update(info["settings"])
            if info.get("note"):
                settings["prepared"] = info["note"]
            peers.append(Variant(name=name, path=dest, kind=peer.kind, precision=peer.precision, label=peer.label,
                                 role="peer", owner="peer", lineage=["peer"], files=info["files"], settings=settings,
                                 python=None if python == sys.executable else python))
    return peers, skipped


def locked_settings(cfg: BenchConfig) -> dict:
    return {"threads": list(cfg.threads), "beams": list(cfg.beams), "input_tokens": cfg.input_tokens,
            "output_tokens": f"{cfg.output_tokens} forced (min_new_tokens = max_new_tokens)", "do_sample": False}


def vocab_maps(variants: list[Variant], base: Variant | None, inputs: Inputs) -> dict[str, VocabMap]:
    """The variants whose vocabulary is not the bench tokenizer's (a peer's is its base's), by name; their labels
    say so."""
    maps = {}
    for v in variants:
        own = base.path if v.role == "peer" and base is not None else v.path
        m = None if v.kind == "triton" else vocab_map(inputs.tokenizer_dir, own)
        if m is not None:
            maps[v.name] = m
            v.label += f", {m.pieces:,}-piece vocabulary"
    return maps


def measure(v: Variant, cfg: BenchConfig, inputs: Inputs, tmp: Path, progress: bool = True,
            vmap: VocabMap | None = None) -> dict:
    """One worker process for `v`; its result, or {'error': one line} when it crashed or ran out of time. With
    `vmap`, the worker gets the inputs in the variant's own ids; its outputs are decoded with its tokenizer."""
    data, eos = tmp / "inputs.npz", tuple(inputs.eos)
    if vmap is not None:
        data = tmp / "logs" / f"{v.name}.inputs.npz"
        eos = vmap.save(inputs, data)
    job = {"variant": {"kind": v.kind, "path": str(v.path), "settings": v.settings}, "threads": list(cfg.threads),
           "batch_sizes": list(cfg.batch_sizes), "beams": list(cfg.beams), "output_tokens": cfg.output_tokens,
           "repeats": cfg.repeats, "warmup": cfg.warmup, "eos": list(eos), "inputs": str(data),
           "max_new_tokens": cfg.max_new_tokens, "eval_batch": EVAL_BATCH}
    job_file = tmp / "logs" / f"{v.name}.job.json"
    job_file.write_text(json.dumps(job))
    total = len(cfg.threads) * len(cfg.batch_sizes) * len(cfg.beams) + 1

    with Reporter("bench", total, unit="cell", what=v.name, enabled=progress) as bar:
        def on_event(e: dict) -> None:
            if e.get("event") == "progress":
                bar.update(done=e["done"], what=f"{v.name}: {e.get('what', '')}")

        retried = None
        for attempt in range(2):  # a worker killed by a signal is run once more (OpenVINO's crashes now and then)
            rc, timed_out, result = _spawn(v.python or sys.executable, ["measure", str(job_file)], tmp, v.name,
                                           cfg.timeout_s, on_event)
            if attempt or timed_out or rc >= 0 or result is not None:
                break
            log_file = tmp / "logs" / f"{v.name}.log"
            retried = (f"the first worker was killed by {signal.Signals(-rc).name} ({_last_error(log_file)}; its "
                       f"log: logs/{v.name}.crash.log); this is the second's result")
            log_file.replace(log_file.with_suffix(".crash.log"))
        bar.update(done=total)
    job_file.unlink()
    if retried is not None and result is not None:
        result["retried"] = retried
    if vmap is not None:
        data.unlink(missing_ok=True)
        if result is not None:
            result.update(vocabulary=vmap.summary(inputs), tokenizer_dir=str(vmap.tokenizer_dir))
    if timed_out:
        return {"error": f"timed out after {cfg.timeout_s} s (--timeout-s)"}
    if rc != 0 or result is None:
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        return {"error": f"worker {how}: {_last_error(tmp / 'logs' / f'{v.name}.log')}"}
    return result


def _spawn(python: str, args: list[str], tmp: Path, name: str, timeout_s: int, on_event) -> tuple:
    """Run the worker; stream its events to `on_event`; -> (exit code, timed out, result dict or None)."""
    result_file = tmp / "logs" / f"{name}.result.json"
    env = dict(os.environ)
    root = str(Path(t5compress.__file__).resolve().parent.parent)  # this t5compress, also under another venv
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    with open(tmp / "logs" / f"{name}.log", "w") as logf, _killed_on_error(subprocess.Popen(
            [python, "-m", WORKER, *args, str(result_file)], stdout=subprocess.PIPE, stderr=logf,
            stdin=subprocess.DEVNULL, text=True, env=env)) as proc:
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
        reader.start()
        deadline, timed_out = time.monotonic() + timeout_s, False
        while True:
            try:
                line = lines.get(timeout=0.2)
                try:
                    on_event(json.loads(line))
                except ValueError:
                    pass
            except queue.Empty:
                if proc.poll() is not None and not reader.is_alive():
                    break
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    timed_out = True
                    break
        rc = proc.wait()
    result = json.loads(result_file.read_text()) if result_file.is_file() and not timed_out else None
    result_file.unlink(missing_ok=True)
    return rc, timed_out, result


@contextlib.contextmanager
def _killed_on_error(proc: subprocess.Popen):
    """`proc`, killed if the block ends in an error: `kill PID` (SIGTERM) reaches this process only, where Ctrl-C
    reaches the worker too, and a worker left running would measure on for minutes into a removed directory."""
    try:
        yield proc
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _last_error(log_file: Path) -> str:
    """The exception line of a worker's log (its last line that looks like one), else its last line."""
    lines = [x.strip() for x in log_file.read_text(errors="replace").splitlines() if x.strip()] \
        if log_file.is_file() else []
    errors = [x for x in lines if ("Error" in x or "Exception" in x) and not x.startswith(("File ", "Traceback"))]
    return first_line(Exception((errors or lines or ["no output"])[-1]))[:200]
