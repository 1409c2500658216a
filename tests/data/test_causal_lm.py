"""DatasetForCausalLM: samples are exact slices of the token stream, splits, determinism, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from oslo.data import DatasetForCausalLM, IndexedDataset

SEQ = 16


def _stream(prefix) -> np.ndarray:
    dataset = IndexedDataset(prefix)
    return np.asarray(dataset.read(0, dataset.num_tokens), dtype=np.int64)


def test_samples_are_consecutive_slices_of_the_concatenated_documents(dataset_prefixes):
    stream = _stream(dataset_prefixes["mmap"])
    dataset = DatasetForCausalLM(dataset_prefixes["mmap"], SEQ, split_type="valid")
    assert len(dataset) == len(stream) // SEQ
    for index in (0, 1, len(dataset) - 1):
        item = dataset[index]
        expected = torch.from_numpy(stream[index * SEQ : (index + 1) * SEQ])
        assert torch.equal(item["input_ids"], expected)
        assert torch.equal(item["labels"], expected)
        assert torch.equal(item["attention_mask"], torch.ones(SEQ, dtype=torch.long))
        assert item["input_ids"].dtype == torch.long


@pytest.mark.parametrize("split_type", ["train", "valid"])
def test_identical_samples_across_impls(dataset_prefixes, split_type):
    datasets = [
        DatasetForCausalLM(dataset_prefixes[impl], SEQ, split_type=split_type, binarization_impl=read_as)
        for impl in ("mmap", "lazy", "cached")
        for read_as in ("mmap", "lazy", "cached")
    ]
    reference = [datasets[0][i]["input_ids"] for i in range(len(datasets[0]))]
    for dataset in datasets[1:]:
        assert len(dataset) == len(reference)
        assert all(torch.equal(dataset[i]["input_ids"], reference[i]) for i in range(len(dataset)))


def test_splits_are_disjoint_and_cover_every_sample(dataset_prefixes):
    prefix = dataset_prefixes["mmap"]
    bounds = [(0.0, 0.8, "train"), (0.8, 0.9, "valid"), (0.9, 1.0, "test")]
    splits = [DatasetForCausalLM(prefix, SEQ, split, start, end) for start, end, split in bounds]
    positions = [sorted(split.sample_index(i) for i in range(len(split))) for split in splits]
    total = splits[0].total_samples
    assert sum(positions, []) == list(range(total))
    assert [len(p) for p in positions] == [round(0.8 * total), round(0.9 * total) - round(0.8 * total),
                                          total - round(0.9 * total)]


def test_order_is_deterministic_for_a_seed(dataset_prefixes):
    prefix = dataset_prefixes["mmap"]
    order = lambda dataset: [dataset.sample_index(i) for i in range(len(dataset))]  # noqa: E731
    first = order(DatasetForCausalLM(prefix, SEQ, seed=7))
    assert first == order(DatasetForCausalLM(prefix, SEQ, seed=7))
    assert first != order(DatasetForCausalLM(prefix, SEQ, seed=8))
    assert first != sorted(first)  # train is shuffled by default
    assert order(DatasetForCausalLM(prefix, SEQ, split_type="test")) == sorted(first)
    assert order(DatasetForCausalLM(prefix, SEQ, shuffle=False)) == sorted(first)


def test_batches_feed_a_causal_lm(dataset_prefixes, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    loader = DataLoader(DatasetForCausalLM(dataset_prefixes["mmap"], SEQ), batch_size=4)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, SEQ)
    output = model(**batch)
    assert output.loss.ndim == 0 and torch.isfinite(output.loss)


# -- bad input ------------------------------------------------------------------------------------


def test_missing_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No indexed dataset at .*nothing\.idx' does not exist"):
        DatasetForCausalLM(str(tmp_path / "nothing"), SEQ)


@pytest.mark.parametrize("start, end", [(0.5, 0.5), (0.9, 0.1)])
def test_start_weight_not_below_end_weight(dataset_prefixes, start, end):
    message = rf"start_weight \({start}\) must be smaller than end_weight \({end}\)"
    with pytest.raises(ValueError, match=message):
        DatasetForCausalLM(dataset_prefixes["mmap"], SEQ, start_weight=start, end_weight=end)


@pytest.mark.parametrize("field, value", [("start_weight", -0.1), ("end_weight", 1.5)])
def test_weights_outside_unit_interval(dataset_prefixes, field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a fraction in \[0, 1\], got {value}"):
        DatasetForCausalLM(dataset_prefixes["mmap"], SEQ, **{field: value})


def test_split_without_samples(dataset_prefixes):
    message = r"holds no sample.*max_seq_length=100000000.*shorter max_seq_length"
    with pytest.raises(ValueError, match=message):
        DatasetForCausalLM(dataset_prefixes["mmap"], 100_000_000)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_seq_length": 0}, "max_seq_length must be a positive int, got 0"),
        ({"split_type": "dev"}, r"split_type='dev' is not supported.*\['train', 'valid', 'test'\]"),
        ({"binarization_impl": "ram"}, r"binarization_impl='ram' is not supported"),
    ],
)
def test_bad_arguments(dataset_prefixes, kwargs, message):
    arguments = {"data_name": dataset_prefixes["mmap"], "max_seq_length": SEQ, **kwargs}
    with pytest.raises(ValueError, match=message):
        DatasetForCausalLM(**arguments)


def test_index_out_of_range(dataset_prefixes):
    dataset = DatasetForCausalLM(dataset_prefixes["mmap"], SEQ)
    with pytest.raises(IndexError, match=f"sample index {len(dataset)} is out of range"):
        dataset[len(dataset)]
