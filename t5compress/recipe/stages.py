"""The stages a recipe can chain, in a registry: what each consumes and produces, how its settings become the
stage's own config (the CLI's), how it runs, and the key numbers its report gives.

    data → create | load | pretrain → train | qat → prune → export → quantize → triton → bench
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from t5compress import artifacts
from t5compress.config import option, require
from t5compress.recipe import schema, summary

log = logging.getLogger(__name__)

# Artifacts passed between stages.
DATA, MODEL, QAT_MODEL, EXPORT, INT8, REPOSITORY, BENCH = (
    "data", "model", "qat-model", "export", "int8 export", "model repository", "bench report")
# A stage named here is planned but has not landed in this version: a recipe using it is rejected, not skipped.
PLANNED = {
    "serve": "a recipe cannot start a Triton server yet; run `t5compress serve OUT/<triton stage id>` after it",
}
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


@dataclass(frozen=True)
class Kind:
    """One kind of stage: how a recipe's settings become its config, and what it reads; it runs through the
    stage protocol (`run(src, cfg, out, *, force, progress)`), the registered stage's or the recipe's own."""

    name: str
    rank: int  # position in the chain: a stage comes after the stages of lower rank it reads
    consumes: tuple[str, ...]  # artifacts accepted as input; () for a source stage
    keys: frozenset[str]  # setting keys (besides stage, input, variants)
    build: Callable[[str, dict, Inputs], Any]  # (where, settings, inputs) -> the stage's config
    produces: Callable[[str | None], str]  # input artifact -> output artifact
    summary: Callable[[dict], str]
    help: str
    run: Callable[..., dict] | None = None  # a recipe-only stage's run; None: the registered stage of this name
    # (built config, inputs) -> (src, cfg) of the stage's run: by default the input stage's dir and the config
    split: Callable[[Any, Inputs], tuple[Any, Any]] = lambda built, i: (i.src, built)  # noqa: E731

    def execute(self, built: Any, inputs: Inputs, out: Path, progress: bool) -> dict:
        from t5compress.stages import stage

        run = self.run or stage(self.name).runner()
        src, cfg = self.split(built, inputs)
        return run(src, cfg, out, force=True, progress=progress)


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


def run_data(src: None, spec: DataSpec, out: Path, *, force: bool = True, progress: bool = True) -> dict:
    """The recipe's `data` stage: generated examples, or the user's files named."""
    from t5compress.tasks import make_examples, write_jsonl

    with artifacts.envelope("data", None, spec, out, force=force, inputs=()) as env, env.staging() as tmp:
        if spec.generate:
            write_jsonl(tmp / "train.jsonl", make_examples(spec.train_examples, spec.seed))
            write_jsonl(tmp / "eval.jsonl", make_examples(spec.eval_examples, spec.seed + 1))
            counts = {"train": spec.train_examples, "eval": spec.eval_examples}
        else:
            counts = {"train": spec.train, "eval": spec.eval}
        env.report = {"stage": "data", "generated": spec.generate, "examples": counts}
    return env.report


# --- load ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSpec:
    model: str = option(help="Hub id (e.g. t5-small; needs a network once) or local model directory.")

    def __post_init__(self) -> None:
        require(bool(self.model), "model", "give a hub id or a model directory")
        from t5compress.model.load import is_local

        require(not is_local(self.model) or Path(self.model).is_dir(), "model", f"'{self.model}' is not a directory")


def run_load(src: str, spec: LoadSpec, out: Path, *, force: bool = True, progress: bool = True) -> dict:
    """The recipe's `load` stage: a checkpoint from the Hub or a local directory, saved as a model dir."""
    from t5compress.model.load import describe, load_model, load_tokenizer, save_model_dir

    with artifacts.envelope("load", src, spec, out, force=force, inputs=[src]) as env:
        model, tokenizer = load_model(src), load_tokenizer(src)
        report = {"stage": "load", "source": src, "model": describe(model)}
        return env.write(report, lambda tmp: save_model_dir(model, tokenizer, tmp))


# --- the stages that already exist as CLI commands ----------------------------------------------------------------


def _defaults(settings: dict, **values: Any) -> dict:
    """`settings` with the data the stages before give, where the recipe does not say otherwise."""
    return {**{k: v for k, v in values.items() if v is not None}, **settings}


