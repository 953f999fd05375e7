"""Reading the user's text (files, stdin, command-line arguments) as UTF-8, in one place.

A byte sequence that is not UTF-8 is a one-line DataError naming the source, the line and the byte offset, never a
UnicodeDecodeError traceback, nor (for arguments, which Python decodes with surrogateescape) a lone surrogate that
a tokenizer later fails on. A UTF-8 byte order mark at the start is dropped, as `utf-8-sig` does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from t5compress.errors import DataError

BOM = b"\xef\xbb\xbf"
STDIN = "<stdin>"
MAX_LINE = 64 << 20  # bytes in one line of text: far more than any model reads as one input
# What a command that holds all of its input in memory (`generate`) reads at most, over every source together: a day
# of generation on a CPU is well under a million inputs, and a million short lines already cost ~100 MB as Python
# strings; endless input (`yes | t5compress generate DIR -`) is refused here instead of exhausting memory.
MAX_INPUT_LINES = 1_000_000
MAX_INPUT_BYTES = 256 << 20


@dataclass
class Budget:
    """Lines and bytes read so far by one command over all its sources, refused past the limits."""

    max_lines: int = MAX_INPUT_LINES
    max_bytes: int = MAX_INPUT_BYTES
    lines: int = 0
    bytes: int = 0

    def take(self, size: int, where: str) -> None:
        """Count one line of `size` bytes read at `where`; a DataError once the input is over a limit."""
        self.lines, self.bytes = self.lines + 1, self.bytes + size
        if self.lines > self.max_lines:
            raise DataError(f"{where}: more than {self.max_lines:,} lines of input; every input is read before "
                            "generation starts: split it into several runs")
        if self.bytes > self.max_bytes:
            raise DataError(f"{where}: more than {self.max_bytes >> 20} MB of input; every input is read before "
                            "generation starts: split it into several runs")


def _bounded(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of `stream`, each read up to MAX_LINE + 1 bytes (so an endless one stops there)."""
    while raw := stream.readline(MAX_LINE + 1):
        yield raw


def decode(data: bytes, where: str, offset: int = 0) -> str:
    """`data` as UTF-8 text; `offset`: where `data` starts in its source, so the error gives the source's offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte offset {offset + e.start})"
                        ) from None


def _open(path: Path, what: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{what} '{path}' does not exist") from None
    except IsADirectoryError:
        raise DataError(f"{what} '{path}' is a directory, not a file") from None
    except OSError as e:
        why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e))
        raise DataError(f"cannot read {what} '{path}': {why}") from None


def numbered_lines(raw_lines: Iterable[bytes] | BinaryIO, name: str,
                   budget: Budget | None = None) -> Iterator[tuple[int, str]]:
    """(line number, text without its line ending) of a byte stream, every line decoded as UTF-8; a line longer than
    MAX_LINE is a DataError (what a file without line breaks, such as /dev/zero, would otherwise become: memory
    exhausted by one line), and so is input past `budget`, when given."""
    offset = 0
    for lineno, raw in enumerate(_bounded(raw_lines) if hasattr(raw_lines, "readline") else raw_lines, 1):
        if len(raw) > MAX_LINE:
            raise DataError(f"{name}:{lineno}: a line longer than {MAX_LINE >> 20} MB; give text, one input per line")
        if budget is not None:
            budget.take(len(raw), f"{name}:{lineno}")
        skip = len(BOM) if lineno == 1 and raw.startswith(BOM) else 0
        yield lineno, decode(raw[skip:], f"{name}:{lineno}", offset + skip).rstrip("\r\n")
        offset += len(raw)


def read_lines(path: str | os.PathLike, what: str = "file", budget: Budget | None = None
               ) -> Iterator[tuple[int, str]]:
    """(line number, text) of a file, or of stdin for '-'; errors name `what` and the path. With `budget`, lines
    count against it (shared by every source a command reads)."""
    if str(path) == "-":
        stdin = getattr(sys.stdin, "buffer", None)  # bytes; a replaced sys.stdin may be text only
        raw = stdin if stdin is not None else (line.encode("utf-8", "surrogateescape") for line in sys.stdin)
        yield from numbered_lines(raw, STDIN, budget)
        return
    with _open(Path(path), what) as f:
        yield from numbered_lines(f, str(path), budget)


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A whole file as UTF-8 text (a leading BOM dropped)."""
    with _open(Path(path), what) as f:
        data = f.read()
    skip = len(BOM) if data.startswith(BOM) else 0
    return decode(data[skip:], str(path), skip)


def check_text(value: str, where: str) -> str:
    """`value` if UTF-8 can encode it; a lone surrogate (what a JSON escape like \\udcff or undecodable bytes become)
    is a DataError, where a tokenizer would raise a TypeError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: not text: {value[e.start]!r} at character {e.start} is a lone surrogate") from None
    return value


def argument(value: str, where: str) -> str:
    """A command-line argument as it was typed: undecodable bytes (surrogate escapes) are a DataError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        try:
            data = os.fsencode(value)  # the bytes that were typed
        except UnicodeEncodeError:
            data = value.encode("utf-8", "surrogatepass")
        return decode(data, where)
    return value
