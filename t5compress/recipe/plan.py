"""A recipe file read and validated as a whole before anything runs: keys, types, the stages' own checks, the chain
order, every stage's input; then what a run would do (run or skip, and why) from the fingerprints of the last run."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from t5compress import __version__, artifacts
from t5compress.config import INPUT_FIELDS
from t5compress.recipe import schema
from t5compress.recipe.schema import RecipeError
from t5compress.recipe.stages import DATA_SUFFIXES, KINDS, PLANNED, Inputs, Kind, data_files
from t5compress.stages import DATA, chain_text

TOP_KEYS = ("name", "description", "out", "stages")
STAGE_KEYS = ("stage", "input")
CHAIN = chain_text()
STATE_FILE = "recipe.json"
RESERVED_IDS = (STATE_FILE,)  # names the runner itself writes in OUT: a stage dir of that name would collide
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# The settings that name a file or folder of the user's (the data stage's own, create's text, the stages' data, a
# pretrain corpus, a recovery teacher, prune's vocabulary data and keep list): each one that is a local path must
# exist when the recipe is validated.
NESTED_KEYS = ("recover",)  # nested configs a recipe gives under their own key (the others are flattened)


@dataclass(frozen=True)
class Stage:
    id: str
    kind: Kind
    dir: Path
    config: Any  # the stage's own frozen config (what its CLI command builds)
    inputs: Inputs
    artifact: str  # what it produces
    deps: tuple[str, ...]  # ids of the stages whose outputs it reads (input, data, bench variants)


class NotLanded(RecipeError):
    """The recipe names a stage that is planned but not in this version."""


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    out: Path
    stages: tuple[Stage, ...]
    description: str = ""

    def stage(self, sid: str) -> Stage:
        return next(s for s in self.stages if s.id == sid)


def load(path: str | Path, out: str | Path | None = None, overrides: dict[str, dict] | None = None,
         only: tuple[str, ...] | None = None) -> Recipe:
    """Read and validate the recipe at `path`. `out` replaces its out dir, `overrides` its stages' settings
    ({stage id: {key: value}}), `only` keeps these stages and the ones they read. Raises RecipeError (one line)."""
    return parse(schema.load_yaml(path), str(path), out, overrides, only)


def parse(doc: dict, source: str, out: str | Path | None = None, overrides: dict[str, dict] | None = None,
          only: tuple[str, ...] | None = None) -> Recipe:
    schema.check_keys(source, doc, TOP_KEYS)
    for key in ("name", "stages") + (() if out else ("out",)):
        if key not in doc:
            raise RecipeError(f"{source}: {key}: required")
    name = schema.coerce(f"{source}: name", doc["name"], str)
    where = "--out" if out is not None else f"{source}: out"
    out = Path(out if out is not None else schema.coerce(f"{source}: out", doc["out"], str))
    if out.exists() and not out.is_dir():  # each stage writes OUT/<stage id>: OUT must be a directory or nothing
        raise RecipeError(f"{where}: '{out}' exists and is not a directory; choose another output path")
    raw = doc["stages"]
    if not isinstance(raw, dict) or not raw:
        raise RecipeError(f"{source}: stages: give a mapping of stage id to settings, in chain order ({CHAIN})")
    raw = {sid: dict(settings or {}) if isinstance(settings, dict) or settings is None else settings
           for sid, settings in raw.items()}
    for sid, extra in (overrides or {}).items():
        if sid not in raw:
            raise schema.unknown_key(f"{source}: stages", sid, raw)
        raw[sid] = {**raw[sid], **extra}
    stages: list[Stage] = []
    for sid, settings in raw.items():
        try:
            stages.append(_stage(source, str(sid), settings, stages, out))
        except NotLanded:
            if not only or sid in only:
                raise
            # a stage left out by `only` may wait for its module; a kept stage that reads it fails on its input
    if only:
        stages = _keep(source, stages, only)
    return Recipe(name, source, out, tuple(stages), str(doc.get("description") or ""))


def _stage(source: str, sid: str, settings: Any, before: list[Stage], out: Path) -> Stage:
    where = sid
    if not _ID.match(sid):
        raise RecipeError(f"{source}: stages.{sid}: a stage id names its directory: letters, digits, '-', '_', '.'")
    if sid.lower() in RESERVED_IDS:
        raise RecipeError(f"{source}: stages.{sid}: '{sid}' is the file the runner keeps in OUT; name the stage "
                          "something else")
    if not isinstance(settings, dict):
        raise RecipeError(f"{source}: {where}: expected a mapping of settings, got {settings!r}")
    settings = dict(settings)
    kind_name = settings.pop("stage", sid)
    kind = _kind(source, where, kind_name)
    try:
        schema.check_keys(where, settings, set(kind.keys) | set(STAGE_KEYS))
        data = next((s for s in before if s.artifact == DATA), None)
        if kind.name == "data" and data is not None:
            raise RecipeError(f"{where}: a recipe has one data stage ('{data.id}' already is)")
        _check_order(where, kind, before, "input" in settings)
        src = _input(where, kind, settings.pop("input", None), before)
        variants = _variants(where, settings.pop("variants", None), before) if "variants" in kind.keys else ()
        train, evl = (data.inputs.train, data.inputs.eval) if data else (None, None)
        inputs = Inputs(train=train, eval=evl, src=src.dir if src else None,
                        src_artifact=src.artifact if src else None,
                        variants=tuple(v.dir for v in variants), names=tuple(v.id for v in variants))
        settings = _interpolate(where, settings, {"${data.train}": train, "${data.eval}": evl})
        config = kind.build(where, settings, inputs)
        _check_inputs_exist(where, config, out)
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from None
    if kind.name == "data":
        train, evl = data_files(config, out / sid)
        inputs = Inputs(train=train, eval=evl)
    deps = [s.id for s in (src, *variants) if s is not None]
    if data is not None and data.id not in deps and _reads(config, (inputs.train, inputs.eval)):
        deps.insert(0, data.id)
    return Stage(sid, kind, out / sid, config, inputs, kind.produces(src.artifact if src else None), tuple(deps))


def _check_inputs_exist(where: str, config: Any, out: Path) -> None:
    """Every local path among the stage's INPUT_FIELDS exists, unless an earlier stage writes it (it lies in OUT)."""
    for name, value in _input_paths(config):
        p = Path(value).expanduser()
        local = p.suffix.lower() in DATA_SUFFIXES or value.startswith((".", "/", "~"))
        if local and not p.exists() and not _within(p, out):
            raise RecipeError(f"{where}.{name}: '{value}' does not exist")


