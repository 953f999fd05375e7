"""The `serve` stage: a Triton Inference Server on a model repository, until it is stopped.

    run("runs/repo", ServeConfig(http_port=8000), on_ready=print)   # blocks; Ctrl-C (or SIGTERM) stops it

It reads a repository (written by the `triton` stage) and writes no directory: OUT is optional, and when given it
receives the stage's `t5compress.json` and `report.json` (endpoints, log, how long it served, how it ended, the
restarts and the drain) after the server stopped. What happens while it serves (a dead backend process, the
drain on Ctrl-C / SIGTERM) is `supervise.Supervisor`'s.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.errors import ModelError, Terminated
from t5compress.triton.supervise import Supervisor

log = logging.getLogger(__name__)


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
    drain_timeout: int = option(10, "On Ctrl-C or SIGTERM: seconds the requests in flight may take to finish (new "
                                    "connections are refused at once) before the server is stopped; a second "
                                    "Ctrl-C stops it at once.")
    restarts: int = option(3, "When a model's backend process dies (Triton would fail every request to it from "
                              "then on), restart the server, at most this many times; 0: stop with an error.")

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            require(0 < port < 65536, name, f"must be a port number (1-65535), got {port}")
        require(self.timeout > 0, "timeout", f"must be > 0, got {self.timeout}")
        require(self.drain_timeout >= 0, "drain_timeout", f"must be >= 0, got {self.drain_timeout}")
        require(self.restarts >= 0, "restarts", f"must be >= 0, got {self.restarts}")


def _interrupt(signum, _frame) -> None:
    raise Terminated(signum)


def run(src: str | os.PathLike, cfg: ServeConfig, out: str | os.PathLike | None = None, *, force: bool = False,
        progress: bool = True, on_ready: Callable | None = None, on_event: Callable[[str], None] | None = None
        ) -> artifacts.Report:
    """Serve the repository `src` until Ctrl-C / SIGTERM (or the server fails); `on_ready(server, log_path)` is
    called each time the models are loaded (again after a restart), `on_event(line)` with what the supervision saw
    and did. Returns the report (also written into `out`, if given)."""
    from t5compress.triton.server import ServerError, find_server

    with artifacts.envelope("serve", src, cfg, out, force=force) as env:  # no `out`: nothing claimed or written
        server = find_server(cfg.tritonserver)
        src = Path(src)
        if not src.is_dir():
            raise ModelError(f"'{src}' is not a directory; write a repository with `t5compress triton EXPORT_DIR "
                             f"{src}`")
        log_path = Path(cfg.log_file) if cfg.log_file else _fresh_log()
        signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the server as Ctrl-C does
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
        watch = Supervisor(server, src, cfg, log_path, on_ready or (lambda *_: None), on_event or log.info)
        try:
            watch.serve()
        except KeyboardInterrupt as e:
            watch.drain(getattr(e, "signum", signal.SIGINT))
        finally:
            watch.end()
        report = env.write({"stage": "serve", "repository": str(src), "server": server.origin, **watch.record,
                            "log": str(log_path)})
    if watch.failure:
        raise ServerError(watch.failure)
    return report


def _fresh_log() -> Path:
    """A new log file made by us: a predictable name in /tmp could be a planted link."""
    fd, name = tempfile.mkstemp(prefix="t5compress-tritonserver-", suffix=".log")
    os.close(fd)
    return Path(name)
