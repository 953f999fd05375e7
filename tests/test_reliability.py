"""Reliability, second pass: what `kill PID`, a full disk, a second recipe run and mismatched files do. Real CLI runs
in subprocesses (real signals, a real file-size limit) on a tiny model: rc != 0, one line naming the problem, no
traceback, and nothing half-written left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import build_tiny_t5

CLI = [sys.executable, "-m", "t5compress.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "T5COMPRESS_PROGRESS": "off"}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """What the stages read: a tiny model dir, its ONNX export and a small data file."""
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.tasks import make_examples, write_jsonl

    root = tmp_path_factory.mktemp("ws")
    build_tiny_t5(root / "model")
    export(root / "model", ExportConfig(), root / "onnx")
    write_jsonl(root / "train.jsonl", make_examples(40, seed=0))
    return root


def _args(template: str, ws: Path, out: Path) -> list[str]:
    return template.format(m=ws / "model", e=ws / "onnx", d=ws / "train.jsonl", o=out).split()


def _start(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            **kwargs)


def _wait_for(root: Path, pattern: str, proc: subprocess.Popen, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not list(root.glob(pattern)):
        assert proc.poll() is None, ("the run ended before it could be signalled", proc.communicate())
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.01)


def _one_line(stderr: str, needle: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and needle in lines[0], (needle, stderr)
    return lines[0]


# --- 1. SIGTERM takes Ctrl-C's path ---------------------------------------------------------------------------------

# (id, command with {m} model, {e} export, {d} data, {o} out; the path under OUT's parent that shows the stage is at
# work; what may stay after the signal)
TERMINATED = [
    ("export-staging", "export {m} {o}", ".out.*.tmp/*", []),
    ("quantize-calibrating", "quantize {e} {o} --calib-data {d} --samples 32 --min-agreement 0",
     ".quantize.*/.owner", []),
    ("prune-claimed", "prune {m} {o} --calib-data {d} --heads 0.5", ".out.lock", []),
    # training keeps OUT.partial for --resume, as on Ctrl-C; before its first checkpoint a plain rerun starts over
    ("train-before-first-checkpoint", "train {m} {d} {o} --max-steps 400 --save-every 1000 --eval-every 1000",
     "out.partial/run.json", ["out.partial"]),
]


@pytest.mark.parametrize("name, template, at_work, kept", TERMINATED, ids=[t[0] for t in TERMINATED])
def test_sigterm_mid_stage_is_ctrl_c(ws, tmp_path, name, template, at_work, kept):
    out = tmp_path / "out"
    proc = _start(_args(template, ws, out))
    _wait_for(tmp_path, at_work, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, err)
    _one_line(err, "interrupted (SIGTERM)")
    assert sorted(p.name for p in tmp_path.iterdir()) == kept  # no lock, no temporary sibling, no scratch dir
    if kept:  # what stays is not a dead end: the plain rerun starts over
        rerun = subprocess.run([*CLI, *_args(template.replace("400", "2"), ws, out)], capture_output=True, text=True,
                               env=ENV, timeout=180)
        assert rerun.returncode == 0, rerun.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_quantize_leaves_scratch_that_the_next_run_beside_it_removes(ws, tmp_path):
    proc = _start(_args("quantize {e} {o} --calib-data {d} --samples 32 --min-agreement 0", ws, tmp_path / "a"))
    _wait_for(tmp_path, ".quantize.*/.owner", proc)
    proc.kill()
    proc.wait()
    scratch = list(tmp_path.glob(".quantize.*"))
    assert scratch  # what kill -9 leaves; the next quantize into another OUT in the same folder removes it
    done = subprocess.run([*CLI, *_args("quantize {e} {o} --dynamic --min-agreement 0", ws, tmp_path / "b")],
                          capture_output=True, text=True, env=ENV, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "scratch dir(s) left" in done.stderr and "by a killed run" in done.stderr, done.stderr
    assert not any(p.exists() for p in scratch)
    assert not list(tmp_path.glob(".quantize.*"))


def test_a_live_runs_scratch_is_not_touched(tmp_path):
    from t5compress import artifacts

    code = ("import sys, time; from t5compress import artifacts\n"
            "with artifacts.scratch_dir(sys.argv[1], '.quantize.') as d:\n"
            "    print(d, flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        theirs = Path(holder.stdout.readline().strip())
        with artifacts.scratch_dir(tmp_path, ".quantize.") as mine:
            assert theirs.is_dir() and mine.is_dir() and mine != theirs
        assert theirs.is_dir() and not mine.exists()
    finally:
        holder.kill()
        holder.wait()
