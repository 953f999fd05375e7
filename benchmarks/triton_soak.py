"""Soak and fault benchmark of `t5compress serve`: many requests, memory growth, a leaf killed, a SIGTERM under load.

A small random-weight model (t5-efficient-tiny-nl2 shape, byte-level vocabulary; or --model-dir / --export-dir) is
exported, made static int8, written as a `--portable` repository (or --flavour in-process) and served by
`t5compress serve` (a real tritonserver on 127.0.0.1, free ports), run as a child process as a user runs it. Then:

- soak: --requests single-text requests from --clients threads, alternately HTTP and gRPC, bounded by --max-seconds;
  every request has a client timeout (--timeout), so a request that never answers counts as a hang instead of
  stalling the run. Errors, empty answers, answers that differ from the local runtime on the same export, latency
  percentiles, requests/s, and the RSS of the server plus its python backend stubs (from /proc) before and after,
  against a stated growth bound.
- leaf: while the clients keep sending, `kill -9` the python backend stub serving one model (default the decoder with
  past, the leaf every generation step calls; in-process, the text model). Recorded: how each request around the
  kill ended and how long it took, what serve said, when serve had the server ready again, when the first request
  sent after the kill succeeded, what the dead server left behind; the phase ends once --recovery-requests requests
  sent after the recovery have succeeded (or after --fault-seconds).
- sigterm: while the clients keep sending, SIGTERM to serve. Recorded: how the requests in flight and those sent
  after the signal ended, serve's exit code and lines, how long it took to exit, processes of the server left, its
  shared-memory regions left, and whether its three ports can be bound again.

    .venv/bin/python benchmarks/triton_soak.py                      # ~4-6 min on 2 cores
    .venv/bin/python benchmarks/triton_soak.py --requests 300 --warmup 100 --out /tmp/soak

Needs `make triton-env`. Writes benchmarks/results/current/triton_soak.json and .md (--out, --name).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
ARCH = "t5-efficient-tiny-nl2"
LEAVES = ("encoder", "decoder", "decoder_with_past")
MODEL = "t5"  # the served text model's name
RECOVERY_SECONDS = 60.0  # a recovery attempt whose requests take longer than this did not work
STARTED = time.monotonic()


def say(msg: str) -> None:
    """A plain progress line (no terminal needed)."""
    print(f"[{time.monotonic() - STARTED:6.1f}s] {msg}", flush=True)


# ---- the server's processes, from /proc ------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    kb = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), 0)
    return kb / 1024


def server_memory(server_pid: int) -> dict:
    """RSS of the server and of each stub, and their sum (shared pages such as the shm regions count in each)."""
    from t5compress.triton import processes

    def name(p: int) -> str:
        stub = processes.stub_of(p)
        return "tritonserver" if p == server_pid else stub.model if stub else f"pid {p} ({processes.state(p)})"

    procs = {name(p): round(rss_mb(p), 1) for p in processes.tree(server_pid)}
    return {"total_mb": round(sum(procs.values()), 1), "processes": procs}


# ---- clients ---------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    start: float  # seconds since the phase began
    seconds: float
    protocol: str
    status: str  # ok, mismatch (answered, not the local runtime's text), empty, error, timeout
    message: str = ""


class Load:
    """Requests from threads, each with its own client (HTTP for even threads, gRPC for odd), each with a timeout."""

    def __init__(self, server, model: str, texts: list[str], want: dict[str, str], timeout: float, settings: dict):
        self.server, self.model, self.texts, self.want = server, model, texts, want
        self.timeout, self.settings = timeout, settings
        self.samples: list[dict] = []  # server RSS at each progress line: does it level off or keep growing?
        self.outcomes_so_far: list[Outcome] = []

    def _client(self, protocol: str):
        if protocol == "http":
            import tritonclient.http as http

            return http.InferenceServerClient(self.server.http_url, connection_timeout=self.timeout,
                                              network_timeout=self.timeout)
        import tritonclient.grpc as grpc

        return grpc.InferenceServerClient(self.server.grpc_url)

    def _one(self, client, protocol: str, text: str, t0: float) -> Outcome:
        from t5compress.triton.client import inputs

        extra = {"client_timeout": self.timeout} if protocol == "grpc" else {}
        start = time.perf_counter()
        try:
            result = client.infer(self.model, inputs(protocol, [text], **self.settings), **extra)
            got = result.as_numpy("OUTPUT_TEXT").reshape(-1)[0].decode("utf-8")
        except Exception as e:  # tritonclient, gevent, socket and grpc errors all end the same way here
            took = time.perf_counter() - start
            message = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            timed_out = took >= self.timeout * 0.98 or "timed out" in message.lower() or "deadline" in message.lower()
            return Outcome(start - t0, took, protocol, "timeout" if timed_out else "error", message)
        took = time.perf_counter() - start
        status = "empty" if not got.strip() else "ok" if got == self.want.get(text, got) else "mismatch"
        return Outcome(start - t0, took, protocol, status, "" if status == "ok" else got[:80])

    def run(self, requests: int, clients: int, max_seconds: float, stop: threading.Event | None = None,
            progress: float = 0.0) -> tuple[list[Outcome], float, int]:
        """Up to `requests` requests within `max_seconds` (or until `stop`); outcomes, wall seconds, stuck threads."""
        stop = stop or threading.Event()
        outcomes: list[Outcome] = []
        self.outcomes_so_far = outcomes  # read while it runs (appends only)
        lock, counter = threading.Lock(), iter(range(requests))
        t0 = time.perf_counter()
        deadline = t0 + max_seconds

        def worker(k: int) -> None:
            protocol = ("http", "grpc")[k % 2]
            client = self._client(protocol)
            while not stop.is_set() and time.perf_counter() < deadline:
                with lock:
                    j = next(counter, None)
                if j is None:
                    break
                outcome = self._one(client, protocol, self.texts[(j + k) % len(self.texts)], t0)
                with lock:
                    outcomes.append(outcome)
                if outcome.status in ("error", "timeout"):  # a connection that failed is not reused
                    _close(client)
                    time.sleep(0.1)  # as a client with a retry loop would: refusals are counted, not hammered
                    client = self._client(protocol)
            _close(client)

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
        for t in threads:
            t.start()
        report = t0 + progress
        while any(t.is_alive() for t in threads) and time.perf_counter() < deadline + self.timeout + 10:
            time.sleep(0.2)
            if progress and time.perf_counter() >= report:
                report += progress
                with lock:
                    done = Counter(o.status for o in outcomes)
                mem = server_memory(self.server.pid)
                self.samples.append({"requests": sum(done.values()), "total_mb": mem["total_mb"],
                                     "tritonserver_mb": mem["processes"]["tritonserver"]})
                say(f"  {sum(done.values())} requests done: {dict(done)}; server RSS {mem['total_mb']} MB")
        stuck = sum(t.is_alive() for t in threads)  # a client timeout that did not fire: a real hang
        with lock:
            return list(outcomes), time.perf_counter() - t0, stuck


def _close(client) -> None:
    try:
        client.close()
    except Exception:  # closing a broken connection may raise; it is dropped either way
        pass


def summary(outcomes: list[Outcome], wall: float) -> dict:
    count = Counter(o.status for o in outcomes)
    ms = np.array([o.seconds for o in outcomes if o.status in ("ok", "mismatch", "empty")]) * 1000
    pct = {f"p{q}_ms": round(float(np.percentile(ms, q)), 1) if ms.size else None for q in (50, 90, 99)}
    return {"requests": len(outcomes), "ok": count["ok"], "mismatch": count["mismatch"], "empty": count["empty"],
            "errors": count["error"], "timeouts": count["timeout"], **pct,
            "max_ms": round(float(ms.max()), 1) if ms.size else None,
            "requests_per_s": round((len(outcomes) - count["error"] - count["timeout"]) / wall, 2),
            "seconds": round(wall, 1),
            "by_protocol": {p: dict(Counter(o.status for o in outcomes if o.protocol == p)) for p in ("http", "grpc")},
            "messages": dict(Counter(o.message for o in outcomes if o.status != "ok").most_common(5))}


# ---- building and serving --------------------------------------------------------------------------------------


def prepare(args, work: Path) -> tuple[Path, str]:
    """An export dir (int8 unless --no-int8) and what it is."""
    import torch

    from t5compress.bench.inputs import generated_texts
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    if args.export_dir:
        return args.export_dir, f"given export {args.export_dir}"
    model_dir, what = args.model_dir, f"given model {args.model_dir}"
    if model_dir is None:
        from t5compress.model.load import create_model, save_model_dir
        from t5compress.model.tokenization import byte_level

        tok = byte_level()
        model = create_model(ARCH, vocab_size=len(tok))
        with torch.no_grad():  # random init can repeat one token; a smaller embedding varies the output
            model.shared.weight.mul_(0.3)
        model_dir, what = work / "model", f"random-weight {ARCH}, byte-level vocabulary"
        save_model_dir(model, tok, model_dir)
    export(model_dir, ExportConfig(), work / "onnx", force=True)
    if args.no_int8:
        return work / "onnx", f"{what}, fp32 ONNX"
    calib = work / "calib.txt"
    calib.write_text("\n".join(generated_texts(32, 1)) + "\n")
    cfg = QuantizeConfig(calib_data=str(calib), samples=32, min_agreement=0.0)  # random weights: no accuracy gate
    quantize(work / "onnx", cfg, work / "int8", force=True, progress=False)
    return work / "int8", f"{what}, static int8 ONNX"


class ServeProcess:
    """`t5compress serve REPO` as a child process, as a user runs it; its lines kept, the server's pid followed."""

    def __init__(self, repo: Path, log_path: Path, *options: str) -> None:
        import subprocess
        import sys

        from t5compress.triton.server import Ports

        self.ports = Ports.free()
        self.http_url, self.grpc_url = f"127.0.0.1:{self.ports.http}", f"127.0.0.1:{self.ports.grpc}"
        argv = [sys.executable, "-m", "t5compress.cli", "serve", str(repo), "--http-port", str(self.ports.http),
                "--grpc-port", str(self.ports.grpc), "--metrics-port", str(self.ports.metrics), "--log-file",
                str(log_path), *options]
        env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "COLUMNS": "400"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[tuple[float, str]] = []  # (perf_counter when read, line)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append((time.perf_counter(), line.rstrip()))
            say(f"  serve: {line.rstrip()}")

    def wait_for(self, needle: str, count: int = 1, timeout: float = 240) -> tuple[float, str]:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            found = [x for x in self.lines if needle in x[1]]
            if len(found) >= count:
                return found[count - 1]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"serve never said {needle!r}: " + " | ".join(ln for _, ln in self.lines[-8:]))

    @property
    def pid(self) -> int:
        """The tritonserver serving now (the last 'ready (pid N)' line)."""
        last = [ln for _, ln in self.lines if ln.startswith("ready (pid ")][-1]
        return int(last.split("pid ")[1].split(")")[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def left_behind(server_pid: int, shm: set[str], ports=None) -> dict:
    """What a server that should be gone left: live processes of its group, its stubs' shm regions, ports taken."""
    import socket

    from t5compress.triton import processes

    taken = []
    for port in (ports.http, ports.grpc, ports.metrics) if ports else ():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return {"processes": len(processes.group(server_pid)),
            "shm_regions": sum((processes.SHM_DIR / n).exists() for n in shm), "ports_taken": taken}


def _sender(load: Load, clients: int, seconds: float) -> tuple[threading.Thread, threading.Event, dict, float]:
    """Clients sending in the background until the event is set; their outcomes land in the dict."""
    stop, box = threading.Event(), {}

    def send() -> None:  # far more requests than can be sent in the time
        box["outcomes"], box["wall"], box["stuck"] = load.run(10**9, clients, seconds, stop)

    t0 = time.perf_counter()
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, stop, box, t0


# ---- the leaf phase: a stub killed under load ------------------------------------------------------------------


def leaf_fault(serve: ServeProcess, load: Load, args, model: str) -> dict:
    """kill -9 `model`'s stub under load; serve restarts the server; until --recovery-requests succeed again."""
    from t5compress.triton import processes

    old = serve.pid
    stubs = processes.stubs(old)
    victim = next((p for p, s in stubs.items() if s.model == model), None)
    if victim is None:
        raise SystemExit(f"no python backend stub serving {model} under server pid {old}")
    thread, stop, box, t0 = _sender(load, args.clients, args.fault_seconds + 120)
    time.sleep(args.settle)
    say(f"leaf: kill -9 {victim} (python backend stub of {model}); {args.clients} clients keep sending")
    os.kill(victim, signal.SIGKILL)
    killed = time.perf_counter() - t0
    record: dict = {"model": model, "stub_pid": victim, "killed_at_s": round(killed, 2)}
    try:
        said, line = serve.wait_for("ready again after", timeout=args.fault_seconds + 60)
        record["ready_again_after_kill_s"] = round(said - t0 - killed, 2)
        record["serve_said"] = [ln for at, ln in serve.lines if at - t0 >= killed and "serve:" in ln]
    except SystemExit as e:
        record["ready_again_after_kill_s"] = None
        record["serve_said"] = [str(e)]
    record["old_server_left"] = left_behind(old, {s.shm for s in stubs.values()})
    deadline = time.perf_counter() + args.fault_seconds
    while time.perf_counter() < deadline:  # until enough requests sent after recovery have succeeded
        done = list(load.outcomes_so_far)
        back = record["ready_again_after_kill_s"]
        if back is not None and sum(o.status == "ok" and o.start >= killed + back for o in done) \
                >= args.recovery_requests:
            break
        time.sleep(0.2)
    stop.set()
    thread.join(args.timeout + 30)
    outcomes = box.get("outcomes", [])
    record["requests"] = classify_around(outcomes, killed)
    record["stuck_threads"] = box.get("stuck", "sender did not return")
    back = record["ready_again_after_kill_s"]
    record["after_recovery"] = dict(Counter(o.status for o in outcomes if back is not None and
                                            o.start >= killed + back))
    say(f"leaf: requests that ended after the kill {json.dumps(record['requests']['after_kill'])}; after the "
        f"recovery {record['after_recovery']}")
    return record


def classify_around(outcomes: list[Outcome], killed: float) -> dict:
    """Requests that ended before the event, and those in flight or sent after it (how they ended, how fast)."""
    before = [o for o in outcomes if o.start + o.seconds < killed]
    after = sorted((o for o in outcomes if o.start + o.seconds >= killed), key=lambda o: o.start)
    failed = [o for o in after if o.status in ("error", "timeout")]
    first_ok = next((o for o in after if o.status == "ok" and o.start >= killed), None)
    return {
        "sent": len(outcomes),
        "before": dict(Counter(o.status for o in before)),
        "after_kill": dict(Counter(o.status for o in after)),
        "in_flight": dict(Counter(o.status for o in after if o.start < killed)),
        "sent_after": dict(Counter(o.status for o in after if o.start >= killed)),
        "hangs": sum(o.status == "timeout" for o in after),
        "failure_p50_s": round(float(np.median([o.seconds for o in failed])), 2) if failed else None,
        "slowest_failure_s": round(max((o.seconds for o in failed), default=0.0), 2),
        "failures_end_by_s": round(max((o.start + o.seconds - killed for o in failed), default=0.0), 2),
        "first_ok_sent_after_s": round(first_ok.start - killed, 2) if first_ok else None,
        "messages": dict(Counter(o.message for o in failed).most_common(6)),
        "in_flight_messages": dict(Counter(o.message for o in failed if o.start < killed)),
    }


# ---- the sigterm phase: serve stopped under load -------------------------------------------------------------


def sigterm(serve: ServeProcess, load: Load, args) -> dict:
    """SIGTERM to serve while the clients send; how every request ended, how serve exited, what was left."""
    from t5compress.triton import processes

    server = serve.pid
    shm = {s.shm for s in processes.stubs(server).values()}
    thread, stop, box, t0 = _sender(load, args.clients, args.settle + 120)
    time.sleep(args.settle)
    say(f"sigterm: kill -TERM {serve.proc.pid} (serve) under load")
    serve.proc.send_signal(signal.SIGTERM)
    signalled = time.perf_counter() - t0
    try:
        code = serve.proc.wait(90)
    except Exception:  # noqa: BLE001 -- serve did not exit: that is the result
        code = None
    exited = time.perf_counter() - t0
    stopped = next((at - t0 for at, ln in serve.lines if ln.startswith("tritonserver stopped")), None)
    time.sleep(2)  # requests sent after serve exited: refused (connection refused), counted too
    stop.set()
    thread.join(args.timeout + 30)
    outcomes = box.get("outcomes", [])
    record = {"signalled_at_s": round(signalled, 2), "serve_exit_code": code,
              "serve_exit_s": round(exited - signalled, 2) if code is not None else None,
              "server_stopped_s": round(stopped - signalled, 2) if stopped is not None else None,
              "requests": classify_around(outcomes, signalled),
              "stuck_threads": box.get("stuck", "sender did not return"),
              "serve_said": [ln for at, ln in serve.lines if at - t0 >= signalled],
              "left": left_behind(server, shm, serve.ports)}
    say(f"sigterm: serve exited {code} after {record['serve_exit_s']} s; requests {record['requests']['after_kill']}"
        f"; left {record['left']}")
    return record

# ---- report ----------------------------------------------------------------------------------------------------


def markdown(r: dict) -> str:
    s, m = r["soak"], r["memory"]
    lines = ["# Triton soak: `t5compress serve` under load, a leaf killed, a SIGTERM", "",
             f"{r['model']}, {r['flavour']} repository, served by `t5compress serve` (a child process, "
             f"`{' '.join(r['serve_options'])}`), {r['machine']}; one run.", "",
             f"Soak: {s['requests']} requests from {r['clients']} clients (HTTP and gRPC alternately), "
             f"{r['settings']['max_new_tokens']} new tokens forced, client timeout {r['timeout_s']:g} s: "
             f"**{'pass' if r['soak_pass'] else 'FAIL'}**", "",
             "| requests | ok | mismatch | empty | errors | hangs | p50 ms | p90 ms | p99 ms | req/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {s['requests']} | {s['ok']} | {s['mismatch']} | {s['empty']} | {s['errors']} | {s['timeouts']} | "
             f"{s['p50_ms']} | {s['p90_ms']} | {s['p99_ms']} | {s['requests_per_s']} |", "",
             f"- server RSS (tritonserver + python stubs, from /proc): {m['at_ready']['total_mb']} MB when ready, "
             f"{m['before']['total_mb']} MB after {r['warmup']} warm-up requests, {m['after']['total_mb']} MB after "
             f"the soak; bound {m['bound']}: **{'pass' if m['pass'] else 'FAIL'}**",
             f"- growth over the second half of the soak: {m['mb_per_1000_requests_second_half']} MB per 1000 "
             "requests; RSS as the soak went on (requests done: total MB / tritonserver alone MB): "
             + ", ".join(f"{x['requests']}: {x['total_mb']} / {x['tritonserver_mb']}" for x in m["series"]),
             "- mismatch = answered with a text other than the local runtime's on the same export and text"]
    if "leaf" in r:
        f, a = r["leaf"], r["leaf"]["requests"]
        lines += ["", f"## A leaf killed: `kill -9` of the python backend stub of `{f['model']}` under load: "
                  f"**{'pass' if r['leaf_pass'] else 'FAIL'}**", "",
                  "| requests sent in the phase | ended before the kill | in flight at the kill | sent after it "
                  "| hangs | serve had the server ready again | first success sent after the kill |",
                  "|---:|---|---|---|---:|---:|---:|",
                  f"| {a['sent']} | {_counts(a['before'])} | {_counts(a['in_flight'])} | {_counts(a['sent_after'])} "
                  f"| {a['hangs']} | {_s(f['ready_again_after_kill_s'])} after the kill | "
                  f"{_s(a['first_ok_sent_after_s'])} |", "",
                  f"- a failed request took {_s(a['failure_p50_s'])} (median), {_s(a['slowest_failure_s'])} at most; "
                  f"the last failure ended {_s(a['failures_end_by_s'])} after the kill",
                  "- errors the clients got: " + "; ".join(f"`{k}` x{v}" for k, v in a["messages"].items()),
                  "- of those, the requests in flight at the kill: "
                  + ("; ".join(f"`{k}` x{v}" for k, v in a["in_flight_messages"].items()) or "none"),
                  f"- requests sent after the server was ready again: {_counts(f['after_recovery'])}",
                  f"- the killed server left: {f['old_server_left']['processes']} processes, "
                  f"{f['old_server_left']['shm_regions']} shared-memory regions",
                  "- serve said: " + " / ".join(f"`{ln}`" for ln in f["serve_said"])]
    if "sigterm" in r:
        t, a = r["sigterm"], r["sigterm"]["requests"]
        lines += ["", f"## SIGTERM to serve under load: **{'pass' if r['sigterm_pass'] else 'FAIL'}**", "",
                  "| requests sent in the phase | in flight at the signal | sent after it | hangs | serve exit code "
                  "| server stopped after | serve exited after | processes left | shm regions left "
                  "| ports still taken |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
                  f"| {a['sent']} | {_counts(a['in_flight'])} | {_counts(a['sent_after'])} | {a['hangs']} | "
                  f"{t['serve_exit_code']} | {_s(t['server_stopped_s'])} | {_s(t['serve_exit_s'])} | "
                  f"{t['left']['processes']} | "
                  f"{t['left']['shm_regions']} | {t['left']['ports_taken'] or 'none'} |", "",
                  "- errors the clients got: " + "; ".join(f"`{k}` x{v}" for k, v in a["messages"].items()),
                  "- of those, the requests in flight at the signal: "
                  + ("; ".join(f"`{k}` x{v}" for k, v in a["in_flight_messages"].items()) or "none"),
                  "- serve said: " + " / ".join(f"`{ln}`" for ln in t["serve_said"])]
    return "\n".join(lines) + "\n"


def _counts(c: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(c.items())) or "none"


def _s(x) -> str:
    return "-" if x is None else f"{x} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="soak requests")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (even: HTTP, odd: gRPC)")
    ap.add_argument("--warmup", type=int, default=400, help="requests before the soak's RSS 'before' (not counted)")
    ap.add_argument("--max-seconds", type=float, default=180.0, help="the soak stops sending after this long")
    ap.add_argument("--timeout", type=float, default=30.0, help="client timeout of every request (seconds)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request (forced)")
    ap.add_argument("--model-dir", type=Path, help="serve this model dir (exported here) instead of a random one")
    ap.add_argument("--export-dir", type=Path, help="serve this ONNX export dir as it is")
    ap.add_argument("--no-int8", action="store_true", help="serve the fp32 export")
    ap.add_argument("--flavour", choices=("portable", "in-process"), default="portable",
                    help="portable: leaf models in their own processes; in-process: the default repository")
    ap.add_argument("--no-fault", action="store_true", help="soak only")
    ap.add_argument("--fault-model", choices=LEAVES, default="decoder_with_past",
                    help="leaf whose stub is killed (portable; in-process kills the text model's)")
    ap.add_argument("--fault-seconds", type=float, default=60.0, help="at most this long after the kill")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of load before the kill and the SIGTERM")
    ap.add_argument("--recovery-requests", type=int, default=50, help="successes after the recovery that end it")
    ap.add_argument("--drain-timeout", type=int, default=10, help="serve --drain-timeout")
    ap.add_argument("--workdir", type=Path, help="model, export, repository and server log (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current", help="where NAME.json and .md go")
    ap.add_argument("--name", default="triton_soak", help="file name of the results, without extension")
    args = ap.parse_args()

    from t5compress.bench.inputs import generated_texts
    from t5compress.runtime import load_runtime
    from t5compress.triton import TritonConfig, run

    work = args.workdir or Path(tempfile.mkdtemp(prefix="triton-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"building the model and export in {work}")
    export_dir, what = prepare(args, work)
    repo, log_path = work / "repo", work / "server.log"
    run(export_dir, TritonConfig(name=MODEL, portable=args.flavour == "portable", max_batch_size=args.clients),
        repo, force=True)
    settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    texts = generated_texts(64, 7)
    rt = load_runtime(export_dir, threads=1)
    want = {t: rt.generate_text([t], **settings)[0] for t in texts}  # what each answer must be
    options = ["--drain-timeout", str(args.drain_timeout), "--restarts", "1"]
    say(f"repository {repo}; starting t5compress serve {' '.join(options)}")
    serve = ServeProcess(repo, log_path, *options)
    record: dict = {"model": what, "flavour": args.flavour, "serve_options": options, "clients": args.clients,
                    "timeout_s": args.timeout, "settings": settings, "warmup": args.warmup,
                    "machine": f"{os.cpu_count()} CPUs", "server_log": str(log_path)}
    try:
        serve.wait_for("ready (pid")
        load = Load(serve, MODEL, texts, want, args.timeout, settings)
        at_ready = server_memory(serve.pid)
        # Warm-up, not counted: measured here (results/archive/triton_soak_long.md), the server's RSS jumps by
        # ~180 MB in the first few hundred requests (portable), then creeps up by ~4-6 MB per 1000 requests.
        say(f"ready (pid {serve.pid}), RSS {at_ready['total_mb']} MB; warm-up: {args.warmup} requests")
        warm = load.run(args.warmup, args.clients, args.max_seconds)[0]
        record["warmup_statuses"] = dict(Counter(o.status for o in warm))
        before = server_memory(serve.pid)
        say(f"soak: {args.requests} requests, {args.clients} clients, at most {args.max_seconds:g} s")
        outcomes, wall, stuck = load.run(args.requests, args.clients, args.max_seconds, progress=10)
        after = server_memory(serve.pid)
        series = [{"requests": 0, "total_mb": before["total_mb"],
                   "tritonserver_mb": before["processes"]["tritonserver"]}, *load.samples,
                  {"requests": len(outcomes), "total_mb": after["total_mb"],
                   "tritonserver_mb": after["processes"]["tritonserver"]}]
        s = record["soak"] = {**summary(outcomes, wall), "stuck_threads": stuck, "asked": args.requests}
        limit = before["total_mb"] * 1.2 + 50
        half = next(x for x in series if x["requests"] >= len(outcomes) / 2)  # too few samples: the last one
        late = (after["total_mb"] - half["total_mb"]) * 1000 / (len(outcomes) - half["requests"]) \
            if half["requests"] < len(outcomes) else None
        record["memory"] = {"at_ready": at_ready, "before": before, "after": after, "series": series,
                            "mb_per_1000_requests_second_half": round(late, 1) if late is not None else None,
                            "bound": f"after <= before x 1.2 + 50 MB = {limit:.0f} MB",
                            "pass": after["total_mb"] <= limit}
        record["soak_pass"] = (s["requests"] == args.requests and s["errors"] + s["timeouts"] + s["empty"] == 0
                               and not stuck and record["memory"]["pass"])
        say(f"soak: {s['requests']} requests, {s['ok']} ok, {s['mismatch']} mismatch, {s['errors']} errors, "
            f"{s['timeouts']} hangs; p50/p90/p99 {s['p50_ms']}/{s['p90_ms']}/{s['p99_ms']} ms")
        if not args.no_fault:
            model = MODEL if args.flavour == "in-process" else f"{MODEL}_{args.fault_model}"
            f = record["leaf"] = leaf_fault(serve, load, args, model)
            a = f["requests"]
            record["leaf_pass"] = (a["hangs"] == 0 and f["stuck_threads"] == 0 and f["ready_again_after_kill_s"]
                                   is not None and f["after_recovery"].get("ok", 0) >= args.recovery_requests
                                   and set(f["after_recovery"]) <= {"ok"} and a["after_kill"].get("mismatch", 0)
                                   == 0 and f["old_server_left"]["processes"] == 0
                                   and f["old_server_left"]["shm_regions"] == 0)
            t = record["sigterm"] = sigterm(serve, load, args)
            record["sigterm_pass"] = (t["serve_exit_code"] == 0 and t["requests"]["hangs"] == 0 and
                                      t["stuck_threads"] == 0 and not t["left"]["ports_taken"] and
                                      t["left"]["processes"] == 0 and t["left"]["shm_regions"] == 0 and
                                      t["requests"]["after_kill"].get("mismatch", 0) == 0)
    finally:
        serve.close()
    record["machine"] += f", load average {os.getloadavg()[0]:.1f} at the end"
    from t5compress.bench.stamp import write_result

    write_result(args.out / args.name, record, markdown(record))
    print(markdown(record), flush=True)
    say(f"results → {args.out / args.name}.json and .md")


if __name__ == "__main__":
    main()
