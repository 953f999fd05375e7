"""The directory contract shared by every stage: atomic outputs, lineage (`t5compress.json`) and `report.json`.

Every stage reads one directory and writes a new one. The new one is built in a temporary sibling and renamed into
place only when the stage succeeded, so an interrupted or failed run never leaves a half-written output.

A stage's `run` is only its own work inside the envelope, which claims `out` (or refuses it), times the run, writes
t5compress.json and report.json into a temporary sibling and renames it into place:

    with artifacts.envelope("quantize", src, cfg, out, force=force) as env:  # claims `out`, or raises OutputError
        graphs = quantize_graphs(src, cfg)                                    # the stage's own work
        return env.write({"stage": "quantize", "seconds": env.seconds()}, lambda tmp: graphs.save(tmp))

A stage whose report describes the files it wrote fills `with env.staging() as tmp:` and sets `env.report` last.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from t5compress import __version__
from t5compress.config import INPUT_FIELDS
from t5compress.errors import OutputError

META_FILE = "t5compress.json"
Report = dict  # what a stage returns and writes as report.json
REPORT_FILE = "report.json"

log = logging.getLogger(__name__)
T = TypeVar("T")


def check_output(out: str | os.PathLike, force: bool, inputs: Iterable[Any] = ()) -> Path:
    """Claim `out` for this run, before any heavy work: refuse it when it overlaps an input (whatever `force` says),
    when another run is writing it, or when it exists without `force`; then remove what killed runs left beside it.

    `inputs` are everything the stage reads (model dirs, data and calibration files, configs: any string in them that
    names an existing path counts). A symbolic link OUT means its target (see `_followed`), which is returned. The
    claim is a lock on `out` held until `staged_output` ends, the stage returns or raises (`envelope`), or the process
    exits, so two runs writing one `out` cannot both succeed.
    """
    out = _followed(Path(out))
    refuse_overlap(out, inputs)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output '{out}' exists and is not a directory; remove it or choose another path")
    parent = out.resolve().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write to '{parent}': permission denied; choose another output path")
    _lock(out)
    if out.exists() and not force:
        _unlock(out)
        raise OutputError(f"output '{out}' already exists; pass --force to replace it")
    _remove_stale_temporaries(out)
    return out


def _followed(out: Path) -> Path:
    """The directory a symbolic link OUT names: the run claims, stages beside and replaces the link's target (on the
    target's file system), and the link keeps naming the result. A link to nothing is refused: it is often a volume
    that is not mounted, and writing it would fill the disk beneath the mount point."""
    if not out.is_symlink():
        return out
    target = Path(os.path.realpath(out))
    if not target.exists():
        raise OutputError(f"output '{out}' is a symbolic link to '{os.readlink(out)}', which does not exist (a volume "
                          "not mounted?); create the target directory or give its path as the output")
    return target


def refuse_overlap(out: str | os.PathLike, inputs: Iterable[Any]) -> None:
    """Raise if `out` is, contains or lies inside an existing input path: writing it would change or delete what the
    stage reads. `inputs` may hold paths, hub ids or whole config dataclasses (their strings are looked at)."""
    target = Path(out).resolve()
    for name in strings_in(list(inputs)):
        if not name.strip():
            continue  # an empty setting (no prefix, say) is not the current directory
        try:
            p = Path(name)
            if not p.exists():
                continue  # a hub id, a dataset name, or a missing file the stage itself reports
            src = p.resolve()
        except (OSError, ValueError):
            continue
        if src == target:
            raise OutputError(f"output '{out}' is the input '{name}'; a stage never writes over what it reads: "
                              "choose another output path")
        if target in src.parents:
            raise OutputError(f"output '{out}' contains the input '{name}' (replacing it would delete the input); "
                              "choose an output outside it")
        if src in target.parents:
            raise OutputError(f"output '{out}' is inside the input '{name}'; an input is never changed: choose an "
                              "output outside it")


def strings_in(obj: Any) -> list[str]:
    """Every string in `obj` that may name a path: paths, strings, lists, dicts, and the values of the INPUT_FIELDS of
    (nested) config dataclasses (a config's other strings are choices, such as `weight_range: full`)."""
    if isinstance(obj, os.PathLike):
        return [os.fspath(obj)]
    if isinstance(obj, str):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name in INPUT_FIELDS]
        nested = [v for f in dataclasses.fields(obj) if dataclasses.is_dataclass(v := getattr(obj, f.name))]
        obj = values + nested
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple, set)):
        return [s for v in obj for s in strings_in(v)]
    return []


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, force: bool = False, inputs: Iterable[Any] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` on success, delete it on any error.

    The finished files get the permissions the umask gives (libraries such as safetensors write 0600), and the
    rename refuses an `out` that appeared meanwhile unless `force`. The claim on `out` is released at the end.
    """
    out = check_output(out, force, inputs)
    try:
        try:
            out.resolve().parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.resolve().parent))
        except OSError as e:
            raise OutputError(f"cannot create output '{out}': {e.strerror}") from e
        try:
            yield tmp
            follow_umask(tmp)
            if out.exists() and not force:
                raise OutputError(f"output '{out}' appeared while this run was writing it; nothing was replaced: "
                                  "pass --force or choose another path")
            replace_dir(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        _unlock(out)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory `tmp` to `final`; an existing `final` is swapped out by rename, then deleted."""
    if final.exists():
        old = tmp.with_name(tmp.name + ".old")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def follow_umask(root: Path) -> None:
    """Give `root` and everything under it the permissions open()/mkdir() would have: 0666/0777 minus the umask."""
    mask = _umask()
    for p in (root, *root.rglob("*")):
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        full = 0o777 if p.is_dir() or mode & 0o111 else 0o666
        p.chmod(full & ~mask)


# --- the claim on an output: a lock file beside it ------------------------------------------------------------------
# flock is released by the kernel when its holder dies, so a lock left by kill -9 is recognised as stale by simply
# acquiring it. `_held` makes the claim re-entrant within one process (a stage checks early and stages later).

_held: dict[Path, tuple[int, int]] = {}  # lock file -> (fd, pid of the holder)


def lock_file(out: Path) -> Path:
    return out.resolve().parent / f".{out.name}.lock"


def _lock(out: Path) -> None:
    path = lock_file(out)
    if path in _held or int(os.environ.get("RANK", "0") or 0) != 0:
        return  # under `accelerate launch` / torchrun only rank 0 writes outputs, and it holds the claim
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output '{out}': {e.strerror}") from e
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666 & ~_umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputError(f"output '{out}' is being written by another t5compress run (pid {holder}); wait for "
                              "it to finish or choose another path") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and our lock: take the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[path] = (fd, os.getpid())


def _unlock(out: Path) -> None:
    _release(lock_file(out))


def _release(path: Path) -> None:
    fd, pid = _held.pop(path, (None, None))
    if fd is None:
        return
    if pid == os.getpid():  # a forked child must not remove its parent's lock
        with contextlib.suppress(OSError):
            os.unlink(path)
    os.close(fd)


@contextlib.contextmanager
def claim(tree: str | os.PathLike) -> Iterator[Path]:
    """Hold the claim on `tree` (a directory a whole run writes, such as a recipe's OUT) for the block: another run
    claiming it, or writing it as one stage's output, is refused in one line. Re-entrant within the process."""
    tree = Path(tree)
    with _claims_end_here():
        _lock(tree)
        yield tree


@contextlib.contextmanager
def _claims_end_here() -> Iterator[None]:
    """Release the claims taken inside the block when it ends, rather than at process exit."""
    before = set(_held)
    try:
        yield
    finally:
        for path in set(_held) - before:
            _release(path)


@atexit.register
def _release_all() -> None:
    for path in list(_held):
        _release(path)


def _remove_stale_temporaries(out: Path) -> None:
    """Remove `.OUT.XXXXXXXX.tmp` siblings: with the claim held, only a killed run can have left them."""
    parent = out.resolve().parent
    if not parent.is_dir():
        return
    pattern = re.compile(re.escape(f".{out.name}.") + r"[a-z0-9_]{8}\.tmp(\.old)?")
    stale = [p for p in parent.iterdir() if pattern.fullmatch(p.name)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    if stale:
        log.warning("removed %d temporary dir(s) left beside '%s' by an interrupted run: %s", len(stale), out,
                    ", ".join(p.name for p in stale))


# --- scratch dirs: owned by a live process, or removable -------------------------------------------------------------
# A stage's scratch (quantize's augmented calibration graphs: gigabytes at t5-base) lives beside its output, on the
# same file system. A lock inside names its owner; a later run removes every scratch dir whose lock nobody holds, the
# debris of a kill -9 (Ctrl-C and SIGTERM unwind through the `with` and remove their own).

SCRATCH_OWNER = ".owner"


@contextlib.contextmanager
def scratch_dir(near: str | os.PathLike, prefix: str) -> Iterator[Path]:
    """A new folder `near/PREFIXXXXXXXXX`, removed when the block ends; first removes the `prefix` folders there
    whose owner died."""
    near = Path(near)
    _remove_orphaned_scratch(near, prefix)
    # made under another name and renamed once its owner holds the lock: a folder of the pattern always has one
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}new.", dir=near))
    fd = os.open(path / SCRATCH_OWNER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else can hold it
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        path = path.rename(near / f"{prefix}{path.name[-8:]}")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # still locked while it goes, so no other run touches it
        os.close(fd)


def _remove_orphaned_scratch(near: Path, prefix: str) -> None:
    pattern = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}")
    removed = []
    for p in near.iterdir() if near.is_dir() else ():
        if not (pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()):
            continue
        try:  # no owner file: made by an older version, which may still be running; not ours to judge
            fd = os.open(p / SCRATCH_OWNER, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its owner is alive
        shutil.rmtree(p, ignore_errors=True)
        os.close(fd)
        removed.append(p.name)
    if removed:
        log.warning("removed %d scratch dir(s) left in '%s' by a killed run: %s", len(removed), near,
                    ", ".join(removed))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (temporary file in the same directory, then rename), with the umask's permissions."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600; an output dir is often copied into a container and read by another user, so the file
        # gets what open() would have given it (0666 minus the umask), like every other file in the dir.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=_json_default)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: str | os.PathLike) -> dict | None:
    path = Path(path)
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def dir_hash(path: str | os.PathLike) -> str:
    """Content hash of a directory: sha256 over relative file names and bytes, in sorted order."""
    root = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(root)).encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def write_meta(out: Path, stage: str, config: Any, parent: str | os.PathLike | None) -> dict:
    """Write `t5compress.json`: which stage made this directory, with which config, from what."""
    parent_info = None
    if parent is not None:
        p = Path(parent)
        parent_info = {"path": str(p.resolve()) if p.exists() else str(parent)}
        if p.is_dir():
            parent_info["sha256"] = dir_hash(p)
            parent_meta = read_json(p / META_FILE)
            if parent_meta:
                parent_info["stage"] = parent_meta.get("stage")
    meta = {
        "stage": stage,
        "t5compress_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "parent": parent_info,
    }
    write_json(out / META_FILE, meta)
    return meta


def trained_input_length(path: str | os.PathLike) -> int | None:
    """The input length a model dir was trained with (`data.max_source_length` in its t5compress.json), if recorded.

    Only a stage that trained on data records it (train, qat, recovery fine-tuning); `create` reads text for its
    tokenizer only, so its data settings say nothing about the model.
    """
    meta = read_json(Path(path) / META_FILE) if Path(path).is_dir() else None
    if not meta or meta.get("stage") == "create":
        return None
    data = (meta.get("config") or {}).get("data") or {}
    value = data.get("max_source_length") if isinstance(data, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


def write_report(out: Path, report: dict) -> None:
    write_json(out / REPORT_FILE, report)


_SRC: Any = object()  # `envelope(parent=...)` default: the lineage's parent is the stage's `src`


class Envelope:
    """One stage run's output, claimed: its temporary sibling, its timing, t5compress.json and report.json."""

    def __init__(self, stage: str, out: Path | None, force: bool, inputs: list, record: Any, parent: Any) -> None:
        self.stage, self.out, self.force, self.inputs = stage, out, force, inputs
        self.record, self.parent = record, parent
        self.report: Report | None = None  # set by the stage before its `staging()` block ends
        self.started = time.perf_counter()

    def seconds(self, ndigits: int = 1) -> float:
        """Seconds since the run claimed its output."""
        return round(time.perf_counter() - self.started, ndigits)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A temporary sibling of `out` for the stage's files; when the block ends, t5compress.json and `self.report`
        (report.json) are written beside them and the sibling is renamed to `out` (deleted on any error)."""
        with staged_output(self.out, self.force, self.inputs) as tmp:
            yield tmp
            if self.report is None:
                raise RuntimeError(f"the {self.stage} stage set no report before its output was written")
            write_meta(tmp, self.stage, self.record, self.parent)
            write_report(tmp, self.report)

    def write(self, report: Report, fill: Callable[[Path], Any] | None = None) -> Report:
        """Write `out` in one go (`fill(tmp)` writes the stage's own files) and return `report`; nothing is written
        when the run has no `out`."""
        self.report = report
        if self.out is not None:
            with self.staging() as tmp:
                if fill is not None:
                    fill(tmp)
        return report


@contextlib.contextmanager
def envelope(stage: str, src: Any, cfg: Any, out: str | os.PathLike | None, *, force: bool = False,
             inputs: Iterable[Any] | None = None, record: Any = None, parent: Any = _SRC) -> Iterator[Envelope]:
    """Claim `out` for the stage `stage` now (before any heavy work), and release it when the block ends.

    Args:
        inputs: what the stage reads, refused as an output (default: `src` and `cfg`).
        record: the config recorded in t5compress.json (default: `cfg` as a dict).
        parent: the input directory recorded as the output's parent (default: `src`).
        out: None for a stage whose output directory is optional (`serve`): nothing is claimed or written.
    """
    inputs = [src, cfg] if inputs is None else list(inputs)
    with _claims_end_here():
        if out is not None:
            out = check_output(out, force, inputs)
        try:
            yield Envelope(stage, out, force, inputs, dataclasses.asdict(cfg) if record is None else record,
                           src if parent is _SRC else parent)
        except BaseException as e:
            _drop_unresumable_workdir(out)
            if out is not None and (full := disk_full(e)) is not None:
                raise OutputError(no_space_message(full, out, inputs)) from e
            raise
        finally:
            _workdirs.pop(out, None)


# --- a full disk: whichever library was writing, one line, nothing half-written ------------------------------------
# Every stage writes inside its envelope, through a temporary sibling (removed on any error) or into a work dir beside
# OUT (kept only when it holds a checkpoint to resume from), so by the time the error reaches the envelope nothing
# half-written is left; what remains is telling the user what happened in terms of space.

_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
         errno.EFBIG: "file size limit reached"}
_FULL_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
              "File too large": errno.EFBIG}


def disk_full(e: BaseException) -> OSError | None:
    """The out-of-space error behind `e`, if that is what `e` is: an OSError (ENOSPC, EDQUOT, or EFBIG from a file
    size limit) anywhere in its chain, or a library's error that only carries the system's message (safetensors'
    SafetensorError, torch's stream writer, a stage's own error quoting it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return e
        for text, code in _FULL_TEXT.items():
            if text in str(e):
                return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


def no_space_message(e: OSError, out: Path, inputs: Iterable[Any]) -> str:
    """"no space left on device writing 'OUT/file' (needed about N MB, M MB free)": what the output would have
    needed is estimated by the size of what the stage read (an output is about as large as its input)."""
    target = _shown(Path(e.filename), out) if isinstance(e.filename, str) else out
    parent = out.resolve().parent
    free = shutil.disk_usage(parent).free if parent.is_dir() else 0
    needed = sum(_size(Path(name)) for name in strings_in(list(inputs)) if name.strip())
    sizes, remedy = [f"needed about {_mb(needed)}" if needed else "", f"{_mb(free)} free"], "free some space"
    if e.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        sizes[1] = f"files are limited to {_mb(limit)}" if limit != resource.RLIM_INFINITY else ""
        remedy = "raise the limit (ulimit -f)"
    detail = ", ".join(x for x in sizes if x)
    return (f"{_FULL[e.errno]} writing '{target}'" + (f" ({detail})" if detail else "")
            + f"; nothing was written: {remedy} or choose another output path")


def _shown(path: Path, out: Path) -> Path:
    """`path` as the user knows it: a file inside the temporary sibling is named as inside OUT."""
    sibling = re.compile(re.escape(f".{out.name}.") + r"[a-z0-9_]{8}\.tmp")
    for parent in path.parents:
        if sibling.fullmatch(parent.name):
            return out / path.relative_to(parent)
    return path


def _size(path: Path) -> int:
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    except (OSError, ValueError):
        pass
    return 0


def _mb(n: int) -> str:
    mb = n / 2**20
    return f"{mb:,.0f} MB" if mb >= 10 else f"{mb:.1f} MB" if mb >= 0.1 else f"{mb:.2f} MB"


# --- a work dir beside OUT (training checkpoints): kept after a failure only when there is something to resume ----

_workdirs: dict[Path, tuple[Path, Callable[[Path], bool]]] = {}  # OUT -> (its work dir, whether that is resumable)


def attach_workdir(out: Path, work: Path, resumable: Callable[[Path], bool]) -> None:
    """Have the envelope of `out` remove `work` if the stage fails (or is interrupted) while `resumable(work)` is
    false: a run stopped before its first checkpoint leaves nothing to resume, so nothing to keep."""
    _workdirs[Path(out)] = (Path(work), resumable)


def _drop_unresumable_workdir(out: Path | None) -> None:
    work, resumable = _workdirs.pop(out, (None, None))
    if work is not None and work.is_dir() and not resumable(work):
        shutil.rmtree(work, ignore_errors=True)
