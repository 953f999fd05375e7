"""A running tritonserver's processes, read from /proc: its python backend stubs, whether they live, and what to clean.

    stubs(server_pid)          # {pid: Stub(model, shm)} of every python backend stub the server started
    state(pid)                 # 'running', 'sleeping', 'zombie' (dead, not reaped) ... or 'gone'
    end_group(server_pid)      # SIGKILL whatever is left of the server's process group; unlink its stubs' shm

Measured with the server of nvidia-pytriton 0.7 (Triton 2.51): a stub that dies (kill -9, the OOM killer) is never
reaped nor restarted, and the server goes on answering ready while every request to that model fails with "Stub
process ... is not healthy"; after the server's exit timeout it exits without stopping its stubs, which then ignore
SIGTERM and keep their /dev/shm region. The stubs stay in the server's process group (`start` makes the server a
session leader), which is how they are found and ended here. Linux only, as the server is.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

STUB = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
STATES = {"R": "running", "S": "sleeping", "D": "disk sleep", "Z": "zombie", "T": "stopped", "X": "dead",
          "I": "idle"}


@dataclass(frozen=True)
class Stub:
    """One python backend stub: the model it serves and its shared-memory region's name."""

    model: str
    shm: str


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def state(pid: int) -> str:
    fields = _stat(pid)
    return "gone" if fields is None else STATES.get(fields[0], fields[0])


def alive(pid: int) -> bool:
    return state(pid) not in ("gone", "zombie", "dead")


def how_it_ended(pid: int) -> str:
    """'killed by signal 9 (SIGKILL)' or 'exited with code N' for a zombie; 'is gone' once reaped, 'is running',
    'is sleeping' ... while it lives."""
    fields = _stat(pid)
    if fields is None or len(fields) < 50:
        return "is gone"
    if fields[0] != "Z":
        return f"is {STATES.get(fields[0], fields[0])}"
    status = int(fields[49])  # field 52 of stat: the exit status as waitpid(2) gives it
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by signal {sig} ({signal.Signals(sig).name})"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def _all() -> dict[int, list[str]]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (fields := _stat(int(d.name))) is not None:
            out[int(d.name)] = fields
    return out


def tree(root: int) -> list[int]:
    """`root` and every process below it (the server and its python backend stubs)."""
    parents = {pid: int(f[1]) for pid, f in _all().items()}
    found, grew = [root], True
    while grew:
        new = [p for p, pp in parents.items() if pp in found and p not in found]
        found += new
        grew = bool(new)
    return found


def group(pgid: int) -> list[int]:
    """Every live process whose process group is `pgid` (a server started as a session leader: itself and its
    stubs, orphaned or not)."""
    return [pid for pid, f in _all().items() if int(f[3]) == pgid and f[0] not in "ZX"]


def stub_of(pid: int) -> Stub | None:
    """The stub at `pid`: its command line names the model file (<repo>/<model>/<version>/model.py), then the
    shared-memory region."""
    args = cmdline(pid)
    if len(args) < 3 or not args[0].endswith(STUB):
        return None
    return Stub(Path(args[1]).parent.parent.name, args[2])


def stubs(server_pid: int) -> dict[int, Stub]:
    """pid -> Stub for every python backend stub below the server."""
    return {p: s for p in tree(server_pid)[1:] if (s := stub_of(p)) is not None}


def end_group(pgid: int, shm_names: set[str] = frozenset()) -> dict:
    """SIGKILL every process left in the group `pgid`, and unlink the /dev/shm regions in `shm_names` (and those of
    the stubs found) that are still there and ours. Returns what it ended and removed."""
    left = group(pgid)
    names = set(shm_names) | {s.shm for p in left if (s := stub_of(p)) is not None}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    removed = []
    for name in sorted(names):
        path = SHM_DIR / name
        try:
            if "/" not in name and path.lstat().st_uid == os.geteuid():
                path.unlink()
                removed.append(name)
        except OSError:  # gone already, or not ours
            pass
    return {"killed": left, "shm_removed": removed}
