"""The stages of the chain, registered once: name, config class, run function, what each reads and writes.

    spec = stage("quantize")
    report = spec.runner()("export-dir", spec.config_class()(mode="dynamic"), "int8-dir")

Every stage's `run` has one shape, `run(src, cfg, out, *, force=False, progress=True, ...) -> Report`: it reads `src`
(a directory of a kind in `t5compress.kinds`, or what `reads` says), never changes it, and writes `out` (a directory
of the kind `writes` names) with its `t5compress.json` and `report.json`. The CLI, the recipe runner and `info` read
this registry; entries name their module, imported when used, so reading the registry stays cheap and imports no
stage.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from t5compress.config import choose


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: str  # where its `run` and its config class live (imported when used)
    config: str  # the name of its frozen config class there
    reads: str  # what `src` is: a directory kind of t5compress.kinds, or architecture / corpus / variants / nothing
    writes: str | None  # the directory kind OUT becomes (None: serve and demo, whose OUT is not one directory kind)
    help: str

    def config_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.config)

    def runner(self) -> Callable[..., dict[str, Any]]:
        return importlib.import_module(self.module).run


STAGES: dict[str, StageSpec] = {s.name: s for s in (
    StageSpec("create", "t5compress.model.create", "CreateConfig", "architecture", "model",
              "a new randomly initialised T5 of a named architecture"),
    StageSpec("pretrain", "t5compress.pretrain.stage", "PretrainConfig", "corpus", "model",
              "span-corruption pre-training, from scratch or from a checkpoint"),
    StageSpec("train", "t5compress.train.stage", "FinetuneConfig", "model", "model", "fine-tune on text-to-text data"),
    StageSpec("qat", "t5compress.qat.stage", "QatConfig", "model", "qat-model", "quantization-aware fine-tuning"),
    StageSpec("prune", "t5compress.prune.stage", "PruneConfig", "model", "model",
              "remove heads, FFN channels, layers and unused vocabulary, then recover"),
    StageSpec("recover", "t5compress.prune.recover", "RecoverConfig", "model", "model",
              "recovery fine-tuning of a pruned model"),
    StageSpec("export", "t5compress.export.stage", "ExportConfig", "model", "onnx-export",
              "ONNX or TorchScript graphs, verified against PyTorch"),
    StageSpec("quantize", "t5compress.quantize.stage", "QuantizeConfig", "onnx-export", "onnx-export",
              "int8 of an ONNX export (static, dynamic, block-wise, accuracy-aware)"),
    StageSpec("triton", "t5compress.triton.stage", "TritonConfig", "onnx-export", "triton-repository",
              "a Triton Inference Server model repository"),
    StageSpec("serve", "t5compress.triton.serve", "ServeConfig", "triton-repository", None,
              "a Triton Inference Server on a repository, until stopped"),
    StageSpec("bench", "t5compress.bench.stage", "BenchConfig", "variants", "bench",
              "latency, memory, size and accuracy of variants and peers"),
    StageSpec("demo", "t5compress.demo", "DemoConfig", "nothing", None, "the quickstart recipe on generated data"),
)}


def stage(name: str) -> StageSpec:
    """The registered stage `name`; an unknown name lists the valid ones."""
    return choose(STAGES, name, "stage")
