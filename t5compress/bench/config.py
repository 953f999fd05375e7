"""What `t5compress bench` measures: one frozen config, shared by the CLI, the recipe runner and the scripts in
`benchmarks/`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from t5compress.bench.expect import parse as parse_expectations
from t5compress.config import option as opt
from t5compress.config import require

DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
PEERS = ("pytorch", "optimum-fp32", "optimum-int8", "ctranslate2-int8", "openvino-fp32", "openvino-int8")


@dataclass(frozen=True)
class BenchConfig:
    data: str | None = opt(None, "Eval data (any file `train` reads): accuracy (exact match, ROUGE-L, BLEU) and the "
                                 "texts the latency inputs are cut from. Without it, generated sentences: latency, and"
                                 " agreement with the first variant as the accuracy.")
    field: str = opt("source", "Field of the eval records holding the input text.")
    target_field: str = opt("target", "Field of the eval records holding the reference output.")
    prefix: str = opt("", "Task prefix added to every eval text, as in `train`.")
    eval_max: int = opt(200, "Score accuracy on at most this many eval records.")
    max_new_tokens: int = opt(64, "Token limit for the accuracy run (free length: generation stops at </s>).")
    batch_sizes: tuple[int, ...] = opt((1, 8), "Batch sizes of the latency grid.")
    input_tokens: int = opt(32, "Input length of the latency grid (eval texts cut or repeated to exactly this).")
    output_tokens: int = opt(32, "Output length of the latency grid, forced for every variant (min = max).")
    threads: tuple[int, ...] = opt((1,), "CPU thread counts of the latency grid.")
    beams: tuple[int, ...] = opt((1, 4), "Beam widths of the latency grid (1: greedy).")
    repeats: int = opt(5, "Timed calls per grid cell (p50/p90/p99 over these; warm-up excluded).")
    warmup: int = opt(1, "Untimed calls per grid cell before timing.")
    peers: tuple[str, ...] = opt((), f"Peer engines prepared from the first PyTorch variant: {', '.join(PEERS)}, "
                                     "or 'all'.")
    peer_python: str | None = opt(None, "Python interpreter for peers not importable here (e.g. "
                                        ".venv-bench/bin/python from `make bench-env`).")
    edge: bool = opt(False, "Edge profile: 1 and 2 threads, int8 variants first, cold start and peak memory, and "
                            "the CPU features found.")
    timeout_s: int = opt(1800, "Give up on a variant whose measuring process runs longer than this (seconds).")
    plots: bool = opt(True, "Write PNG plots (latency vs accuracy with the Pareto front, sizes, latency vs batch).")
    device: str = opt("cpu", "Where our ONNX export variants run: cpu, cuda, cuda:N or auto (ONNX Runtime's CUDA "
                             "provider; one line when it or a GPU is missing). PyTorch and the peers run on the CPU.")
    seed: int = opt(0, "Seed of the generated sentences used without --data.")
    expect: tuple[str, ...] = opt((), "Expectations to check, KEY=RATIO: int8, pruned+int8, fp32 (our fastest such "
                                      "variant at least RATIO x the fastest peer of its precision, per grid cell) or "
                                      "size (our int8 files at most RATIO x our fp32 export's).")

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "threads", "beams"):
            values = getattr(self, name)
            require(bool(values) and all(int(v) >= 1 for v in values), name, f"give integers >= 1, got {values}")
        require(self.input_tokens >= 2, "input_tokens", f"must be >= 2, got {self.input_tokens}")
        require(self.output_tokens >= 1, "output_tokens", f"must be >= 1, got {self.output_tokens}")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(self.eval_max >= 1, "eval_max", f"must be >= 1, got {self.eval_max}")
        require(self.repeats >= 1, "repeats", f"must be >= 1, got {self.repeats}")
        require(self.warmup >= 0, "warmup", f"must be >= 0, got {self.warmup}")
        require(self.timeout_s >= 1, "timeout_s", f"must be >= 1, got {self.timeout_s}")
        parse_expectations(self.expect)  # a bad item is one line naming it, before anything is measured
        require(bool(DEVICE_RE.match(self.device)), "device", f"choose cpu, cuda, cuda:N or auto, not {self.device!r}")
        bad = [p for p in self.peers if p not in (*PEERS, "all")]
        require(not bad, "peers", f"unknown peer {', '.join(bad)}; choose from {', '.join(PEERS)} or all")

    @property
    def expectations(self) -> dict[str, float]:
        return parse_expectations(self.expect)

    @property
    def peer_names(self) -> tuple[str, ...]:
        return PEERS if "all" in self.peers else tuple(p for p in PEERS if p in self.peers)
