"""The Typer CLI: the only package that imports typer."""

from t5compress.cli.app import app, main

__all__ = ["app", "main"]
