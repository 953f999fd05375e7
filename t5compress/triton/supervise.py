"""What `serve` does while its tritonserver runs: restart it when a model's backend process dies, drain it on a stop.

    watch = Supervisor(find_server(), repo, ServeConfig(), log_path, on_ready, say)
    try:
        watch.serve()                 # until KeyboardInterrupt (Ctrl-C, or SIGTERM raised as one) or a failure
    except KeyboardInterrupt:
        watch.drain(signal.SIGINT)    # requests in flight finish (at most cfg.drain_timeout s)
    finally:
        watch.end()                   # no server, stub or shared memory left, ports free
    watch.record, watch.failure

Why, measured with Triton 2.51 (nvidia-pytriton 0.7; docs/reliability.md has the numbers):
- A python backend stub that dies (kill -9, the OOM killer) is neither reaped nor restarted: the server and the
  model keep answering ready while every request to the model fails ("Stub process ... is not healthy"), for as long
  as the server runs. Reloading the model through the model-control API brings it back, but the dead instance never
  unloads: the server can then no longer stop cleanly. So the supervisor watches the stubs (from /proc) and restarts
  the whole server on the same ports: requests in flight get an error, new ones are refused until it is ready.
- On SIGTERM Triton closes its listening sockets at once, but goes on serving new requests on connections already
  open, and waits for every connection, idle keep-alive ones included, until its exit timeout; then it exits without
  stopping its stubs (which ignore SIGTERM and keep their /dev/shm region). So the drain here first makes the text
  model refuse new requests (a file named in the server's environment, `contract.STOPPING_ENV`), watches the
  server's pending-request gauge, ends the server once nothing is in flight (or at the drain timeout), and ends the
  stubs and removes their shared memory itself.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from t5compress.runtime import contract
from t5compress.triton import processes
from t5compress.triton.server import Ports, ServerCommand, TritonServer, start

POLL_S = 0.25  # how often the stubs are checked, and the pending requests during a drain
GRACE_S = 3.0  # once nothing is in flight: time for Triton to unload its models and exit by itself (~2.7 s measured)


class Supervisor:
    """One `serve` run: the current server, its restarts, how it stopped (`record`), and why it failed."""

    def __init__(self, server: ServerCommand, repo: Path, cfg, log_path: Path, on_ready: Callable,
                 say: Callable[[str], None]) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="t5compress-serve-"))
        self.stopping = self.scratch / "stopping"  # exists while draining: the text model refuses new requests
        server = dataclasses.replace(server, env={**server.env, contract.STOPPING_ENV: str(self.stopping)})
        self.server, self.repo, self.cfg, self.log_path = server, repo, cfg, log_path
        self.on_ready, self.say = on_ready, say
        self.ports = Ports(cfg.http_port, cfg.grpc_port, cfg.metrics_port)
        self.running: TritonServer | None = None
        self.stubs: dict[int, processes.Stub] = {}  # pid -> stub, of the current server
        self.started = time.monotonic()
        self.failure: str | None = None
        self.record: dict = {"http": f"{cfg.host}:{cfg.http_port}", "grpc": f"{cfg.host}:{cfg.grpc_port}",
                             "metrics": f"http://{cfg.host}:{cfg.metrics_port}/metrics", "restarts": [],
                             "ended": None, "exit_code": None}

    def _start(self) -> None:
        self.running = start(self.server, self.repo, self.ports, host=self.cfg.host, log_path=self.log_path,
                             wait=None, exit_timeout=max(self.cfg.drain_timeout, 1), die_with_parent=True)
        self.running.wait_ready(self.cfg.timeout)
        self.stubs = processes.stubs(self.running.pid)
        self.running.shm |= {s.shm for s in self.stubs.values()}
        self.on_ready(self.running, self.log_path)

    def serve(self) -> None:
        """Start the server and watch it until a KeyboardInterrupt, or until it fails (then `failure` says why)."""
        self._start()
        while True:
            time.sleep(POLL_S)
            code = self.running.process.poll()
            if code is not None:
                self.record["ended"] = f"exited with code {code}"
                self.failure = f"tritonserver exited with code {code}{self.running.log_hint()}"
                return
            dead = {pid: stub for pid, stub in self.stubs.items() if not processes.alive(pid)}
            if dead and not self._restart(dead):
                return

    def _restart(self, dead: dict[int, processes.Stub]) -> bool:
        """Restart the server after `dead` stubs died; False (and `failure`) when the restarts are used up."""
        pid, stub = next(iter(dead.items()))
        how = processes.how_it_ended(pid)
        what = f"model '{stub.model}': its python backend process (pid {pid}) {how}"
        done = self.record["restarts"]
        if len(done) >= self.cfg.restarts:
            self.record["ended"] = f"{what}; no restart left"
            self.failure = (f"{what}, and Triton would fail every request to it from now on; stopped after "
                            f"{len(done)} restart(s) (--restarts {self.cfg.restarts}; log: {self.log_path})")
            return False
        self.say(f"{what}; Triton would fail every request to it from now on: restarting tritonserver "
                 f"({len(done) + 1} of at most {self.cfg.restarts})")
        t = time.monotonic()
        self.running.kill()
        self._start()
        took = time.monotonic() - t
        done.append({"model": stub.model, "pid": pid, "how": how, "at_s": round(t - self.started, 1),
                     "ready_again_s": round(took, 2)})
        self.say(f"tritonserver ready again after {took:.1f} s (pid {self.running.pid})")
        return True

    def drain(self, signum: int) -> None:
        """Stop the server gracefully: new connections are refused at once, requests in flight may finish within
        cfg.drain_timeout; a second Ctrl-C or SIGTERM ends it at once."""
        r = self.running
        if r is None or r.process.poll() is not None:
            return
        name = signal.Signals(signum).name
        self.say(f"{name}: stopping; requests in flight may finish for up to {self.cfg.drain_timeout} s, new ones "
                 "are refused; Ctrl-C again to stop at once")
        t = time.monotonic()
        self.running.shm |= {s.shm for s in processes.stubs(r.pid).values()}
        self.stopping.touch()  # new requests on connections already open get an error from the text model
        r.process.send_signal(signal.SIGTERM)  # Triton closes its listening sockets
        pending, why, deadline = None, "drain timeout", t + self.cfg.drain_timeout
        try:
            while True:
                if r.process.poll() is not None:
                    pending, why = 0, "server exited"
                    break
                now = r.pending()
                if now == 0:  # Triton may still wait out idle connections: a moment to exit on its own, no more
                    pending, why = 0, "nothing in flight"
                    _wait(r, min(GRACE_S, max(deadline - time.monotonic(), 0)))
                    break
                pending = now if now is not None else pending
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            why = "a second interrupt"
        self.record["drain"] = {"signal": name, "seconds": round(time.monotonic() - t, 2), "ended_by": why,
                                "in_flight_at_end": pending}
        self.record["ended"] = f"stopped ({name})"
        if pending:
            self.say(f"{pending} request(s) still in flight after {time.monotonic() - t:.1f} s ({why}): their "
                     "clients get an error; a longer --drain-timeout lets them finish")

    def end(self) -> None:
        """No server, stub or stub shared memory left, whatever happened; ignores further signals meanwhile."""
        before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.running is not None:
                self.record["exit_code"] = self.running.kill()
                self.record["left_behind"] = {"processes": len(self.running.left_behind.get("killed", [])),
                                              "shm_regions": len(self.running.left_behind.get("shm_removed", []))}
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
            for s, handler in before.items():
                signal.signal(s, handler)
        self.record["seconds"] = round(time.monotonic() - self.started, 1)


def _wait(server: TritonServer, seconds: float) -> None:
    try:
        server.process.wait(seconds)
    except subprocess.TimeoutExpired:
        pass
