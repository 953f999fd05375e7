"""Weights on disk, read in one guarded place: which safetensors files a model dir has, their headers (checked
against the file sizes, so a truncated or foreign file is one line, not a traceback), and their tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

from t5compress.errors import ModelError, first_line


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model dir: model.safetensors, or the shards its index names."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if not index.is_file():
        return [p / "model.safetensors"] if (p / "model.safetensors").exists() else []
    try:
        shards = sorted(set(map(str, json.loads(read_bytes(index)).get("weight_map", {}).values())))
    except (ValueError, AttributeError, TypeError) as e:
        raise ModelError(f"{index.name} in '{p}' is damaged: not a safetensors index ({first_line(e)})") from None
    return [p / s for s in shards]


def weight_headers(path: str | os.PathLike) -> dict[str, dict]:
    """The tensor table of every weights file of a model dir, each file checked against its header (see
    `safetensors_header`): the one place that reads a model dir's weights files before a loader does."""
    headers: dict[str, dict] = {}
    for f in weight_files(path):
        headers.update(safetensors_header(f))
    return headers


def safetensors_header(file: str | os.PathLike) -> dict[str, dict]:
    """The tensor table of a safetensors file ({name: {dtype, shape, data_offsets}}), read without the weights.

    Raises a one-line ModelError when the file cannot be read (naming permission problems as such) or is damaged:
    shorter than its header says (a truncated copy or download), or not a safetensors file at all.
    """
    f = Path(file)
    try:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise _damaged(f, f"{size} bytes, too short to be one")
            n = int.from_bytes(head, "little")
            if not 0 < n <= size - 8:
                raise _damaged(f, f"its header length ({n:,} bytes) does not fit in the file ({size:,} bytes)")
            raw = fh.read(n)
    except OSError as e:
        raise _unreadable(f, e) from None
    try:
        header = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise _damaged(f, f"its header is not JSON ({first_line(e)})") from None
    if not isinstance(header, dict):
        raise _damaged(f, "its header is not a table of tensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise _damaged(f, "its header is not a table of tensors") from None
    if end != size - 8 - n:
        what = "truncated" if end > size - 8 - n else "wrong size"
        raise _damaged(f, f"{what}: its header lists {end:,} bytes of tensor data, the file holds {size - 8 - n:,}")
    return tensors


def _damaged(file: Path, why: str) -> ModelError:
    return ModelError(f"{file.name} in '{file.parent}' is damaged or not a safetensors file: {why}")


def _unreadable(file: Path, e: OSError) -> ModelError:
    why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or first_line(e))
    return ModelError(f"cannot read {file.name} in '{file.parent}': {why}")


def read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise _unreadable(file, e) from None


def load_safetensors(file: str | os.PathLike) -> dict:
    """`safetensors.torch.load_file`, behind the header check: every direct read of a weights file goes here."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = Path(file)
    safetensors_header(f)
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _damaged(f, first_line(e)) from e
