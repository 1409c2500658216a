"""Reading and writing token files in Megatron-LM's indexed-dataset formats.

A dataset is a pair of files sharing a prefix: ``<prefix>.bin`` holds the token ids of every
sequence back to back, and ``<prefix>.idx`` describes where each sequence starts. Two index
layouts exist and both are byte-compatible with Megatron-LM, so files move between the tools in
either direction:

``mmap`` layout (Megatron's ``MMapIndexedDataset``, the one used in practice), little-endian::

    b"MMIDIDX\\x00\\x00"              9 bytes   magic
    version                          uint64    always 1
    dtype code                       uint8     see DTYPE_CODES
    sequence count N                 uint64
    document count D                 uint64    length of doc_idx (= number of documents + 1)
    sizes                            int32[N]  tokens per sequence
    pointers                         int64[N]  byte offset of each sequence in the .bin
    doc_idx                          int64[D]  sequence index where each document starts, then N

``lazy`` / ``cached`` layout (Megatron's legacy ``IndexedDataset``, from fairseq)::

    b"TNTIDX\\x00\\x00"               8 bytes   magic
    version                          uint64    always 1
    dtype code, element size         uint64 x2
    sequence count N, sizes count S  uint64 x2 (S = N for 1-D token sequences)
    document count D                 uint64
    dim_offsets                      int64[N + 1]
    data_offsets                     int64[N + 1]  element (not byte) offset of each sequence
    sizes                            int64[S]
    doc_idx                          int64[D]

The layout in a file is detected from its magic, so any of the three access strategies
(``mmap``: memory-map the ``.bin``; ``lazy``: read from disk on every access; ``cached``: load the
whole ``.bin`` into memory) can read either layout.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)

MMAP_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
INDEX_VERSION = 1

BINARIZATION_IMPLS = ("mmap", "lazy", "cached")


def check_binarization_impl(binarization_impl: str) -> None:
    """Raise ``ValueError`` unless ``binarization_impl`` is one of :data:`BINARIZATION_IMPLS`."""
    if binarization_impl not in BINARIZATION_IMPLS:
        raise ValueError(
            f"binarization_impl={binarization_impl!r} is not supported; use one of {list(BINARIZATION_IMPLS)}."
        )

# Megatron-LM's numeric dtype codes (megatron/core/datasets/indexed_dataset.py, class DType).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Fixed part of the mmap index: magic + version + dtype code + two counts.
_MMAP_HEADER_BYTES = len(MMAP_MAGIC) + 8 + 1 + 8 + 8
# Fixed part of the legacy index: magic + version + (code, element size) + (N, S) + D.
_LEGACY_HEADER_BYTES = len(LEGACY_MAGIC) + 8 + 16 + 16 + 8

# Arrays derived from the sizes are produced in blocks of this many entries, so that writing or
# validating an index never needs memory proportional to the number of sequences.
_BLOCK = 1 << 20


def best_fitting_dtype(vocab_size: int) -> np.dtype:
    """Choose the token dtype for a vocabulary, the way Megatron-LM does.

    Args:
        vocab_size: number of distinct token ids (the largest id plus one).

    Returns:
        ``uint16`` when ``vocab_size < 65500`` (Megatron's threshold), otherwise ``int32``.
    """
    if vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def index_file_path(prefix: str) -> str:
    """Return the ``.idx`` path of the dataset at ``prefix``."""
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    """Return the ``.bin`` path of the dataset at ``prefix``."""
    return prefix + ".bin"


def normalize_prefix(path: str | os.PathLike) -> str:
    """Turn ``foo``, ``foo.bin`` or ``foo.idx`` into the dataset prefix ``foo``."""
    path = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


class IndexedDatasetBuilder:
    """Streams token sequences into a ``.bin``/``.idx`` pair.

    Tokens go to disk as they arrive, and the per-sequence sizes are spooled to a temporary file,
    so memory stays constant however many sequences are written. Each document is stored as one
    sequence (what Megatron-LM's ``preprocess_data.py`` writes without ``--split-sentences``), so
    ``doc_idx`` is ``0, 1, ..., N``. Files are written under temporary names and moved into place
    by :meth:`finalize`, so an interrupted run never leaves a valid-looking half dataset.

    Args:
        prefix: output path without suffix; ``prefix.bin`` and ``prefix.idx`` are created.
        dtype: numpy dtype of the stored token ids (see :func:`best_fitting_dtype`).
        binarization_impl: ``"mmap"`` writes the ``MMIDIDX`` index; ``"lazy"`` and ``"cached"``
            write the legacy ``TNTIDX`` index (as Megatron-LM does for those impls).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype, binarization_impl: str = "mmap") -> None:
        check_binarization_impl(binarization_impl)
        dtype = np.dtype(dtype)
        if dtype not in _CODE_OF_DTYPE:
            raise ValueError(
                f"dtype={dtype} has no Megatron-LM dtype code; use one of "
                f"{sorted(str(d) for d in _CODE_OF_DTYPE)} (uint16 or int32 for token ids)."
            )
        self.prefix = normalize_prefix(prefix)
        self.dtype = dtype
        self.binarization_impl = binarization_impl
        directory = os.path.dirname(os.path.abspath(self.prefix))
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"Cannot write dataset '{self.prefix}': directory '{directory}' does not exist. "
                "Create it first or choose another save_file_name."
            )
        self._bin_tmp = self.prefix + ".bin.tmp"
        self._idx_tmp = self.prefix + ".idx.tmp"
        # Both handles live until finalize() or abort(), which close them.
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115
        self._sizes_spool = tempfile.TemporaryFile(dir=directory, prefix=".oslo-sizes-")  # noqa: SIM115
        self.num_sequences = 0
        self.num_tokens = 0
        self._closed = False

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document (one sequence) of token ids.

        Args:
            tokens: the document's token ids.
        """
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([tokens.size], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append several documents whose token ids are concatenated in ``tokens``.

        Args:
            tokens: 1-D array with the token ids of all documents back to back.
            sizes: number of tokens of each document; must sum to ``tokens.size``.
        """
        if self._closed:
            raise RuntimeError(f"Builder for '{self.prefix}' is already finalized or aborted.")
        sizes = np.asarray(sizes, dtype=np.int64)
        total = int(sizes.sum())
        if total != tokens.size:
            raise ValueError(
                f"sizes sum to {total} tokens but {tokens.size} tokens were given; "
                "sizes must list the length of every document in tokens."
            )
        if sizes.size and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
            raise ValueError(
                f"document sizes must lie in [0, {np.iinfo(np.int32).max}] (the .idx stores int32), "
                f"got min {sizes.min()} and max {sizes.max()}; split very long documents."
            )
        if tokens.dtype != self.dtype:
            tokens = _cast_tokens(tokens, self.dtype)
        self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._sizes_spool.write(sizes.astype(np.int32).tobytes())
        self.num_sequences += sizes.size
        self.num_tokens += total

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        if self._closed:
            return
        self._bin.close()
        try:
            with open(self._idx_tmp, "wb") as index:
                if self.binarization_impl == "mmap":
                    self._write_mmap_index(index)
                else:
                    self._write_legacy_index(index)
            os.replace(self._bin_tmp, data_file_path(self.prefix))
            os.replace(self._idx_tmp, index_file_path(self.prefix))
        except BaseException:
            self.abort()
            raise
        finally:
            self._sizes_spool.close()
            self._closed = True
        logger.info(
            "Wrote %d sequences (%d tokens, %s) to %s.bin/.idx",
            self.num_sequences,
            self.num_tokens,
            self.dtype,
            self.prefix,
        )

    def abort(self) -> None:
        """Close and delete the partial output; the final ``.bin``/``.idx`` are left untouched."""
        self._closed = True
        for handle in (self._bin, self._sizes_spool):
            handle.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def _size_blocks(self) -> Iterator[np.ndarray]:
        self._sizes_spool.seek(0)
        while True:
            block = self._sizes_spool.read(_BLOCK * 4)
            if not block:
                return
            yield np.frombuffer(block, dtype=np.int32)

    def _write_mmap_index(self, index: BinaryIO) -> None:
        n = self.num_sequences
        index.write(MMAP_MAGIC)
        index.write(struct.pack("<Q", INDEX_VERSION))
        index.write(struct.pack("<B", _CODE_OF_DTYPE[self.dtype]))
        index.write(struct.pack("<Q", n))
        index.write(struct.pack("<Q", n + 1))
        index.writelines(block.tobytes() for block in self._size_blocks())
        # pointers: byte offset of each sequence = exclusive running sum of sizes * itemsize
        carry = 0
        for block in self._size_blocks():
            ends = np.cumsum(block, dtype=np.int64) * self.dtype.itemsize + carry
            starts = np.empty_like(ends)
            starts[0] = carry
            starts[1:] = ends[:-1]
            index.write(starts.tobytes())
            carry = int(ends[-1])
        _write_arange(index, n + 1)

    def _write_legacy_index(self, index: BinaryIO) -> None:
        n = self.num_sequences
        index.write(LEGACY_MAGIC)
        index.write(struct.pack("<Q", INDEX_VERSION))
        index.write(struct.pack("<QQ", _CODE_OF_DTYPE[self.dtype], self.dtype.itemsize))
        index.write(struct.pack("<QQ", n, n))
        index.write(struct.pack("<Q", n + 1))
        _write_arange(index, n + 1)  # dim_offsets: every sequence is 1-D
        index.write(struct.pack("<q", 0))  # data_offsets, in elements
        carry = 0
        for block in self._size_blocks():
            ends = np.cumsum(block, dtype=np.int64) + carry
            index.write(ends.tobytes())
            carry = int(ends[-1])
        for block in self._size_blocks():
            index.write(block.astype(np.int64).tobytes())
        _write_arange(index, n + 1)  # doc_idx


