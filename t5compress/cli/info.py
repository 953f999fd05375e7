"""`t5compress info DIR`."""

from __future__ import annotations

from typing import Annotated

import typer

from t5compress.cli.common import command, console, err_console


@command
def info(
    path: Annotated[str, typer.Argument(help="A model or export directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Show what a model or export directory holds: architecture, size, lineage and reported metrics."""
    import json

    from t5compress.info import inspect_dir, render

    data = inspect_dir(path)
    if json_out:  # the warnings are in the JSON ("warnings"): stdout stays one JSON document
        console.print_json(json.dumps(data))
        return
    for warning in data["warnings"]:
        err_console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)
    render(data, console)
