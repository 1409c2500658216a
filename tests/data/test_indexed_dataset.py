"""The .bin/.idx formats: byte layout, reading Megatron-LM-shaped files, and rejecting bad files."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from oslo.data import IndexedDataset, IndexedDatasetBuilder
from oslo.data.indexed_dataset import best_fitting_dtype

DOCS = [[1, 2, 3], [4, 5], [6]]


def _long(values) -> bytes:
    return np.asarray(values, dtype=np.int64).tobytes()


def _expected_mmap_idx(sizes, doc_idx, code, itemsize) -> bytes:
    """The MMIDIDX index spelled out from the format description, independent of oslo's writer."""
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * itemsize
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(sizes))
        + struct.pack("<Q", len(doc_idx))
        + np.asarray(sizes, dtype=np.int32).tobytes()
        + _long(pointers)
        + _long(doc_idx)
    )


def _expected_legacy_idx(sizes, doc_idx, code, itemsize) -> bytes:
    n = len(sizes)
    return (
        b"TNTIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<QQ", code, itemsize)
        + struct.pack("<QQ", n, n)
        + struct.pack("<Q", len(doc_idx))
        + _long(range(n + 1))
        + _long(np.concatenate([[0], np.cumsum(sizes)]))
        + _long(sizes)
        + _long(doc_idx)
    )


def _build(prefix, impl="mmap", dtype=np.uint16, docs=DOCS):
    with IndexedDatasetBuilder(prefix, dtype, impl) as builder:
        for doc in docs:
            builder.add_document(doc)
    return prefix


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4)])
def test_mmap_writer_bytes_match_megatron_layout(tmp_path, dtype, code):
    prefix = _build(str(tmp_path / "d"), "mmap", dtype)
    itemsize = np.dtype(dtype).itemsize
    assert (tmp_path / "d.idx").read_bytes() == _expected_mmap_idx([3, 2, 1], [0, 1, 2, 3], code, itemsize)
    assert (tmp_path / "d.bin").read_bytes() == np.arange(1, 7, dtype=dtype).tobytes()
    dataset = IndexedDataset(prefix, "mmap")
    assert [list(dataset[i]) for i in range(len(dataset))] == DOCS


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_legacy_writer_bytes_match_megatron_layout(tmp_path, impl):
    prefix = _build(str(tmp_path / "d"), impl, np.int32)
    assert (tmp_path / "d.idx").read_bytes() == _expected_legacy_idx([3, 2, 1], [0, 1, 2, 3], 4, 4)
    assert (tmp_path / "d.bin").read_bytes() == np.arange(1, 7, dtype=np.int32).tobytes()
    dataset = IndexedDataset(prefix, impl)
    assert [list(dataset[i]) for i in range(len(dataset))] == DOCS


@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
@pytest.mark.parametrize("layout", ["mmap", "legacy", "mmap-multimodal"])
def test_reads_megatron_files_with_multi_sequence_documents(tmp_path, impl, layout):
    # Megatron with --split-sentences stores several sequences per document: doc_idx is not 0..N.
    sizes, doc_idx = [2, 3, 1], [0, 2, 3]
    tokens = np.array([10, 11, 20, 21, 22, 30], dtype=np.int32)
    if layout == "legacy":
        index = _expected_legacy_idx(sizes, doc_idx, 4, 4)
    else:
        index = _expected_mmap_idx(sizes, doc_idx, 4, 4)
        if layout == "mmap-multimodal":
            index += np.zeros(len(sizes), dtype=np.int8).tobytes()  # one mode byte per sequence
    (tmp_path / "m.idx").write_bytes(index)
    (tmp_path / "m.bin").write_bytes(tokens.tobytes())
    dataset = IndexedDataset(str(tmp_path / "m"), impl)
    assert len(dataset) == 3 and dataset.num_documents == 2 and dataset.num_tokens == 6
    assert list(dataset.doc_idx) == doc_idx
    assert [list(dataset[i]) for i in range(3)] == [[10, 11], [20, 21, 22], [30]]
    assert list(dataset.read(1, 4)) == [11, 20, 21, 22]
    assert dataset.dtype == np.int32


def test_best_fitting_dtype_follows_megatron_threshold():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(250_000) == np.int32


