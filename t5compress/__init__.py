"""t5compress: make T5-family models small and fast, and ship them."""

__version__ = "0.1.0"
