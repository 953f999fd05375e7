"""Soak and fault benchmark of the served text model: many requests, memory growth, and a python stub killed mid-load.

A small random-weight model (t5-efficient-tiny-nl2 shape, byte-level vocabulary; or --model-dir / --export-dir) is
exported, made static int8, written as a `--portable` repository and served by a real tritonserver on 127.0.0.1
(free ports, explicit model control so a model can be reloaded). Then:

- soak: --requests single-text requests from --clients threads, alternately HTTP and gRPC, bounded by --max-seconds;
  every request has a client timeout (--timeout), so a request that never answers counts as a hang instead of
  stalling the run. Errors, empty answers, answers that differ from the local runtime on the same export, latency
  percentiles, requests/s, and the RSS of the server plus its python backend stubs (from /proc) before and after,
  against a stated growth bound.
- fault: while the clients keep sending, `kill -9` the python backend stub serving one leaf model (default the
  decoder with past, which every generation step calls). Recorded: readiness of the server and the models over time,
  the server's log lines, how each request around the kill ended and how long it took, then how service came back,
  trying in order: the python backend restarting its stub itself, reloading the model through the model control API,
  restarting the server; the first that makes the next --recovery-requests requests all succeed is recorded.

    .venv/bin/python benchmarks/triton_soak.py                      # ~3-5 min on 2 cores
    .venv/bin/python benchmarks/triton_soak.py --requests 200 --clients 4 --out /tmp/soak

Needs `make triton-env`. Writes benchmarks/results/current/triton_soak.json and .md (or under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
ARCH = "t5-efficient-tiny-nl2"
LEAVES = ("encoder", "decoder", "decoder_with_past")
RECOVERY_SECONDS = 60.0  # a recovery attempt whose requests take longer than this did not work
STARTED = time.monotonic()


def say(msg: str) -> None:
    """A plain progress line (no terminal needed)."""
    print(f"[{time.monotonic() - STARTED:6.1f}s] {msg}", flush=True)


# ---- the server's processes, from /proc ------------------------------------------------------------------------


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (the server, its python backend stubs)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    tree, grew = [root], True
    while grew:
        new = [p for p, pp in parents.items() if pp in tree and p not in tree]
        tree += new
        grew = bool(new)
    return tree


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def stub_model(pid: int) -> str | None:
    """The model a python backend stub serves: its command line names the model file (<repo>/<model>/<v>/model.py)."""
    args = _cmdline(pid)
    if not args or not args[0].endswith("triton_python_backend_stub") or len(args) < 2:
        return None
    return Path(args[1]).parent.parent.name


def stubs(server_pid: int) -> dict[str, int]:
    """Model name -> pid of its stub (one instance per model here)."""
    return {m: p for p in process_tree(server_pid)[1:] if (m := stub_model(p))}


def process_state(pid: int) -> str:
    """'running', 'sleeping', 'zombie' (dead, not yet reaped by its parent) ... or 'gone'."""
    names = {"R": "running", "S": "sleeping", "D": "disk sleep", "Z": "zombie", "T": "stopped", "X": "dead"}
    try:
        code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return names.get(code, code)


def rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    kb = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), 0)
    return kb / 1024


def server_memory(server_pid: int) -> dict:
    """RSS of the server and of each stub, and their sum (shared pages such as the shm regions count in each)."""
    name = lambda p: "tritonserver" if p == server_pid else stub_model(p) or f"pid {p} ({process_state(p)})"  # noqa: E731
    procs = {name(p): round(rss_mb(p), 1) for p in process_tree(server_pid)}
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


def serve(repo: Path, log_path: Path):
    from t5compress.triton.server import Ports, find_server, start

    # Explicit model control (every model loaded at start) so that a model can be reloaded during the fault phase.
    return start(find_server(), repo, Ports.free(), log_path=log_path, wait=180,
                 extra_args=("--model-control-mode=explicit", "--load-model=*"))


def index_state(http_url: str, model: str) -> str:
    """The model's state in the repository index (POST /v2/repository/index), e.g. READY or UNAVAILABLE."""
    try:
        req = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=2) as r:
            entries = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"no answer ({type(e).__name__})"
    states = [f"v{e.get('version', '?')} {e.get('state', '?')}" for e in entries if e.get("name") == model]
    return ", ".join(states) or "absent"