def _input_paths(config: Any, prefix: str = ""):
    """(key as the recipe spells it, value) of the string INPUT_FIELDS of a config and of the configs in it."""
    if not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from _input_paths(value, prefix + (f"{f.name}." if f.name in NESTED_KEYS else ""))
        elif f.name in INPUT_FIELDS and isinstance(value, str) and value:
            yield prefix + f.name, value


def _within(p: Path, out: Path) -> bool:
    try:
        p.resolve().relative_to(out.resolve())
    except ValueError:
        return False
    return True


def _interpolate(where: str, settings: Any, values: dict[str, str | None]) -> Any:
    """`${data.train}` and `${data.eval}` in a setting name the data stage's files (wherever OUT is)."""
    if isinstance(settings, dict):
        return {k: _interpolate(f"{where}.{k}", v, values) for k, v in settings.items()}
    if isinstance(settings, str) and settings in values:
        if values[settings] is None:
            raise RecipeError(f"{where}: {settings} names a file no data stage before this one gives")
        return values[settings]
    return settings


def _kind(source: str, where: str, name: Any) -> Kind:
    if name in PLANNED:
        raise NotLanded(f"{source}: {where}: stage '{name}' has not landed in t5compress {__version__}: "
                          f"{PLANNED[name]}")
    if name not in KINDS:
        valid = sorted(KINDS)
        close = difflib.get_close_matches(str(name), valid, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of {', '.join(valid)}"
        what = f"unknown stage {name!r}"
        if name == where:
            what = f"'{where}' is not a stage name, and it has no `stage:` key"
        raise RecipeError(f"{source}: {where}: {what}; {hint}")
    return KINDS[name]


def _check_order(where: str, kind: Kind, before: list[Stage], explicit: bool) -> None:
    """Stages come in chain order; a stage that reads an earlier one by `input:` may start a branch."""
    prev = before[-1] if before else None
    if prev is None or explicit or kind.rank >= prev.kind.rank:
        return
    raise RecipeError(f"{where}: a {kind.name} stage cannot come after '{prev.id}' ({prev.kind.name}): stages run in "
                      f"chain order, {CHAIN}; move it, or give `input:` to branch from an earlier stage")


def _producers(consumes: tuple[str, ...]) -> str:
    names = [k.name for k in KINDS.values() if any(k.produces(a) in consumes for a in (None, "model", "qat-model"))]
    return ", ".join(dict.fromkeys(names))


def _input(where: str, kind: Kind, given: Any, before: list[Stage]) -> Stage | None:
    if not kind.consumes or "variants" in kind.keys:
        if given is not None:
            raise RecipeError(f"{where}.input: a {kind.name} stage reads no other stage's output")
        return None
    if given is not None:
        src = next((s for s in before if s.id == given), None)
        if src is None:
            earlier = ", ".join(s.id for s in before) or "none"
            raise RecipeError(f"{where}.input: no stage '{given}' before this one (earlier stages: {earlier})")
        if src.artifact not in kind.consumes:
            raise RecipeError(f"{where}.input: '{src.id}' gives {_a(src.artifact)}; a {kind.name} stage reads "
                              f"{_a(' or '.join(kind.consumes))} (from {_producers(kind.consumes)})")
        return src
    src = next((s for s in reversed(before) if s.artifact in kind.consumes), None)
    if src is None:
        raise RecipeError(f"{where}: a {kind.name} stage reads {_a(' or '.join(kind.consumes))}, and no stage before "
                          f"it gives one (add {_producers(kind.consumes)} before it)")
    return src


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _variants(where: str, given: Any, before: list[Stage]) -> list[Stage]:
    kind = KINDS["bench"]
    if given is None:
        found = [s for s in before if s.artifact in kind.consumes and s.kind.name != "create"]
        if not found:
            raise RecipeError(f"{where}.variants: no stage before it gives a model or an export to measure")
        return found
    if isinstance(given, str):
        given = [given]
    if not isinstance(given, list) or not given:
        raise RecipeError(f"{where}.variants: give a list of stage ids, e.g. [train, export, quantize]")
    out = []
    for sid in given:
        src = next((s for s in before if s.id == sid), None)
        if src is None:
            raise schema.unknown_key(f"{where}.variants", sid, [s.id for s in before]) from None
        if src.artifact not in kind.consumes:
            raise RecipeError(f"{where}.variants: '{sid}' gives {_a(src.artifact)}, not a model or export to measure")
        out.append(src)
    return out


def _reads(config: Any, files: tuple[str | None, ...]) -> bool:
    wanted = {f for f in files if f}
    return bool(wanted & set(artifacts.strings_in(config)))


def _keep(source: str, stages: list[Stage], only: tuple[str, ...]) -> list[Stage]:
    ids = {s.id for s in stages}
    for sid in only:
        if sid not in ids:
            raise schema.unknown_key(f"{source}: stages", sid, ids)
    keep = set(only)
    for s in reversed(stages):
        if s.id in keep:
            keep |= set(s.deps)
    return [s for s in stages if s.id in keep]


# --- fingerprints and the plan ----------------------------------------------------------------------------------


def settings_fingerprint(recipe: Recipe, stage: Stage) -> tuple[str, str]:
    """The stage's kind and config, with the recipe's out dir written as $OUT (moving a run keeps it) and the content
    of the user's files it names (editing a data file reruns what reads it)."""
    config = _portable(dataclasses.asdict(stage.config), str(recipe.out))
    files = {}
    for s in artifacts.strings_in(config):
        p = Path(s)
        if "$OUT" not in s and p.is_file():
            files[s] = _file_hash(p)
        elif "$OUT" not in s and p.is_dir() and stage.kind.name == "load":
            files[s] = artifacts.dir_hash(p)
    return _hash({"kind": stage.kind.name, "config": config}), _hash(files)


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _portable(obj: Any, out: str) -> Any:
    if isinstance(obj, str):
        return obj.replace(out, "$OUT", 1) if obj.startswith(out) else obj
    if isinstance(obj, dict):
        return {k: _portable(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_portable(v, out) for v in obj]
    return obj


def _file_hash(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def fingerprints(recipe: Recipe) -> dict[str, dict]:
    """Per stage: its settings fingerprint, its inputs' fingerprints, and the fingerprint of all of it."""
    result: dict[str, dict] = {}
    for s in recipe.stages:
        settings, files = settings_fingerprint(recipe, s)
        deps = {d: result[d]["fingerprint"] for d in s.deps}
        fp = _hash({"settings": settings, "files": files, "deps": deps, "version": __version__})
        result[s.id] = {"fingerprint": fp, "settings": settings, "files": files, "deps": deps, "version": __version__}
    return result


def read_state(out: Path) -> dict:
    state = artifacts.read_json(out / STATE_FILE) if out.is_dir() else None
    return state if isinstance(state, dict) and isinstance(state.get("stages"), dict) else {"stages": {}}


def complete(stage: Stage) -> bool:
    """The stage's directory holds its report (stages write through a temporary sibling, so a dir with its report is
    whole)."""
    return (stage.dir / artifacts.REPORT_FILE).is_file()


def plan(recipe: Recipe, force: bool = False) -> list[dict]:
    """What a run does, stage by stage: {id, kind, dir, action: run|skip, why, fingerprint}."""
    fps, state = fingerprints(recipe), read_state(recipe.out)["stages"]
    _refuse_overlaps(recipe, state)
    rows, running = [], set()
    for s in recipe.stages:
        fp, old = fps[s.id], state.get(s.id) or {}
        why = _why_run(s, fp, old, running, force)
        if why:
            running.add(s.id)
        rows.append({"id": s.id, "kind": s.kind.name, "dir": str(s.dir), "action": "run" if why else "skip",
                     "why": why or "done, unchanged", **fp})
    return rows


def _refuse_overlaps(recipe: Recipe, state: dict) -> None:
    """No stage dir may be, hold or lie inside a file the user gave (the recipe, data, models), even with --force.
    Paths inside stage dirs this recipe wrote (recorded in its state) are its own products, not the user's."""
    own = [(recipe.out / sid).resolve() for sid in state]
    named = [Path(s).resolve() for stage in recipe.stages for s in artifacts.strings_in(stage.config) if s]
    user = [recipe.source] + [p for p in named if not any(d == p or d in p.parents for d in own)]
    for stage in recipe.stages:
        artifacts.refuse_overlap(stage.dir, user)


def _why_run(s: Stage, fp: dict, old: dict, running: set, force: bool) -> str | None:
    if force:
        return "--force"
    if not old or not s.dir.is_dir():
        return "not run yet"
    if old.get("unfinished"):
        return "the last run of it did not finish"
    if not complete(s):
        return "output incomplete"
    if old.get("version") != fp["version"]:
        return f"t5compress {old.get('version')} → {fp['version']}"
    if old.get("settings") != fp["settings"]:
        return "settings changed"
    if old.get("files") != fp["files"]:
        return "a file it reads changed"
    for d in s.deps:
        if d in running:
            return f"input '{d}' reruns"
        if (old.get("deps") or {}).get(d) != fp["deps"][d]:
            return f"input '{d}' changed"
    if old.get("fingerprint") != fp["fingerprint"]:
        return "inputs changed"
    return None
