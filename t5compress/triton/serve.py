"""The `serve` stage: a Triton Inference Server on a model repository, until it is stopped.

    run("runs/repo", ServeConfig(http_port=8000), on_ready=print)   # blocks; Ctrl-C (or SIGTERM) stops it

It reads a repository (written by the `triton` stage) and writes no directory: OUT is optional, and when given it
receives the stage's `t5compress.json` and `report.json` (endpoints, log, how long it served, how it ended) after
the server stopped.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.errors import ModelError


@dataclass(frozen=True)
class ServeConfig:
    http_port: int = option(8000, "HTTP port.")
    grpc_port: int = option(8001, "gRPC port.")
    metrics_port: int = option(8002, "Prometheus metrics port.")
    host: str = option("127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
    tritonserver: str | None = option(None, "tritonserver executable (default: PATH, then the nvidia-pytriton "
                                            "environment).")
    log_file: str | None = option(None, "Write the server's log here (default: a temporary file, named when the "
                                        "server is ready).")
    timeout: float = option(180.0, "Seconds to wait for the models to load.")

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            require(0 < port < 65536, name, f"must be a port number (1-65535), got {port}")
        require(self.timeout > 0, "timeout", f"must be > 0, got {self.timeout}")


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run(src: str | os.PathLike, cfg: ServeConfig, out: str | os.PathLike | None = None, *, force: bool = False,
        progress: bool = True, on_ready: Callable | None = None) -> artifacts.Report:
    """Serve the repository `src` until Ctrl-C / SIGTERM (or the server exits); `on_ready(server, log_path)` is
    called once the models are loaded. Returns the report (also written into `out`, if given)."""
    from t5compress.triton.server import Ports, ServerError, find_server, start

    with artifacts.envelope("serve", src, cfg, out, force=force) as env:  # no `out`: nothing claimed or written
        server = find_server(cfg.tritonserver)
        src = Path(src)
        if not src.is_dir():
            raise ModelError(f"'{src}' is not a directory; write a repository with `t5compress triton EXPORT_DIR "
                             f"{src}`")
        log_path = Path(cfg.log_file) if cfg.log_file else _fresh_log()
        signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the server as Ctrl-C does
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
        ports = Ports(cfg.http_port, cfg.grpc_port, cfg.metrics_port)
        running = start(server, src, ports, host=cfg.host, log_path=log_path, wait=None)  # opens the log safely
        started, ended = time.monotonic(), "stopped"
        try:
            running.wait_ready(cfg.timeout)
            if on_ready is not None:
                on_ready(running, log_path)
            code = running.process.wait()
            ended = f"exited with code {code}"
        except KeyboardInterrupt:
            pass
        finally:
            code = running.stop()
        report = env.write({"stage": "serve", "repository": str(src), "server": server.origin,
                            "http": running.http_url, "grpc": running.grpc_url, "metrics": running.metrics_url,
                            "log": str(log_path), "ended": ended, "exit_code": code,
                            "seconds": round(time.monotonic() - started, 1)})  # how long it served
    if ended != "stopped":
        raise ServerError(f"tritonserver {ended} (log: {log_path})")
    return report


def _fresh_log() -> Path:
    """A new log file made by us: a predictable name in /tmp could be a planted link."""
    fd, name = tempfile.mkstemp(prefix="t5compress-tritonserver-", suffix=".log")
    os.close(fd)
    return Path(name)
