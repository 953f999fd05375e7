"""`t5compress demo`: the embedded quickstart recipe (recipes/quickstart.yaml), no download, no argument."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import command
from t5compress.cli.run import DryRun, Rerun
from t5compress.config import default_of as _d
from t5compress.config import help_of as _h
from t5compress.demo import DemoConfig as C
from t5compress.stages import stage


@command
def demo(
    out: Annotated[Path | None, typer.Option(
        help="Where the demo writes its stages (default: the quickstart recipe's, runs/quickstart).")] = None,
    max_steps: Annotated[int, typer.Option(help=_h(C, "max_steps"))] = _d(C, "max_steps"),
    train_examples: Annotated[int, typer.Option(help=_h(C, "train_examples"))] = _d(C, "train_examples"),
    seed: Annotated[int, typer.Option(help=_h(C, "seed"))] = _d(C, "seed"),
    dry_run: DryRun = False,
    force: Rerun = False,
) -> None:
    """Build a small T5 on generated data, fine-tune it, ship it (ONNX, int8, pruned + int8, pruned +
    vocabulary-trimmed + int8) and benchmark the variants: the quickstart recipe, as `t5compress run
    recipes/quickstart.yaml` runs it. Done stages are skipped."""
    from t5compress import demo, recipe
    from t5compress.cli.run import announce, print_plan, print_results

    cfg = C(max_steps=max_steps, train_examples=train_examples, seed=seed)
    r = demo.load(cfg, out)
    print_plan(r, recipe.plan(r, force=force))
    if dry_run:
        return
    print_results(stage("demo").runner()(None, cfg, out, force=force, on_stage=announce))
