"""The Typer app, shared option aliases and the error boundary that turns T5CompressError into one red line."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import re
import signal
import sys
import threading
import typing
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from t5compress.config import default_of
from t5compress.errors import ConfigError, T5CompressError, Terminated

app = typer.Typer(
    name="t5compress",
    help="Make T5-family models small and fast, and ship them: fine-tune, export to ONNX/TorchScript, generate.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console(stderr=False)
err_console = Console(stderr=True)

_state = {"debug": False}

# Shared options, declared once.
Force = Annotated[bool, typer.Option("--force", help="Replace OUT if it already exists.")]
OutDir = Annotated[Path, typer.Argument(help="Output directory (must not exist unless --force).")]
ModelDir = Annotated[str, typer.Argument(help="Model directory (Hugging Face format) or hub id.")]
Threads = Annotated[int | None, typer.Option(
    "--threads", min=0, show_default=False,
    help="CPU threads for inference. Default: one per physical core of this machine, at most 8 (2 threads beat 1 at "
    "batch 1 and 8 on the 2-vCPU machines measured); 1: no thread pool; 0: ONNX Runtime's own default.")]
Seed = Annotated[int, typer.Option("--seed", help="Random seed.")]
Device = Annotated[str, typer.Option(
    "--device", help="Where ONNX graphs run: cpu, cuda or cuda:N (ONNX Runtime's CUDA provider, from the gpu extra; "
    "one line and exit 2 when it or a GPU is missing, never a silent CPU run) or auto (CUDA when it starts, else "
    "CPU).")]


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False,
    progress: Annotated[str | None, typer.Option(
        "--progress", help="How long work shows progress: auto (a bar on a terminal, else a plain line every few "
        "seconds), bar, lines or off. Default: $T5COMPRESS_PROGRESS, else auto.")] = None,
    progress_every: Annotated[float | None, typer.Option(
        "--progress-every", min=0, help="Seconds between two progress lines. Default: "
        "$T5COMPRESS_PROGRESS_EVERY, else 10.")] = None,
) -> None:
    from t5compress import progress as reporting

    _state["debug"] = debug
    if progress is not None and progress.lower() not in reporting.MODES:
        fail(f"--progress: choose one of {', '.join(reporting.MODES)}, not {progress!r}")
    reporting.configure(progress and progress.lower(), progress_every)
    level = logging.INFO if verbose or debug else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def command(fn):
    """Register `fn` as a CLI command behind the error boundary: one red line and a non-zero exit, no traceback.

    A termination signal takes Ctrl-C's path (see `terminations_interrupt`): "interrupted (SIGTERM)" and exit
    128 + the signal's number (143), as a shell reports a process that SIGTERM ended; Ctrl-C exits 130.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with terminations_interrupt():
                return fn(*args, **kwargs)
        except T5CompressError as e:
            if _state["debug"]:
                raise
            _print_error(str(e))
            raise typer.Exit(code=e.exit_code) from None
        except Terminated as e:
            err_console.print(f"[red]interrupted[/red] ({signal.Signals(e.signum).name})")
            raise typer.Exit(code=128 + e.signum) from None
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/red]")
            raise typer.Exit(code=130) from None

    return app.command()(wrapper)


TERMINATIONS = (signal.SIGTERM, signal.SIGHUP)  # `kill`, Docker, Kubernetes, systemd, CI; a closed terminal


@contextlib.contextmanager
def terminations_interrupt():
    """While the block runs, a termination signal raises `Terminated` (a KeyboardInterrupt) where the program is, so
    every stage unwinds as on Ctrl-C: its claim, temporary sibling and scratch dirs go. A second signal during that
    cleanup is ignored (it would cut the cleanup short; SIGKILL is what a supervisor sends next). Signal handlers
    belong to the main thread; elsewhere (a command run from a worker thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, _frame):
        for s in TERMINATIONS:
            if signal.getsignal(s) is interrupt:
                signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)

    # a signal the caller chose to ignore (`nohup` ignores SIGHUP) stays ignored
    before = {s: signal.signal(s, interrupt) for s in TERMINATIONS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def fail(message: str) -> None:
    """Report a usage problem found in the CLI layer itself."""
    _print_error(message)
    raise typer.Exit(code=2)


def _print_error(message: str) -> None:
    """One red line, whatever the message holds: line breaks (from a library's message) become spaces, and square
    brackets (paths, `name [split]`) are printed as they are, not read as rich markup."""
    line = re.sub(r"\s*\n\s*", " ", message.strip())
    err_console.print(f"[red]error:[/red] {escape(line)}", highlight=False, soft_wrap=True)


def show(name: str, report: dict, out: Any = None, done: str = "") -> None:
    """Print what stage `name` measured (the rows its registry entry describes the report with), then, given `out`,
    `done` and where the result is."""
    from t5compress.stages import stage

    for label, value in stage(name).describe(report):
        console.print(f"{label}: {value}", highlight=False, markup=False, soft_wrap=True)
    if out is not None:
        console.print(f"{done} → [bold]{escape(str(out))}[/bold]".lstrip(), highlight=False, soft_wrap=True)


def stdin_is_piped() -> bool:
    return not sys.stdin.isatty()


# --- options from config fields: the one way a command turns its options into the stage's config --------------------


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


def field_options(cls: type, *names: str, skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """Keyword options for the fields `names` of config class `cls` (default: every field with a plain type): type,
    default and help come from the dataclass. A bool has its `--no-` form; a tuple is given comma-separated."""
    hints = typing.get_type_hints(cls)
    params = []
    for f in dataclasses.fields(cls):
        if (names and f.name not in names) or f.name in skip:
            continue
        hint, default, help_ = hints[f.name], default_of(cls, f.name), f.metadata.get("help", "")
        if _is_tuple(hint):
            hint, default, help_ = str, ",".join(str(v) for v in default), help_ + " Comma-separated."
        elif dataclasses.is_dataclass(hint) or typing.get_origin(hint) in (dict, list):
            if names:
                raise TypeError(f"{cls.__name__}.{f.name} is not a plain option")
            continue
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=Annotated[hint, typer.Option(help=help_)]))
    return params


def config_from(cls: type, opts: dict, **given: Any):
    """An instance of config class `cls` from the command's options (its fields' ones are popped from `opts`),
    with `given` fields set by the command itself; comma-separated tuple options are split and typed."""
    hints = typing.get_type_hints(cls)
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name not in opts or f.name in given:
            continue
        value = opts.pop(f.name)
        if _is_tuple(hints[f.name]) and isinstance(value, str):
            value = _split(value, typing.get_args(hints[f.name])[0], f.name)
        values[f.name] = value
    return cls(**values)


def _split(text: str, kind: type, name: str) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')}: give comma-separated {kind.__name__} values, e.g. "
                          f"1,8; got {text!r}") from None


def with_options(*groups: list[inspect.Parameter]):
    """Give a command extra options (Typer reads the signature); the function receives them as **opts."""

    def deco(fn):
        sig = inspect.signature(fn, eval_str=True)  # string annotations (PEP 563) would lose their help texts
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        fn.__signature__ = sig.replace(parameters=[*own, *(p for g in groups for p in g)])
        return fn

    return deco
