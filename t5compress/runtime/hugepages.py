"""Back the weights ONNX Runtime just loaded with 2 MiB pages (Linux transparent huge pages).

A decoder step streams every weight of the decoder and the LM head once (39 MB for a flan-t5-small int8 step), and
with 4 KiB pages that is about ten thousand TLB misses a step. On a 2-vCPU AMD EPYC, flan-t5-small int8 generated
1.00-1.13x faster with its weights on huge pages (paired process runs, 1 thread: docs/benchmarks.md, "Weights on
huge pages"). ONNX Runtime allocates the weights itself (and MLAS its pre-packed copies), so the runtime
cannot place them; instead it notes the process's anonymous memory regions before opening the sessions and asks the
kernel to collapse the regions that appeared meanwhile (`madvise` MADV_HUGEPAGE, then MADV_COLLAPSE: Linux 6.1 and
later, with transparent huge pages not set to `never`). Anywhere else it does nothing. T5COMPRESS_HUGEPAGES=0 turns it
off. glibc's tunable GLIBC_TUNABLES=glibc.malloc.hugetlb=1, set before a process starts, does the same for every
later allocation too (each step's cache tensors): on top of this, 1.04x at b8 beam 4 and nothing measurable elsewhere.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from pathlib import Path

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE = 2 << 20  # bytes in one huge page on x86-64 and arm64 (4 KiB base pages)
ENV = "T5COMPRESS_HUGEPAGES"


def enabled() -> bool:
    """Linux, not switched off by T5COMPRESS_HUGEPAGES=0, and transparent huge pages not `never`."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV, "1") == "0":
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def regions() -> set[tuple[int, int]]:
    """(start, end) of the process's private anonymous read-write mappings (the heap included); empty if unknown."""
    if not enabled():
        return set()
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if fields[1] == "rw-p" and (len(fields) < 6 or fields[5] == "[heap]"):  # private, no file
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    found.add((start, end))
    except (OSError, ValueError, IndexError):
        return set()
    return found


def collapse_new(before: set[tuple[int, int]]) -> int:
    """Collapse the huge pages inside the regions that are not in `before` (as `regions` gave it) whose base pages
    are nearly all in memory already (`DENSE`); returns the bytes the kernel collapsed (0 where it cannot).

    MADV_COLLAPSE fills a huge page's absent base pages: over a heap the C library had just trimmed (the weights'
    copies freed once packed), collapsing every huge page made a loaded t5-small int8 runtime 16-22 MB larger, while
    the weights, allocated whole, are dense."""
    if not enabled():
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return 0
    done = 0
    for start, end in sorted(regions() - before):
        lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE  # the huge pages that lie wholly inside
        for page in range(lo, hi, HUGE):
            if _dense(libc, page):
                libc.madvise(page, HUGE, MADV_HUGEPAGE)  # also lets the kernel keep it huge if it moves it
                done += HUGE if _collapse_page(libc, page) else 0
    return done


DENSE = 0.9  # the share of a huge page's base pages in memory for it to be collapsed


def _dense(libc, page: int) -> bool:
    """Whether at least `DENSE` of the base pages of the huge page at `page` are in memory (`mincore`)."""
    count = HUGE // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * count)()
    if libc.mincore(page, HUGE, vec) != 0:
        return False
    return sum(b & 1 for b in vec) >= DENSE * count


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; nothing elsewhere). Opening a session
    copies each weight before ONNX Runtime packs it and frees the copy, and glibc keeps most of what is freed mapped:
    a t5-small int8 runtime held 7 MB less after a trim at load, and as much less after a batch-8 call."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


def _collapse_page(libc, page: int, tries: int = 3) -> bool:
    """MADV_COLLAPSE on one huge page, tried again while the kernel answers EAGAIN (a page briefly locked or
    referenced); False where it cannot (no free 2 MiB block, say)."""
    for _ in range(tries):
        if libc.madvise(page, HUGE, MADV_COLLAPSE) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            return False
    return False
