"""Fixed-length causal language modelling samples cut from a binarized corpus."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from oslo.data.indexed_dataset import IndexedDataset, check_binarization_impl

logger = logging.getLogger(__name__)

SPLIT_TYPES = ("train", "valid", "test")


class DatasetForCausalLM(Dataset):
    """Causal language modelling samples from a corpus written by :class:`DatasetPreprocessor`.

    All documents are concatenated (with their end-of-document tokens, if the preprocessor appended
    them) into one token stream, which is cut into consecutive, non-overlapping samples of
    ``max_seq_length`` tokens; a last partial sample is dropped. Of the ``S`` samples, this dataset
    holds those from ``round(start_weight * S)`` up to (excluding) ``round(end_weight * S)``, so
    splits built from adjacent weight ranges (``[0, 0.8)``, ``[0.8, 0.9)``, ``[0.9, 1.0)``) are
    disjoint and together cover every sample.

    Each item is a dict of ``int64`` tensors of shape ``(max_seq_length,)``: ``input_ids``,
    ``labels`` (equal to ``input_ids``; Hugging Face causal LM heads shift labels themselves) and
    ``attention_mask`` (all ones, since samples contain no padding). The default collate function
    stacks them into batches that go straight into a model's ``forward``.

    Args:
        data_name: dataset path without suffix (``data_name.bin`` / ``data_name.idx``).
        max_seq_length: tokens per sample.
        split_type: ``"train"``, ``"valid"`` or ``"test"``; the train split is shuffled by default.
        start_weight: start of this split, as a fraction of all samples, in ``[0, 1)``.
        end_weight: end of this split (exclusive), as a fraction of all samples, in ``(0, 1]``.
        binarization_impl: how tokens are read: ``"mmap"``, ``"lazy"`` or ``"cached"``.
        seed: seed of the sample order; the same seed gives the same order on every run and rank.
        shuffle: permute the samples of the split; defaults to ``True`` for ``"train"`` and
            ``False`` for ``"valid"``/``"test"``.
    """

    def __init__(
        self,
        data_name: str | os.PathLike,
        max_seq_length: int,
        split_type: str = "train",
        start_weight: float = 0.0,
        end_weight: float = 1.0,
        binarization_impl: str = "mmap",
        seed: int = 42,
        shuffle: bool | None = None,
    ) -> None:
        if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
            raise ValueError(f"max_seq_length must be a positive int, got {max_seq_length!r}.")
        if split_type not in SPLIT_TYPES:
            raise ValueError(f"split_type={split_type!r} is not supported; use one of {list(SPLIT_TYPES)}.")
        check_binarization_impl(binarization_impl)
        for name, value in (("start_weight", start_weight), ("end_weight", end_weight)):
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0 or math.isnan(value):
                raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}.")
        if start_weight >= end_weight:
            raise ValueError(
                f"start_weight ({start_weight}) must be smaller than end_weight ({end_weight}): the "
                "split covers samples in [start_weight, end_weight) of the data, e.g. 0.0 and 0.8."
            )

        self.data_name = os.fspath(data_name)
        self.max_seq_length = max_seq_length
        self.split_type = split_type
        self.start_weight = float(start_weight)
        self.end_weight = float(end_weight)
        self.binarization_impl = binarization_impl
        self.seed = seed
        self.shuffle = split_type == "train" if shuffle is None else shuffle
        self.indexed_dataset = IndexedDataset(self.data_name, binarization_impl)

        total = self.indexed_dataset.num_tokens // max_seq_length
        self.total_samples = total
        self.start = round(self.start_weight * total)
        self.end = round(self.end_weight * total)
        if self.end <= self.start:
            raise ValueError(
                f"the {split_type} split [{start_weight}, {end_weight}) of '{self.data_name}' holds no "
                f"sample: the corpus has {self.indexed_dataset.num_tokens} tokens, i.e. {total} samples "
                f"of max_seq_length={max_seq_length}. Use a larger corpus, a shorter max_seq_length or "
                "a wider weight range."
            )
        self._order: np.ndarray | None = None
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(seed))
            self._order = rng.permutation(self.end - self.start).astype(np.int64) + self.start
        logger.info(
            "DatasetForCausalLM %s (%s): samples %d..%d of %d, %d tokens each",
            self.data_name,
            split_type,
            self.start,
            self.end,
            total,
            max_seq_length,
        )

    def __len__(self) -> int:
        return self.end - self.start

    def sample_index(self, index: int) -> int:
        """Position of item ``index`` among all samples of the corpus (before splitting)."""
        length = len(self)
        if not -length <= index < length:
            raise IndexError(f"sample index {index} is out of range for {length} samples")
        index %= length
        return int(self._order[index]) if self._order is not None else self.start + index

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.sample_index(index)
        tokens = self.indexed_dataset.read(sample * self.max_seq_length, self.max_seq_length)
        input_ids = torch.from_numpy(tokens.astype(np.int64))
        return {
            "input_ids": input_ids,
            "labels": input_ids.clone(),
            "attention_mask": torch.ones(self.max_seq_length, dtype=torch.long),
        }

    def __repr__(self) -> str:
        return (
            f"DatasetForCausalLM(data_name={self.data_name!r}, split_type={self.split_type!r}, "
            f"samples={len(self)}, max_seq_length={self.max_seq_length}, "
            f"binarization_impl={self.binarization_impl!r})"
        )
