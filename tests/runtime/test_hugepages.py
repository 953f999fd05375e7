"""The runtime moves the weights ONNX Runtime loads onto 2 MiB pages (Linux 6.1+ with transparent huge pages), only
where memory is dense, and gives the C heap's free pages back after load."""

from __future__ import annotations

import mmap
import platform
import sys

import numpy as np
import pytest

from t5compress.runtime import hugepages, load_runtime
from tests.conftest import build_tiny_t5

# What this kernel can do decides what the tests expect: every branch asserts a number.
CAN = hugepages.enabled() and tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit()) >= (6, 1)


def _smaps_kb(address: int, field: str) -> int:
    """`field` (Rss, AnonHugePages) of the mapping that holds `address`, in kB, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_a_region_allocated_after_the_snapshot_is_collapsed_and_keeps_its_bytes():

    expected = (np.arange(6 << 20) % 251).astype(np.uint8)
    before = hugepages.regions()
    # a new private anonymous mapping, whatever malloc would have done with 6 MiB
    region = mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(region, dtype=np.uint8)
    a[:] = expected
    done = hugepages.collapse_new(before)
    if CAN:
        assert done >= 2 << 20 and _smaps_kb(a.ctypes.data + (3 << 20), "AnonHugePages") >= 2048
    else:
        assert done == 0
    assert np.array_equal(a, expected)
    assert hugepages.collapse_new(hugepages.regions()) == 0  # nothing new since
    del a
    region.close()


def _own_vma(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A private anonymous region of `size` bytes that is a mapping of its own in /proc/self/smaps: a PROT_NONE page
    on either side keeps the kernel from merging it with a neighbouring anonymous mapping, whose pages would count."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    region = mmap.mmap(-1, size + 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)
    for guard in (0, size + mmap.PAGESIZE):
        assert libc.mprotect(whole.ctypes.data + guard, mmap.PAGESIZE, 0) == 0, ctypes.get_errno()
    return region, whole[mmap.PAGESIZE : mmap.PAGESIZE + size]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_a_sparse_region_is_not_collapsed_its_absent_pages_stay_absent():
    before = hugepages.regions()
    region, a = _own_vma(6 << 20)
    a[:: 16 * mmap.PAGESIZE] = 7  # one base page in 16 written
    rss = _smaps_kb(a.ctypes.data, "Rss")
    assert rss == 6 << 10 >> 4  # the written pages: 384 kB
    hugepages.collapse_new(before)
    assert _smaps_kb(a.ctypes.data, "AnonHugePages") == 0
    assert _smaps_kb(a.ctypes.data, "Rss") == rss  # MADV_COLLAPSE would have filled 6 MiB
    assert int(a.sum()) == 7 * len(range(0, 6 << 20, 16 * mmap.PAGESIZE))
    del a
    region.close()


def _anon_kb() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))


def test_trim_heap_gives_the_heaps_free_pages_back():
    # 32 MiB of 16 KiB arrays, each under the C library's mmap threshold: on the heap; the last one pins its top
    arrays = [np.ones(16 << 10, np.uint8) for _ in range(2048)]
    del arrays[:-1]
    held = _anon_kb()
    hugepages.trim_heap()
    freed = held - _anon_kb()
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert freed > 16 << 10, freed  # kB: at least half of what was freed left the process
    else:  # no malloc_trim: nothing to give back, and no error
        assert freed < 4 << 10, freed
    assert int(arrays[0].sum()) == 16 << 10


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.enabled() and hugepages.regions() == set()
    a = np.ones(4 << 20, dtype=np.uint8)
    assert hugepages.collapse_new(set()) == 0 and a.sum() == 4 << 20


# Run in a fresh process as a user's would be: the weights' bytes on huge pages, what the kernel did with a fresh 4 MiB
# region at the same moment (a probe: MADV_COLLAPSE also needs a free 2 MiB block, which a fragmented machine may
# not have), and the process's AnonHugePages in kB, then the tokens greedy and beam.
_LOADED = """
import json, mmap, sys
import numpy as np
from t5compress.runtime import hugepages, load_runtime
rt = load_runtime(sys.argv[1])
before = hugepages.regions()
region = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
np.frombuffer(region, dtype=np.uint8)[:] = 1
probe = hugepages.collapse_new(before)
huge_kb = sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages:"))
texts = json.loads(sys.argv[2])
print(json.dumps([rt.hugepage_bytes, probe, huge_kb] + [rt.generate_text(texts, num_beams=b, max_new_tokens=12)
                                                        for b in (1, 3)]))
"""


def test_weights_on_huge_pages_generate_the_same_tokens(tmp_path, monkeypatch):
    """A model with about 15 MB of weights: load_runtime collapses them (where the kernel can), says how much truly,
    and the tokens, greedy and beam, are those of the same dir loaded without."""
    import json
    import subprocess

    from t5compress.export import ExportConfig
    from t5compress.export import run as export

    src = build_tiny_t5(tmp_path / "model", seed=1, d_model=256, d_ff=1024, d_kv=32, num_heads=8)
    export(src, ExportConfig(), tmp_path / "onnx")
    texts = ["hello world", "a longer input sentence to translate", "x"]
    done = subprocess.run([sys.executable, "-c", _LOADED, str(tmp_path / "onnx"), json.dumps(texts)], check=True,
                          capture_output=True, text=True)
    on_bytes, probe, huge_kb, *on = json.loads(done.stdout.splitlines()[-1])
    if CAN and probe:  # the kernel had huge pages to give at that moment: the weights got them
        assert on_bytes >= 8 << 20
    elif not CAN:
        assert on_bytes == 0 and probe == 0
    assert on_bytes + probe <= huge_kb << 10  # what it says it moved is on huge pages
    monkeypatch.setenv(hugepages.ENV, "0")
    off = load_runtime(tmp_path / "onnx")
    assert off.hugepage_bytes == 0
    assert on == [off.generate_text(texts, num_beams=b, max_new_tokens=12) for b in (1, 3)]
