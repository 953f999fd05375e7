"""The option reference in docs/<page>.md, rendered from the CLI itself so it cannot drift from `--help`.

Each page holds one generated block per command it documents:

    <!-- options:start train -->
    ...usage, the command's help and a table of its arguments and options...
    <!-- options:end -->

`python -m t5compress.cli.docgen` (or `make docs`) rewrites every block in place; `--check` only reports the stale
ones and exits 1. tests/cli/test_docs.py fails while any block differs from what `render` gives now.
"""

from __future__ import annotations

import inspect
import re
import sys
from enum import Enum
from pathlib import Path

import typer

from t5compress.cli.app import app

DOCS = Path(__file__).resolve().parents[2] / "docs"

# Commands documented on another command's page: recover is a prune step, serve and bench-triton run what triton
# writes. Every other command has the page of its own name.
PAGE_OF = {"recover": "prune", "serve": "triton", "bench-triton": "triton"}

BLOCK = re.compile(r"<!-- options:start (?P<name>[\w-]+) -->\n.*?<!-- options:end -->", re.DOTALL)


def commands() -> dict:
    """The click commands of the app, by name, in the order they are registered."""
    return dict(typer.main.get_command(app).commands)


def _context(name: str, cmd):
    """The context `t5compress NAME --help` renders in (the app's settings, such as -h, are inherited)."""
    group = typer.main.get_command(app)
    root = typer.Context(group, info_name="t5compress", **group.context_settings)
    return typer.Context(cmd, info_name=name, parent=root, **cmd.context_settings)


def page_of(name: str) -> str:
    """The docs page (file stem under docs/) that documents command `name`."""
    return PAGE_OF.get(name, name)


def _md(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, no pipes, no HTML-looking tags (`</s>`)."""
    text = " ".join(text.split())
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def _type(param, ctx) -> str:
    if getattr(param, "is_flag", False):
        return "flag"
    label = param.display_type(ctx).strip("<>").removesuffix(" range")
    if label.startswith("list[") and label.endswith("]"):  # repeated: say it once, in words
        label = label[5:-1]
    if param.min is not None and param.max is not None:
        label += f", {param.min} to {param.max}"
    elif param.min is not None:
        label += f", ≥ {param.min}"
    elif param.max is not None:
        label += f", ≤ {param.max}"
    if param.multiple:
        label += ", repeatable"
    elif param.nargs == -1:
        label += ", one or more" if param.required else ", any number"
    return label


def _value(value) -> str:
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, (list, tuple)):
        return ", ".join(_value(v) for v in value)
    return str(value)


def _default(param, ctx) -> str:
    if param.required:
        return "required"
    value = param.get_default(ctx, call=False)
    if callable(value):
        return "(dynamic)"
    if getattr(param, "is_flag", False):
        if param.secondary_opts:  # --bucket/--no-bucket: the default is the spelling that is on
            return f"`{(param.opts if value else param.secondary_opts)[0]}`"
        return "on" if value else ""
    if value is None or value == () or value == []:
        return ""
    return f"`{_value(value)}`" if value != "" else '`""`'


def _names(param) -> str:
    if param.param_type_name == "argument":
        return param.name.upper()
    # Long names first: click keeps --help's names in a set, whose order changes from run to run.
    names = " / ".join(f"`{o}`" for o in sorted(param.opts, key=lambda o: not o.startswith("--")))
    if param.secondary_opts:
        names += " / " + " / ".join(f"`{o}`" for o in param.secondary_opts)
    return names


def _usage(name: str, cmd) -> str:
    parts = ["t5compress", name, "[OPTIONS]"]
    for p in cmd.params:
        if p.param_type_name != "argument":
            continue
        arg = p.name.upper() + ("..." if p.nargs == -1 else "")
        parts.append(arg if p.required else f"[{arg}]")
    return " ".join(parts)


def render(name: str) -> str:
    """The generated block for command `name`, markers included."""
    cmd = commands()[name]
    ctx = _context(name, cmd)
    lines = [f"<!-- options:start {name} -->",
             "<!-- generated from the CLI by `make docs` (python -m t5compress.cli.docgen); do not edit -->",
             f"`{_usage(name, cmd)}`", ""]
    for para in inspect.cleandoc(cmd.help or "").split("\n\n"):
        if para.strip():
            lines += [_md(para), ""]
    lines += ["| argument / option | type | default | help |", "|---|---|---|---|"]
    for p in [*cmd.params, cmd.get_help_option(ctx)]:
        if p is None or getattr(p, "hidden", False):
            continue
        lines.append(f"| {_names(p)} | {_md(_type(p, ctx))} | {_default(p, ctx)} | {_md(p.help or '')} |")
    lines.append("<!-- options:end -->")
    return "\n".join(lines)


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of one page, by command name."""
    return {m["name"]: m[0] for m in BLOCK.finditer(text)}


def update(docs: Path = DOCS, check: bool = False) -> list[str]:
    """Rewrite every stale block under `docs` (only list them with check=True); returns the stale commands."""
    names = commands()
    stale = []
    for page in sorted(docs.glob("*.md")):
        text = page.read_text()

        def fresh(m: re.Match, page: Path = page) -> str:
            name = m["name"]
            if name not in names:
                raise SystemExit(f"{page}: block for '{name}', which is not a command ({', '.join(names)})")
            new = render(name)
            if new != m[0]:
                stale.append(name)
            return new

        new_text = BLOCK.sub(fresh, text)
        if new_text != text and not check:
            tmp = page.with_name(page.name + ".tmp")
            tmp.write_text(new_text)
            tmp.replace(page)
    return stale


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    stale = update(check=check)
    verb = "stale" if check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "docs: every options block is up to date")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
