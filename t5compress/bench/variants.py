"""What a bench variant is: a spec (`PATH` or `NAME=PATH`) resolved to a kind, its precision, its lineage and
exactly the model files it loads (their bytes are its size on disk).

Kinds are a registry, tried in order on the directory; an unknown directory is a one-line ModelError naming the
kinds accepted. The lineage in `t5compress.json` (followed parent by parent while the parents exist) says which
stage made a dir: an ONNX dir quantized by `quantize` is `int8 static` / `int8 dynamic`, one exported from a `qat`
dir is `int8 qat`, anything with `prune` in its ancestry is pruned.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from t5compress import kinds
from t5compress.artifacts import META_FILE, REPORT_FILE, read_json
from t5compress.errors import ModelError
from t5compress.lineage import source_checkpoint
from t5compress.names import DECODER_MERGED, GRAPHS, ONNX_SUFFIX, TORCHSCRIPT_SUFFIX
from t5compress.runtime.sessions import load_onnx

URL_SCHEMES = ("http://", "https://", "grpc://")


@dataclass
class Variant:
    """One thing measured: a user's variant or a peer prepared from the first PyTorch variant."""

    name: str
    path: Path
    kind: str  # pytorch | onnx | torchscript | ctranslate2 | openvino (the engine that runs it)
    precision: str  # fp32 | int8 | int4 (4-bit weights: `quantize --bits 4`)
    label: str  # what it is, for people: "ONNX int8 static (pruned)"
    role: str = "variant"  # variant | peer
    owner: str = "ours"  # ours | baseline | peer (who made the runtime: the speed-ups compare ours with peers)
    pruned: bool = False
    lineage: list[str] = field(default_factory=list)  # stages, newest first
    files: list[str] = field(default_factory=list)  # relative to path: exactly what the engine loads
    settings: dict = field(default_factory=dict)  # engine settings (peers: what a user of that tool would set)
    python: str | None = None  # interpreter that runs it (None: this one)

    @property
    def size_bytes(self) -> int | None:
        if self.kind == "triton":  # served from another machine's disk: not ours to measure
            return None
        return sum((self.path / f).stat().st_size for f in self.files)

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.settings.get("url") or str(self.path), "kind": self.kind,
                "precision": self.precision, "label": self.label, "role": self.role, "owner": self.owner,
                "pruned": self.pruned, "lineage": self.lineage, "files": self.files, "size_bytes": self.size_bytes,
                "source": None if self.kind == "triton" else source_checkpoint(self.path),
                "settings": self.settings, "python": self.python}


def lineage(path: Path, limit: int = 12) -> list[str]:
    """Stages that made `path`, newest first, following `t5compress.json` parents while they exist."""
    stages, p = [], path
    for _ in range(limit):
        meta = read_json(p / META_FILE) if p.is_dir() else None
        if not meta:
            break
        stages.append(meta.get("stage") or "?")
        parent = meta.get("parent") or {}
        if not parent.get("path"):
            break
        if not Path(parent["path"]).is_dir():  # moved or deleted: the recorded stage of the parent is all we know
            if parent.get("stage"):
                stages.append(parent["stage"])
            break
        p = Path(parent["path"])
    return stages


def onnx_files(path: Path, graphs: list[str]) -> list[str]:
    """The graph files plus the external-data files their initializers point at (read from the graph headers)."""

    files = []
    for g in graphs:
        files.append(g)
        model = load_onnx(str(path / g), load_external_data=False)
        for t in model.graph.initializer:
            for entry in t.external_data:
                if entry.key == "location" and entry.value not in files:
                    files.append(entry.value)
    return files


