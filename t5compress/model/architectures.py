"""Named T5 architectures: the T5 sizes, T5 v1.1 / Flan-T5 shapes and the T5-Efficient naming scheme.

T5-Efficient names are `t5-efficient-<size>[-<variant><n>...]`, where a variant changes one dimension of the base
size (Tay et al., "Scale Efficiently"): nl (layers in encoder and decoder), el (encoder layers), dl (decoder layers),
dm (d_model), ff (d_ff), kv (d_kv), nh (num_heads). Example: `t5-efficient-small-el2` is t5-efficient-small with a
2-layer encoder (47.92M parameters with the 32128-token vocabulary).
"""

from __future__ import annotations

import re
from typing import Any

from t5compress.errors import ConfigError

# (encoder layers, decoder layers, d_model, d_ff, d_kv, num_heads)
_EFFICIENT_SIZES = {
    "tiny": (4, 4, 256, 1024, 64, 4),
    "mini": (4, 4, 384, 1536, 64, 8),
    "small": (6, 6, 512, 2048, 64, 8),
    "base": (12, 12, 768, 3072, 64, 12),
    "large": (24, 24, 1024, 4096, 64, 16),
    "xl": (24, 24, 1024, 16384, 128, 32),
    "xxl": (24, 24, 1024, 65536, 128, 128),
}
_V1_1_SIZES = {
    "small": (8, 8, 512, 1024, 64, 6),
    "base": (12, 12, 768, 2048, 64, 12),
    "large": (24, 24, 1024, 2816, 64, 16),
    "xl": (24, 24, 2048, 5120, 64, 32),
}
_VARIANT_FIELDS = {
    "nl": ("num_layers", "num_decoder_layers"),
    "el": ("num_layers",),
    "dl": ("num_decoder_layers",),
    "dm": ("d_model",),
    "ff": ("d_ff",),
    "kv": ("d_kv",),
    "nh": ("num_heads",),
}
_EFFICIENT_RE = re.compile(r"^t5-efficient-(?P<size>[a-z]+)(?P<variants>(?:-[a-z]{2}\d+)*)$")



def _shape(sizes: tuple[int, ...]) -> dict[str, int]:
    enc, dec, d_model, d_ff, d_kv, heads = sizes
    return dict(num_layers=enc, num_decoder_layers=dec, d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_heads=heads)


def _v1_0(sizes: tuple[int, ...]) -> dict[str, Any]:
    return {**_shape(sizes), "feed_forward_proj": "relu", "tie_word_embeddings": True}


def _v1_1(sizes: tuple[int, ...]) -> dict[str, Any]:
    return {**_shape(sizes), "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}


def _registry() -> dict[str, dict[str, Any]]:
    reg: dict[str, dict[str, Any]] = {}
    for size, shape in _EFFICIENT_SIZES.items():
        reg[size] = _v1_0(shape)
        reg[f"t5-{size}"] = _v1_0(shape)
        reg[f"t5-efficient-{size}"] = _v1_0(shape)
    for size, shape in _V1_1_SIZES.items():
        reg[f"t5-v1_1-{size}"] = _v1_1(shape)
        reg[f"flan-t5-{size}"] = _v1_1(shape)
    return reg


ARCHITECTURES = _registry()


def architecture(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """T5Config keyword arguments for a named architecture, with explicit overrides applied last."""
    key = name.lower().split("/")[-1]
    if key in ARCHITECTURES:
        kwargs = dict(ARCHITECTURES[key])
    else:
        m = _EFFICIENT_RE.match(key)
        if not m or m.group("size") not in _EFFICIENT_SIZES:
            raise ConfigError(
                f"unknown architecture {name!r}; use one of {', '.join(sorted(ARCHITECTURES))} "
                "or a T5-Efficient name such as t5-efficient-small-el2 (variants nl, el, dl, dm, ff, kv, nh)"
            )
        kwargs = _v1_0(_EFFICIENT_SIZES[m.group("size")])
        for part in filter(None, m.group("variants").split("-")):
            code, value = part[:2], int(part[2:])
            if code not in _VARIANT_FIELDS:
                raise ConfigError(f"architecture {name!r}: unknown variant {code!r}; use nl, el, dl, dm, ff, kv or nh")
            if value <= 0:
                raise ConfigError(f"architecture {name!r}: variant {part!r} must be positive")
            for fld in _VARIANT_FIELDS[code]:
                kwargs[fld] = value
    for k, v in (overrides or {}).items():
        kwargs[k] = v
    return kwargs


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse `key=value` strings into T5Config overrides (ints, floats, booleans and strings)."""
    from transformers import T5Config

    known = set(T5Config().to_dict())
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. d_model=256")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in known:
            raise ConfigError(f"override {key!r} is not a T5Config field (e.g. d_model, d_ff, num_heads, num_layers)")
        out[key] = _parse_value(raw)
    return out


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw
