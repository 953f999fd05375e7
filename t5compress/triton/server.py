"""Find and run a Triton Inference Server: NVIDIA's `tritonserver` on PATH, or the one in the `nvidia-pytriton` wheel.

    with start(find_server(), "repo", Ports.free()) as server:
        server.http_url  # 127.0.0.1:PORT, ready

The wheel's server needs three things its own launcher would set up (measured, see shared/DESIGN.md): a backend
directory holding the python backend plus the stub built for the environment's Python, the wheel's `.libs` folder on
LD_LIBRARY_PATH, and the environment's `bin` first on PATH (the stub finds its packages through `python3` on PATH).
That environment is its own (`make triton-env`): nvidia-pytriton pins numpy<2, and with numpy 2 the stub answers
every request with an empty tensor.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from t5compress.errors import T5CompressError
from t5compress.triton import processes

log = logging.getLogger(__name__)

ENV_VAR = "T5COMPRESS_TRITON_ENV"  # a virtual environment with nvidia-pytriton (made by `make triton-env`)
DEFAULT_ENV = Path(__file__).resolve().parents[2] / ".venv-triton"
HOW_TO_GET_ONE = (
    "no Triton server found: run `make triton-env` in the t5compress checkout (a server environment with the "
    f"tritonserver of nvidia-pytriton, found as .venv-triton or through ${ENV_VAR}), put NVIDIA's `tritonserver` on "
    "PATH (their container, see the Dockerfile), or pass --tritonserver PATH"
)


class ServerError(T5CompressError):
    """No Triton server can be found, or it did not start."""


@dataclass(frozen=True)
class ServerCommand:
    """How to run one tritonserver: the executable, extra arguments and the environment it needs."""

    executable: Path
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    origin: str = ""  # where it was found, for messages

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> Ports:
        """Three ports free on 127.0.0.1 now (the kernel picks them)."""
        socks = [socket.socket() for _ in range(3)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return cls(*(s.getsockname()[1] for s in socks))
        finally:
            for s in socks:
                s.close()


def find_server(explicit: str | os.PathLike | None = None, env_dir: str | os.PathLike | None = None) -> ServerCommand:
    """An explicit path, else `tritonserver` on PATH, else the nvidia-pytriton server environment."""
    if explicit is not None:
        exe = Path(explicit)
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise ServerError(f"--tritonserver '{exe}' is not an executable file")
        return ServerCommand(exe, origin=str(exe))
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerCommand(Path(on_path), origin=f"{on_path} (on PATH)")
    env = Path(env_dir or os.environ.get(ENV_VAR) or DEFAULT_ENV)
    found = pytriton_server(env)
    if found is None:
        raise ServerError(HOW_TO_GET_ONE)
    return found


def pytriton_server(env: Path) -> ServerCommand | None:
    """The tritonserver bundled in `env`'s nvidia-pytriton, with a backend dir for `env`'s Python; None if absent."""
    pkgs = sorted(env.glob("lib/python3.*/site-packages"))
    if not pkgs or not (pkgs[0] / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        return None
    site = pkgs[0]
    bundle = site / "pytriton" / "tritonserver"
    py_version = site.parent.name.removeprefix("python")  # "3.11"
    stub = bundle / "python_backend_stubs" / py_version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton in '{env}' has no python backend stub for Python {py_version}")
    backends = env / "t5compress-backends"
    _install_python_backend(bundle / "backends" / "python", stub, backends / "python")
    bin_dir = str(env / "bin")
    libs = [str(site / "nvidia_pytriton.libs"), *_libpython_dir(env, py_version)]
    env_vars = {
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in [*libs, os.environ.get("LD_LIBRARY_PATH", "")] if p),
        "VIRTUAL_ENV": str(env),
    }
    for leak in ("PYTHONPATH", "PYTHONHOME"):  # the stub's python3 must see the server environment only
        env_vars[leak] = ""
    return ServerCommand(bundle / "bin" / "tritonserver", ("--backend-directory", str(backends)), env_vars,
                         origin=f"nvidia-pytriton in {env}")


def _libpython_dir(env: Path, py_version: str) -> list[str]:
    """The base interpreter's lib dir when it holds libpython (pyenv and other prefixes off the loader's path)."""
    try:
        lines = (env / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return []
    cfg = {k.strip(): v.strip() for k, v in (ln.split("=", 1) for ln in lines if "=" in ln)}
    lib = Path(cfg.get("home", "")).parent / "lib"
    return [str(lib)] if (lib / f"libpython{py_version}.so.1.0").is_file() else []


def _install_python_backend(src: Path, stub: Path, dest: Path) -> None:
    """Copy the backend library, its utils module and the stub into `dest` (once; refreshed when the wheel changes)."""
    files = [src / "libtriton_python.so", src / "triton_python_backend_utils.py", stub]
    if all((dest / f.name).is_file() and (dest / f.name).stat().st_mtime >= f.stat().st_mtime for f in files):
        return
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, dest / f.name)


@dataclass
class TritonServer:
    """A running tritonserver process bound to 127.0.0.1 (or `host`), stopped by PID."""

    process: subprocess.Popen
    ports: Ports
    host: str
    log_path: Path | None
    shm: set[str] = field(default_factory=set)  # shared-memory regions of its stubs, removed when it ends
    left_behind: dict = field(default_factory=dict)  # what `kill` ended and removed after it

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports.metrics}/metrics"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                  f"{self.log_hint()}")
            if self.ready():
                return
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s{self.log_hint()}")

    def log_hint(self) -> str:
        """The log line that says why: a model that failed to load, else the last error that is not about the GPU."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines if (ln.startswith("E") or "error" in ln.lower())
                  and "Cuda" not in ln and "NVML" not in ln]  # no GPU is not the problem
        models = [ln for ln in errors if "failed to load '" in ln]
        why = (models or errors[-1:] or [""])[0]
        why = why.split('] "', 1)[-1].rstrip('"')  # drop Triton's "E1203 12:00:00 pid file.cc:1]" prefix
        return f": {why} (log: {self.log_path})" if why else f" (log: {self.log_path})"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (Triton unloads the models and exits), SIGKILL if it has not exited after `timeout`; then end
        whatever it left behind (stubs it did not stop, their shared memory). Returns the server's exit code."""
        if self.process.poll() is None:
            self.shm |= {s.shm for s in processes.stubs(self.pid).values()}  # named while they can still be read
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver %d did not stop in %.0f s: killing it", self.pid, timeout)
        return self.kill()

    def kill(self) -> int:
        """SIGKILL the server and every process of its group at once, remove their shared memory; the exit code."""
        if self.process.poll() is None:
            self.shm |= {s.shm for s in processes.stubs(self.pid).values()}
        left = processes.end_group(self.pid, self.shm)  # the server leads its own process group
        if left["killed"] or left["shm_removed"]:
            log.info("ended after tritonserver %d: processes %s, shared memory %s", self.pid, left["killed"],
                     left["shm_removed"])
        self.left_behind = left
        return self.process.wait()

    def pending(self) -> int | None:
        """Requests queued or running in the server (Triton's pending-request gauge, every model summed); None when
        its metrics do not answer."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=1) as r:
                lines = r.read().decode(errors="replace").splitlines()
        except (urllib.error.URLError, OSError):
            return None
        values = [ln.rsplit(" ", 1)[-1] for ln in lines if ln.startswith("nv_inference_pending_request_count{")]
        try:
            return int(sum(float(v) for v in values))
        except ValueError:
            return None

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(
    server: ServerCommand,
    repository: str | os.PathLike,
    ports: Ports | None = None,
    host: str = "127.0.0.1",
    log_path: str | os.PathLike | None = None,
    wait: float | None = 120.0,
    extra_args: tuple[str, ...] = (),
    exit_timeout: int = 5,
    die_with_parent: bool = False,
) -> TritonServer:
    """Start tritonserver on `repository`, listening on `host` only; wait until ready unless `wait` is None.

    `exit_timeout`: seconds Triton waits on SIGTERM for open connections and requests in flight before it exits
    (its default is 30). `die_with_parent`: the server gets SIGTERM if the thread that started it dies (even by
    SIGKILL), so a killed `serve` leaves no server behind."""
    repo = Path(repository).resolve()
    if not repo.is_dir():
        raise ServerError(f"model repository '{repo}' is not a directory (write one with `t5compress triton`)")
    ports = ports or Ports()
    argv = [
        str(server.executable), *server.args, f"--model-repository={repo}",
        f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
        f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}",
        "--exit-on-error=true", "--strict-readiness=true",
        f"--exit-timeout-secs={exit_timeout}",
        *extra_args,
    ]
    log.info("starting %s", " ".join(argv))
    out = open_log(log_path) if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(argv, env=server.environ(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,  # Ctrl-C in a terminal reaches us, not the server
                                preexec_fn=_die_with_parent if die_with_parent else None)
    except OSError as e:
        raise ServerError(f"cannot run '{server.executable}': {e.strerror}") from e
    finally:
        if log_path:
            os.close(out)  # the child holds its own copy
    running = TritonServer(proc, ports, host, Path(log_path) if log_path else None)
    if wait is not None:
        running.wait_ready(wait)
    return running


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent thread ends (prctl PR_SET_PDEATHSIG; Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def open_log(path: str | os.PathLike) -> int:
    """A descriptor to write the server log at `path`, emptied; never through a link, never into another's file.

    Log paths often live in shared directories such as /tmp, where another user can plant a symbolic link (or a hard
    link, or a FIFO) at the name: a plain `open(path, "w")` would then overwrite whatever the link points at. Here the
    last path component must not be a symbolic link (O_NOFOLLOW), and an existing file is only reused, emptied, when it
    is a regular file of ours with a single link. A new file gets the umask's mode.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO cannot stall us
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise ServerError(f"refusing to write the server log '{path}': {why}; pass another log file") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise ServerError(f"refusing to write the server log '{path}': it is not a regular file of this user with a "
                          "single link; pass another log file")
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    return fd
