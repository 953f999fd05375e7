"""The Typer app, shared option aliases and the error boundary that turns T5CompressError into one red line."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from t5compress.errors import T5CompressError

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
Threads = Annotated[int, typer.Option("--threads", min=0, help="CPU threads for inference (0: runtime default).")]
Seed = Annotated[int, typer.Option("--seed", help="Random seed.")]


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
    """Register `fn` as a CLI command behind the error boundary: one red line and a non-zero exit, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except T5CompressError as e:
            if _state["debug"]:
                raise
            err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=e.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/red]")
            raise typer.Exit(code=130) from None

    return app.command()(wrapper)


def fail(message: str) -> None:
    """Report a usage problem found in the CLI layer itself."""
    err_console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def stdin_is_piped() -> bool:
    return not sys.stdin.isatty()