def _build_create(where: str, s: dict, i: Inputs):
    from t5compress.data import DataConfig
    from t5compress.model.create import CreateConfig

    text = i.train if s.get("tokenizer", "unigram") == "unigram" else None
    return schema.build(where, CreateConfig, _defaults(s, text=text), {"data": DataConfig})


def _finetune(where: str, s: dict, i: Inputs, cls: type, flatten: dict):
    return schema.build(where, cls, _defaults(s, train_data=i.train, eval_data=i.eval), flatten)


def _build_train(where: str, s: dict, i: Inputs):
    from t5compress.data import DataConfig
    from t5compress.train.loop import TrainConfig
    from t5compress.train.stage import FinetuneConfig

    return _finetune(where, s, i, FinetuneConfig, {"data": DataConfig, "train": TrainConfig})


def _build_qat(where: str, s: dict, i: Inputs):
    from t5compress.data import DataConfig
    from t5compress.qat.scheme import FakeQuantConfig
    from t5compress.qat.stage import QatConfig
    from t5compress.train.loop import TrainConfig
    from t5compress.train.stage import FinetuneConfig

    flatten = {"finetune": (FinetuneConfig, {"data": DataConfig, "train": TrainConfig}), "quant": FakeQuantConfig}
    return _finetune(where, s, i, QatConfig, flatten)


def _recover_flatten() -> dict:
    from t5compress.data import DataConfig
    from t5compress.train.distill import DistillConfig
    from t5compress.train.loop import TrainConfig

    return {"kd": DistillConfig, "data_cfg": DataConfig, "train": TrainConfig}


def _build_prune(where: str, s: dict, i: Inputs):
    from t5compress.data import DataConfig
    from t5compress.prune.recover import RecoverConfig
    from t5compress.prune.stage import PruneConfig

    rec = s.get("recover")
    recover = None
    if rec is not None and rec is not False:
        if rec is True:
            rec = {}
        if not isinstance(rec, dict):
            raise schema.RecipeError(f"{where}.recover: expected a mapping of recovery settings or true, got {rec!r}")
        if "lr" in rec:  # a rate the recipe gives is taken as given, as the CLI's --lr
            rec = {"lr_per_width": False, **rec}
        flatten = _recover_flatten()
        schema.check_keys(f"{where}.recover", rec, schema.flat_keys(RecoverConfig, flatten))
        read = {k: v for k, v in s.items() if k in schema.flat_keys(DataConfig, {})}  # read the data as prune does
        recover = schema.build(f"{where}.recover", RecoverConfig,
                               _defaults({**read, **rec}, data=i.train, eval_data=i.eval), flatten)
    settings = {k: v for k, v in s.items() if k != "recover"}
    return schema.build(where, PruneConfig, _defaults(settings, calib_data=i.train, eval_data=i.eval),
                        {"data": DataConfig}, fixed={"recover": recover})


def _build_export(where: str, s: dict, i: Inputs):
    from t5compress.export.stage import ExportConfig

    return schema.build(where, ExportConfig, s)


def _build_quantize(where: str, s: dict, i: Inputs):
    from t5compress.quantize import QuantizeConfig

    calib = i.train if s.get("mode", "static") == "static" else None
    # the check reads the held-out eval texts, not the training ones the model has learnt (see quantize.stage)
    return schema.build(where, QuantizeConfig, _defaults(s, calib_data=calib, eval_data=i.eval))


def _build_triton(where: str, s: dict, i: Inputs):
    from t5compress.triton.stage import TritonConfig

    return schema.build(where, TritonConfig, s)


def _build_bench(where: str, s: dict, i: Inputs):
    from t5compress.bench import BenchConfig

    return schema.build(where, BenchConfig, _defaults(s, data=i.eval))


@dataclass(frozen=True)
class PretrainSpec:
    """The `pretrain` stage: its corpus (the command's SRC argument) beside the stage's own config."""

    corpus: str
    config: Any


