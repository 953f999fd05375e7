"""The triton stage: ONNX export dir in, Triton Inference Server model repository out.

    run("export-dir", TritonConfig(name="t5", portable=True), "repo") -> report

Every config.pbtxt is generated from code and parsed through Triton's `model_config_pb2` before it is written; the
repository is built in a temporary sibling and renamed into place, with `t5compress.json` and `report.json` at its
top level (Triton ignores files there).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from t5compress import artifacts
from t5compress.config import choose, option, require
from t5compress.errors import ModelError
from t5compress.names import GENERATOR, GRAPHS, MANIFEST_FILE, ONNX_SUFFIX
from t5compress.triton import config as pbtxt
from t5compress.triton import repository

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class TritonConfig:
    name: str = option("t5", help="Name of the text-in/text-out model; the leaf models get it as prefix.")
    kind: str = option("cpu", help="Where the leaf models run: cpu or gpu (Triton instance group kind; gpu implies "
                                   "--leaves).")
    leaves: bool = option(False, help="The graphs as separate leaf models, called over BLS at every decoder step "
                                      "(ONNX Runtime backend, or python models with --portable). Default on CPU: "
                                      "the text model runs them itself, in its own process, and the cache never "
                                      "leaves it.")
    instances: int = option(1, help="Instances of each leaf model (per GPU with --kind gpu).")
    bls_instances: int = option(1, help="Instances of the text-in/text-out model.")
    threads: int = option(1, help="ONNX Runtime intra-op threads per graph (per leaf model instance, or in the text "
                                  "model).")
    portable: bool = option(False, help="Leaf models as python models running ONNX Runtime (no ONNX Runtime backend; "
                                        "implies --leaves).")
    max_batch_size: int = option(8, help="Texts the text model generates together (dynamic batching), and the most "
                                         "one request may hold (a bigger one gets an error naming both sizes).")
    max_beams: int = option(4, help="Largest num_beams a request may ask for (sizes the leaf models' batches).")
    max_new_tokens: int = option(512, help="Largest max_new_tokens a request may ask for.")
    max_input_tokens: int = option(-1, help="Longer request texts are truncated to this many tokens and the response "
                                             "says so (TRUNCATED); -1: the export's limit, 0: no limit.")
    queue_delay_us: int = option(2000, help="Dynamic batching: microseconds a request may wait for others.")
    inflight: bool = option(False, help="The text model decoupled: greedy requests join the running batch at the "
                                        "next decoder step and leave when done, and may ask for `stream` (a response "
                                        "per step); clients use gRPC streaming. In-flight batching needs an export "
                                        "made with --inflight (graphs.json says so); others are served "
                                        "batch-at-a-time. In-process flavour only.")
    search_graph: bool = option(False, help="Serve the export's generator.onnx (`export --search-graph`): the whole "
                                            "search in one ONNX Runtime call per batch, in the text model or, with "
                                            "--leaves, as one leaf model (<name>_generator) called once per batch "
                                            "instead of three called every step. Not with --inflight.")

    def __post_init__(self) -> None:
        require(bool(NAME_RE.match(self.name)), "name",
                f"must be letters, digits, '_', '.', '-' (a directory name), got {self.name!r}")
        choose(pbtxt.KINDS, self.kind, "instance kind")
        for field in ("instances", "bls_instances", "threads", "max_batch_size", "max_beams", "max_new_tokens"):
            require(getattr(self, field) >= 1, field, f"must be >= 1, got {getattr(self, field)}")
        require(self.max_input_tokens >= -1, "max_input_tokens", f"must be >= -1, got {self.max_input_tokens}")
        require(self.queue_delay_us >= 0, "queue_delay_us", f"must be >= 0, got {self.queue_delay_us}")
        require(not self.inflight or self.flavour == "in-process", "inflight",
                "the decoupled text model runs the graphs itself: drop --leaves/--portable/--kind gpu")
        require(not (self.inflight and self.search_graph), "search_graph",
                "generator.onnx answers when the whole batch is done: in-flight batching and streaming step the "
                "graphs themselves; drop --search-graph or --inflight")

    @property
    def flavour(self) -> str:
        """in-process (the text model runs the graphs), portable (python leaves) or onnxruntime (backend leaves)."""
        if self.portable:
            return "portable"
        return "onnxruntime" if self.leaves or self.kind != "cpu" else "in-process"

    def leaf_names(self) -> dict[str, str]:
        """Export graph name -> leaf model name."""
        graphs = (GENERATOR,) if self.search_graph else GRAPHS
        return {g: f"{self.name}_{repository.LEAF_SUFFIXES[g]}" for g in graphs}


def plan(src: Path, cfg: TritonConfig) -> list[repository.ModelPlan]:
    """Every model of the repository, configs validated; nothing is written."""
    if cfg.flavour == "in-process":
        return [repository.text_model(src, cfg.name, cfg.bls_instances, cfg.threads, cfg.max_batch_size,
                                      cfg.queue_delay_us, cfg.max_beams, cfg.max_new_tokens, cfg.max_input_tokens,
                                      cfg.inflight, cfg.search_graph)]
    leaves = cfg.leaf_names()
    # the decoders see batch x beams rows; generator.onnx takes whole batches with their settings (not batched)
    leaf_batch = 0 if cfg.search_graph else cfg.max_batch_size * cfg.max_beams
    models = [repository.bls_model(src, cfg.name, leaves, cfg.bls_instances, cfg.max_batch_size, cfg.queue_delay_us,
                                   cfg.max_beams, cfg.max_new_tokens, cfg.max_input_tokens)]
    models += [repository.leaf_model(src, g, leaves[g], cfg.kind, cfg.instances, cfg.threads, leaf_batch,
                                     cfg.queue_delay_us, cfg.portable) for g in leaves]
    return models


def check_export(src: Path, search_graph: bool = False) -> None:
    from t5compress.runtime import detect_format

    fmt = detect_format(src)  # one line naming missing graphs for anything that is not an export dir
    if fmt != "onnx":
        raise ModelError(f"'{src}' is a {fmt} export: a Triton repository needs an ONNX export "
                         "(t5compress export MODEL OUT --onnx)")
    for needed in (MANIFEST_FILE, "tokenizer.json"):
        if not (src / needed).is_file():
            raise ModelError(f"'{src}' has no {needed}: re-export it with `t5compress export MODEL OUT --onnx`")
    if search_graph and not (src / f"{GENERATOR}{ONNX_SUFFIX}").is_file():
        raise ModelError(f"--search-graph: '{src}' has no {GENERATOR}{ONNX_SUFFIX}; export it with "
                         "`t5compress export MODEL OUT --search-graph`")


def run(src: str | os.PathLike, cfg: TritonConfig, out: str | os.PathLike, *, force: bool = False,
        progress: bool = True) -> artifacts.Report:
    """Write the model repository for export dir `src` to `out`; returns the report (also in `out`/report.json)."""
    src = Path(src)
    with artifacts.envelope("triton", src, cfg, out, force=force) as env:
        check_export(src, cfg.search_graph)
        models = plan(src, cfg)  # every config checked before the first file is written
        with env.staging() as tmp:
            for model in models:
                repository.write(model, tmp)
            env.report = {
                "stage": "triton",
                "flavour": cfg.flavour,
                "decoupled": cfg.inflight,
                "inflight_batching": cfg.inflight and repository.has_inflight_layout(src),
                "kind": cfg.kind,
                "models": {m.name: _describe(m) for m in models},
                "bytes": sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()),
                "seconds": env.seconds(2),
            }
    log.info("model repository written to %s", out)
    return env.report


def _describe(model: repository.ModelPlan) -> dict:
    c = model.config
    return {
        "backend": c.backend or c.platform,
        "max_batch_size": repository.batch_limit(c),  # what a request may hold, not the declared value
        "instances": [f"{g.count} x {pbtxt.KINDS_BY_VALUE[g.kind]}" for g in c.instance_group],
        "inputs": [i.name for i in c.input],
        "outputs": len(c.output),
    }
