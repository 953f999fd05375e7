"""The stages of the chain, registered once: name, config class, run function, what each reads and writes, where it
sits in a recipe, and how its report is told to people.

    spec = stage("quantize")
    report = spec.runner()("export-dir", spec.config_class()(mode="dynamic"), "int8-dir")
    print(spec.describe(report))  # [(what, value), ...]: the key numbers first

Every stage's `run` has one shape, `run(src, cfg, out, *, force=False, progress=True, ...) -> Report`: it reads `src`
(a directory of a kind in `t5compress.kinds`, or what `reads` says), never changes it, and writes `out` (a directory
of the kind `writes` names) with its `t5compress.json` and `report.json`. The CLI, the recipe runner and `info` read
this registry; entries name their modules, imported when used, so reading the registry stays cheap and imports no
stage. A stage's report is told to people by one function of `t5compress.describe`, named here: the CLI prints its
rows after the stage ran, `info` shows them, and the recipe's results table shows the first one.

    data → create | load | pretrain → train | qat | prune → export → quantize → triton → bench
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from t5compress.config import choose

# What a recipe passes from one stage to the next (finer than a directory kind: an int8 export is an onnx export).
DATA, MODEL, QAT_MODEL, EXPORT, INT8, REPOSITORY, BENCH = (
    "data", "model", "qat-model", "export", "int8 export", "model repository", "bench report")
ANY_MODEL = (MODEL, QAT_MODEL, EXPORT, INT8)


@dataclass(frozen=True)
class Chain:
    """Where a stage sits in a recipe: after the stages of lower rank it reads, what it takes and what it makes."""

    rank: int
    consumes: tuple[str, ...]  # artifacts accepted as input; () for a source stage
    makes: str  # the artifact it makes
    makes_from: tuple[tuple[str, str], ...] = ()  # (input artifact, artifact made) where that differs from `makes`

    def product(self, artifact: str | None) -> str:
        """The artifact this stage makes from an input of kind `artifact`."""
        return dict(self.makes_from).get(artifact or "", self.makes)


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: str  # where its `run` and its config class live (imported when used)
    config: str  # the name of its frozen config class there
    reads: str  # what `src` is: a directory kind of t5compress.kinds, or architecture / corpus / variants / nothing
    writes: str | None  # the directory kind OUT becomes (None: data, serve and demo, whose OUT is no directory kind)
    help: str
    chain: Chain | None = None  # where it sits in a recipe (None: no recipe runs it)
    recipe: str | None = None  # why a recipe cannot run it (yet), when it is a stage users would put there
    describer: str | None = None  # its function in t5compress.describe (None: its report is not told to people)
    run: str = "run"  # the name of its run function in `module`

    def config_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.config)

    def runner(self) -> Callable[..., dict[str, Any]]:
        return getattr(importlib.import_module(self.module), self.run)

    def describe(self, report: dict) -> list[tuple[str, str]]:
        """The report told to people: (what, value) rows, the key numbers first ([] when it has none)."""
        if self.describer is None:
            return []
        return getattr(importlib.import_module("t5compress.describe"), self.describer)(report or {})


STAGES: dict[str, StageSpec] = {s.name: s for s in (
    StageSpec("data", "t5compress.recipe.stages", "DataSpec", "nothing", None,
              "generated demo data or your data files", Chain(0, (), DATA), describer="data", run="run_data"),
    StageSpec("create", "t5compress.model.create", "CreateConfig", "architecture", "model",
              "a new randomly initialised T5 of a named architecture", Chain(1, (), MODEL), describer="create"),
    StageSpec("load", "t5compress.recipe.stages", "LoadSpec", "model", "model",
              "a checkpoint from the Hub or a local directory", Chain(1, (), MODEL), describer="load", run="run_load"),
    StageSpec("pretrain", "t5compress.pretrain.stage", "PretrainConfig", "corpus", "model",
              "span-corruption pre-training, from scratch or from a checkpoint", Chain(1, (), MODEL),
              describer="pretrain"),
    StageSpec("train", "t5compress.train.stage", "FinetuneConfig", "model", "model", "fine-tune on text-to-text data",
              Chain(2, (MODEL,), MODEL), describer="train"),
    StageSpec("qat", "t5compress.qat.stage", "QatConfig", "model", "qat-model", "quantization-aware fine-tuning",
              Chain(2, (MODEL,), QAT_MODEL), describer="qat"),
    StageSpec("prune", "t5compress.prune.stage", "PruneConfig", "model", "model",
              "remove heads, FFN channels, layers and unused vocabulary, then recover", Chain(2, (MODEL,), MODEL),
              describer="prune"),
    StageSpec("recover", "t5compress.prune.recover", "RecoverConfig", "model", "model",
              "recovery fine-tuning of a pruned model", describer="recover"),
    StageSpec("export", "t5compress.export.stage", "ExportConfig", "model", "onnx-export",
              "ONNX or TorchScript graphs, verified against PyTorch",
              Chain(4, (MODEL, QAT_MODEL), EXPORT, makes_from=((QAT_MODEL, INT8),)), describer="export"),
    StageSpec("quantize", "t5compress.quantize.stage", "QuantizeConfig", "onnx-export", "onnx-export",
              "int8 of an ONNX export (static, dynamic, block-wise, accuracy-aware)", Chain(5, (EXPORT,), INT8),
              describer="quantize"),
    StageSpec("triton", "t5compress.triton.stage", "TritonConfig", "onnx-export", "triton-repository",
              "a Triton Inference Server model repository", Chain(6, (EXPORT, INT8), REPOSITORY), describer="triton"),
    StageSpec("serve", "t5compress.triton.serve", "ServeConfig", "triton-repository", None,
              "a Triton Inference Server on a repository, until stopped",
              recipe="a recipe cannot start a Triton server yet; run `t5compress serve OUT/<triton stage id>` "
                     "after it"),
    StageSpec("bench", "t5compress.bench.stage", "BenchConfig", "variants", "bench",
              "latency, memory, size and accuracy of variants and peers", Chain(7, ANY_MODEL, BENCH),
              describer="bench"),
    StageSpec("demo", "t5compress.demo", "DemoConfig", "nothing", None, "the quickstart recipe on generated data"),
)}


def stage(name: str) -> StageSpec:
    """The registered stage `name`; an unknown name lists the valid ones."""
    return choose(STAGES, name, "stage")


def chain_text() -> str:
    """The chain a recipe runs, read off the registry: 'data → create | load | pretrain → train | ... → bench'."""
    ranks: dict[int, list[str]] = {}
    for s in STAGES.values():
        if s.chain is not None:
            ranks.setdefault(s.chain.rank, []).append(s.name)
    return " → ".join(" | ".join(names) for _, names in sorted(ranks.items()))
