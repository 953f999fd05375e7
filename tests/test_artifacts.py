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


def test_the_envelope_claims_writes_meta_and_report_and_renames(tmp_path):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        lr: float = 0.1

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    with artifacts.envelope("train", src, Cfg(), out) as env:  # claimed at once: a second writer is refused
        assert artifacts.lock_file(out).exists() and env.out == out
        with pytest.raises(OutputError, match="is the input"):
            with artifacts.envelope("train", src, Cfg(), src):
                pass
        report = env.write({"stage": "train", "seconds": env.seconds()}, lambda tmp: (tmp / "w").write_text("x"))
    assert not artifacts.lock_file(out).exists()  # released when the block ends, not at process exit
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "t5compress.json", "w"]
    assert json.loads((out / "report.json").read_text()) == report
    meta = json.loads((out / "t5compress.json").read_text())
    assert (meta["stage"], meta["config"], meta["parent"]["path"]) == ("train", {"lr": 0.1}, str(src.resolve()))

    with pytest.raises(OutputError, match="already exists; pass --force"):
        with artifacts.envelope("train", src, Cfg(), out):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with artifacts.envelope("x", None, Cfg(), out, force=True, record={"mine": 1}) as env:
            with env.staging() as tmp:
                (tmp / "half").write_text("y")
                raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # old output intact, no temporaries, no lock
    with pytest.raises(RuntimeError, match="set no report"):
        with artifacts.envelope("x", None, Cfg(), out, force=True) as env, env.staging():
            pass
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "t5compress.json", "w"]


def test_an_envelope_without_out_claims_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with artifacts.envelope("serve", "repo", {"port": 1}, None, record={"port": 1}) as env:
        assert env.write({"stage": "serve"}) == {"stage": "serve"}
    assert list(tmp_path.iterdir()) == []
