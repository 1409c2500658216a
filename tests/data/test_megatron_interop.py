"""Files move between oslo and Megatron-LM in both directions (runs only if megatron-core is installed).

megatron-core is not an oslo dependency; install it (``pip install megatron-core``) to run these.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oslo.data import DatasetPreprocessor, IndexedDataset

megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _megatron_preprocess(tokenizer, documents, prefix):
    """What Megatron-LM's tools/preprocess_data.py does for GPT data with --append-eod."""
    dtype = megatron.DType.optimal_dtype(len(tokenizer))
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        ids = tokenizer(document)["input_ids"]
        if ids:
            ids = ids + [tokenizer.eos_token_id]
            builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(prefix + ".idx")


def test_oslo_output_is_byte_identical_to_megatron(tmp_path, tokenizer, documents):
    _megatron_preprocess(tokenizer, documents, str(tmp_path / "megatron"))
    DatasetPreprocessor(tokenizer, chunk_size=32, num_workers=2).preprocess(
        documents, str(tmp_path / "oslo"), progress_bar=False
    )
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"oslo{suffix}").read_bytes() == (tmp_path / f"megatron{suffix}").read_bytes()


def test_megatron_reads_oslo_files(dataset_prefixes, tokenizer, documents):
    ours = IndexedDataset(dataset_prefixes["mmap"])
    theirs = megatron.IndexedDataset(dataset_prefixes["mmap"])
    assert len(theirs) == len(ours)
    assert all(np.array_equal(theirs[i], ours[i]) for i in range(len(ours)))
    assert np.array_equal(theirs.document_indices, ours.doc_idx)


@pytest.mark.parametrize("impl", ["mmap", "lazy", "cached"])
def test_oslo_reads_megatron_files_with_sentences(tmp_path, impl):
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    documents = [[[5, 6], [7, 8, 9]], [[10]], [[11, 12, 13, 14], [15], [16, 17]]]
    for document in documents:
        for sentence in document:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(str(tmp_path / "m"), impl)
    theirs = megatron.IndexedDataset(str(tmp_path / "m"))
    assert [ours[i].tolist() for i in range(len(ours))] == [s for d in documents for s in d]
    assert np.array_equal(ours.doc_idx, theirs.document_indices) and ours.num_documents == 3
