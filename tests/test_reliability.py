"""Reliability, second pass: what `kill PID`, a full disk, a second recipe run and mismatched files do. Real CLI runs
in subprocesses (real signals, a real file-size limit) on a tiny model: rc != 0, one line naming the problem, no
traceback, and nothing half-written left behind."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
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
    # before its first checkpoint a training run has nothing to resume: OUT.partial goes too (after one, it stays)
    ("train-before-first-checkpoint", "train {m} {d} {o} --max-steps 400 --save-every 1000 --eval-every 1000",
     "out.partial/run.json", []),
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
    assert _processes_naming(tmp_path) == []  # no worker left running


def test_sigterm_mid_bench_ends_its_worker_too(ws, tmp_path):
    """SIGTERM reaches the bench only (Ctrl-C reaches its worker too): the worker it was measuring with goes as well,
    rather than measuring on, orphaned, into a removed directory."""
    proc = _start(["--progress", "lines", "--progress-every", "0", *_args("bench {e} --out {o} --data {d}", ws,
                                                                          tmp_path / "out")])
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while not any("cell" in line for line in lines):  # the worker is measuring
        assert proc.poll() is None and time.monotonic() < deadline, lines
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    assert proc.returncode == 143, lines
    _one_line("".join(line for line in lines if not line.startswith("[bench]")), "interrupted (SIGTERM)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert _processes_naming(tmp_path) == []


def _processes_naming(path: Path) -> list[str]:
    """The command lines of running processes that name `path` (a worker the run started, say)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in argv:
            found.append(argv)
    return found


@pytest.mark.parametrize("rerun", [[], ["--resume"]], ids=["plain", "resume"])
def test_a_kill_9_before_the_first_checkpoint_is_no_dead_end(ws, tmp_path, rerun):
    """Both reruns work: the plain one starts over (there is nothing to lose), --resume starts at step 0."""
    train = "train {m} {d} {o} --max-steps 400 --save-every 1000 --eval-every 1000"
    proc = _start(_args(train, ws, tmp_path / "out"))
    _wait_for(tmp_path, "out.partial/run.json", proc)
    proc.kill()
    proc.wait()
    assert (tmp_path / "out.partial").is_dir()
    done = subprocess.run([*CLI, *_args(train.replace("400", "2"), ws, tmp_path / "out"), *rerun],
                          capture_output=True, text=True, env=ENV, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "before its first checkpoint" in done.stderr, done.stderr
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


# --- 2. a full disk: one line, nothing half-written -----------------------------------------------------------------

def _file_size_limit(limit: int):
    """A `preexec_fn` that gives the child a file size limit: a write past it fails with EFBIG, as a full disk fails
    with ENOSPC (Python ignores SIGXFSZ, so the write returns the error instead of killing the process)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _tmpfs(path: Path, size: str):
    """A tmpfs of `size` at `path` (where this machine lets the tests mount one: root in a container usually can)."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield path
    subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """300 kB of disk: less than any stage below writes."""
    yield from _tmpfs(tmp_path / "disk", "300k")


@pytest.fixture
def other_disk(tmp_path):
    """Another file system than tmp_path's, with room."""
    yield from _tmpfs(tmp_path / "other", "50m")


# (id, command; the output of each is at most a few hundred kB: 40 kB of file size or 300 kB of disk stop it)
WRITERS = [
    ("export", "export {m} {o}"),
    ("quantize-dynamic", "quantize {e} {o} --dynamic --min-agreement 0"),
    ("train", "train {m} {d} {o} --max-steps 2 --eval-every 2"),
    ("prune", "prune {m} {o} --calib-data {d} --heads 0.5"),
]


@pytest.mark.parametrize("name, template", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_file_size_limit_is_one_line_and_leaves_nothing(ws, tmp_path, name, template):
    out = tmp_path / "out"
    done = subprocess.run([*CLI, *_args(template, ws, out)], capture_output=True, text=True, env=ENV, timeout=180,
                          preexec_fn=_file_size_limit(40_000))
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr, f"file size limit reached writing '{out}")
    assert "files are limited to 0.04 MB); nothing was written: raise the limit (ulimit -f)" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, template", WRITERS[:3], ids=[w[0] for w in WRITERS[:3]])
def test_a_full_disk_is_one_line_and_leaves_nothing(ws, small_disk, name, template):
    out = small_disk / "out"
    done = subprocess.run([*CLI, *_args(template, ws, out)], capture_output=True, text=True, env=ENV, timeout=180)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr, f"no space left on device writing '{out}")
    assert "MB free); nothing was written: free some space" in line and "needed about" in line, line
    assert sorted(p.name for p in small_disk.iterdir()) == []


# --- 3. one run of a recipe at a time -------------------------------------------------------------------------------

def _chain(path: Path, ws: Path, out: Path) -> Path:
    path.write_text(json.dumps({"name": "r", "out": str(out), "stages": {
        "model": {"stage": "load", "model": str(ws / "model")},
        "onnx": {"stage": "export"},
        "int8": {"stage": "quantize", "mode": "dynamic", "min_agreement": 0}}}))
    return path


def test_a_second_run_of_a_running_recipe_is_refused_before_it_plans(ws, tmp_path):
    recipe = _chain(tmp_path / "r.yaml", ws, tmp_path / "out")
    first = _start(["run", str(recipe)])
    _wait_for(tmp_path, ".out.lock", first)  # the first run holds the whole of OUT now
    second = subprocess.run([*CLI, "run", str(recipe), "--force"], capture_output=True, text=True, env=ENV,
                            timeout=120)
    _, err1 = first.communicate(timeout=180)
    assert first.returncode == 0, err1
    assert second.returncode == 2 and second.stdout == "", second  # refused before the plan is printed
    _one_line(second.stderr, f"output '{tmp_path / 'out'}' is being written by another t5compress run (pid "
                             f"{first.pid})")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.yaml"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["int8", "model", "onnx", "recipe.json"]


