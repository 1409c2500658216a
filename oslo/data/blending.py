"""Mixing several datasets into one with exact, deterministic proportions."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

logger = logging.getLogger(__name__)


class DatasetBlender(Dataset):
    """One dataset whose samples come from several datasets in fixed proportions.

    The blend has ``num_samples`` items (by default the sum of the datasets' lengths). Dataset
    ``d`` receives exactly its share ``weights[d] / sum(weights)`` of them, rounded by the
    largest-remainder method so the counts add up, and its items are spread evenly: in every prefix
    of the blend, each dataset's count is within about one item of its share. Dataset ``d``'s
    ``j``-th item is its sample ``j % len(d)``, so a dataset with more weight than samples repeats
    (one more epoch of it) and one with less is cut short. The mapping is a pure function of the
    lengths and weights: the same on every run and every rank.

    Args:
        datasets: the datasets to blend (any map-style datasets with ``len``).
        weights: relative weight of each dataset (non-negative, not all zero; need not sum to 1).
            ``None`` weights each dataset by its length, so every sample appears exactly once.
        num_samples: length of the blend; defaults to the total length of ``datasets``.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float] | None = None,
        num_samples: int | None = None,
    ) -> None:
        datasets = list(datasets)
        if not datasets:
            raise ValueError("datasets is empty; pass a list with at least one dataset to blend.")
        lengths = np.array([len(dataset) for dataset in datasets], dtype=np.int64)
        if weights is None:
            if lengths.sum() == 0:
                raise ValueError("all datasets are empty, so there is nothing to blend.")
            weights_array = lengths.astype(np.float64)
        else:
            weights_array = _check_weights(weights, len(datasets))
        empty = [i for i in range(len(datasets)) if lengths[i] == 0 and weights_array[i] > 0]
        if empty:
            raise ValueError(
                f"datasets {empty} are empty but have weights {[float(weights_array[i]) for i in empty]}; "
                "remove them or give them weight 0."
            )
        if num_samples is None:
            num_samples = int(lengths.sum())
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"num_samples must be a non-negative int, got {num_samples!r}.")

        self.datasets = datasets
        self.weights = weights_array / weights_array.sum()
        self.counts = _apportion(self.weights, num_samples)
        self.dataset_index, self.sample_index = _interleave(self.counts, lengths)
        logger.info(
            "DatasetBlender: %d samples from %d datasets, counts %s",
            num_samples,
            len(datasets),
            self.counts.tolist(),
        )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> Any:
        length = len(self)
        if not -length <= index < length:
            raise IndexError(f"sample index {index} is out of range for {length} samples")
        return self.datasets[int(self.dataset_index[index])][int(self.sample_index[index])]


def _check_weights(weights: Sequence[float], count: int) -> np.ndarray:
    weights = list(weights)
    if len(weights) != count:
        raise ValueError(
            f"got {len(weights)} weights for {count} datasets; pass one weight per dataset "
            "or weights=None to weight by length."
        )
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
            raise TypeError(f"weights[{i}] = {weight!r} is not a number; weights must be floats.")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(
                f"weights[{i}] = {weight!r} is invalid: weights must be finite and non-negative "
                "(0 leaves a dataset out)."
            )
    array = np.asarray(weights, dtype=np.float64)
    if array.sum() <= 0:
        raise ValueError(
            f"weights {weights} are all zero, so no dataset would be drawn; give at least one "
            "dataset a positive weight."
        )
    return array


def _apportion(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total``, each within one of ``shares * total``."""
    quotas = shares * total
    counts = np.floor(quotas).astype(np.int64)
    remainder = total - int(counts.sum())
    if remainder > 0:
        # largest fractional part first; ties go to the earlier dataset (stable sort)
        order = np.argsort(-(quotas - counts), kind="stable")
        counts[order[:remainder]] += 1
    return counts


def _interleave(counts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Place dataset ``d``'s ``j``-th item at the ideal position ``(j + 0.5) / counts[d]``."""
    keys, owners, positions = [], [], []
    for dataset, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        j = np.arange(count, dtype=np.int64)
        keys.append((j + 0.5) / count)
        owners.append(np.full(count, dataset, dtype=np.int64))
        positions.append(j % lengths[dataset])
    if not keys:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    key, owner, position = np.concatenate(keys), np.concatenate(owners), np.concatenate(positions)
    order = np.lexsort((owner, key))  # by ideal position, ties by dataset
    dataset_dtype = np.int16 if len(counts) <= np.iinfo(np.int16).max else np.int64
    return owner[order].astype(dataset_dtype), position[order]
