"""The stages as a recipe runs them: the chain is the stage registry's (`t5compress.stages`: order, what each stage
takes and makes, its run and config); here is only how a recipe's flat settings become a stage's own config (the
CLI's), and the recipe's own `data` and `load` stages.

    data → create | load | pretrain → train | qat | prune → export → quantize → triton → bench
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.recipe import schema
from t5compress.stages import STAGES, StageSpec

log = logging.getLogger(__name__)

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet")


@dataclass(frozen=True)
class Inputs:
    """What the stages before a stage give it: the data files and the directory of its input stage."""

    train: str | None = None
    eval: str | None = None
    src: Path | None = None  # the input stage's directory (None for sources)
    src_artifact: str | None = None
    variants: tuple[Path, ...] = ()  # bench only: the variants' directories
    names: tuple[str, ...] = ()  # and their stage ids, the names they get in the report


# --- data ------------------------------------------------------------------------------------------------------

GENERATORS = ("demo",)


@dataclass(frozen=True)
class DataSpec:
    generate: str | None = option(None, f"Generate the data: {', '.join(GENERATORS)} (the demo's two tasks).")
    train: str | None = option(None, "Training data (any format `train` reads) instead of generated data.")
    eval: str | None = option(None, "Held-out data; default: a split of the training data.")
    train_examples: int = option(4000, "Generated training examples.")
    eval_examples: int = option(200, "Generated held-out examples.")
    seed: int = option(0, "Seed of the generated data.")

    def __post_init__(self) -> None:
        require((self.generate is None) != (self.train is None), "generate",
                "give either generate (generated data) or train (a data file), not both or neither")
        require(self.generate is None or self.generate in GENERATORS, "generate",
                f"choose one of {', '.join(GENERATORS)}, got {self.generate!r}")
        require(self.train_examples >= 10, "train_examples", f"must be >= 10, got {self.train_examples}")
        require(self.eval_examples >= 2, "eval_examples", f"must be >= 2, got {self.eval_examples}")
        for name in ("train", "eval"):
            path = getattr(self, name)
            looks_like_file = path is not None and Path(path).suffix in DATA_SUFFIXES
            require(not looks_like_file or Path(path).exists(), name, f"'{path}' does not exist")


def data_files(spec: DataSpec, out: Path) -> tuple[str, str | None]:
    """The train and eval files a data stage gives the stages after it."""
    if spec.generate:
        return str(out / "train.jsonl"), str(out / "eval.jsonl")
    return spec.train, spec.eval


def run_data(src: None, cfg: DataSpec, out: Path, *, force: bool = False, progress: bool = True) -> dict:
    """The recipe's `data` stage: generated examples, or the user's files named."""
    from t5compress.tasks import make_examples, write_jsonl

    with artifacts.envelope("data", None, cfg, out, force=force, inputs=()) as env, env.staging() as tmp:
        if cfg.generate:
            write_jsonl(tmp / "train.jsonl", make_examples(cfg.train_examples, cfg.seed))
            write_jsonl(tmp / "eval.jsonl", make_examples(cfg.eval_examples, cfg.seed + 1))
            counts = {"train": cfg.train_examples, "eval": cfg.eval_examples}
        else:
            counts = {"train": cfg.train, "eval": cfg.eval}
        env.report = {"stage": "data", "generated": cfg.generate, "examples": counts}
    return env.report


# --- load ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSpec:
    model: str = option(help="Hub id (e.g. t5-small; needs a network once) or local model directory.")

    def __post_init__(self) -> None:
        require(bool(self.model), "model", "give a hub id or a model directory")
        from t5compress.model.load import is_local

        require(not is_local(self.model) or Path(self.model).is_dir(), "model", f"'{self.model}' is not a directory")


def run_load(src: str, cfg: LoadSpec, out: Path, *, force: bool = False, progress: bool = True) -> dict:
    """The recipe's `load` stage: a checkpoint from the Hub or a local directory, saved as a model dir."""
    from t5compress.model.load import describe, load_model, load_tokenizer, save_model_dir

    with artifacts.envelope("load", src, cfg, out, force=force, inputs=[src]) as env:
        model, tokenizer = load_model(src), load_tokenizer(src)
        report = {"stage": "load", "source": src, "model": describe(model)}
        return env.write(report, lambda tmp: save_model_dir(model, tokenizer, tmp))


