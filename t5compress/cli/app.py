"""Entry point: the command table. Each module below registers its commands on the shared app."""

from __future__ import annotations

from t5compress.cli import bench, demo, export, generate, info, pretrain, prune, qat, quantize, run, train, triton  # noqa: F401
from t5compress.cli.common import app


def main() -> None:
    app()