def _write_arange(handle: BinaryIO, count: int) -> None:
    handle.writelines(
        np.arange(start, min(count, start + _BLOCK), dtype=np.int64).tobytes()
        for start in range(0, count, _BLOCK)
    )


def _cast_tokens(tokens: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if tokens.size and np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        low, high = int(tokens.min()), int(tokens.max())
        if low < info.min or high > info.max:
            raise ValueError(
                f"token ids span [{low}, {high}] but the dataset dtype {dtype} holds only "
                f"[{info.min}, {info.max}]; build the dataset with a wider dtype (int32)."
            )
    return tokens.astype(dtype)


class IndexedDataset:
    """Reads a ``.bin``/``.idx`` pair written by oslo or Megatron-LM.

    The token stream of all sequences, concatenated, is available through :meth:`read`; single
    sequences through indexing. The index layout (``MMIDIDX`` or ``TNTIDX``) is detected from the
    file; ``binarization_impl`` only picks the access strategy. Opening checks the header, the file
    sizes and the offsets, so a truncated or corrupt file fails here rather than mid-training.

    Args:
        prefix: dataset path without suffix (a trailing ``.bin``/``.idx`` is accepted and dropped).
        binarization_impl: ``"mmap"`` maps the ``.bin`` into memory, ``"lazy"`` reads from disk at
            every access, ``"cached"`` loads the whole ``.bin`` into memory at construction.
    """

    def __init__(self, prefix: str | os.PathLike, binarization_impl: str = "mmap") -> None:
        check_binarization_impl(binarization_impl)
        self.prefix = normalize_prefix(prefix)
        self.binarization_impl = binarization_impl
        self._open()

    # -- construction -------------------------------------------------------------------------

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"No indexed dataset at '{self.prefix}': '{path}' does not exist. Pass the "
                    "save_file_name given to DatasetPreprocessor.preprocess (the path without "
                    ".bin/.idx), or run the preprocessor first."
                )
        with open(idx_path, "rb") as stream:
            head = stream.read(len(MMAP_MAGIC))
        if head == MMAP_MAGIC:
            self.index_format = "mmap"
            self._read_mmap_index(idx_path)
        elif head[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
            self.index_format = "legacy"
            self._read_legacy_index(idx_path)
        else:
            raise ValueError(
                f"'{idx_path}' is not an indexed-dataset index: it starts with {head!r}, expected "
                f"{MMAP_MAGIC!r} (mmap) or {LEGACY_MAGIC!r} (lazy/cached). The file is corrupt or "
                "of another format; re-run DatasetPreprocessor.preprocess to rebuild it."
            )
        self._check_offsets(idx_path)
        self.num_tokens = self._count_tokens()
        expected = self.num_tokens * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise ValueError(
                f"'{bin_path}' has {actual} bytes but its index describes {self.num_tokens} tokens "
                f"of {self.dtype} ({expected} bytes): the .bin is truncated or does not belong to "
                "this .idx. Re-run DatasetPreprocessor.preprocess to rebuild both files."
            )
        self._pid = os.getpid()
        self._fd: int | None = None
        self._tokens: np.ndarray | None = None
        if self.binarization_impl == "cached":
            self._tokens = np.fromfile(bin_path, dtype=self.dtype)
        elif self.binarization_impl == "mmap":
            self._tokens = self._map_tokens(bin_path)

    def _map_tokens(self, bin_path: str) -> np.ndarray:
        if self.num_tokens == 0:
            return np.empty(0, dtype=self.dtype)  # mmap cannot map an empty file
        return np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def _read_mmap_index(self, idx_path: str) -> None:
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_MMAP_HEADER_BYTES)
        if len(header) < _MMAP_HEADER_BYTES:
            raise _truncated(idx_path, file_size, _MMAP_HEADER_BYTES)
        (version,) = struct.unpack_from("<Q", header, 9)
        (code,) = struct.unpack_from("<B", header, 17)
        n, d = struct.unpack_from("<QQ", header, 18)
        _check_version(idx_path, version)
        self.dtype = _dtype_of(idx_path, code)
        expected = _MMAP_HEADER_BYTES + 4 * n + 8 * n + 8 * d
        # Megatron's multimodal datasets append one int8 mode per sequence; the tokens are the same.
        if file_size not in (expected, expected + n):
            raise _truncated(idx_path, file_size, expected)
        raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = _MMAP_HEADER_BYTES
        self.sizes = np.frombuffer(raw, dtype=np.int32, count=n, offset=offset)
        offset += 4 * n
        self.pointers = np.frombuffer(raw, dtype=np.int64, count=n, offset=offset)
        offset += 8 * n
        self.doc_idx = np.frombuffer(raw, dtype=np.int64, count=d, offset=offset)

    def _read_legacy_index(self, idx_path: str) -> None:
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_LEGACY_HEADER_BYTES)
            if len(header) < _LEGACY_HEADER_BYTES:
                raise _truncated(idx_path, file_size, _LEGACY_HEADER_BYTES)
            (version,) = struct.unpack_from("<Q", header, 8)
            code, element_size = struct.unpack_from("<QQ", header, 16)
            n, s = struct.unpack_from("<QQ", header, 32)
            (d,) = struct.unpack_from("<Q", header, 48)
            _check_version(idx_path, version)
            self.dtype = _dtype_of(idx_path, code)
            if element_size != self.dtype.itemsize:
                raise ValueError(
                    f"'{idx_path}' declares element size {element_size} for dtype {self.dtype} "
                    f"(itemsize {self.dtype.itemsize}): the index is corrupt. Re-run "
                    "DatasetPreprocessor.preprocess to rebuild it."
                )
            expected = _LEGACY_HEADER_BYTES + 8 * (2 * (n + 1) + s + d)
            if file_size != expected:
                raise _truncated(idx_path, file_size, expected)
            if s != n:
                raise ValueError(
                    f"'{idx_path}' stores {s} sizes for {n} sequences: only 1-D token sequences are "
                    "supported. Rebuild the dataset with DatasetPreprocessor."
                )
            dim_offsets = np.fromfile(stream, dtype=np.int64, count=n + 1)
            self._data_offsets = np.fromfile(stream, dtype=np.int64, count=n + 1)
            self.sizes = np.fromfile(stream, dtype=np.int64, count=s)
            self.doc_idx = np.fromfile(stream, dtype=np.int64, count=d)
        if not np.array_equal(dim_offsets, np.arange(n + 1)):
            raise ValueError(
                f"'{idx_path}' has dim_offsets of multi-dimensional items: only 1-D token sequences "
                "are supported. Rebuild the dataset with DatasetPreprocessor."
            )
        self.pointers = self._data_offsets[:-1] * self.dtype.itemsize

    def _check_offsets(self, idx_path: str) -> None:
        """Sequences must be stored back to back, in order, starting at byte 0."""
        n = len(self.sizes)
        carry = 0
        for start in range(0, n, _BLOCK):
            sizes = np.asarray(self.sizes[start : start + _BLOCK], dtype=np.int64)
            pointers = np.asarray(self.pointers[start : start + _BLOCK])
            if sizes.size and sizes.min() < 0:
                raise _corrupt(idx_path, f"a negative sequence size at sequence >= {start}")
            expected = np.empty_like(sizes)
            expected[0] = carry
            np.cumsum(sizes[:-1] * self.dtype.itemsize, out=expected[1:])
            expected[1:] += carry
            if not np.array_equal(pointers, expected):
                bad = start + int(np.flatnonzero(pointers != expected)[0])
                raise _corrupt(
                    idx_path,
                    f"sequence {bad} starts at byte {int(self.pointers[bad])}, expected "
                    f"{int(expected[bad - start])} (sequences must be contiguous)",
                )
            carry = int(expected[-1] + sizes[-1] * self.dtype.itemsize)
        if self.index_format == "legacy" and n and self._data_offsets[-1] * self.dtype.itemsize != carry:
            raise _corrupt(idx_path, "the last data offset does not match the sequence sizes")
        doc_idx = self.doc_idx
        if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] > n:
            raise _corrupt(idx_path, f"doc_idx must start at 0 and stay within the sequence count {n}")
        for start in range(0, len(doc_idx), _BLOCK):
            block = np.asarray(doc_idx[start : start + _BLOCK + 1])
            if np.any(np.diff(block) < 0):
                raise _corrupt(idx_path, "doc_idx is not non-decreasing")

    def _count_tokens(self) -> int:
        total = 0
        for start in range(0, len(self.sizes), _BLOCK):
            total += int(np.sum(self.sizes[start : start + _BLOCK], dtype=np.int64))
        return total

    # -- pickling: workers reopen the files instead of copying mapped or cached data ----------

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "binarization_impl": self.binarization_impl}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self.binarization_impl = state["binarization_impl"]
        self._open()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None and getattr(self, "_pid", None) == os.getpid():
            os.close(fd)

    # -- access --------------------------------------------------------------------------------

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(doc_idx) - 1``)."""
        return len(self.doc_idx) - 1

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> np.ndarray:
        """Token ids of sequence ``index`` (a read-only view for ``mmap``/``cached``)."""
        n = len(self.sizes)
        if not -n <= index < n:
            raise IndexError(f"sequence index {index} is out of range for {n} sequences")
        index %= n
        start = int(self.pointers[index]) // self.dtype.itemsize
        return self.read(start, int(self.sizes[index]))

    def read(self, start: int, count: int) -> np.ndarray:
        """Read ``count`` tokens of the concatenated token stream, starting at token ``start``.

        Args:
            start: position in the concatenation of all sequences.
            count: number of tokens to read.

        Returns:
            A 1-D array of ``count`` token ids in the file's dtype.
        """
        if start < 0 or count < 0 or start + count > self.num_tokens:
            raise IndexError(
                f"token range [{start}, {start + count}) is outside the {self.num_tokens} tokens "
                f"of '{self.prefix}'"
            )
        if self._tokens is not None:
            return self._tokens[start : start + count]
        return self._pread(start, count)

    def _pread(self, start: int, count: int) -> np.ndarray:
        # A descriptor per process: positional reads keep DataLoader workers from racing on a
        # shared file offset, and a forked child must not use its parent's descriptor.
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(data_file_path(self.prefix), os.O_RDONLY | getattr(os, "O_BINARY", 0))
            self._pid = os.getpid()
        out = np.empty(count, dtype=self.dtype)
        nbytes = out.nbytes
        offset = start * self.dtype.itemsize
        if hasattr(os, "preadv"):
            got = os.preadv(self._fd, [memoryview(out).cast("B")], offset)
        else:
            data = os.pread(self._fd, nbytes, offset)
            got = len(data)
            out[...] = np.frombuffer(data, dtype=self.dtype)
        if got != nbytes:
            raise OSError(
                f"short read from '{data_file_path(self.prefix)}': {got} of {nbytes} bytes at offset "
                f"{offset}; the file shrank after it was opened. Rebuild the dataset."
            )
        return out

    def __repr__(self) -> str:
        return (
            f"IndexedDataset(prefix={self.prefix!r}, binarization_impl={self.binarization_impl!r}, "
            f"sequences={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"
        )


def _check_version(idx_path: str, version: int) -> None:
    if version != INDEX_VERSION:
        raise ValueError(
            f"'{idx_path}' has index version {version}; only version {INDEX_VERSION} exists in "
            "Megatron-LM's format, so the file is corrupt. Re-run DatasetPreprocessor.preprocess."
        )


def _dtype_of(idx_path: str, code: int) -> np.dtype:
    if code not in DTYPE_CODES:
        raise ValueError(
            f"'{idx_path}' declares dtype code {code}; valid codes are {sorted(DTYPE_CODES)}. The "
            "index is corrupt; re-run DatasetPreprocessor.preprocess to rebuild it."
        )
    return DTYPE_CODES[code]


def _truncated(idx_path: str, actual: int, expected: int) -> ValueError:
    return ValueError(
        f"'{idx_path}' has {actual} bytes but its header requires {expected}: the index is "
        "truncated or corrupt. Re-run DatasetPreprocessor.preprocess to rebuild it."
    )


def _corrupt(idx_path: str, detail: str) -> ValueError:
    return ValueError(
        f"'{idx_path}' is corrupt: {detail}. Re-run DatasetPreprocessor.preprocess to rebuild it."
    )
