"""Lookup tables held by the rows looked up (`runtime.lazyrows`): the rows copied in are the stored table's, the
others take no memory, and the stored table's pages the copies read are unmapped when the call is done."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from t5compress.runtime import sharedkv
from t5compress.runtime.lazyrows import LazyRows

VOCAB, D = 32128, 512  # t5-small's table: 16 MB at int8
OFFSET = 3 * mmap.PAGESIZE + 13  # where the table starts in its file: not on a page


def resident_pages(address: int, size: int) -> int:
    """Pages of [address, address + size) in memory (`mincore`; of anonymous memory: those written)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = address - address % mmap.PAGESIZE
    pages = -(-(address + size - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def mapped_pages(address: int, size: int) -> int:
    """Pages of [address, address + size) mapped into this process (/proc/self/pagemap's present bit; of a file
    mapping: those this process faulted in, not those in the page cache)."""
    first, last = address // mmap.PAGESIZE, (address + size - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first + 1) * 8), np.uint64)
    return int((entries >> np.uint64(63)).sum())


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A (D, VOCAB) int8 table in a file at OFFSET, mapped: the tied table's layout."""
    file = tmp_path_factory.mktemp("lazyrows") / "weights.onnx_data"
    table = np.random.default_rng(0).integers(-127, 128, (D, VOCAB), dtype=np.int8)
    file.write_bytes(b"\x01" * OFFSET + table.tobytes() + b"\x02" * 100)
    with open(file, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return table, mapping


@pytest.mark.parametrize("transposed", [True, False], ids=["by column", "by row"])
def test_a_lazy_table_holds_the_rows_looked_up_and_no_more(stored, transposed):
    table, mapping = stored
    shape = (D, VOCAB) if transposed else (VOCAB, D)
    source = np.frombuffer(mapping, np.int8, D * VOCAB, OFFSET).reshape(shape)
    expected = table if transposed else table.reshape(VOCAB, D)  # the same bytes read as rows
    lazy = LazyRows(source, transposed, mapping, OFFSET)
    address = lazy.array.ctypes.data
    assert lazy.array.shape == (VOCAB, D) and resident_pages(address, lazy.array.nbytes) == 0
    ids = np.random.default_rng(1).integers(0, VOCAB, (8, 32))
    lazy.fill(ids)
    lazy.fill(ids[:2])  # nothing new
    seen = np.unique(ids)
    rows = expected.T[seen] if transposed else expected[seen]
    np.testing.assert_array_equal(lazy.array[seen], rows)
    assert np.flatnonzero(lazy.done).tolist() == seen.tolist()
    # the 256 ids' rows, a page each at most (512 bytes a row): not the table's 3,922 pages
    assert resident_pages(address, lazy.array.nbytes) <= seen.size
    assert not lazy.array[np.setdiff1d(np.arange(VOCAB), seen)].any()  # the others read as zeros
    assert mapped_pages(source.ctypes.data, source.nbytes) > 0  # the fills read the stored table
    lazy.drop()
    assert mapped_pages(source.ctypes.data, source.nbytes) == 0  # unmapped again (still in the page cache)


def test_ids_out_of_range_are_left_to_the_lookup(stored):
    table, mapping = stored
    lazy = LazyRows(np.frombuffer(mapping, np.int8, D * VOCAB, OFFSET).reshape(D, VOCAB), True, mapping, OFFSET)
    lazy.fill(np.array([3, VOCAB + 5]))
    assert not lazy.done.any()  # nothing copied: the session's Gather says what is wrong
    lazy.fill(np.array([-1]))  # ONNX Runtime's Gather reads negative ids from the end, as numpy does
    np.testing.assert_array_equal(lazy.array[-1], table[:, -1])


def test_a_table_another_node_reads_is_not_filled_lazily():
    """Only a table that lookups alone read is held by the rows looked up: a tied LM head reading the same
    (vocab, d) initializer (a MatMul on its transpose, as another tool may export it) needs all of it."""
    from onnx import TensorProto, helper

    table = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[VOCAB, D])  # its bytes in the dir's file
    table.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.onnx_data"), ("offset", "0"), ("length", str(VOCAB * D * 4))):
        entry = table.external_data.add()
        entry.key, entry.value = key, value
    lookup = helper.make_node("Gather", ["table", "ids"], ["embedded"], axis=0)
    head = helper.make_node("Gemm", ["hidden", "table"], ["logits"], transB=1)
    graph = helper.make_graph([lookup], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, [None, D])], [table])
    assert list(sharedkv._row_tables(helper.make_model(graph))) == ["table"]
    graph.node.append(head)
    assert sharedkv._row_tables(helper.make_model(graph)) == {}
    graph.node.remove(head)  # a lookup of constant ids, which ONNX Runtime may fold when it opens the session
    graph.initializer.append(helper.make_tensor("some", TensorProto.INT64, [2], [1, 2]))
    graph.node.append(helper.make_node("Gather", ["table", "some"], ["constant"], axis=0))
    assert sharedkv._row_tables(helper.make_model(graph)) == {}