def test_builder_leaves_nothing_behind_on_error(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document([1, 2])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_builder_rejects_ids_that_do_not_fit(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16) as builder:
        with pytest.raises(ValueError, match=r"\[0, 70000\].*uint16.*int32"):
            builder.add_document(np.array([0, 70000]))


def test_empty_dataset_round_trips(tmp_path):
    prefix = _build(str(tmp_path / "e"), docs=[])
    for impl in ("mmap", "lazy", "cached"):
        dataset = IndexedDataset(prefix, impl)
        assert len(dataset) == 0 and dataset.num_tokens == 0


def test_pickle_reopens_instead_of_copying(tmp_path):
    prefix = _build(str(tmp_path / "d"), docs=[list(range(5000))])
    for impl in ("mmap", "lazy", "cached"):
        dataset = IndexedDataset(prefix, impl)
        payload = pickle.dumps(dataset)
        assert len(payload) < 1000
        assert list(pickle.loads(payload)[0]) == list(range(5000))


def test_lazy_reads_are_safe_in_forked_loader_workers(tmp_path):
    docs = [list(range(i, i + 7)) for i in range(0, 700, 7)]
    dataset = IndexedDataset(_build(str(tmp_path / "d"), docs=docs), "lazy")
    dataset[0]  # the parent opens its descriptor before the workers fork

    class Wrapped(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            return torch.from_numpy(dataset[i].astype(np.int64))

    loader = DataLoader(Wrapped(), batch_size=10, num_workers=2, multiprocessing_context="fork")
    assert torch.cat([batch.flatten() for batch in loader]).tolist() == list(range(700))


# -- bad files ------------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    return _build(str(tmp_path / "g"))


def test_missing_idx(tmp_path, good):
    (tmp_path / "g.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"g\.idx' does not exist.*save_file_name"):
        IndexedDataset(good)


def test_missing_bin(tmp_path, good):
    (tmp_path / "g.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"g\.bin' does not exist.*run the preprocessor"):
        IndexedDataset(good)


def test_bad_magic(tmp_path, good):
    path = tmp_path / "g.idx"
    path.write_bytes(b"GARBAGE!!" + path.read_bytes()[9:])
    with pytest.raises(ValueError, match=r"not an indexed-dataset index.*GARBAGE.*MMIDIDX.*re-run"):
        IndexedDataset(good)


def test_bad_version(tmp_path, good):
    path = tmp_path / "g.idx"
    data = bytearray(path.read_bytes())
    data[9:17] = struct.pack("<Q", 7)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="index version 7.*only version 1"):
        IndexedDataset(good)


def test_bad_dtype_code(tmp_path, good):
    path = tmp_path / "g.idx"
    data = bytearray(path.read_bytes())
    data[17] = 42
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"dtype code 42; valid codes are \[1, 2, 3, 4, 5, 6, 7, 8\]"):
        IndexedDataset(good)


@pytest.mark.parametrize("keep", [5, 20, 40, -1])
def test_truncated_idx(tmp_path, good, keep):
    path = tmp_path / "g.idx"
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match=r"truncated|not an indexed-dataset index"):
        IndexedDataset(good)


@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_truncated_legacy_idx(tmp_path, impl):
    prefix = _build(str(tmp_path / "l"), impl)
    path = tmp_path / "l.idx"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"has \d+ bytes but its header requires \d+.*truncated"):
        IndexedDataset(prefix, impl)


def test_truncated_bin(tmp_path, good):
    path = tmp_path / "g.bin"
    path.write_bytes(path.read_bytes()[:-2])
    message = r"g\.bin' has 10 bytes but its index describes 6 tokens.*12 bytes.*truncated"
    with pytest.raises(ValueError, match=message):
        IndexedDataset(good)


def test_corrupt_pointers(tmp_path, good):
    path = tmp_path / "g.idx"
    data = bytearray(path.read_bytes())
    pointer_offset = 34 + 4 * 3
    data[pointer_offset + 8 : pointer_offset + 16] = struct.pack("<q", 4)  # sequence 1 should start at 6
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"corrupt: sequence 1 starts at byte 4, expected 6"):
        IndexedDataset(good)


def test_bad_impl_name(good):
    with pytest.raises(ValueError, match=r"binarization_impl='memmap'.*\['mmap', 'lazy', 'cached'\]"):
        IndexedDataset(good, "memmap")


def test_out_of_range_reads(good):
    dataset = IndexedDataset(good)
    with pytest.raises(IndexError, match="sequence index 3 is out of range for 3"):
        dataset[3]
    with pytest.raises(IndexError, match=r"token range \[4, 8\) is outside the 6 tokens"):
        dataset.read(4, 4)
