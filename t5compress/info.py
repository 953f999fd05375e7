"""What a model or export directory holds: architecture, parameters, size on disk, lineage and reported metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from t5compress import kinds
from t5compress.artifacts import META_FILE, REPORT_FILE, read_json
from t5compress.errors import ModelError, first_line
from t5compress.lineage import source_checkpoint, vs_source
from t5compress.model.weights import weight_headers
from t5compress.names import ONNX_SUFFIX, TORCHSCRIPT_SUFFIX
from t5compress.runtime.fit import check_export
from t5compress.runtime.sessions import TORCHSCRIPT_WARNING, check_onnx, check_torchscript

_ARCH_KEYS = ("model_type", "num_layers", "num_decoder_layers", "d_model", "d_ff", "d_kv", "num_heads",
              "feed_forward_proj", "tie_word_embeddings", "vocab_size")


def _kind(p: Path) -> str:
    kind = kinds.kind_of(p)
    if kind is None or kind.name in ("triton-repository", "bench"):
        raise ModelError(f"'{p}' is neither a model directory (model.safetensors) nor an export directory "
                         "(*.onnx, *.pt)")
    return {"onnx-export": "onnx export", "torchscript-export": "torchscript export"}.get(kind.name, "model")


def _parameters(p: Path, kind: str) -> int | None:
    """Count parameters from the safetensors headers only (no weights are read)."""
    if kind != "model":
        return None
    total = 0
    for t in weight_headers(p).values():
        count = 1
        for d in t.get("shape") or ():
            count *= int(d)
        total += count
    return total


def _check_graphs(p: Path, kind: str) -> None:
    """Every graph file parses (ONNX, with its external data) or reads as an archive (TorchScript): a damaged export
    is an error, not a table. Model dirs are checked by their safetensors headers (`_parameters`)."""
    if kind == "onnx export":
        for f in sorted(p.glob(f"*{ONNX_SUFFIX}")):
            check_onnx(f)
        check_export(p)  # and the graphs belong together
    elif kind == "torchscript export":
        for f in sorted(p.glob(f"*{TORCHSCRIPT_SUFFIX}")):
            check_torchscript(f)


def _json(path: Path) -> dict | None:
    """A JSON file of the dir (config, lineage, report), or None when absent; a damaged one is a ModelError."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path.name} in '{path.parent}' is damaged: {first_line(e)}") from None
    if data is not None and not isinstance(data, dict):
        raise ModelError(f"{path.name} in '{path.parent}' is damaged: not a JSON object")
    return data


def inspect_dir(path: str | Path) -> dict[str, Any]:
    """What the dir holds; a ModelError (the CLI exits 2) when a file it is made of is damaged or unreadable."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"'{p}' is not a directory")
    kind = _kind(p)
    config = _json(p / "config.json") or {}
    files = {f.name: f.stat().st_size for f in sorted(p.iterdir()) if f.is_file()}
    meta = _json(p / META_FILE)
    report = _json(p / REPORT_FILE) or {}
    parameters = _parameters(p, kind)
    _check_graphs(p, kind)
    return {
        "path": str(p),
        "kind": kind,
        "architecture": {k: config[k] for k in _ARCH_KEYS if k in config},
        "parameters": parameters or (report.get("model") or {}).get("parameters"),  # exports: from the report
        "size_bytes": sum(f.stat().st_size for f in p.rglob("*") if f.is_file()),
        "source": None if kind == "model" else source_checkpoint(p),  # the safetensors it was made from
        "files": files,
        "lineage": None if meta is None else {"stage": meta.get("stage"), "created": meta.get("created"),
                                               "parent": meta.get("parent"), "what": _stage_help(meta.get("stage"))},
        "report": report,
        "warnings": [TORCHSCRIPT_WARNING] if kind == "torchscript export" else [],
    }


def _stage_help(name: str | None) -> str | None:
    """What the stage that made a directory does, from the stage registry."""
    from t5compress.stages import STAGES

    spec = STAGES.get(name or "")
    return spec.help if spec else None


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _report_rows(report: dict) -> list[tuple[str, str]]:
    """What the stage that made the directory measured, told by that stage (the registry names how)."""
    from t5compress.stages import STAGES

    spec = STAGES.get(report.get("stage") or "")
    return spec.describe(report) if spec else []


def _shown(path: str) -> str:
    """A recorded (absolute) path as the user would type it: relative when it lies under the current directory."""
    import os

    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def render(data: dict[str, Any], console) -> None:
    """Print the inspection as rich tables."""
    from rich.table import Table

    t = Table(title=f"{data['path']} ({data['kind']})", show_header=False, title_justify="left")
    for k, v in data["architecture"].items():
        t.add_row(k, str(v))
    if data["parameters"] is not None:
        t.add_row("parameters", f"{data['parameters']:,} ({data['parameters'] / 1e6:.2f}M)")
    t.add_row("size on disk", f"{_human(data['size_bytes'])} ({data['size_bytes']:,} bytes)")
    for k, v in vs_source(data["size_bytes"], data.get("source"), "dir vs checkpoint"):
        t.add_row(k, v)
    for name, size in data["files"].items():
        if name.endswith((".onnx", ".pt", ".safetensors", ".onnx_data")):
            t.add_row(f"  {name}", _human(size))
    lin = data["lineage"]
    if lin:
        parent = _shown((lin.get("parent") or {}).get("path", "-"))
        what = f" ({lin['what']})" if lin.get("what") else ""
        t.add_row("made by", f"{lin['stage']}{what} at {lin['created']} from {parent}")
    else:
        t.add_row("made by", "not t5compress (no t5compress.json)")
    for k, v in _report_rows(data["report"]):
        t.add_row(k, v)
    console.print(t)
    graphs = (data["report"] or {}).get("graphs")  # quantize: a dict per graph; export: the graph names
    sens = graphs.get("sensitivity") if isinstance(graphs, dict) else None
    if sens and sens["groups"]:
        console.print(_sensitivity_table(sens))


def _sensitivity_table(report: dict):
    """What `quantize` measured per layer group with only that group int8, most sensitive first."""
    from rich.table import Table

    from t5compress.quantize.describe import ranked, summary

    t = Table(title="int8 sensitivity: only this group int8, the rest fp32 (" + summary(report) + ")",
              title_justify="left")
    for col in ("group", "nodes", "next token", "mean logit error", "max logit error", "int8"):
        t.add_column(col, justify="left" if col == "group" else "right")
    for r in ranked(report):
        t.add_row(r["group"], str(r["nodes"]), f"{r['next_token_agreement']:.2%}", f"{r['mean_rel_logit_error']:.4f}",
                  f"{r['max_rel_logit_error']:.4f}", "kept fp32" if r["kept"] else "int8")
    return t