def _build_pretrain(where: str, s: dict, i: Inputs) -> PretrainSpec:
    from t5compress.pretrain.stage import PretrainConfig
    from t5compress.train.loop import TrainConfig

    corpus = s.get("corpus")
    if not isinstance(corpus, str) or not corpus:
        raise schema.RecipeError(f"{where}.corpus: required: the text (a file, folder or dataset) to pre-train on")
    return PretrainSpec(corpus, schema.build(where, PretrainConfig, s, {"train": TrainConfig}))


def _same(artifact: str | None) -> str:
    return MODEL


KINDS: dict[str, Kind] = {}


def _register(kind: Kind, cls: type | None = None, flatten: dict | None = None, extra: tuple[str, ...] = ()) -> None:
    keys = set(extra)
    if cls is not None:
        keys |= schema.flat_keys(cls, flatten or {})
    KINDS[kind.name] = dataclasses.replace(kind, keys=frozenset(keys))


def _setup() -> None:
    from t5compress.data import DataConfig
    from t5compress.qat.scheme import FakeQuantConfig
    from t5compress.stages import stage
    from t5compress.train.loop import TrainConfig

    CreateConfig, PretrainConfig, FinetuneConfig, QatConfig, PruneConfig, ExportConfig, QuantizeConfig, \
        TritonConfig, BenchConfig = (stage(n).config_class() for n in (  # noqa: N806 -- classes
            "create", "pretrain", "train", "qat", "prune", "export", "quantize", "triton", "bench"))

    ft = {"data": DataConfig, "train": TrainConfig}
    none = frozenset()
    _register(Kind("data", 0, (), none, lambda w, s, i: schema.build(w, DataSpec, s), lambda a: DATA,
                   summary.data_summary, "generated demo data or your data files", run=run_data,
                   split=lambda spec, i: (None, spec)), DataSpec)
    _register(Kind("create", 1, (), none, _build_create, _same, summary.params,
                   "a new randomly initialised T5 of a named architecture", split=lambda cfg, i: (cfg.arch, cfg)),
              CreateConfig, {"data": DataConfig})
    _register(Kind("load", 1, (), none, lambda w, s, i: schema.build(w, LoadSpec, s), _same, summary.params,
                   "a checkpoint from the Hub or a local directory", run=run_load,
                   split=lambda spec, i: (spec.model, spec)),
              LoadSpec)
    _register(Kind("train", 2, (MODEL,), none, _build_train, _same, summary.train_summary,
                   "fine-tune"), FinetuneConfig, ft)
    _register(Kind("qat", 2, (MODEL,), none, _build_qat, lambda a: QAT_MODEL, summary.train_summary,
                   "quantization-aware fine-tuning"), QatConfig, {"finetune": (FinetuneConfig, ft),
                                                                 "quant": FakeQuantConfig})
    _register(Kind("prune", 2, (MODEL,), none, _build_prune, _same, summary.prune_summary,
                   "remove heads / FFN channels / layers, then recover"), PruneConfig, {"data": DataConfig})
    _register(Kind("export", 4, (MODEL, QAT_MODEL), none, _build_export,
                   lambda a: INT8 if a == QAT_MODEL else EXPORT, summary.export_summary,
                   "ONNX or TorchScript graphs"),
              ExportConfig)
    _register(Kind("quantize", 5, (EXPORT,), none, _build_quantize, lambda a: INT8,
                   summary.quantize_summary, "int8 (static or dynamic)"), QuantizeConfig)
    _register(Kind("triton", 6, (EXPORT, INT8), none, _build_triton, lambda a: REPOSITORY,
                   lambda r: f"{len(r.get('models') or {})} models, {summary.mb(r.get('bytes'))}",
                   "a Triton model repository"), TritonConfig)
    _register(Kind("bench", 7, (MODEL, QAT_MODEL, EXPORT, INT8), none, _build_bench, lambda a: BENCH,
                   summary.bench_summary, "latency and accuracy of the variants",
                   split=lambda cfg, i: ([f"{n}={p}" for n, p in zip(i.names, i.variants, strict=True)], cfg)),
              BenchConfig,
              extra=("variants",))
    _register(Kind("pretrain", 1, (), frozenset(), _build_pretrain, _same, summary.train_summary,
                   "span-corruption pre-training of a new model", split=lambda spec, i: (spec.corpus, spec.config)),
              PretrainConfig, {"train": TrainConfig},
              extra=("corpus",))


_setup()
