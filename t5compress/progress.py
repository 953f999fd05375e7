"""Progress of long work: a rich bar on a terminal, a plain line every few seconds elsewhere (a log file, CI), or
nothing.

    with Reporter("train", total=800, unit="step", enabled=progress) as p:
        p.update(info="loss 2.31 lr 4.0e-04 52 ex/s")   # -> [train] step 120/800 (15%) loss 2.31 ... ETA 3m10s

The form is `auto` (a bar when the stream, stderr by default, is a terminal, else lines), `bar`, `lines` or `off`:
from `configure` (the CLI's --progress), else $T5COMPRESS_PROGRESS. Lines are at most every
$T5COMPRESS_PROGRESS_EVERY seconds (default 10; --progress-every); the first and the last are always printed.
This is the one module of the library that writes to a stream.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from t5compress.errors import ConfigError

MODES = ("auto", "bar", "lines", "off")
MODE_ENV, EVERY_ENV = "T5COMPRESS_PROGRESS", "T5COMPRESS_PROGRESS_EVERY"
DEFAULT_EVERY = 10.0
LONG_RUN_S = 30 * 60  # a projected run longer than this is worth a warning before it starts
HEAVY_SHARE = 0.5  # so is a peak resident memory above this share of the machine's

_chosen: dict[str, Any] = {"mode": None, "every": None}
_consoles: dict[int, Any] = {}


def configure(mode: str | None = None, every: float | None = None) -> None:
    """Choose the form and the spacing of lines for this process; None leaves them to the environment."""
    if mode is not None and mode not in MODES:
        raise ConfigError(f"progress: choose one of {', '.join(MODES)}, not {mode!r}")
    if every is not None and every < 0:
        raise ConfigError(f"progress_every: must be >= 0 seconds, got {every}")
    _chosen.update(mode=mode, every=every)


def resolve(enabled: bool, stream: TextIO) -> str:
    """The form progress takes on `stream`: bar, lines or off."""
    if not enabled:
        return "off"
    mode = _chosen["mode"] or os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(f"{MODE_ENV}: choose one of {', '.join(MODES)}, not {mode!r}")
    if mode == "auto":
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"
    return mode


def interval() -> float:
    """Seconds between two progress lines."""
    if _chosen["every"] is not None:
        return float(_chosen["every"])
    raw = os.environ.get(EVERY_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_EVERY
    except ValueError:
        value = -1.0
    if value < 0:
        raise ConfigError(f"{EVERY_ENV}: give a number of seconds >= 0, not {raw!r}")
    return value


def duration(seconds: float) -> str:
    """A short human duration: 45s, 3m10s, 2h05m, 4d11h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def throughput(rate: float, unit: str) -> str:
    """`rate` units per second, as `12.3 step/s`, or `4.0 s/step` when slower than one a second."""
    return f"{rate:.1f} {unit}/s" if rate >= 1 else f"{1 / rate:.1f} s/{unit}"


def line(name: str, done: int, total: int | None, *, unit: str = "", what: str = "", info: str = "",
         elapsed: float = 0.0, rate: float | None = None, eta: bool = True, closing: bool = False) -> str:
    """One progress line: `[name] what unit done/total (pct%) info rate ETA|elapsed|done in`.

    `rate` is units per second in this run (None: unknown); it is shown unless `info` already says how fast.
    """
    parts = [f"[{name}]"] + ([what] if what else [])
    if unit or total is not None:
        count = f"{done}/{total} ({100 * done / total:.0f}%)" if total else str(done)
        parts.append(f"{unit} {count}" if unit else count)
    parts += [info] if info else []
    if rate and not info and unit:
        parts.append(throughput(rate, unit))
    finished = total is not None and done >= total
    if finished or (closing and total is None):
        parts.append(f"done in {duration(elapsed)}")
    elif closing:
        parts.append(f"stopped after {duration(elapsed)}")
    elif eta and total and rate:
        parts.append(f"ETA {duration((total - done) / rate)}")
    else:
        parts.append(f"{duration(elapsed)} elapsed")
    return " ".join(parts)


