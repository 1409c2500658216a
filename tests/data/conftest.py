"""Fixtures for the data tests: a small generated corpus and a tokenizer trained on it locally."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .corpus import EOD, make_documents


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return make_documents(400)


@pytest.fixture(scope="session")
def backend_tokenizer(documents: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer(backend_tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend_tokenizer, eos_token=EOD)


@pytest.fixture(scope="session")
def dataset_prefixes(tmp_path_factory, tokenizer, documents) -> dict[str, str]:
    """The fixture corpus preprocessed once per binarization impl (in-process, to stay fast)."""
    from oslo.data import DatasetPreprocessor

    directory = tmp_path_factory.mktemp("preprocessed")
    prefixes = {}
    for impl in ("mmap", "lazy", "cached"):
        prefix = str(directory / f"corpus_{impl}")
        preprocessor = DatasetPreprocessor(tokenizer, binarization_impl=impl, num_workers=0)
        preprocessor.preprocess(documents, prefix, progress_bar=False)
        prefixes[impl] = prefix
    return prefixes
