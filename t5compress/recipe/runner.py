"""Running a validated recipe: each stage into its own directory, skipping the ones whose output is complete and
whose fingerprint (settings + inputs' fingerprints + t5compress version) matches the last run's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from t5compress import artifacts
from t5compress.errors import OutputError
from t5compress.progress import Reporter
from t5compress.recipe.plan import STATE_FILE, Recipe, Stage, plan, read_state

log = logging.getLogger(__name__)


OnStage = Callable[[Stage, dict, int, int], None]


def run(recipe: Recipe, force: bool = False, progress: bool = True, on_stage: OnStage | None = None) -> dict:
    """Run `recipe` (stage by stage, in order) and return the result: one row per stage with its action, why, time
    and key numbers, and each stage's report. The state of the run is kept in OUT/recipe.json.

    The whole of OUT is claimed first (`claimed`), so a second run of the recipe is refused before it plans.
    """
    with claimed(recipe):
        return _run(recipe, force, progress, on_stage)


def claimed(recipe: Recipe):
    """Claim the recipe's OUT for the block (see `artifacts.claim`): one run of a recipe at a time."""
    return artifacts.claim(recipe.out)


def _run(recipe: Recipe, force: bool, progress: bool, on_stage: OnStage | None) -> dict:
    rows = plan(recipe, force)
    state = read_state(recipe.out)
    foreign = [s.dir for s in recipe.stages if s.dir.exists() and s.id not in state["stages"]]
    if foreign and not force:  # nothing of the user's is replaced without --force, as with every stage's OUT
        raise OutputError(f"'{foreign[0]}' exists and was not written by this recipe (no entry in "
                          f"{recipe.out / STATE_FILE}); pass --force to replace it, or choose another --out")
    recipe.out.mkdir(parents=True, exist_ok=True)
    state.update({"recipe": recipe.name, "source": recipe.source})
    started = time.perf_counter()
    reports: dict[str, dict] = {}
    # on a terminal the caller announces each stage (on_stage); in a log, a line per stage says where the run is
    with Reporter("run", len(rows), unit="stage", enabled=progress, bar=False, eta=False) as bar:
        for n, (stage, row) in enumerate(zip(recipe.stages, rows, strict=True), start=1):
            if on_stage is not None:
                on_stage(stage, row, n, len(rows))
            if row["action"] == "skip":
                reports[stage.id] = artifacts.read_json(stage.dir / artifacts.REPORT_FILE) or {}
                old = state["stages"].get(stage.id, {})
                row.update(seconds=old.get("seconds"), summary=old.get("summary", ""))
                bar.update(done=n, info=f"{stage.id} skipped ({row['why']})")
                continue
            bar.note(f"stage {n}/{len(rows)}: {stage.id} ({stage.kind.name}) → {stage.dir}")
            reports[stage.id] = _run_stage(recipe, state, stage, row, progress)
            bar.update(done=n, info=f"{stage.id} done in {row['seconds']} s ({row['summary']})", force=True)
    return {"recipe": recipe.name, "source": recipe.source, "out": str(recipe.out), "stages": rows,
            "ran": [r["id"] for r in rows if r["action"] == "run"],
            "skipped": [r["id"] for r in rows if r["action"] == "skip"],
            "seconds": round(time.perf_counter() - started, 1), "reports": reports}


def _run_stage(recipe: Recipe, state: dict, stage: Stage, row: dict, progress: bool) -> dict:
    """Run one stage, keeping OUT/recipe.json up to date; its report (`row` gets its time and key numbers)."""
    log.info("stage %s (%s) → %s: %s", stage.id, stage.kind.name, stage.dir, row["why"])
    # a failure below leaves the stage marked unfinished: the next run redoes it (its dir is still this recipe's)
    state["stages"][stage.id] = {**state["stages"].get(stage.id, {}), "kind": stage.kind.name,
                                 "dir": str(stage.dir), "unfinished": True}
    _save(recipe, state)
    t0 = time.perf_counter()
    report = stage.kind.execute(stage.config, stage.inputs, stage.dir, progress)
    seconds = round(time.perf_counter() - t0, 1)
    summary = _summary(stage, report)
    row.update(seconds=seconds, summary=summary)
    state["stages"][stage.id] = {k: row[k] for k in ("fingerprint", "settings", "files", "deps", "version")} | {
        "kind": stage.kind.name, "dir": str(stage.dir), "seconds": seconds, "summary": summary}
    _save(recipe, state)
    return report


def _summary(stage: Stage, report: dict) -> str:
    """The key numbers of the stage's report: the first row the stage describes it with."""
    try:
        rows = stage.kind.spec.describe(report or {})
        return rows[0][1] if rows else ""
    except (KeyError, TypeError, ValueError) as e:  # a report of another shape must not fail a finished stage
        log.warning("no summary for stage %s: %s", stage.id, e)
        return ""


def _save(recipe: Recipe, state: dict) -> None:
    artifacts.write_json(recipe.out / STATE_FILE, state)
