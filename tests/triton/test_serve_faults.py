"""`t5compress serve` under faults, as a real CLI process on a real tritonserver under a real load.

A leaf model's python backend process is killed with SIGKILL: every request ends (the right text, or an error),
none hangs, and serve restarts the server, which answers again; with no restart left serve stops in one line. A
SIGTERM under load: every request ends, serve exits 0, and no server process, stub or shared-memory region is left,
the ports are free. Timings are the benchmark's (benchmarks/triton_soak.py); here only what happened is asserted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from t5compress.triton import TritonConfig, processes, run
from t5compress.triton.server import Ports, find_server

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["translate: hello world", "summarize: a b c d e f", "the cat sat on the mat", "q"]
TIMEOUT = 60.0  # a client timeout: a request that reaches it is a hang


@pytest.fixture(scope="module")
def served(runtime_export, tmp_path_factory):
    """A portable repository (leaf models in their own processes) of a tiny export, and the local runtime's texts."""
    from t5compress.runtime import load_runtime

    try:
        find_server()
    except Exception as e:  # noqa: BLE001 -- the server tests need `make triton-env`
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("faults")
    export = runtime_export[1]
    run(export, TritonConfig(name="t5", portable=True), root / "repo", progress=False)
    want = {t: load_runtime(export).generate_text([t])[0] for t in TEXTS}
    return root / "repo", want