def http_ready(url: str) -> str:
    """'ready', 'not ready (HTTP 400)' or why there was no answer; 2 s timeout."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return "ready" if r.status == 200 else f"not ready (HTTP {r.status})"
    except urllib.error.HTTPError as e:
        return f"not ready (HTTP {e.code})"
    except (urllib.error.URLError, OSError) as e:
        return f"no answer ({type(e).__name__})"


# ---- the fault phase -------------------------------------------------------------------------------------------


def fault(server, load: Load, args, leaf: str, log_path: Path) -> tuple[dict, object]:
    """Kill `leaf`'s stub under load; watch; restore service. Returns the record and the server now serving."""
    stop = threading.Event()
    box: dict = {}

    def send() -> None:  # until `stop`: far more requests than can be sent in the time
        box["outcomes"], box["wall"], box["stuck"] = load.run(10**9, args.clients, args.fault_seconds + 60, stop)

    sender = threading.Thread(target=send, daemon=True)
    t0 = time.perf_counter()
    sender.start()
    time.sleep(args.settle)
    victim = stubs(server.pid).get(leaf)
    if victim is None:
        stop.set()
        raise SystemExit(f"no python backend stub serving {leaf} under server pid {server.pid}")
    log_offset = log_path.stat().st_size
    urls = {"server": f"http://{server.http_url}/v2/health/ready", leaf: f"http://{server.http_url}/v2/models/{leaf}"
            "/ready", args.name: f"http://{server.http_url}/v2/models/{args.name}/ready"}
    say(f"fault: kill -9 {victim} (python backend stub of {leaf}); {args.clients} clients keep sending")
    os.kill(victim, signal.SIGKILL)
    killed = time.perf_counter() - t0
    timeline, last, checks = [], None, Counter()
    while time.perf_counter() - t0 < killed + args.fault_seconds:
        state = {k: http_ready(u) for k, u in urls.items()}
        state["index"] = index_state(server.http_url, leaf)
        state["killed_stub"] = process_state(victim)
        state["stub_pid"] = stubs(server.pid).get(leaf)
        checks.update(["checks"] + [f"{k} ready" for k in urls if state[k] == "ready"])
        if state != last:
            timeline.append({"t_after_kill_s": round(time.perf_counter() - t0 - killed, 2), **state})
            say(f"  +{timeline[-1]['t_after_kill_s']:.1f}s {state}")
            last = state
        time.sleep(0.25)
    stop.set()
    sender.join(args.timeout + 30)
    watched = log_path.read_bytes()[log_offset:].decode(errors="replace").splitlines()
    outcomes = box.get("outcomes", [])
    around = classify_around(outcomes, killed)
    record = {"leaf": leaf, "stub_pid": victim, "killed_at_s": round(killed, 2), "timeline": timeline,
              "readiness_checks": dict(checks),
              "requests": around, "stuck_threads": box.get("stuck", "sender did not return"),
              "server_alive": server.process.poll() is None, "log_lines_while_watching": len(watched)}
    say(f"fault: requests that ended after the kill {json.dumps(around['after_kill'])}")
    record["recovery"], server = recover(server, load, args, leaf)
    with open(log_path, "rb") as f:  # everything the first server wrote from the kill on, recovery included
        f.seek(log_offset)
        record["log"] = [ln[:240] for ln in f.read().decode(errors="replace").splitlines()][:40]
    return record, server


def classify_around(outcomes: list[Outcome], killed: float) -> dict:
    """Requests that ended before the kill, and those in flight or sent after it (how they ended, how fast)."""
    before = [o for o in outcomes if o.start + o.seconds < killed]
    after = sorted((o for o in outcomes if o.start + o.seconds >= killed), key=lambda o: o.start)
    failed = [o for o in after if o.status in ("error", "timeout")]
    first_ok = next((o for o in after if o.status == "ok" and o.start >= killed), None)
    return {
        "before_kill": dict(Counter(o.status for o in before)),
        "after_kill": dict(Counter(o.status for o in after)),
        "in_flight_at_kill": dict(Counter(o.status for o in after if o.start < killed)),
        "hangs": sum(o.status == "timeout" for o in after),
        "failure_p50_s": round(float(np.median([o.seconds for o in failed])), 2) if failed else None,
        "slowest_failure_s": round(max((o.seconds for o in failed), default=0.0), 2),
        "failures_end_by_s": round(max((o.start + o.seconds - killed for o in failed), default=0.0), 2),
        "first_ok_sent_after_s": round(first_ok.start - killed, 2) if first_ok else None,
        "messages": dict(Counter(o.message for o in failed).most_common(5)),
    }


