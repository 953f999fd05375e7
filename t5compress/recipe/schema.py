"""Reading a recipe's YAML and turning a stage's settings into the stage's own frozen config.

The keys a stage accepts are the fields of the config classes its CLI command builds (flattened the way the command
flattens them), so a recipe and the CLI spell every setting the same way and share every check: the configs'
`__post_init__` runs, and its ConfigError comes back as one line naming `stage.key`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from t5compress.errors import ConfigError, DataError
from t5compress.textio import read_text


class RecipeError(ConfigError):
    """A recipe is invalid: one line naming the file, the stage and the key."""


def load_yaml(path: str | Path) -> dict:
    """The recipe file as a mapping; duplicate keys are an error (YAML would silently keep the last one)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise RecipeError(f"{path}: line {key_node.start_mark.line + 1}: key {key!r} given twice")
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    p = Path(path)
    if p.is_dir():
        raise RecipeError(f"recipe '{path}' is a directory; give the recipe's YAML file")
    if not p.is_file():
        raise RecipeError(f"recipe '{path}' does not exist")
    try:
        text = read_text(p, "recipe")
    except DataError as e:  # binary garbage, or a file it cannot read
        raise RecipeError(str(e)) from None
    try:
        doc = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        why = " ".join(str(getattr(e, "problem", None) or e).split())  # one line: yaml's messages span several
        raise RecipeError(f"{path}: {where}not valid YAML ({why})") from None
    if not isinstance(doc, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with name, out and stages")
    return doc


def unknown_key(where: str, key: Any, valid: typing.Iterable[str]) -> RecipeError:
    """'where.key: unknown key; did you mean ...?' with the closest valid key, or the valid keys when none is close."""
    valid = sorted(valid)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
    return RecipeError(f"{where}.{key}: unknown key; {hint}")


def check_keys(where: str, settings: dict, valid: typing.Iterable[str]) -> None:
    valid = set(valid)
    for key in settings:
        if key not in valid:
            raise unknown_key(where, key, valid)


def coerce(where: str, value: Any, hint: Any) -> Any:
    """`value` as the annotated type `hint` (YAML gives lists for tuples, ints for floats), else a one-line error."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(where, value, arg)
            except RecipeError as e:
                errors.append(e)
        raise errors[0]
    if hint is Any:
        return value
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        item = args[0] if args else Any
        return tuple(coerce(f"{where}[{i}]", v, item) for i, v in enumerate(items))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping, got {_show(value)}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{where}: expected true or false, got {_show(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{where}: expected an integer, got {_show(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{where}: expected a number, got {_show(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise RecipeError(f"{where}: expected a string, got {_show(value)}")
        return str(value)
    return value


def _show(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"


def fields_of(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Each field of config class `cls` with its resolved type annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def flat_keys(cls: type, flatten: dict) -> set[str]:
    """The keys of `cls` with the nested configs named in `flatten` merged into the same level (a value is a config
    class, or a (class, its own flatten) pair)."""
    keys = set()
    for name in fields_of(cls):
        if name in flatten:
            sub_cls, sub_flat = _split(flatten[name])
            keys |= flat_keys(sub_cls, sub_flat)
        else:
            keys.add(name)
    return keys


def _split(sub: Any) -> tuple[type, dict]:
    return sub if isinstance(sub, tuple) else (sub, {})


def build(where: str, cls: type, settings: dict, flatten: dict[str, type] | None = None,
          fixed: dict[str, Any] | None = None, base: Any = None) -> Any:
    """Construct config `cls` from the flat `settings` (nested configs in `flatten` take their own fields from the same
    level); `fixed` are values the recipe sets itself (not keys of the stage). Errors name `where.key`."""
    flatten = flatten or {}
    kwargs: dict[str, Any] = dict(fixed or {})
    if base is not None:  # the field's own default (e.g. recovery's 4,800 steps), changed only where the recipe says
        kwargs = {n: getattr(base, n) for n in fields_of(cls) if n not in flatten} | kwargs
    for name, (f, hint) in fields_of(cls).items():
        if name in flatten:
            sub_cls, sub_flat = _split(flatten[name])
            sub_base = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            kwargs[name] = build(where, sub_cls, settings, sub_flat, base=sub_base)
        elif name in settings and name not in (fixed or {}):
            kwargs[name] = coerce(f"{where}.{name}", settings[name], hint)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise RecipeError(f"{where}.{e}") from None
    except TypeError:  # a required field the recipe did not give
        missing = [n for n, (f, _) in fields_of(cls).items() if n not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            hint = " (give it, or put a data stage first)" if "data" in missing[0] else ""
            raise RecipeError(f"{where}.{missing[0]}: required{hint}") from None
        raise