class Serve:
    """`t5compress serve REPO` as a child process; its output lines collected by a thread."""

    def __init__(self, repo: Path, *args: str) -> None:
        self.ports = Ports.free()
        argv = [sys.executable, "-m", "t5compress.cli", "serve", str(repo), "--http-port", str(self.ports.http),
                "--grpc-port", str(self.ports.grpc), "--metrics-port", str(self.ports.metrics), *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()

    def wait_for(self, needle: str, count: int = 1, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [ln for ln in self.lines if needle in ln]
            if len(found) >= count:
                return found[count - 1]
            assert self.proc.poll() is None or len(found) >= count, "".join(self.lines)
            time.sleep(0.1)
        raise AssertionError(f"no {needle!r} after {timeout} s: {''.join(self.lines)}")

    def server_pid(self, count: int = 1) -> int:
        return int(self.wait_for("ready (pid", count).split("pid ")[1].split(")")[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Outcome(NamedTuple):
    sent: float  # time.monotonic()
    ok: bool  # answered (always with the right text: checked as it comes)
    message: str  # the error, when not ok
    ended: float


class Load:
    """Clients sending TEXTS until stopped, alternately HTTP and gRPC; every request's Outcome kept."""

    def __init__(self, ports: Ports, want: dict[str, str] | None, clients: int = 2, **settings) -> None:
        self.ports, self.want, self.settings = ports, want, settings
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._send, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()

    def _send(self, k: int) -> None:
        from t5compress.runtime import contract
        from t5compress.triton.client import inputs

        protocol = ("http", "grpc")[k % 2]
        url = f"127.0.0.1:{self.ports.http if protocol == 'http' else self.ports.grpc}"
        extra = {"client_timeout": TIMEOUT} if protocol == "grpc" else {}
        n, client = 0, None
        while not self.stop.is_set():
            text, sent = TEXTS[(n + k) % len(TEXTS)], time.monotonic()
            n += 1
            try:
                client = client or _client(protocol, url)  # kept open, as clients do: Triton waits for it on SIGTERM
                result = client.infer("t5", inputs(protocol, [text], **self.settings), **extra)
                got = contract.texts_of(result.as_numpy(contract.OUTPUT_TEXT.name))[0][0]
            except Exception as e:  # noqa: BLE001 -- an error is an outcome: counted, the load goes on
                message = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.outcomes.append(Outcome(sent, False, message, time.monotonic()))
                client = _close(client)
                time.sleep(0.05)
                continue
            assert self.want is None or got == self.want[text], (got, text)  # an answer is always the right one
            self.outcomes.append(Outcome(sent, True, "", time.monotonic()))
        _close(client)

    def ok_since(self, t: float) -> int:
        return sum(o.ok for o in list(self.outcomes) if o.sent >= t)

    def wait_ok_since(self, t: float, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.ok_since(t) < n:
            assert time.monotonic() < deadline, self.outcomes[-5:]
            time.sleep(0.1)

    def finish(self) -> list[Outcome]:
        self.stop.set()
        for t in self.threads:
            t.join(TIMEOUT + 10)
        assert not any(t.is_alive() for t in self.threads), "a request hung"
        return self.outcomes


def _client(protocol: str, url: str):
    if protocol == "http":
        import tritonclient.http as http

        return http.InferenceServerClient(url, connection_timeout=TIMEOUT, network_timeout=TIMEOUT)
    import tritonclient.grpc as grpc

    return grpc.InferenceServerClient(url)


def _sigterm(serve: Serve, load: Load) -> tuple[float, int, list]:
    """SIGTERM to serve under `load`: when it was sent, serve's exit code, every request's outcome (none hung)."""
    term = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    out = serve.proc.wait(timeout=60)
    return term, out, load.finish()


def _close(client) -> None:
    try:
        if client is not None:
            client.close()
    except Exception:  # noqa: BLE001 -- a broken connection is dropped either way
        pass


def _nothing_left(server_pid: int, shm: set[str], ports: Ports) -> None:
    assert processes.group(server_pid) == [], "processes of the server left"
    assert not [n for n in shm if (processes.SHM_DIR / n).exists()], "shared memory left"
    for port in (ports.http, ports.grpc, ports.metrics):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # raises if still taken


@pytest.mark.slow
def test_a_killed_leaf_restarts_the_server_and_sigterm_under_load_leaves_nothing(served):
    repo, want = served
    serve = Serve(repo, "--drain-timeout", "5", "--restarts", "1")
    load = Load(serve.ports, want)  # sends once the server answers (errors until then)
    try:
        first = serve.server_pid()
        stubs = processes.stubs(first)
        shm = {s.shm for s in stubs.values()}
        load.wait_ok_since(0, 4)
        leaf = next(pid for pid, s in stubs.items() if s.model == "t5_decoder_with_past")
        os.kill(leaf, signal.SIGKILL)
        killed = time.monotonic()
        line = serve.wait_for("restarting tritonserver")
        assert f"model 't5_decoder_with_past': its python backend process (pid {leaf}) killed by signal 9" in line
        second = serve.server_pid(2)
        assert second != first
        assert processes.group(first) == [] and not [n for n in shm if (processes.SHM_DIR / n).exists()]
        load.wait_ok_since(time.monotonic(), 4)  # served again
        shm = {s.shm for s in processes.stubs(second).values()}

        term, out, outcomes = _sigterm(serve, load)
    finally:
        load.stop.set()
        serve.close()
    text = "".join(serve.lines)
    assert out == 0, text
    assert "tritonserver stopped" in text and "Traceback" not in text and "error:" not in text, text
    assert "still in flight" not in text, text  # the drain ended with nothing in flight
    _nothing_left(second, shm, serve.ports)
    # Every request ended (no thread hung): answered right (checked as they came) or an error.
    assert any(o.ok for o in outcomes if o.sent >= killed) and any(o.ok for o in outcomes if o.sent < term)
    assert all(o.ok or o.message for o in outcomes)


@pytest.mark.slow
def test_a_dead_leaf_with_no_restart_left_is_one_line_and_leaves_nothing(served):
    repo, _ = served
    serve = Serve(repo, "--restarts", "0")
    try:
        pid = serve.server_pid()
        stubs = processes.stubs(pid)
        leaf = next(p for p, s in stubs.items() if s.model == "t5_encoder")
        os.kill(leaf, signal.SIGKILL)
        out = serve.proc.wait(timeout=60)
    finally:
        serve.close()
    errors = [ln for ln in serve.lines if ln.startswith("error:")]
    assert out != 0 and len(errors) == 1 and "Traceback" not in "".join(serve.lines), serve.lines
    assert f"model 't5_encoder': its python backend process (pid {leaf}) killed by signal 9" in errors[0]
    assert "--restarts 0" in errors[0]
    _nothing_left(pid, {s.shm for s in stubs.values()}, serve.ports)


@pytest.mark.slow
def test_a_drain_that_runs_out_cuts_the_requests_in_flight_with_an_error_and_says_so(served):
    """--drain-timeout 0 under long requests: those generating are cut (an error each, none hangs), serve says how
    many and still exits 0 with nothing left."""
    repo, _ = served
    serve = Serve(repo, "--drain-timeout", "0")
    load = Load(serve.ports, None, clients=4, max_new_tokens=512, min_new_tokens=512)
    try:
        pid = serve.server_pid()
        shm = {s.shm for s in processes.stubs(pid).values()}
        load.wait_ok_since(0, 2)
        term, out, outcomes = _sigterm(serve, load)
    finally:
        load.stop.set()
        serve.close()
    text = "".join(serve.lines)
    assert out == 0 and "Traceback" not in text and "error:" not in text, text
    cut = serve.wait_for("still in flight")
    assert int(cut.split("serve: ")[1].split(" request(s)")[0]) >= 1, cut
    assert any(not o.ok for o in outcomes if o.sent < term < o.ended)  # one in flight got an error, none hung
    _nothing_left(pid, shm, serve.ports)