def recover(server, load: Load, args, leaf: str) -> tuple[list[dict], object]:
    """Try the python backend's own restart, then a model reload, then a server restart; stop at the first to work."""
    import tritonclient.http as http

    attempts = []

    def probe(method: str, seconds: float) -> bool:
        outcomes, wall, stuck = load.run(args.recovery_requests, args.clients, RECOVERY_SECONDS)
        s = summary(outcomes, wall)
        ok = s["ok"] + s["mismatch"] == args.recovery_requests and not stuck
        attempts.append({"method": method, "action_s": round(seconds, 2), "restored": ok, "stuck": stuck,
                         **{k: s[k] for k in ("requests", "ok", "mismatch", "empty", "errors", "timeouts", "p50_ms",
                                              "messages")}})
        say(f"recovery by {method}: {s['ok']}/{args.recovery_requests} ok, {s['errors']} errors, "
            f"{s['timeouts']} timeouts")
        return ok

    if probe("waiting (for the python backend to restart its stub)", 0.0):
        return attempts, server
    t = time.perf_counter()
    try:
        client = http.InferenceServerClient(server.http_url, network_timeout=120)
        client.load_model(leaf)  # in explicit mode this reloads a loaded model
        client.close()
    except Exception as e:
        attempts.append({"method": f"model control API: load_model({leaf})", "restored": False,
                         "error": str(e)[:300]})
    else:
        if probe(f"model control API: load_model({leaf})", time.perf_counter() - t):
            return attempts, server
    t = time.perf_counter()
    server.stop()
    server = serve(args.repo, args.log_path.with_suffix(".restart.log"))
    load.server = server
    probe("server restart", time.perf_counter() - t)
    return attempts, server


# ---- report ----------------------------------------------------------------------------------------------------


