"""Weights on disk, read in one guarded place: which safetensors files a model dir has, their headers (checked
against the file sizes, so a truncated or foreign file is one line, not a traceback), and their tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

from t5compress.errors import ModelError, first_line
from t5compress.names import LAYOUT_KEY


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model dir: model.safetensors, or the shards its index names."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if not index.is_file():
        return [p / "model.safetensors"] if (p / "model.safetensors").exists() else []
    try:
        shards = sorted(set(map(str, json.loads(read_bytes(index)).get("weight_map", {}).values())))
    except (ValueError, AttributeError, TypeError) as e:
        raise ModelError(f"{index.name} in '{p}' is damaged: not a safetensors index ({first_line(e)})") from None
    return [p / s for s in shards]


def weight_headers(path: str | os.PathLike) -> dict[str, dict]:
    """The tensor table of every weights file of a model dir, each file checked against its header (see
    `safetensors_header`) and against config.json (see `check_config_fits`): the one place that reads a model dir's
    weights files before a loader does."""
    headers: dict[str, dict] = {}
    for f in weight_files(path):
        headers.update(safetensors_header(f))
    check_config_fits(path, headers)
    return headers


# The shape of each T5 weight in config.json's terms (inner: num_heads * d_kv). Enough to name what disagrees when a
# config.json is edited or copied from another model, before a loader fails on "size mismatch" with no names.
_BLOCK = r"(?:en|de)coder\.block\.\d+\.layer\.\d+\."
_SHAPES = (
    (r"shared\.weight|lm_head\.weight|(?:en|de)coder\.embed_tokens\.weight", ("vocab_size", "d_model")),
    (_BLOCK + r"(?:SelfAttention|EncDecAttention)\.[qkv]\.weight", ("inner", "d_model")),
    (_BLOCK + r"(?:SelfAttention|EncDecAttention)\.o\.weight", ("d_model", "inner")),
    (_BLOCK + r"SelfAttention\.relative_attention_bias\.weight", ("relative_attention_num_buckets", "num_heads")),
    (_BLOCK + r"DenseReluDense\.wi(?:_0|_1)?\.weight", ("d_ff", "d_model")),
    (_BLOCK + r"DenseReluDense\.wo\.weight", ("d_model", "d_ff")),
    (r"(?:en|de)coder\.(?:final_layer_norm|block\.\d+\.layer\.\d+\.layer_norm)\.weight", ("d_model",)),
)
_PER_LAYER = ("inner", "num_heads", "d_ff")  # sizes a non-uniformly pruned model records per layer instead


def check_config_fits(path: str | os.PathLike, headers: dict[str, dict]) -> None:
    """A one-line ModelError naming the sizes on which config.json and the weights' shapes (`headers`) disagree, and
    a tensor that shows it; nothing when they agree, or when config.json is missing or unreadable (its readers say
    so). Per-layer sizes are not compared for a model that records them (non-uniform pruning)."""
    import re

    config_file = Path(path) / "config.json"
    try:
        config = json.loads(config_file.read_bytes())
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        return
    sizes = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    if "num_heads" in sizes and "d_kv" in sizes:
        sizes["inner"] = sizes["num_heads"] * sizes["d_kv"]
    skip = _PER_LAYER if config.get(LAYOUT_KEY) else ()
    wrong: dict[str, tuple[int, str, list]] = {}
    for name, table in sorted(headers.items()):
        shape = table.get("shape") if isinstance(table, dict) else None
        dims = next((d for pattern, d in _SHAPES if re.fullmatch(pattern, name)), None)
        if dims is None or not isinstance(shape, list) or len(shape) != len(dims):
            continue
        for key, got in zip(dims, shape, strict=True):
            if key in sizes and key not in skip and got != sizes[key] and key not in wrong:
                wrong[key] = (got, name, shape)
    for stack, key in (("encoder", "num_layers"), ("decoder", "num_decoder_layers")):
        blocks = {int(m.group(1)) for n in headers if (m := re.match(rf"{stack}\.block\.(\d+)\.", n))}
        want = sizes.get(key, sizes.get("num_layers"))
        if blocks and want is not None and len(blocks) != want:
            wrong[key] = (len(blocks), f"{stack}.block.*", [f"{len(blocks)} blocks"])
    if wrong:
        said = "; ".join(
            f"{'num_heads x d_kv' if k == 'inner' else k}: {_said(k, sizes)} in config.json, {got} in the weights "
            f"({name} {shape})" for k, (got, name, shape) in wrong.items())
        raise ModelError(f"config.json in '{Path(path)}' does not match its weights: {said}; the config belongs to "
                         "another model (or was edited): use the config.json saved with these weights")


def _said(key: str, sizes: dict[str, int]) -> str:
    return f"{sizes['num_heads']} x {sizes['d_kv']}" if key == "inner" else str(sizes[key])


def safetensors_header(file: str | os.PathLike) -> dict[str, dict]:
    """The tensor table of a safetensors file ({name: {dtype, shape, data_offsets}}), read without the weights.

    Raises a one-line ModelError when the file cannot be read (naming permission problems as such) or is damaged:
    shorter than its header says (a truncated copy or download), or not a safetensors file at all.
    """
    f = Path(file)
    try:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise _damaged(f, f"{size} bytes, too short to be one")
            n = int.from_bytes(head, "little")
            if not 0 < n <= size - 8:
                raise _damaged(f, f"its header length ({n:,} bytes) does not fit in the file ({size:,} bytes)")
            raw = fh.read(n)
    except OSError as e:
        raise _unreadable(f, e) from None
    try:
        header = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise _damaged(f, f"its header is not JSON ({first_line(e)})") from None
    if not isinstance(header, dict):
        raise _damaged(f, "its header is not a table of tensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise _damaged(f, "its header is not a table of tensors") from None
    if end != size - 8 - n:
        what = "truncated" if end > size - 8 - n else "wrong size"
        raise _damaged(f, f"{what}: its header lists {end:,} bytes of tensor data, the file holds {size - 8 - n:,}")
    return tensors


def _damaged(file: Path, why: str) -> ModelError:
    return ModelError(f"{file.name} in '{file.parent}' is damaged or not a safetensors file: {why}")


def _unreadable(file: Path, e: OSError) -> ModelError:
    why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or first_line(e))
    return ModelError(f"cannot read {file.name} in '{file.parent}': {why}")


def read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise _unreadable(file, e) from None


def load_safetensors(file: str | os.PathLike) -> dict:
    """`safetensors.torch.load_file`, behind the header check: every direct read of a weights file goes here."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = Path(file)
    safetensors_header(f)
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _damaged(f, first_line(e)) from e
