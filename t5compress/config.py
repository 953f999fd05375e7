"""Helpers for the frozen per-stage config dataclasses: one help string per field, reused by the CLI."""

from __future__ import annotations

import dataclasses
from typing import Any

from t5compress.errors import ConfigError

# The config fields whose value names something a stage reads (a file, a directory, a program): only these are
# inputs to the output-overlap check and to a recipe's checks, never a choice such as `weight_range: full` that
# happens to spell the name of a folder in the current directory.
INPUT_FIELDS = ("train", "eval", "text", "train_data", "eval_data", "calib_data", "data", "corpus", "teacher", "vocab",
                "vocab_keep", "model", "peer_python", "tritonserver")


def option(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:  # noqa: A002
    """A dataclass field that carries its one-line help text in metadata."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


def help_of(cls: type, name: str) -> str:
    """The help string of field `name` of config class `cls`."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def default_of(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return None
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def require(cond: bool, field: str, message: str) -> None:
    """Raise a ConfigError naming `field` unless `cond` holds."""
    if not cond:
        raise ConfigError(f"{field}: {message}")


def choose(registry: dict, key: str, what: str) -> Any:
    """Look `key` up in a registry; an unknown key lists the valid ones."""
    try:
        return registry[key]
    except KeyError:
        raise ConfigError(f"unknown {what} {key!r}; choose one of: {', '.join(sorted(registry))}") from None
