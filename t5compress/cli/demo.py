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
    """Build a small T5, fine-tune it on generated data, export it to ONNX (verified) and int8, and score each."""
    from rich.table import Table

    from t5compress import demo as stage

    summary = stage.run(C(max_steps=max_steps, train_examples=train_examples, seed=seed), out, force=force)
    tr = summary["train"]
    n_eval = (summary["eval"] or {}).get("examples", "?")
    t = Table(title=f"demo: {summary['parameters']:,}-parameter T5, {tr['steps']} fine-tuning steps in "
              f"{tr['seconds']} s, scored on {n_eval} held-out examples", title_justify="left")
    for col in ("backend", "exact_match", "rougeL", "bleu", "ms/example", "MB"):
        t.add_column(col, justify="right")
    for name, b in summary["backends"].items():
        t.add_row(name, str(b["exact_match"]), str(b["rougeL"]), str(b["bleu"]), str(b["ms_per_example"]),
                  str(b["size_mb"]))
    console.print(t)
    parity = summary["parity"]
    console.print(f"ms/example: median, batch 1, 1 thread. Identical outputs: ONNX vs PyTorch "
                  f"{parity['identical_outputs']}, int8 vs ONNX fp32 {parity['int8_identical_outputs']}",
                  highlight=False)
    for s in ((summary["eval"] or {}).get("samples") or [])[:3]:
        console.print(f"  {s['source']!r} → {s['prediction']!r}", highlight=False)
    for k, v in summary["paths"].items():
        console.print(f"{k}: [bold]{v}[/bold]")