def _defaults(settings: dict, **values: Any) -> dict:
    """`settings` with the data the stages before give, where the recipe does not say otherwise."""
    return {**{k: v for k, v in values.items() if v is not None}, **settings}


def _build_create(where: str, s: dict, i: Inputs, cls: type, flatten: dict):
    text = i.train if s.get("tokenizer", "unigram") == "unigram" else None
    return schema.build(where, cls, _defaults(s, text=text), flatten)


def _finetune(where: str, s: dict, i: Inputs, cls: type, flatten: dict):
    return schema.build(where, cls, _defaults(s, train_data=i.train, eval_data=i.eval), flatten)


def _recover_flatten() -> dict:
    from t5compress.data import DataConfig
    from t5compress.train.distill import DistillConfig
    from t5compress.train.loop import TrainConfig

    return {"kd": DistillConfig, "data_cfg": DataConfig, "train": TrainConfig}


def _build_prune(where: str, s: dict, i: Inputs, cls: type, flatten: dict):
    from t5compress.data import DataConfig
    from t5compress.prune.recover import RecoverConfig

    rec = s.get("recover")
    recover = None
    if rec is not None and rec is not False:
        if rec is True:
            rec = {}
        if not isinstance(rec, dict):
            raise schema.RecipeError(f"{where}.recover: expected a mapping of recovery settings or true, got {rec!r}")
        if "lr" in rec:  # a rate the recipe gives is taken as given, as the CLI's --lr
            rec = {"lr_per_width": False, **rec}
        rec_flatten = _recover_flatten()
        schema.check_keys(f"{where}.recover", rec, schema.flat_keys(RecoverConfig, rec_flatten))
        read = {k: v for k, v in s.items() if k in schema.flat_keys(DataConfig, {})}  # read the data as prune does
        recover = schema.build(f"{where}.recover", RecoverConfig,
                               _defaults({**read, **rec}, data=i.train, eval_data=i.eval), rec_flatten)
    settings = {k: v for k, v in s.items() if k != "recover"}
    return schema.build(where, cls, _defaults(settings, calib_data=i.train, eval_data=i.eval), flatten,
                        fixed={"recover": recover})


def _build_quantize(where: str, s: dict, i: Inputs, cls: type, flatten: dict):
    from t5compress.quantize.modes import METHODS

    method = METHODS.get(s.get("mode", "static"))  # an unknown mode is the config's to refuse
    calib = i.train if method is not None and method.needs_texts else None
    # the check reads the held-out eval texts, not the training ones the model has learnt (see quantize.stage)
    return schema.build(where, cls, _defaults(s, calib_data=calib, eval_data=i.eval), flatten)


def _build_bench(where: str, s: dict, i: Inputs, cls: type, flatten: dict):
    return schema.build(where, cls, _defaults(s, data=i.eval), flatten)


@dataclass(frozen=True)
class PretrainSpec:
    """The `pretrain` stage: its corpus (the command's SRC argument) beside the stage's own config."""

    corpus: str
    config: Any


def _build_pretrain(where: str, s: dict, i: Inputs, cls: type, flatten: dict) -> PretrainSpec:
    corpus = s.get("corpus")
    if not isinstance(corpus, str) or not corpus:
        raise schema.RecipeError(f"{where}.corpus: required: the text (a file, folder or dataset) to pre-train on")
    return PretrainSpec(corpus, schema.build(where, cls, s, flatten))


def _plain(where: str, s: dict, i: Inputs, cls: type, flatten: dict):
    return schema.build(where, cls, s, flatten)


