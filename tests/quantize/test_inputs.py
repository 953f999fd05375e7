"""Quantizing never writes into the export dir it reads: ONNX Runtime's quantizer writes `<graph>-inferred.onnx` beside
the graph it is given, onnx-neural-compressor `<graph>_augment.onnx` and its weights, so they are given copies in the
stage's scratch dir. Real runs on the tiny exports; Python's audit events (what opens, removes or renames a path in
the dir) and the dir's listing, bytes and times before and after. We run as root: a read-only dir would not stop a
write, so the test watches instead."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from t5compress.quantize import QuantizeConfig, run

_watch: dict = {}  # while a test watches: the dir, its names before the run, and what touched it


def _audit(event: str, args: tuple) -> None:
    if not _watch:
        return
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
        paths = [path]
    elif event in ("shutil.copyfile", "os.link", "os.symlink"):
        paths, writes = [args[1]], True  # the destination
    elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.truncate", "os.chmod", "os.utime"):
        paths, writes = list(args[:2]) if event == "os.rename" else [args[0]], True
    else:
        return
    for p in paths:
        if not isinstance(p, (str, bytes, os.PathLike)):
            continue  # a file descriptor: opened by path first
        p = Path(os.path.realpath(os.fsdecode(p)))
        if p.parent == _watch["dir"] or p == _watch["dir"]:
            if writes or p.name not in _watch["names"]:  # reading a new name: something else made it there
                _watch["events"].append((event, p.name))


sys.addaudithook(_audit)  # for the rest of the process (a hook cannot be removed): a no-op while nothing is watched


def snapshot(d: Path) -> dict:
    """Every entry of `d`: size, modification time and sha256 of its bytes; and the dir's own time, which any entry
    made or removed in it changes."""
    out: dict = {".": d.stat().st_mtime_ns}
    for f in sorted(d.iterdir()):
        st = f.stat()
        out[f.name] = (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest())
    return out


def watched_run(src: Path, *args, **kwargs) -> tuple[dict, list, dict, dict]:
    """`run(src, ...)` while watching `src`: its report, the audit events on `src`, and its snapshot before and
    after."""
    before = snapshot(src)
    _watch.update(dir=Path(os.path.realpath(src)), names=set(before), events=[])
    try:
        report = run(src, *args, **kwargs)
    finally:
        events = _watch["events"]
        _watch.clear()
    return report, events, before, snapshot(src)


# dynamic on the gated export: each graph is quantized straight from the dir (no tied table to untie); static on
# the relu one: its encoder is (its decoders are untied into scratch first); block-wise never calls ONNX Runtime's
# quantizer
CASES = [("dynamic", "gated_export", {}), ("static", "tiny_export", {"samples": 16}),
         ("blockwise", "gated_export", {})]


@pytest.mark.parametrize("mode, export, extra", CASES, ids=[c[0] for c in CASES])
def test_quantize_writes_nothing_into_the_export_dir(mode, export, extra, demo_jsonl, tmp_path, request):
    src = request.getfixturevalue(export)
    calib = {"calib_data": str(demo_jsonl)} if mode == "static" else {}
    cfg = QuantizeConfig(mode=mode, min_agreement=0.0, **calib, **extra)
    _, events, before, after = watched_run(src, cfg, tmp_path / "int8", progress=False)
    assert events == []
    assert after == before
    assert (tmp_path / "int8" / "encoder_model.onnx").is_file()
