"""The Typer app, shared option aliases and the error boundary that turns T5CompressError into one red line."""

from __future__ import annotations

import functools
import logging
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

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
) -> None:
    _state["debug"] = debug
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
            _print_error(str(e))
            raise typer.Exit(code=e.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/red]")
            raise typer.Exit(code=130) from None

    return app.command()(wrapper)


def fail(message: str) -> None:
    """Report a usage problem found in the CLI layer itself."""
    _print_error(message)
    raise typer.Exit(code=2)


def _print_error(message: str) -> None:
    """One red line, whatever the message holds: line breaks (from a library's message) become spaces, and square
    brackets (paths, `name [split]`) are printed as they are, not read as rich markup."""
    line = re.sub(r"\s*\n\s*", " ", message.strip())
    err_console.print(f"[red]error:[/red] {escape(line)}", highlight=False, soft_wrap=True)


def stdin_is_piped() -> bool:
    return not sys.stdin.isatty()
