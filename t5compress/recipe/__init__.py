"""Recipes: one YAML file that runs a whole chain (data → create | load | pretrain → train | qat | prune → export →
quantize → triton → bench), validated before anything runs, each stage in its own directory, completed stages
skipped on rerun.

    from t5compress import recipe
    result = recipe.run(recipe.load("recipes/quickstart.yaml"))

The chain itself (which stages, in which order, what each takes and makes) is the stage registry's,
`t5compress.stages`. `schema` reads the YAML and turns a stage's settings into that stage's own config (the CLI's
field names and checks); `stages` says how, per stage, and holds the recipe's own `data` and `load` stages; `plan`
validates the chain and decides, from fingerprints, what runs and what is skipped; `runner` runs it.
"""

from pathlib import Path

from t5compress.recipe.plan import Recipe, Stage, load, plan
from t5compress.recipe.runner import claimed, run
from t5compress.recipe.schema import RecipeError
from t5compress.recipe.stages import KINDS, PLANNED

QUICKSTART = Path(__file__).with_name("quickstart.yaml")  # the embedded default; recipes/quickstart.yaml links here

__all__ = ["KINDS", "PLANNED", "QUICKSTART", "Recipe", "RecipeError", "Stage", "claimed", "load", "plan", "run"]
