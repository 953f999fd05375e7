import json
import os
import stat

import pytest

from t5compress import artifacts
from t5compress.errors import OutputError


def test_staged_output_renames_on_success_and_leaves_nothing_on_error(tmp_path):
    out = tmp_path / "out"
    with artifacts.staged_output(out) as tmp:
        (tmp / "a.txt").write_text("x")
        assert not out.exists()
    assert (out / "a.txt").read_text() == "x"

    with pytest.raises(OutputError, match="already exists; pass --force"):
        with artifacts.staged_output(out):
            pass

    with pytest.raises(RuntimeError):
        with artifacts.staged_output(out, force=True) as tmp:
            (tmp / "b.txt").write_text("y")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # old output intact, no temp dir left
    assert (out / "a.txt").read_text() == "x" and not (out / "b.txt").exists()

    with artifacts.staged_output(out, force=True) as tmp:
        (tmp / "b.txt").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]


def test_meta_records_parent_hash_and_stage(tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "w").write_bytes(b"123")
    artifacts.write_meta(parent, "create", {"a": 1}, parent=None)
    child = tmp_path / "child"
    child.mkdir()
    meta = artifacts.write_meta(child, "train", {"lr": 0.1}, parent=parent)
    assert meta["parent"]["sha256"] == artifacts.dir_hash(parent)
    assert meta["parent"]["stage"] == "create"
    assert json.loads((child / "t5compress.json").read_text())["config"] == {"lr": 0.1}
    (parent / "w").write_bytes(b"124")
    assert artifacts.dir_hash(parent) != meta["parent"]["sha256"]


def test_outputs_get_normal_directory_permissions(tmp_path):
    with artifacts.staged_output(tmp_path / "o") as tmp:
        (tmp / "f").write_text("x")
    assert (tmp_path / "o").stat().st_mode & 0o755 == 0o755


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_write_json_and_meta_get_the_umask_permissions_not_mkstemps_0600(tmp_path, umask):
    old = os.umask(umask)
    try:
        with artifacts.staged_output(tmp_path / "o") as tmp:
            artifacts.write_json(tmp / "graphs.json", {"a": 1})
            artifacts.write_report(tmp, {"stage": "x"})
            artifacts.write_meta(tmp, "x", {}, parent=None)
            (tmp / "plain.txt").write_text("x")  # what open() gives: the reference
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "o").iterdir()}
    assert modes == dict.fromkeys(["graphs.json", "report.json", "t5compress.json", "plain.txt"], 0o666 & ~umask)
    assert stat.S_IMODE((tmp_path / "o").stat().st_mode) == 0o777 & ~umask