def _given_src(built: Any, i: Inputs) -> tuple[Any, Any]:
    return i.src, built


@dataclass(frozen=True)
class Adapter:
    """How a recipe's settings become a stage's config: `build(where, settings, inputs, cls, flatten)`, the nested
    configs whose fields a recipe gives at the stage's own level, the recipe's own extra keys, and `split`: (built
    config, inputs) -> (src, cfg) of the stage's run (by default the input stage's dir and the config)."""

    build: Callable[..., Any] = _plain
    flatten: Callable[[], dict] = dict
    extra: tuple[str, ...] = ()
    split: Callable[[Any, Inputs], tuple[Any, Any]] = _given_src


def _finetune_flatten() -> dict:
    from t5compress.data import DataConfig
    from t5compress.train.loop import TrainConfig

    return {"data": DataConfig, "train": TrainConfig}


def _data_flatten() -> dict:
    from t5compress.data import DataConfig

    return {"data": DataConfig}


def _qat_flatten() -> dict:
    from t5compress.qat.scheme import FakeQuantConfig
    from t5compress.train.stage import FinetuneConfig

    return {"finetune": (FinetuneConfig, _finetune_flatten()), "quant": FakeQuantConfig}


def _pretrain_flatten() -> dict:
    from t5compress.train.loop import TrainConfig

    return {"train": TrainConfig}


# The stages whose settings need more than the plain build of their config (the others: export, triton).
ADAPTERS: dict[str, Adapter] = {
    "data": Adapter(split=lambda spec, i: (None, spec)),
    "create": Adapter(_build_create, _data_flatten, split=lambda cfg, i: (cfg.arch, cfg)),
    "load": Adapter(split=lambda spec, i: (spec.model, spec)),
    "pretrain": Adapter(_build_pretrain, _pretrain_flatten, ("corpus",), lambda spec, i: (spec.corpus, spec.config)),
    "train": Adapter(_finetune, _finetune_flatten),
    "qat": Adapter(_finetune, _qat_flatten),
    "prune": Adapter(_build_prune, _data_flatten),
    "quantize": Adapter(_build_quantize),
    "bench": Adapter(_build_bench, extra=("variants",),
                     split=lambda cfg, i: ([f"{n}={p}" for n, p in zip(i.names, i.variants, strict=True)], cfg)),
}


@dataclass(frozen=True)
class Kind:
    """A registered stage as a recipe chains it: its registry entry, the setting keys it takes, how they become
    its config; it runs through the stage protocol (`run(src, cfg, out, *, force, progress)`)."""

    spec: StageSpec
    adapter: Adapter
    keys: frozenset[str] = field(default_factory=frozenset)  # setting keys (besides stage, input, variants)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def rank(self) -> int:
        return self.spec.chain.rank

    @property
    def consumes(self) -> tuple[str, ...]:
        return self.spec.chain.consumes

    def produces(self, artifact: str | None) -> str:
        return self.spec.chain.product(artifact)

    def build(self, where: str, settings: dict, inputs: Inputs) -> Any:
        """The stage's own config from a recipe's settings (`where` names the stage in errors)."""
        return self.adapter.build(where, settings, inputs, self.spec.config_class(), self.adapter.flatten())

    def execute(self, built: Any, inputs: Inputs, out: Path, progress: bool) -> dict:
        src, cfg = self.adapter.split(built, inputs)
        return self.spec.runner()(src, cfg, out, force=True, progress=progress)


def _kind(spec: StageSpec) -> Kind:
    adapter = ADAPTERS.get(spec.name, Adapter())
    keys = schema.flat_keys(spec.config_class(), adapter.flatten()) | set(adapter.extra)
    return Kind(spec, adapter, frozenset(keys))


KINDS: dict[str, Kind] = {s.name: _kind(s) for s in STAGES.values() if s.chain is not None}
# A stage named here is planned but cannot run in a recipe: a recipe using it is rejected, not skipped.
PLANNED = {s.name: s.recipe for s in STAGES.values() if s.recipe}
