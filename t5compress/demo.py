"""The embedded default: a small T5 built, fine-tuned, shipped and benchmarked on data generated here (no download).

`run` runs the quickstart recipe (`t5compress/recipe/quickstart.yaml`, the same file as `recipes/quickstart.yaml`),
so `make demo`, `t5compress demo` and `t5compress run recipes/quickstart.yaml` are one code path.
The data is `t5compress.tasks`' two generated problems.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from t5compress import artifacts
from t5compress.config import option, require

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DemoConfig:
    train_examples: int = option(4000, "Generated training examples.")
    eval_examples: int = option(200, "Generated held-out examples.")
    max_steps: int = option(800, "Fine-tuning steps.")
    seed: int = option(0, "Seed for data, initialisation and training.")
    stages: tuple[str, ...] = option((), "Run only these stages of the quickstart recipe and the stages they read "
                                         "(default: all of them).")

    def __post_init__(self) -> None:
        require(self.train_examples >= 10, "train_examples", "must be >= 10")
        require(self.eval_examples >= 2, "eval_examples", "must be >= 2")
        require(self.max_steps > 0, "max_steps", "must be > 0")

    def overrides(self) -> dict[str, dict]:
        """The quickstart recipe's settings this config changes (none with the defaults)."""
        return {
            "data": {"train_examples": self.train_examples, "eval_examples": self.eval_examples, "seed": self.seed},
            "model-init": {"seed": self.seed},
            "model": {"max_steps": self.max_steps, "eval_every": max(1, self.max_steps // 4), "seed": self.seed},
        }


def load(cfg: DemoConfig, out: str | Path | None = None):
    """The embedded quickstart recipe (`recipes/quickstart.yaml`) with `cfg`'s changes, validated."""
    from t5compress import recipe

    return recipe.load(recipe.QUICKSTART, out=out, overrides=cfg.overrides(), only=cfg.stages or None)


def run(src: None, cfg: DemoConfig, out: str | Path | None = None, *, force: bool = False, progress: bool = True,
        on_stage=None) -> artifacts.Report:
    """Run the quickstart recipe into `out` (default: its own, runs/quickstart): generated data, a new model
    fine-tuned on it, its ONNX, int8 and pruned variants, and their benchmark. Stages already done are skipped.
    Returns the recipe's result; OUT/summary.json holds what each stage measured."""
    from t5compress import recipe

    r = load(cfg, out)
    result = recipe.run(r, force=force, progress=progress, on_stage=on_stage)
    reports = result["reports"]
    model = reports.get("model") or {}
    summary = {
        "recipe": r.source,
        "parameters": (model.get("model") or {}).get("parameters"),
        "eval": model.get("eval"),
        "train": {k: v for k, v in (model.get("train") or {}).items() if k != "history"},
        "stages": [{k: row.get(k) for k in ("id", "kind", "dir", "action", "why", "seconds", "summary")}
                   for row in result["stages"]],
        "paths": {s.id: str(s.dir) for s in r.stages},
    }
    artifacts.write_json(r.out / "summary.json", summary)
    return result
