"""`t5compress run RECIPE.yaml`: a whole chain from one file, validated first, completed stages skipped on rerun."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from t5compress.cli.common import command, console

Rerun = Annotated[bool, typer.Option("--force", help="Rerun every stage, done or not.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Validate the recipe and print the plan; run nothing.")]
RecipeArg = Annotated[str, typer.Argument(
    help="Recipe file (e.g. recipes/t5-small-int8.yaml), or 'quickstart' for the embedded default.")]


@command
def run(
    recipe: RecipeArg = "quickstart",
    out: Annotated[Path | None, typer.Option(help="Output directory (default: the recipe's `out`).")] = None,
    dry_run: DryRun = False,
    only: Annotated[list[str] | None, typer.Option(
        "--only", help="Run only this stage and the stages it reads (repeatable).")] = None,
    force: Rerun = False,
) -> None:
    """Run a recipe: data → create | load | pretrain → train | qat | prune → export → quantize → triton → bench,
    each stage in OUT/<stage id>. A rerun skips the stages whose output is complete and whose settings and inputs
    are unchanged."""
    from t5compress import recipe as recipes

    r = recipes.load(resolve(recipe), out=out, only=tuple(only) if only else None)
    with contextlib.nullcontext() if dry_run else recipes.claimed(r):  # a second run is refused before its plan
        rows = recipes.plan(r, force=force)
        print_plan(r, rows)
        if dry_run:
            return
        result = recipes.run(r, force=force, on_stage=announce)
    print_results(result)


def resolve(name: str) -> Path:
    """A recipe path, or the name of an embedded one ('quickstart')."""
    from t5compress.recipe import QUICKSTART

    p = Path(name)
    if not p.exists() and name in (QUICKSTART.stem, QUICKSTART.name):
        return QUICKSTART
    return p


def print_plan(r, rows: list[dict]) -> None:
    from rich.table import Table

    from t5compress.recipe import QUICKSTART

    runs = sum(row["action"] == "run" for row in rows)
    source = "embedded" if Path(r.source) == QUICKSTART else r.source
    t = Table(title=f"recipe {r.name} ({source}): {runs} of {len(rows)} stages to run", title_justify="left")
    for col in ("stage", "kind", "dir", "action", "why"):
        t.add_column(col)
    for row in rows:
        style = "bold" if row["action"] == "run" else "dim"
        t.add_row(row["id"], row["kind"], row["dir"], f"[{style}]{row['action']}[/{style}]", row["why"])
    console.print(t)


def announce(stage, row: dict, n: int, total: int) -> None:
    if row["action"] == "run":
        console.rule(f"[{n}/{total}] {stage.id} ({stage.kind.name}) → {stage.dir}", align="left")


def print_results(result: dict) -> None:
    from rich.table import Table

    t = Table(title=f"recipe {result['recipe']}: ran {len(result['ran'])}, skipped {len(result['skipped'])}, "
              f"{result['seconds']} s → {result['out']}", title_justify="left")
    for col, justify in (("stage", "left"), ("dir", "left"), ("action", "left"), ("s", "right"),
                         ("key numbers", "left")):
        t.add_column(col, justify=justify)
    for row in result["stages"]:
        seconds = "" if row.get("seconds") is None else f"{row['seconds']:.1f}"
        if seconds and row["action"] == "skip":
            seconds = f"({seconds})"  # the time of the run that made it
        t.add_row(row["id"], row["dir"], row["action"], seconds, row.get("summary") or "")
    console.print(t)
    for row in result["stages"]:
        if row["kind"] == "bench":
            print_bench(Path(row["dir"]), result["reports"].get(row["id"]) or {})


def print_bench(out: Path, report: dict) -> None:
    """The bench stage's table (the same one `t5compress bench` prints) and where its report and plots are."""
    try:
        from t5compress.cli.bench import print_report
    except ImportError:  # the bench command has not landed
        print_report = None
    if print_report is not None and report:
        print_report(report, console)
        entries = report.get("entries") or [{}]
        for sample in ((entries[0].get("accuracy") or {}).get("samples") or [])[:3]:
            console.print(f"  {sample['input']!r} → {sample['output']!r}", highlight=False)
    for name in ("report.md", *sorted(p.name for p in out.glob("*.png"))):
        if (out / name).is_file():
            console.print(f"{name}: [bold]{out / name}[/bold]")
