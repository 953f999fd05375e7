"""`t5compress bench`: every variant (and, with --peers, the tools users would pick instead) on one grid.

    from t5compress.bench import BenchConfig, run
    report = run(["pt=runs/model", "int8=runs/int8"], BenchConfig(data="eval.jsonl", peers=("all",)), "runs/bench")

Each variant is measured in its own process (`bench.worker`): size on disk, cold start, peak memory, a latency grid
with forced output length, accuracy and greedy agreement with the first variant. See `stage.run`.
"""

from t5compress.bench.config import PEERS, BenchConfig
from t5compress.bench.stage import run

__all__ = ["PEERS", "BenchConfig", "run"]
