"""The stamp every benchmark result carries: the commit, the UTC date, the machine and the command it was made with,
in the result's JSON (key `stamp`) and as one line at the top of its Markdown.

    result = {"rows": rows}
    write_result(Path("benchmarks/results/current/NAME"), result, markdown_text)  # NAME.json and NAME.md, stamped
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from t5compress.cpu import cpu_features
from t5compress.progress import memory_total

CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout this t5compress runs from (a git tree when developing)


def commit(root: Path = CHECKOUT) -> str | None:
    """`git rev-parse --short HEAD` of `root`, with "+dirty" when tracked files have changes; None outside git."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def accelerators() -> list[str]:
    """The NVIDIA GPUs the driver lists here, by model name (no process started, nothing imported)."""
    root = Path("/proc/driver/nvidia/gpus")
    names = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        model = next((line.split(":", 1)[1].strip() for line in info.read_text(errors="replace").splitlines()
                      if line.startswith("Model:")), None)
        names.append(model or info.parent.name)
    return names


def machine() -> dict:
    """CPU model, architecture, cores, memory (GB: the machine's, or its container's limit where lower), the ISA
    flags that decide int8 speed (avx2, avx512f, avx512_vnni, avx_vnni, amx; neon, dotprod, i8mm), GPUs, Python."""
    cpu = cpu_features()
    total = memory_total()
    return {"cpu": cpu["model"] or cpu["arch"], "arch": cpu["arch"], "cores": cpu["cpus"],
            "memory_gb": round(total / 2**30, 1) if total else None,
            "flags": [k for k, v in cpu.items() if v is True], "accelerators": accelerators(),
            "python": platform.python_version()}


def _command(argv: list[str]) -> str:
    """`argv` as a shell line: a script or `-m` module of the checkout by its path or name there (run by `python`),
    an installed program by its name."""
    if not argv:
        return ""
    prog = Path(argv[0]).resolve()
    if not prog.is_file():  # `python -c`
        head = ["python", argv[0]]
    elif prog.is_relative_to(CHECKOUT) and prog.name == "__main__.py":  # `python -m PACKAGE`
        head = ["python", "-m", ".".join(prog.parent.relative_to(CHECKOUT).parts)]
    elif prog.is_relative_to(CHECKOUT):
        head = ["python", str(prog.relative_to(CHECKOUT))]
    else:
        head = [prog.name]
    return shlex.join([*head, *argv[1:]])


def stamp(argv: list[str] | None = None) -> dict:
    """{'commit', 'date' (UTC), 'machine', 'command'} for a result made now by `argv` (default: this process's)."""
    return {"commit": commit(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "command": _command(sys.argv if argv is None else argv)}


def stamp_line(s: dict) -> str:
    """The stamp as one Markdown line."""
    m = s["machine"]
    parts = [m["cpu"], f"{m['cores']} cores", f"{m['memory_gb']} GB" if m.get("memory_gb") else None,
             " ".join(m["flags"]) or "no int8 ISA flags", *m.get("accelerators", [])]
    return (f"Stamp: commit `{s.get('commit') or 'unknown'}`, {s['date']}; {', '.join(p for p in parts if p)}; "
            f"command `{s.get('command') or '?'}`.")


def stamped_markdown(markdown: str, s: dict | None) -> str:
    """`markdown` with the stamp line at the top (under its `# ` title where it opens with one); unchanged without a
    stamp (a result made before stamps existed)."""
    if s is None:
        return markdown
    head, _, rest = markdown.partition("\n")
    if head.startswith("# "):
        body = rest.lstrip("\n")
        return f"{head}\n\n{stamp_line(s)}\n\n{body}"
    return f"{stamp_line(s)}\n\n{markdown}"


def _write(path: Path, text: str) -> None:
    """Write `text` atomically: a temporary sibling, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_result(stem: Path, result: dict, markdown: str | None = None) -> dict:
    """Write STEM.json (`result` under a new stamp, first) and STEM.md (`markdown` under the stamp line), creating
    STEM's folder; -> the stamped result. (A re-rendering that measures nothing keeps the old stamp: write its
    Markdown with `stamped_markdown(text, result.get("stamp"))`.)"""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    s = stamp()
    result = {"stamp": s, **{k: v for k, v in result.items() if k != "stamp"}}
    _write(stem.with_name(stem.name + ".json"), json.dumps(result, indent=2, default=str) + "\n")
    if markdown is not None:
        _write(stem.with_name(stem.name + ".md"), stamped_markdown(markdown, s))
    return result
