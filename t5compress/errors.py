"""Typed errors. Each message is one line that names the bad thing and says what to do."""


class T5CompressError(Exception):
    """Base class: the CLI prints the message as one red line and exits non-zero."""

    exit_code = 2


class ConfigError(T5CompressError):
    """A configuration value is invalid."""


class DataError(T5CompressError):
    """Input data is missing, malformed or empty."""


class ModelError(T5CompressError):
    """A model or export directory cannot be loaded or is not what the stage needs."""


class OutputError(T5CompressError):
    """The output location exists (without --force) or cannot be written."""


class ExportError(T5CompressError):
    """An export failed or did not match PyTorch within tolerance."""


class QuantizeError(T5CompressError):
    """Quantization failed, or its result is too far from the fp32 model to ship."""


class Terminated(KeyboardInterrupt):
    """A termination signal (SIGTERM from `kill`, Docker, Kubernetes, systemd; SIGHUP), raised where the program is
    so that it unwinds exactly as Ctrl-C does: every claim, temporary sibling and scratch dir is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors are often pages long)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def hub_reachable() -> bool:
    """Whether the Hugging Face Hub's name resolves: without network, fail at once instead of retrying for minutes."""
    import socket

    try:
        socket.getaddrinfo("huggingface.co", 443)
    except OSError:
        return False
    return True
