"""Progress where no terminal listens: plain lines at an interval (first and last always), nothing when disabled,
and the cost of a training run said after its first step."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys

import pytest

from t5compress import progress
from t5compress.errors import ConfigError
from t5compress.progress import Reporter, duration, first_step_cost, line, throughput


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    """Whatever the environment of the test run says, progress picks its form from the stream."""
    monkeypatch.delenv(progress.MODE_ENV, raising=False)
    monkeypatch.delenv(progress.EVERY_ENV, raising=False)
    progress.configure()
    yield
    progress.configure()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(total: int, steps: int, every: float = 10.0, **kwargs) -> list[str]:
    """A reporter on a pipe, one step a second for `steps` seconds; the lines it printed."""
    out, clock = io.StringIO(), Clock()
    with Reporter("train", total, unit="step", stream=out, every=every, clock=clock, **kwargs) as p:
        for _ in range(steps):
            clock.now += 1
            p.update(info=f"loss {5 - clock.now / 10:.2f}")
    return out.getvalue().splitlines()


def test_lines_come_at_the_interval_and_the_first_and_last_always():
    lines = _run(total=30, steps=30)
    assert [re.search(r"step (\d+)/30", x).group(1) for x in lines] == ["1", "11", "21", "30"]
    assert lines[0] == "[train] step 1/30 (3%) loss 4.90 ETA 29s"
    assert lines[-1] == "[train] step 30/30 (100%) loss 2.00 done in 30s"


def test_a_run_stopped_early_still_prints_where_it_stopped():
    lines = _run(total=100, steps=25)
    assert [re.search(r"step (\d+)/100", x).group(1) for x in lines] == ["1", "11", "21", "25"]
    assert lines[-1] == "[train] step 25/100 (25%) loss 2.50 stopped after 25s"


def test_a_zero_interval_prints_every_update_and_notes_are_never_held_back():
    out, clock = io.StringIO(), Clock()
    with Reporter("quantize", 3, unit="text", what="calibrating", stream=out, every=0, clock=clock) as p:
        for _ in range(3):
            clock.now += 2
            p.update()
            p.note("a note")
        p.update(0)  # no news, no line
    assert out.getvalue().splitlines() == [
        "[quantize] calibrating text 1/3 (33%) 2.0 s/text ETA 4s", "[quantize] a note",
        "[quantize] calibrating text 2/3 (67%) 2.0 s/text ETA 2s", "[quantize] a note",
        "[quantize] calibrating text 3/3 (100%) 2.0 s/text done in 6s", "[quantize] a note",
    ]


def test_the_line_formats_eta_throughput_and_durations():
    assert line("train", 120, 800, unit="step", info="loss 2.31 lr 4.0e-04 52 ex/s", rate=680 / 190,
                elapsed=30) == "[train] step 120/800 (15%) loss 2.31 lr 4.0e-04 52 ex/s ETA 3m10s"
    assert line("bench", 3, 10, unit="cell", rate=0.25, elapsed=12) == "[bench] cell 3/10 (30%) 4.0 s/cell ETA 28s"
    assert line("quantize", 0, None, what="tuning encoder", elapsed=75) == "[quantize] tuning encoder 1m15s elapsed"
    assert line("run", 2, 8, unit="stage", rate=0.1, eta=False, elapsed=20) == \
        "[run] stage 2/8 (25%) 10.0 s/stage 20s elapsed"
    assert [duration(s) for s in (0, 45.4, 190, 3599, 7500, 9_893_000)] == ["0s", "45s", "3m10s", "59m59s", "2h05m",
                                                                            "114d12h"]
    assert throughput(52.04, "ex") == "52.0 ex/s" and throughput(0.5, "step") == "2.0 s/step"


def test_disabled_progress_prints_nothing_anywhere(monkeypatch):
    for stream in (io.StringIO(), Terminal()):
        with Reporter("train", 5, unit="step", enabled=False, stream=stream, every=0) as p:
            p.update()
            p.note("eval")
        assert stream.getvalue() == ""
    monkeypatch.setenv(progress.MODE_ENV, "off")
    assert _run(total=5, steps=5) == []


def test_the_form_follows_the_stream_the_environment_and_configure(monkeypatch):
    assert progress.resolve(True, io.StringIO()) == "lines" and progress.resolve(True, Terminal()) == "bar"
    monkeypatch.setenv(progress.MODE_ENV, "lines")
    assert progress.resolve(True, Terminal()) == "lines"
    progress.configure(mode="off")
    assert progress.resolve(True, Terminal()) == "off"
    # a caller that shows the work on a terminal itself (the recipe runner) gets lines only off the terminal
    progress.configure()
    monkeypatch.delenv(progress.MODE_ENV)
    assert Reporter("run", 3, bar=False, stream=Terminal()).mode == "off"
    assert Reporter("run", 3, bar=False, stream=io.StringIO()).mode == "lines"
    monkeypatch.setenv(progress.EVERY_ENV, "2.5")
    assert Reporter("run", 3, stream=io.StringIO()).every == 2.5
    monkeypatch.setenv(progress.EVERY_ENV, "soon")
    with pytest.raises(ConfigError, match=progress.EVERY_ENV):
        Reporter("run", 3, stream=io.StringIO())
    monkeypatch.setenv(progress.MODE_ENV, "loud")
    with pytest.raises(ConfigError, match="bar, lines, off"):
        Reporter("run", 3, stream=io.StringIO())


def test_the_bar_on_a_terminal_shows_the_work():
    term = Terminal()
    with Reporter("train", 2, unit="step", stream=term) as p:
        assert p.mode == "bar"
        p.update(info="loss 1.00")
        p.update(info="loss 0.50")
    assert "2/2" in term.getvalue() and "loss 0.50" in term.getvalue()


def test_the_first_step_cost_says_when_a_run_is_long_or_memory_heavy():
    gb = 10**9
    text, heavy = first_step_cost(2.3, 800, int(1.9 * gb), 16 * gb)
    assert text == "step 1: 2.30 s/step, 1.9 GB peak RSS (12% of 16.0 GB); 800 steps ≈ 30m40s" and heavy
    assert first_step_cost(0.1, 800, 9 * gb, 16 * gb)[1]  # 56% of the machine's memory
    text, heavy = first_step_cost(0.1, 800, 2 * gb, 16 * gb, gpu=(5 * gb, 80 * gb))
    assert "GPU 5.0 GB peak of 80.0 GB" in text and "≈ 1m20s" in text and not heavy
    assert not first_step_cost(0.1, 10, None, None)[1]
    assert progress.peak_rss() > 0 and progress.memory_total() > progress.peak_rss()


def test_a_long_training_run_warns_with_the_options_that_make_it_cheaper(tiny_model_dir, demo_jsonl, tmp_path,
                                                                          monkeypatch, caplog):
    from t5compress.train import stage as training
    from t5compress.train.loop import TrainConfig

    monkeypatch.setattr(progress, "LONG_RUN_S", 0)  # every run is long
    cfg = training.FinetuneConfig(train_data=str(demo_jsonl),
                                  train=TrainConfig(max_steps=2, batch_size=8, eval_every=0, eval_max_examples=4,
                                                    metric="loss"))
    with caplog.at_level(logging.WARNING, logger="t5compress.train.loop"):
        training.run(str(tiny_model_dir), cfg, tmp_path / "out", progress=False)
    warnings = [r.getMessage() for r in caplog.records if "long or memory-heavy" in r.getMessage()]
    assert len(warnings) == 1
    assert re.search(r"train is long .*step 1: [\d.]+ s/step, [\d.]+ GB peak RSS.*2 steps ≈", warnings[0])
    assert "--batch-size, --max-steps, --max-source-length" in warnings[0]


def test_train_writes_plain_progress_lines_when_stderr_is_a_pipe(tiny_model_dir, demo_jsonl, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("T5COMPRESS_PROGRESS")}
    env["OMP_NUM_THREADS"] = "1"
    args = [sys.executable, "-m", "t5compress.cli", "train", str(tiny_model_dir), str(demo_jsonl), str(tmp_path / "o"),
            "--max-steps", "12", "--batch-size", "8", "--eval-every", "6", "--eval-max-examples", "4",
            "--metric", "loss"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [x for x in done.stderr.splitlines() if x.startswith("[train]")]
    steps = [int(m.group(1)) for x in lines if (m := re.match(r"\[train\] step (\d+)/12 \(\d+%\) loss [\d.]+ ", x))]
    assert steps[0] == 1 and steps[-1] == 12 and steps == sorted(steps)
    assert re.search(r"^\[train\] step 1: [\d.]+ s/step, [\d.]+ GB peak RSS .*; 12 steps ≈ \d+s$", done.stderr, re.M)
    assert re.search(r"^\[train\] step 1/12 \(8%\) loss .* ex/s .* tok/s ETA \d+s$", done.stderr, re.M)
    assert re.search(r"^\[train\] step 12/12 \(100%\) loss .* done in \d+s$", done.stderr, re.M)
    assert any(x.startswith("[train] eval step 6") for x in lines)
    assert "\x1b[" not in done.stderr  # no terminal codes in a log


def test_the_cli_rejects_an_unknown_progress_form():
    from typer.testing import CliRunner

    from t5compress.cli.app import app

    result = CliRunner().invoke(app, ["--progress", "loud", "info", "x"])
    assert result.exit_code == 2 and "--progress: choose one of auto, bar, lines, off" in result.output
