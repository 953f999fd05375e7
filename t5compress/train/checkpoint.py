"""Resumable training checkpoints, written atomically.

Layout of a run's work directory (`OUT.partial/` beside the final output):
    ckpt-0000050/   model.safetensors, optimizer.pt, scheduler.pt, rng.pt, state.json
    latest.json     {"checkpoint": "ckpt-0000050"}   (replaced atomically after the checkpoint is complete)
    best/           the best model so far (model.safetensors + state.json)
A checkpoint is built in a temporary directory and renamed; `latest.json` then points at it; only then are older
checkpoints deleted. A kill -9 at any moment leaves a complete checkpoint that `latest.json` names.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from t5compress import artifacts
from t5compress.artifacts import read_json, replace_dir, write_json
from t5compress.errors import OutputError

LATEST = "latest.json"
log = logging.getLogger(__name__)


def _stage_dir(workdir: Path, final: Path, write) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=workdir))
    try:
        write(tmp)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_weights(model, directory: Path) -> None:
    # save_model de-duplicates tied tensors (shared embedding / lm_head), which save_file refuses.
    safetensors.torch.save_model(model, str(directory / "model.safetensors"))


def load_weights(model, directory: Path) -> None:
    from t5compress.model.weights import safetensors_header

    safetensors_header(directory / "model.safetensors")  # a damaged checkpoint is one line, not a traceback
    safetensors.torch.load_model(model, str(directory / "model.safetensors"))


def save_checkpoint(workdir: Path, model, optimizer, scheduler, state: dict, keep: int = 1) -> Path:
    """Write checkpoint `ckpt-{step}` and point `latest.json` at it; delete older checkpoints beyond `keep`."""
    name = f"ckpt-{state['step']:07d}"

    def write(d: Path) -> None:
        save_weights(model, d)
        torch.save(optimizer.state_dict(), d / "optimizer.pt")
        torch.save(scheduler.state_dict(), d / "scheduler.pt")
        torch.save({"torch": torch.get_rng_state()}, d / "rng.pt")
        (d / "state.json").write_text(json.dumps(state, indent=1))

    _stage_dir(workdir, workdir / name, write)
    write_json(workdir / LATEST, {"checkpoint": name})
    for old in sorted(workdir.glob("ckpt-*"))[:-keep]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return workdir / name


def latest_checkpoint(workdir: Path) -> Path | None:
    """The complete checkpoint `latest.json` names, if there is one."""
    latest = read_json(workdir / LATEST) if (workdir / LATEST).is_file() else None
    d = workdir / latest["checkpoint"] if latest and latest.get("checkpoint") else None
    return d if d is not None and d.is_dir() else None


def resumable(workdir: Path) -> bool:
    return latest_checkpoint(workdir) is not None


def load_checkpoint(workdir: Path, model, optimizer, scheduler) -> dict | None:
    """Restore model, optimizer, scheduler and RNG from the latest checkpoint; return its training state, or None
    when the run was stopped before its first checkpoint (it starts at step 0: nothing was lost)."""
    d = latest_checkpoint(workdir)
    if d is None:
        log.info("'%s' holds no complete checkpoint yet: starting at step 0", workdir)
        return None
    load_weights(model, d)
    optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(d / "scheduler.pt", weights_only=True))
    torch.set_rng_state(torch.load(d / "rng.pt", weights_only=True)["torch"])
    return json.loads((d / "state.json").read_text())


def save_best(workdir: Path, model, info: dict) -> None:
    def write(d: Path) -> None:
        save_weights(model, d)
        (d / "state.json").write_text(json.dumps(info, indent=1))

    _stage_dir(workdir, workdir / "best", write)


def load_best(workdir: Path, model) -> dict | None:
    d = workdir / "best"
    if not (d / "model.safetensors").is_file():
        return None
    load_weights(model, d)
    return json.loads((d / "state.json").read_text())


def workdir_of(out: Path) -> Path:
    """Checkpoints of an unfinished run live beside the output, so `--resume` finds them after a kill -9."""
    return out.with_name(out.name + ".partial")


def prepare_workdir(out: Path, cfg: Any, force: bool, resume: bool) -> Path:
    """The work dir of a training run into `out`: the one to resume (same options), or a fresh one (`force` drops
    an interrupted run's); records the options in run.json.

    A work dir without a complete checkpoint (the run was stopped before its first one) holds nothing to resume: it
    is replaced by a fresh one, with or without `resume`, so neither rerun is a dead end.
    """
    artifacts.check_output(out, force)
    work = workdir_of(out)
    if work.exists() and not resumable(work):
        log.warning("removed '%s': the run that left it stopped before its first checkpoint; starting at step 0", work)
        shutil.rmtree(work)
    elif resume:
        saved = read_json(work / "run.json")
        if saved is None:
            raise OutputError(f"nothing to resume: '{work}' does not exist; run again without --resume")
        if saved["config"] != dataclasses.asdict(cfg):
            raise OutputError(f"'{work}' was started with other options; resume with the same options or use --force")
        artifacts.attach_workdir(out, work, resumable)
        return work
    elif work.exists():
        if not force:
            raise OutputError(f"an interrupted run left '{work}'; pass --resume to continue or --force to start over")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    artifacts.attach_workdir(out, work, resumable)
    write_json(work / "run.json", {"config": dataclasses.asdict(cfg)})
    return work
