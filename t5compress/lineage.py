"""The source checkpoint of a directory: the safetensors an export (or its int8 child) was made from, and its bytes.

Sizes are worth most against what a user started from: `info` and `bench` give an export dir's bytes against its
source's `model.safetensors`, not only against our own fp32 export. The export stage records the source in its
report (`source`), quantize hands it on, so the comparison survives the source dir being moved; dirs made before
that are followed up their `t5compress.json` parents while those exist.
"""

from __future__ import annotations

import os
from pathlib import Path

from t5compress.artifacts import META_FILE, REPORT_FILE, read_json

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def checkpoint_bytes(path: str | os.PathLike) -> int | None:
    """Bytes of the dir's safetensors weights (one file, or the shards its index names); None without them."""
    p = Path(path)
    if (p / SAFETENSORS).is_file():
        return (p / SAFETENSORS).stat().st_size
    index = read_json(p / INDEX) if (p / INDEX).is_file() else None
    if not index:
        return None
    shards = sorted(set((index.get("weight_map") or {}).values()))
    return sum((p / s).stat().st_size for s in shards if (p / s).is_file()) or None


def source_checkpoint(path: str | os.PathLike, limit: int = 12) -> dict | None:
    """{'path', 'safetensors_bytes'} of the checkpoint `path` was made from (itself when it is a model dir), read
    from the reports and lineage; None when no safetensors checkpoint is known (a hub id, a foreign dir)."""
    p = Path(path)
    for _ in range(limit):
        size = checkpoint_bytes(p)
        if size is not None:
            return {"path": str(p.resolve()), "safetensors_bytes": size}
        report = _json(p / REPORT_FILE) or {}
        recorded = report.get("source") or (report.get("size") or {}).get("source")  # export's; quantize's
        if isinstance(recorded, dict) and recorded.get("safetensors_bytes"):
            return {"path": recorded.get("path"), "safetensors_bytes": int(recorded["safetensors_bytes"])}
        parent = ((_json(p / META_FILE) or {}).get("parent") or {}).get("path")
        if not parent or not Path(parent).is_dir():
            return None
        p = Path(parent)
    return None


def vs_source(size: int, source: dict | None, what: str = "bytes vs checkpoint") -> list[tuple[str, str]]:
    """The row giving `size` in bytes against the source checkpoint's safetensors (none when it is not known)."""
    if not source or not source.get("safetensors_bytes"):
        return []
    st = source["safetensors_bytes"]
    return [(what, f"{size:,} bytes, {size / st:.3f}x the source's model.safetensors ({st:,} bytes)")]


def _json(path: Path) -> dict | None:
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
