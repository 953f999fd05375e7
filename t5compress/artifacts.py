"""The directory contract shared by every stage: atomic outputs, lineage (`t5compress.json`) and `report.json`.

Every stage reads one directory and writes a new one. The new one is built in a temporary sibling and renamed into
place only when the stage succeeded, so an interrupted or failed run never leaves a half-written output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from t5compress import __version__
from t5compress.errors import OutputError

META_FILE = "t5compress.json"
REPORT_FILE = "report.json"


def check_output(out: str | os.PathLike, force: bool) -> Path:
    """Fail early (before any heavy work) if `out` cannot be written as a new directory."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"output '{out}' already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output '{out}' exists and is not a directory; remove it or choose another path")
    parent = out.resolve().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write to '{parent}': permission denied; choose another output path")
    return out


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` on success, delete it on any error."""
    out = check_output(out, force)
    try:
        out.resolve().parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.resolve().parent))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; outputs are served by other users (e.g. Triton)
    except OSError as e:
        raise OutputError(f"cannot create output '{out}': {e.strerror}") from e
    try:
        yield tmp
        replace_dir(tmp, out)  # an existing `out` is only reachable with force=True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory `tmp` to `final`; an existing `final` is swapped out by rename, then deleted."""
    if final.exists():
        old = tmp.with_name(tmp.name + ".old")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


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
