"""`t5compress info DIR`."""

from __future__ import annotations

from typing import Annotated

import typer

from t5compress.cli.common import command, console


@command
def info(
    path: Annotated[str, typer.Argument(help="A model or export directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Show what a model or export directory holds: architecture, size, lineage and reported metrics."""
    import json

    from t5compress.info import inspect_dir, render

    data = inspect_dir(path)
    if json_out:
        console.print_json(json.dumps(data))
    else:
        render(data, console)
