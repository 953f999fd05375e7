"""Named T5 architectures: the T5 sizes, T5 v1.1 / Flan-T5 shapes and the T5-Efficient naming scheme.

T5-Efficient names are `t5-efficient-<size>[-<variant><n>...]`, where a variant changes one dimension of the base
size (Tay et al., "Scale Efficiently"): nl (layers in encoder and decoder), el (encoder layers), dl (decoder layers),
dm (d_model), ff (d_ff), kv (d_kv), nh (num_heads). Example: `t5-efficient-small-el2` is t5-efficient-small with a
2-layer encoder (47.92M parameters with the 32128-token vocabulary).
"""

from __future__ import annotations

import math
import re
from typing import Any

from t5compress.errors import ConfigError, first_line

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
    check_overrides(overrides or {}, kwargs)
    return kwargs


# What an override may be, per kind of T5Config field (the rest must have the type of T5Config's default).
_SIZES = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
          "relative_attention_num_buckets", "relative_attention_max_distance")
_RATES = ("dropout_rate", "classifier_dropout")  # in [0, 1)
_POSITIVE = ("layer_norm_epsilon", "initializer_factor")


def check_overrides(overrides: dict[str, Any], merged: dict[str, Any]) -> None:
    """The one check of architecture overrides (CLI -o, recipes, pretrain): each a T5Config field of the right type
    and range, and T5Config accepts the whole; else a ConfigError naming `overrides` and the field."""
    if not overrides:
        return
    from transformers import T5Config
    from transformers.activations import ACT2FN

    defaults = T5Config().to_dict()
    for key, value in overrides.items():
        if key not in defaults:
            raise ConfigError(f"overrides: {key!r} is not a T5Config field (e.g. d_model, d_ff, num_heads, d_kv)")
        if key in _SIZES:
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "a positive integer"
        elif key in _RATES:
            ok, want = _number(value) and 0 <= value < 1, "a number in [0, 1)"
        elif key in _POSITIVE:
            ok, want = _number(value) and value > 0, "a positive number"
        else:
            default = defaults[key]
            kind = bool if isinstance(default, bool) else float if isinstance(default, float) else type(default)
            ok = default is None or (_number(value) if kind is float else
                                     isinstance(value, kind) and (kind is bool or not isinstance(value, bool)))
            want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))
        if not ok:
            raise ConfigError(f"overrides: {key} must be {want}, got {value!r}")
    try:
        config = T5Config(**merged)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"overrides: T5Config refuses them: {first_line(e)}") from None
    if config.dense_act_fn not in ACT2FN:
        raise ConfigError(f"overrides: feed_forward_proj {config.feed_forward_proj!r} names no activation "
                          "transformers knows (e.g. relu, gelu, gated-gelu, gated-silu)")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse `key=value` strings into T5Config overrides (ints, floats, booleans and strings), checked as
    `check_overrides` checks every override."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. d_model=256")
        key, raw = (s.strip() for s in item.split("=", 1))
        out[key] = _parse_value(raw)
    check_overrides(out, out)  # keys, types and ranges (architecture() checks them again against the base sizes)
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