def _pytorch(path: Path) -> dict | None:
    from t5compress.model.load import check_model_dir

    if not (path / "config.json").is_file() or not kinds.is_model_dir(path):
        return None
    check_model_dir(path)  # a non-T5 model dir gets its own line
    if (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = ["model.safetensors.index.json", *sorted(set(index.get("weight_map", {}).values()))]
    return {"kind": "pytorch", "precision": "fp32", "files": files, "label": "PyTorch"}


def _export(path: Path) -> dict | None:
    from t5compress.runtime.sessions import detect_format, onnx_decoders

    names = {f"{g}{s}" for g in (*GRAPHS, DECODER_MERGED) for s in (ONNX_SUFFIX, TORCHSCRIPT_SUFFIX)}
    if not any((path / n).is_file() for n in names):
        return None
    fmt = detect_format(path)  # an incomplete export dir gets its own line
    if fmt == "torchscript":
        return {"kind": "torchscript", "precision": "fp32", "files": [f"{g}{TORCHSCRIPT_SUFFIX}" for g in GRAPHS],
                "label": "TorchScript"}
    layout = onnx_decoders(path)  # what the runtime opens ('auto'): the separate decoders when both are there
    graphs = [f"{g}{ONNX_SUFFIX}" for g in (GRAPHS if layout == "separate" else (GRAPHS[0], DECODER_MERGED))]
    from t5compress.quantize.graphs import is_quantized

    int8 = any(is_quantized(path / g) for g in graphs)  # load_onnx names a damaged graph file
    files = onnx_files(path, graphs)
    label = "ONNX" + (" merged" if layout == "merged" else "")
    dtype = (read_json(path / REPORT_FILE) or {}).get("dtype", "fp32") if not int8 else "int8"  # fp16 exports
    return {"kind": "onnx", "precision": dtype, "files": files, "label": label}


def _ctranslate2(path: Path) -> dict | None:
    if not (path / "model.bin").is_file() or not any(path.glob("*vocabulary.*")):
        return None
    cfg = read_json(path / "config.json") or {}
    quant = str(cfg.get("quantization") or "")
    return {"kind": "ctranslate2", "precision": "int8" if "int8" in quant else "fp32", "files": ["model.bin"],
            "label": "CTranslate2"}


def _openvino(path: Path) -> dict | None:
    xml = sorted(p.name for p in path.glob("openvino_*.xml"))
    if not xml:
        return None
    files = [f for x in xml for f in (x, x[:-4] + ".bin") if (path / f).is_file()]
    int8 = bool((read_json(path / "openvino_config.json") or {}).get("quantization_config"))
    return {"kind": "openvino", "precision": "int8" if int8 else "fp32", "files": files, "label": "OpenVINO"}


KINDS: dict[str, Callable[[Path], dict | None]] = {
    "PyTorch model dir": _pytorch, "ONNX or TorchScript export dir": _export, "CTranslate2 dir": _ctranslate2,
    "OpenVINO dir": _openvino}


def parse_spec(spec: str) -> tuple[str, str]:
    """`NAME=PATH` -> (NAME, PATH); a bare path is named after its directory."""
    name, sep, path = spec.partition("=")
    if sep and name and "/" not in name and not spec.startswith(URL_SCHEMES):
        return name, path
    return Path(spec.rstrip("/")).name or spec, spec


def resolve(spec: str) -> Variant:
    """The variant a spec names; a one-line ModelError when the path is missing or holds no model of a known kind."""
    name, where = parse_spec(spec)
    if where.startswith(URL_SCHEMES):
        return triton_variant(spec, name, where)
    path = Path(where).expanduser()
    if not path.exists():
        raise ModelError(f"variant '{spec}': '{path}' does not exist")
    if not path.is_dir():
        raise ModelError(f"variant '{spec}': '{path}' is not a directory; accepted: {', '.join(KINDS)}")
    for detect in KINDS.values():
        found = detect(path)
        if found:
            break
    else:
        raise ModelError(f"variant '{spec}': '{path}' holds no model bench can run; accepted: {', '.join(KINDS)}")
    stages = lineage(path)
    pruned = any(s in ("prune", "recover") for s in stages)
    label = found.pop("label")
    if found["precision"] == "int8" and found["kind"] in ("onnx", "torchscript"):
        method = _int8_method(path, stages)
        if method == "int4":  # MatMulNBits with 4-bit blocks: its own precision, not int8's
            found["precision"], label = "int4", label + " int4 (4-bit weights)"
        else:
            label += " int8 " + method
    elif found["kind"] in ("onnx", "torchscript", "pytorch"):
        label += f" {found['precision']}" + (" (QAT, fake-quant)" if "qat" in stages[:1] else "")
    if pruned:
        label += " (pruned)"
    owner = "baseline" if found["kind"] == "pytorch" else ("ours" if found["kind"] in ("onnx", "torchscript")
                                                           else "peer")
    return Variant(name=name, path=path, label=label, owner=owner, pruned=pruned, lineage=stages, **found)


def triton_variant(spec: str, name: str, url: str) -> Variant:
    """`http://HOST:PORT/MODEL` (or grpc://): a text model served by Triton (`t5compress triton` + `serve`)."""
    protocol = "grpc" if url.startswith("grpc://") else "http"
    rest = url.split("://", 1)[1].rstrip("/")
    host, _, model = rest.partition("/")
    if not host or ":" not in host:
        raise ModelError(f"variant '{spec}': give the server as {protocol}://HOST:PORT/MODEL, e.g. "
                         f"{protocol}://127.0.0.1:8000/t5")
    if name == Path(rest).name:  # a bare URL: named after its model
        name = f"triton-{model or 't5'}"
    settings = {"url": f"{protocol}://{host}/{model or 't5'}", "host": host, "model": model or "t5",
                "protocol": protocol, "threads": "the server's own (the repository's instances and threads)"}
    return Variant(name=name, path=Path("."), kind="triton", precision="served", owner="ours",
                   label=f"Triton {protocol} ({model or 't5'})", settings=settings)


def _int8_method(path: Path, stages: list[str]) -> str:
    if stages[:1] == ["quantize"]:
        mode = ((read_json(path / META_FILE) or {}).get("config") or {}).get("mode")
        return mode or "quantized"
    if "qat" in stages:
        return "qat"
    return "quantized"


def resolve_all(specs: list[str]) -> list[Variant]:
    """Every spec resolved, before anything runs; names made unique (a second 'onnx' becomes 'onnx-2')."""
    if not specs:
        raise ModelError("give at least one variant (a model or export directory, or NAME=PATH)")
    variants, seen = [], {}
    for spec in specs:
        v = resolve(spec)
        seen[v.name] = seen.get(v.name, 0) + 1
        if seen[v.name] > 1:
            v.name = f"{v.name}-{seen[v.name]}"
        variants.append(v)
    return variants