# --- 6. smaller ones ------------------------------------------------------------------------------------------------

# (id, argv with {r} a recipe whose out is {file}, {dir} a directory; the text of the one line)
SMALL = [
    ("run-a-directory", "run {dir}", "recipe '{dir}' is a directory; give the recipe's YAML file"),
    ("recipe-out-a-file-dry-run", "run {r} --dry-run", "r.yaml: out: '{file}' exists and is not a directory"),
    ("recipe-out-a-file", "run {r}", "r.yaml: out: '{file}' exists and is not a directory"),
    ("recipe-out-option-a-file", "run {r} --out {file}", "--out: '{file}' exists and is not a directory"),
    ("generate-endless-input", "generate {e} --input /dev/zero", "/dev/zero:1: a line longer than"),
]


@pytest.mark.parametrize("name, argv, needle", SMALL, ids=[s[0] for s in SMALL])
def test_smaller_ones_are_one_line(ws, tmp_path, name, argv, needle):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dir").mkdir()
    _chain(tmp_path / "r.yaml", ws, tmp_path / "file")
    before = sorted(p.name for p in tmp_path.iterdir())
    values = {"r": tmp_path / "r.yaml", "file": tmp_path / "file", "dir": tmp_path / "dir", "e": ws / "onnx"}
    done = subprocess.run([*CLI, *argv.format(**values).split()], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 2, done
    _one_line(done.stderr, needle.format(**values))
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp_path / "file").read_text() == "mine"


def test_endless_lines_are_refused_before_any_generation(ws):
    """`yes | t5compress generate DIR -`: every line is short, so only the bound on the whole input stops it: one
    line and exit 2 after a million lines, nothing generated (all input is read before the model is loaded)."""
    yes = subprocess.Popen(["yes", "hello"], stdout=subprocess.PIPE)
    try:
        done = subprocess.run([*CLI, "generate", str(ws / "onnx"), "-"], stdin=yes.stdout, capture_output=True,
                              text=True, env=ENV, timeout=120)
    finally:
        yes.kill()
        yes.wait()
    assert done.returncode == 2 and done.stdout == "", done
    _one_line(done.stderr, "<stdin>:1000001: more than 1,000,000 lines of input")


def test_the_input_bound_counts_bytes_and_every_source_together():
    from t5compress.errors import DataError
    from t5compress.textio import Budget, numbered_lines

    budget = Budget(max_lines=5, max_bytes=20)
    assert [t for _, t in numbered_lines([b"0123456789\n"], "a", budget)] == ["0123456789"]
    with pytest.raises(DataError, match=r"^b:1: more than 0 MB of input"):  # 11 + 11 bytes > 20
        list(numbered_lines([b"0123456789\n"], "b", budget))
    budget = Budget(max_lines=3)
    list(numbered_lines([b"x\n", b"y\n"], "a", budget))
    with pytest.raises(DataError, match=r"^b:2: more than 3 lines of input"):  # the second source's second line
        list(numbered_lines([b"x\n", b"y\n"], "b", budget))


# --- 5. option values are not input paths ---------------------------------------------------------------------------

# (id, command run in a folder holding empty dirs named like option values; what it writes there)
CHOICES = [
    ("quantize-weight-range-full", "quantize {e} full/q --dynamic --min-agreement 0", "full/q"),  # --weight-range
    ("train-precision-auto", "train {m} {d} auto/t --max-steps 1", "auto/t"),  # --precision, --metric ...
]


@pytest.mark.parametrize("name, template, out", CHOICES, ids=[c[0] for c in CHOICES])
def test_an_option_value_that_names_a_folder_is_not_an_input(ws, tmp_path, name, template, out):
    for d in ("full", "auto"):
        (tmp_path / d).mkdir()
    done = subprocess.run([*CLI, *_args(template, ws, Path(out))], capture_output=True, text=True, env=ENV,
                          timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / out / "report.json").is_file()


# --- 7. a symbolic link as OUT means its target; a link to nothing is refused ---------------------------------------


def test_a_link_to_a_directory_on_another_file_system_is_written_through(ws, tmp_path, other_disk):
    """The run claims, stages beside and replaces the link's target, so the rename stays on one file system."""
    (other_disk / "target").mkdir()
    link = tmp_path / "out"
    link.symlink_to(other_disk / "target")
    refused = subprocess.run([*CLI, *_args("export {m} {o}", ws, link)], capture_output=True, text=True, env=ENV,
                             timeout=120)
    assert refused.returncode == 2
    _one_line(refused.stderr, f"output '{other_disk / 'target'}' already exists; pass --force")
    done = subprocess.run([*CLI, *_args("export {m} {o} --force", ws, link)], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and (link / "report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"]
    assert sorted(p.name for p in other_disk.iterdir()) == ["target"]  # no lock, no temporary left beside it


def test_a_link_to_nothing_is_refused_before_any_work(ws, tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "not-mounted" / "run1")
    done = subprocess.run([*CLI, *_args("export {m} {o}", ws, link)], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 2
    _one_line(done.stderr, f"output '{link}' is a symbolic link to '{tmp_path / 'not-mounted' / 'run1'}', which does "
                           "not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and link.is_symlink()
