"""`t5compress demo`: the whole chain on an embedded default, no download, no argument."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import Force, command, console
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.demo import DemoConfig as C


@command
def demo(
    out: Annotated[Path, typer.Option(help="Where the demo writes its data, models and exports.")] = Path("runs/demo"),
    max_steps: Annotated[int, typer.Option(help=_h(C, "max_steps"))] = _d(C, "max_steps"),
    train_examples: Annotated[int, typer.Option(help=_h(C, "train_examples"))] = _d(C, "train_examples"),
    seed: Annotated[int, typer.Option(help=_h(C, "seed"))] = _d(C, "seed"),
    force: Force = False,
) -> None:
    """Build a small T5, fine-tune it on generated data (spell digits, reverse words), evaluate it and report."""
    from rich.table import Table

    from t5compress import demo as stage

    summary = stage.run(C(max_steps=max_steps, train_examples=train_examples, seed=seed), out, force=force)
    ev = summary["eval"] or {}
    t = Table(title=f"demo: {summary['parameters']:,}-parameter T5 after {summary['train']['steps']} steps "
              f"({summary['train']['seconds']} s)", title_justify="left")
    for col in ("metric", "value"):
        t.add_column(col)
    for k in ("loss", "exact_match", "rougeL", "bleu", "examples"):
        t.add_row(k, str(ev.get(k, "-")))
    console.print(t)
    for s in (ev.get("samples") or [])[:3]:
        console.print(f"  {s['source']!r} → {s['prediction']!r}", highlight=False)
    for k, v in summary["paths"].items():
        console.print(f"{k}: [bold]{v}[/bold]")