class Reporter:
    """Progress of one piece of long work, in the form `resolve` picks; a context manager.

    Args:
        name: what runs, printed first on each line (`train`, `quantize`).
        total: units of work in all (None: unknown, no bar and no ETA); `done`: units already done (a resumed run).
        unit: the unit counted (`step`, `text`); `what`: what is being done now (can change with each update).
        enabled: False prints nothing at all (the stages' `progress` parameter).
        bar: False when the caller shows this work on a terminal itself: there it prints nothing, elsewhere lines.
        transient: the bar disappears once done. eta: False where units differ too much in size for an ETA.
        stream: where it writes (default sys.stderr); every: seconds between lines (default `interval()`).
        clock: seconds, monotonic (a fake one in tests).
    """

    def __init__(self, name: str, total: int | None = None, done: int = 0, *, unit: str = "", what: str = "",
                 enabled: bool = True, bar: bool = True, transient: bool = False, eta: bool = True,
                 stream: TextIO | None = None, every: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.total, self.done, self.unit, self.what = name, total, done, unit, what
        self.info, self.transient, self.eta, self.clock = "", transient, eta, clock
        self.stream = stream if stream is not None else sys.stderr
        mode = resolve(enabled, self.stream)
        self.mode = "off" if mode == "bar" and not bar else mode
        self.every = interval() if every is None and self.mode == "lines" else (every or 0.0)
        self.start_done, self.started = done, clock()
        self.printed_at: float | None = None
        self.printed: tuple | None = None
        self.bar: Any = None

    def __enter__(self) -> Reporter:
        if self.mode == "bar":
            self.bar = _rich_progress(self.stream, self.total is not None, self.transient)
            self.bar.__enter__()
            self.task = self.bar.add_task(self._label(), total=self.total, completed=self.done, info="")
        return self

    def __exit__(self, *exc) -> None:
        if self.mode == "bar":
            self.bar.__exit__(*exc)
        elif self.mode == "lines" and self.printed is not None and self.printed != self._state():
            self._print(self.clock(), closing=True)

    def update(self, advance: int = 1, *, done: int | None = None, what: str | None = None, info: str | None = None,
               force: bool = False) -> None:
        """Count `advance` more units done (or set `done`), and say what is done now and how it goes (`info`)."""
        self.done = self.done + advance if done is None else done
        self.what = self.what if what is None else what
        self.info = self.info if info is None else info
        if self.mode == "bar":
            self.bar.update(self.task, completed=self.done, description=self._label(), info=self.info)
        elif self.mode == "lines":
            now = self.clock()
            finished = self.total is not None and self.done >= self.total
            due = finished or self.printed_at is None or now - self.printed_at >= self.every
            if (force or due) and self.printed != self._state():  # no line without news
                self._print(now)

    def track(self, items: Iterable) -> Iterator:
        """Yield `items`, counting one unit after each."""
        for item in items:
            yield item
            self.update()

    def note(self, text: str) -> None:
        """A line of its own (an evaluation's result, a measurement), printed whatever the spacing of lines."""
        if self.mode == "bar":
            self.bar.console.print(text, highlight=False)
        elif self.mode == "lines":
            self._write(f"[{self.name}] {text}")

    def _label(self) -> str:
        return f"{self.name} {self.what}" if self.what else self.name

    def _state(self) -> tuple:
        return self.done, self.what, self.info

    def _print(self, now: float, closing: bool = False) -> None:
        elapsed = now - self.started
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 and self.done > self.start_done else None
        self._write(line(self.name, self.done, self.total, unit=self.unit, what=self.what, info=self.info,
                         elapsed=elapsed, rate=rate, eta=self.eta, closing=closing))
        self.printed_at, self.printed = now, self._state()

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


def _rich_progress(stream: TextIO, counted: bool, transient: bool):
    """A rich Progress on `stream`; one console per stream, so that a bar shown inside another nests in it."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if id(stream) not in _consoles:
        _consoles[id(stream)] = (stream, Console(file=stream))
    console = _consoles[id(stream)][1]
    if counted:
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    else:
        columns = [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()]
    return Progress(*columns, TextColumn("{task.fields[info]}"), console=console, transient=transient)


def peak_rss() -> int | None:
    """This process's peak resident memory in bytes, or None where the system does not say."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def memory_total() -> int | None:
    """The memory this process may use, in bytes: the machine's, or its container's limit where lower."""
    total = None
    try:
        with open("/proc/meminfo") as f:
            total = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit() and (total is None or int(limit) < total):
            total = int(limit)
    except OSError:
        pass
    return total


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def first_step_cost(seconds: float, steps: int, peak: int | None, total: int | None,
                    gpu: tuple[int, int] | None = None) -> tuple[str, bool]:
    """What a run will cost, measured on its first step: a line saying so, and whether the run is long or
    memory-heavy on this machine (projected over LONG_RUN_S, or peak RSS over HEAVY_SHARE of `total`).

    Args:
        seconds: the first step's time; steps: the steps the run has to do in all.
        peak, total: the process's peak resident memory and the machine's memory (bytes; None: unknown).
        gpu: (peak allocated, device memory) in bytes, on a GPU.
    """
    projected = seconds * steps
    memory = []
    if peak is not None:
        share = f" ({100 * peak / total:.0f}% of {gigabytes(total)})" if total else ""
        memory.append(f"{gigabytes(peak)} peak RSS{share}")
    if gpu is not None:
        memory.append(f"GPU {gigabytes(gpu[0])} peak of {gigabytes(gpu[1])}")
    text = ", ".join([f"step 1: {seconds:.2f} s/step", *memory]) + f"; {steps} steps ≈ {duration(projected)}"
    heavy = projected > LONG_RUN_S or (peak is not None and bool(total) and peak > HEAVY_SHARE * total)
    return text, heavy