def markdown(r: dict) -> str:
    s, m, f = r["soak"], r["memory"], r.get("fault")
    lines = [f"Triton soak: {r['model']}, portable repository, {r['machine']}", "",
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
             "- per process, MB (ready → after warm-up → after the soak): "
             + ", ".join(f"{k} {m['at_ready']['processes'].get(k)} → {v} → {m['after']['processes'].get(k)}"
                         for k, v in m["before"]["processes"].items()),
             "- mismatch = answered with a text other than the local runtime's on the same export and text"]
    if f:
        a, c = f["requests"], f["readiness_checks"]
        lines += ["", f"Fault: `kill -9` of the python backend stub of `{f['leaf']}` (pid {f['stub_pid']}) under "
                  f"load, {f['killed_at_s']} s into the phase", "",
                  f"- requests that ended after the kill: {a['after_kill']} (in flight at the kill: "
                  f"{a['in_flight_at_kill']}); hangs (client timeout hit): {a['hangs']}; a failure took "
                  f"{a['failure_p50_s']} s (median), {a['slowest_failure_s']} s at most; the last ended "
                  f"{a['failures_end_by_s']} s after the kill; "
                  + (f"first success sent {a['first_ok_sent_after_s']} s after the kill"
                     if a["first_ok_sent_after_s"] is not None else "no request sent after the kill succeeded"),
                  "- errors seen: " + "; ".join(f"`{k}` x{v}" for k, v in a["messages"].items()),
                  f"- server process alive after the kill: {f['server_alive']}; of {c['checks']} readiness checks "
                  f"in the {r['fault_seconds']:g} s after it, the server answered ready to "
                  f"{c.get('server ready', 0)}, "
                  f"the killed model to {c.get(f['leaf'] + ' ready', 0)}, the text model to "
                  f"{c.get(r['name'] + ' ready', 0)}", "",
                  "Readiness over time (HTTP /v2/health/ready and /v2/models/M/ready, as the clients' is_server_ready "
                  "and is_model_ready ask; the repository index's state; the killed stub's process state; the pid of "
                  "a stub now serving the model):", "",
                  "| after kill s | server | killed model | text model | index | killed stub | stub pid now |",
                  "|---:|---|---|---|---|---|---:|"]
        lines += [f"| {t['t_after_kill_s']} | {t['server']} | {t[f['leaf']]} | {t[r['name']]} | {t['index']} | "
                  f"{t['killed_stub']} | {t['stub_pid']} |" for t in f["timeline"]]
        lines += ["", f"The server logged {f['log_lines_while_watching']} lines in the {r['fault_seconds']:g} s "
                  "after the kill; everything it logged from the kill through the recovery (at most 40 lines):",
                  "", "```",
                  *f["log"], "```", "",
                  "| recovery tried | ok | requests | errors | hangs | p50 ms |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {a['method']} | {a['restored']} | {a.get('requests', '-')} | "
                  f"{a.get('errors', a.get('error', '-'))} | {a.get('timeouts', '-')} | {a.get('p50_ms', '-')} |"
                  for a in f["recovery"]]
        lines += ["", f"Fault phase: **{'pass' if r['fault_pass'] else 'FAIL'}** (no hang, service restored by: "
                  f"{r['recovered_by']})", "",
                  f"The last server's exit code on SIGTERM: {r['server_exit_code']}; the end of its log:", "", "```",
                  *r.get("shutdown_log", []), "```"]
    return "\n".join(lines) + "\n"


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
    ap.add_argument("--no-fault", action="store_true", help="soak only")
    ap.add_argument("--fault-model", choices=LEAVES, default="decoder_with_past", help="leaf whose stub is killed")
    ap.add_argument("--fault-seconds", type=float, default=20.0, help="watch this long after the kill")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of load before the kill")
    ap.add_argument("--recovery-requests", type=int, default=50, help="requests that must all succeed after recovery")
    ap.add_argument("--workdir", type=Path, help="model, export, repository and server log (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "current", help="where triton_soak.json and .md go")
    args = ap.parse_args()
    args.name = "t5"

    from t5compress.bench.inputs import generated_texts
    from t5compress.runtime import load_runtime
    from t5compress.triton import TritonConfig, run

    work = args.workdir or Path(tempfile.mkdtemp(prefix="triton-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"building the model and export in {work}")
    export_dir, what = prepare(args, work)
    args.repo, args.log_path = work / "repo", work / "server.log"
    run(export_dir, TritonConfig(name=args.name, portable=True, max_batch_size=args.clients), args.repo, force=True)
    settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    texts = generated_texts(64, 7)
    rt = load_runtime(export_dir, threads=1)
    want = {t: rt.generate_text([t], **settings)[0] for t in texts}  # what each answer must be
    say(f"repository {args.repo}; starting tritonserver")
    server = serve(args.repo, args.log_path)
    record: dict = {"model": what, "clients": args.clients, "timeout_s": args.timeout, "settings": settings,
                    "fault_seconds": args.fault_seconds, "warmup": args.warmup,
                    "name": args.name, "machine": f"{os.cpu_count()} CPUs", "server_log": str(args.log_path)}
    try:
        load = Load(server, args.name, texts, want, args.timeout, settings)
        at_ready = server_memory(server.pid)
        # Warm-up, not counted: measured here (results/archive/triton_soak_long.md), the server's RSS jumps by
        # ~180 MB in the first few hundred requests (tritonserver itself more than doubles, each stub grows by tens
        # of MB; likely allocator arenas and buffers for new batch shapes), then creeps up by ~4-6 MB per 1000
        # requests.
        # A "before" taken after a few requests would mostly measure that first jump.
        say(f"ready (pid {server.pid}), RSS {at_ready['total_mb']} MB; warm-up: {args.warmup} requests")
        warm = load.run(args.warmup, args.clients, args.max_seconds)[0]
        record["warmup_statuses"] = dict(Counter(o.status for o in warm))
        before = server_memory(server.pid)
        say(f"RSS {before['total_mb']} MB after warm-up ({dict(Counter(o.status for o in warm))}); soak: "
            f"{args.requests} requests, {args.clients} clients, at most {args.max_seconds:g} s")
        outcomes, wall, stuck = load.run(args.requests, args.clients, args.max_seconds, progress=10)
        after = server_memory(server.pid)
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
        say(f"soak: {s['requests']} requests, {s['ok']} ok, {s['mismatch']} mismatch, {s['empty']} empty, "
            f"{s['errors']} errors, {s['timeouts']} hangs; p50/p90/p99 {s['p50_ms']}/{s['p90_ms']}/{s['p99_ms']} ms, "
            f"{s['requests_per_s']} req/s; RSS {before['total_mb']} -> {after['total_mb']} MB")
        if not args.no_fault:
            record["fault"], server = fault(server, load, args, f"{args.name}_{args.fault_model}", args.log_path)
            worked = [a["method"] for a in record["fault"]["recovery"] if a["restored"]]
            record["recovered_by"] = worked[0] if worked else "nothing tried worked"
            record["fault_pass"] = bool(worked) and record["fault"]["requests"]["hangs"] == 0 and \
                record["fault"]["stuck_threads"] == 0
            record["memory"]["after_fault"] = server_memory(server.pid)
    finally:
        record["server_exit_code"] = server.stop()
        if server.log_path and server.log_path.is_file():  # how the last server shut down
            record["shutdown_log"] = [ln[:240] for ln in server.log_path.read_text(errors="replace").splitlines()[-6:]]
    record["machine"] += f", load average {os.getloadavg()[0]:.1f} at the end"
    from t5compress.bench.stamp import write_result

    write_result(args.out / "triton_soak", record, markdown(record))
    print(markdown(record), flush=True)
    say(f"results → {args.out / 'triton_soak.json'} and .md")


if __name__ == "__main__":
    main()
