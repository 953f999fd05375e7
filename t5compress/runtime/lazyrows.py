"""Embedding tables held by the rows looked up: a row is copied in from the dir's file when its id is first seen.

The encoder's and the with-past step's lookups gather rows of a (vocab, d_model) table, which ONNX Runtime reads in
place (`SessionOptions.add_initializer`). Where that table was a copy made at load (a tied int8 table, stored once in
the LM head's (d_model, vocab) layout: `stepgraph.row_lookups`) all of it was in memory for good (16 MB on t5-small,
25 MB on t5-base), and where it was the stored rows, mapped (an untied embedding), each row read mapped the 64 KiB of
the file around it (the kernel's fault-around), so in a few calls most of the table was resident (flan-t5-small: 14
MB after a batch-8 call), while a call looks up a few hundred ids. `LazyRows` holds the table in anonymous memory
that no page of is touched until written (an anonymous mapping: the zero page until then), and `fill(ids)` copies
the rows of ids not seen before from the stored table, which every run that reads the table calls first with its
ids; `drop()` unmaps the stored table's pages the fills read (they stay in the page cache), which the runtime calls
when a call is done. So the table costs a page per 4 KiB of rows ever looked up (at most the whole table, what it
cost before), and a call with no new id reads nothing from the file.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np


class LazyRows:
    """A (vocab, d) table over anonymous memory whose rows are copied from `source` on first lookup."""

    def __init__(self, source: np.ndarray, transposed: bool, mapping=None, offset: int = 0):
        """`source`: the stored table, (vocab, d), or (d, vocab) when `transposed`; `mapping`: the mmap it is a view
        of, at byte `offset` (whose pages `drop` unmaps), or None."""
        self.source, self.transposed = source, transposed
        shape = source.shape[::-1] if transposed else source.shape
        self.memory = mmap.mmap(-1, max(1, source.nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # no fork's
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a row written must not fault in 2 MiB (huge pages set to always)
            self.memory.madvise(mmap.MADV_NOHUGEPAGE)
        self.array = np.frombuffer(self.memory, source.dtype, source.size).reshape(shape)
        self.done = np.zeros(shape[0], bool)
        self.mapping, self.offset, self.read = mapping, offset, False
        self.lock = threading.Lock()

    def fill(self, ids: np.ndarray) -> None:
        """Copy in the rows of `ids` not looked up before. Ids out of the table's range are left to the lookup,
        which says what is wrong."""
        ids = np.asarray(ids).reshape(-1)
        try:
            if self.done[ids].all():
                return
        except IndexError:
            return
        with self.lock:
            new = ids[~self.done[ids]]  # repeats copy a row twice (np.unique's first call costs 7 ms)
            if new.size:
                self.array[new] = self.source[:, new].T if self.transposed else self.source[new]
                self.done[new] = True
                self.read = True

    def drop(self) -> None:
        """Unmap the stored table's pages the fills read since the last drop (they stay in the page cache)."""
        if not self.read or self.mapping is None or not hasattr(self.mapping, "madvise"):
            return
        with self.lock:
            start = self.offset - self.offset % mmap.PAGESIZE
            self.mapping.madvise(mmap.MADV_DONTNEED, start, self.offset + self.source.nbytes - start)
            self.read = False


class Fills:
    """The lazy tables of one dir's sessions: `fill(ids)` before every run that looks ids up, `drop()` after a call."""

    def __init__(self, tables: list[LazyRows]):
        self.tables = tables

    def fill(self, ids: np.ndarray) -> None:
        for t in self.tables:
            t.fill(ids)

    def drop(self) -> None:
        for t in self.tables:
            t.drop()
