"""`t5compress bench`: every variant (and, with --peers, the tools users would pick instead) on one grid."""

from t5compress.bench.config import PEERS, BenchConfig

__all__ = ["PEERS", "BenchConfig"]
