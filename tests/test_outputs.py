"""Nothing lost: an output never overlaps an input (even with --force), one writer per output, kill -9 leaves
nothing a rerun does not clean, and outputs follow the umask. Real CLI runs on a tiny model and export."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from t5compress import artifacts
from t5compress.cli import app
from t5compress.errors import OutputError
from tests.conftest import build_tiny_t5

runner = CliRunner()
CLI = [sys.executable, "-m", "t5compress.cli"]


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with a hash of its bytes: any write, removal or new file shows."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace holding what the stages read: a model dir, an export of it, a data file, a corpus, a recipe."""
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.tasks import make_examples, write_jsonl

    root = tmp_path_factory.mktemp("ws")
    build_tiny_t5(root / "model")
    export(root / "model", ExportConfig(), root / "onnx")
    (root / "data").mkdir()
    write_jsonl(root / "data" / "train.jsonl", make_examples(40, seed=0))
    (root / "corpus.txt").write_text("".join(f"document number {i} about t5.\n" for i in range(50)))
    (root / "recipes").mkdir()
    (root / "recipes" / "r.yaml").write_text(json.dumps({
        "name": "r", "out": str(root), "stages": {"model": {"stage": "load", "model": str(root / "model")}}}))
    return root


# command → (args with {m} model, {e} export, {d} data file, {c} corpus, {o} out; which input the out is set against)
COMMANDS = {
    "create": ("create t5-efficient-tiny {o} --text {d}", "d"),
    "pretrain": ("pretrain {c} {o} --tokenizer byte --max-steps 1", "c"),
    "train": ("train {m} {d} {o} --max-steps 1", "m"),
    "train-data": ("train {m} {d} {o} --max-steps 1", "d"),
    "qat": ("qat {m} {d} {o} --max-steps 1", "m"),
    "prune": ("prune {m} {o} --calib-data {d} --heads 0.5", "m"),
    "recover": ("recover {m} {o} --data {d}", "m"),
    "export": ("export {m} {o}", "m"),
    "export-ts": ("export {m} {o} --torchscript", "m"),
    "quantize": ("quantize {e} {o} --dynamic", "e"),
    "quantize-calib": ("quantize {e} {o} --calib-data {d}", "d"),
    "triton": ("triton {e} {o}", "e"),
    "bench": ("bench {e} --out {o} --data {d}", "e"),
}
WHERE = {"same": "is the input", "above": "contains the input", "inside": "is inside the input"}


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_output_that_overlaps_an_input_is_refused_before_any_work(ws, command, where, force):
    template, against = COMMANDS[command]
    paths = {"m": ws / "model", "e": ws / "onnx", "d": ws / "data" / "train.jsonl", "c": ws / "corpus.txt"}
    src = paths[against]
    out = {"same": src, "above": src.parent, "inside": src / "sub"}[where]
    args = template.format(**{k: str(v) for k, v in paths.items()}, o=str(out)).split() + (["--force"] * force)
    before = _snapshot(ws)
    result = runner.invoke(app, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and WHERE[where] in lines[0] and "Traceback" not in result.output, result.output
    assert _snapshot(ws) == before  # nothing changed, nothing written, no lock or temporary left


@pytest.mark.parametrize("where", ["stage dir is the model", "stage dir holds the recipe"])
def test_a_recipe_stage_dir_that_overlaps_a_user_file_is_refused_even_with_force(ws, where):
    recipe = ws / "recipes" / "r.yaml"
    if where == "stage dir holds the recipe":  # stage id `recipes` under out = ws: OUT/recipes is the recipe's dir
        doc = {"name": "r", "out": str(ws), "stages": {"recipes": {"stage": "load", "model": str(ws / "model")}}}
        recipe = ws / "recipes" / "r2.yaml"
        recipe.write_text(json.dumps(doc))
    before = _snapshot(ws)
    result = runner.invoke(app, ["run", str(recipe), "--force"])
    assert result.exit_code == 2, result.output
    assert "input" in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert _snapshot(ws) == before


def test_an_output_beside_the_input_is_still_fine(ws, tmp_path):
    out = tmp_path / "copy"
    result = runner.invoke(app, ["triton", str(ws / "onnx"), str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "t5compress.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # the lock file went with the run


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_writers_of_one_output_one_wins_the_other_gets_one_line(ws, tmp_path):
    out = tmp_path / "X"
    first = _cli("export", str(ws / "model"), str(out), "--decoders", "merged")
    _wait_for(artifacts.lock_file(out), first)  # the first run holds OUT now
    second = _cli("export", str(ws / "model"), str(out), "--torchscript")
    _, err2 = second.communicate(timeout=120)
    _, err1 = first.communicate(timeout=120)
    assert first.returncode == 0, err1
    assert second.returncode == 2 and "being written by another t5compress run" in err2, err2
    assert len(err2.strip().splitlines()) == 1 and "Traceback" not in err2
    meta = json.loads((out / "t5compress.json").read_text())
    assert meta["config"]["format"] == "onnx" and meta["config"]["decoders"] == "merged"  # the winner's, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X"]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["locked", "staging", "graph written"])
def test_kill_9_at_any_point_then_a_rerun_cleans_up_and_succeeds(ws, tmp_path, point):
    out = tmp_path / "X"
    run = _cli("export", str(ws / "model"), str(out))
    _wait_for(artifacts.lock_file(out), run)
    if point != "locked":
        deadline = time.monotonic() + 60
        while True:
            tmps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            if tmps and (point == "staging" or any(tmps[0].glob("*.onnx"))):
                break
            assert run.poll() is None and time.monotonic() < deadline, "the run finished before it could be killed"
            time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert not out.exists()  # never a half-written OUT
    debris = sorted(p.name for p in tmp_path.iterdir())
    rerun = subprocess.run([*CLI, "export", str(ws / "model"), str(out)], capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr
    if any(name.endswith(".tmp") for name in debris):
        assert "left beside" in rerun.stderr and "by an interrupted run" in rerun.stderr, rerun.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X"]  # debris and stale lock gone
    assert json.loads((out / "report.json").read_text())["stage"] == "export"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_output_file_follows_the_umask(ws, tmp_path, umask):
    old = os.umask(umask)
    try:
        result = runner.invoke(app, ["create", "t5-efficient-tiny", str(tmp_path / "m"), "--tokenizer", "byte"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_a_held_claim_refuses_a_second_writer_and_a_dead_one_is_taken_over(tmp_path):
    out = tmp_path / "o"
    code = ("import sys, time; from t5compress import artifacts; artifacts.check_output(sys.argv[1], False); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputError, match=rf"being written by another t5compress run \(pid {holder.pid}\)"):
            artifacts.check_output(out, force=True)
    finally:
        holder.kill()
        holder.wait()
    assert artifacts.lock_file(out).exists()  # what kill -9 leaves: a lock file nobody holds
    (tmp_path / ".o.abcd1234.tmp").mkdir()  # and the temporaries of the killed run
    (tmp_path / ".o.abcd1234.tmp.old").mkdir()
    (tmp_path / ".o2.abcd1234.tmp").mkdir()  # another output's: not ours to remove
    with artifacts.staged_output(out) as tmp:
        (tmp / "f").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o2.abcd1234.tmp", "o"]


def test_only_rank_0_of_a_distributed_run_claims_the_output(tmp_path, monkeypatch):
    out = tmp_path / "o"
    code = ("import sys, time; from t5compress import artifacts; artifacts.check_output(sys.argv[1], False); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # rank 0 (no RANK set) holds it
        monkeypatch.setenv("RANK", "1")  # another rank of the same run: it writes nothing, so it needs no claim
        assert artifacts.check_output(out, force=False) == out
        assert artifacts.lock_file(out).read_text() == str(holder.pid)  # still rank 0's claim, untouched
    finally:
        holder.kill()
        holder.wait()


def test_the_final_rename_refuses_an_output_that_appeared_meanwhile(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(OutputError, match="appeared while this run was writing it"):
        with artifacts.staged_output(out) as tmp:
            (tmp / "mine").write_text("x")
            out.mkdir()  # another program (not t5compress: it would have waited for the lock) made it
            (out / "theirs").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
