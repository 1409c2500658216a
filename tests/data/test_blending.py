"""DatasetBlender: exact proportions, even spreading, determinism, and bad weights."""

from __future__ import annotations

import numpy as np
import pytest

from oslo.data import DatasetBlender


class Labelled:
    """A dataset whose items say where they come from."""

    def __init__(self, name: str, length: int) -> None:
        self.name, self.length = name, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[str, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return self.name, index


def _sources(blend):
    return [blend[i][0] for i in range(len(blend))]


def test_default_weights_use_every_sample_exactly_once():
    datasets = [Labelled("a", 30), Labelled("b", 50), Labelled("c", 7)]
    blend = DatasetBlender(datasets)
    assert len(blend) == 87
    assert sorted(blend[i] for i in range(87)) == sorted(d[j] for d in datasets for j in range(len(d)))


def test_exact_proportions_with_weights():
    blend = DatasetBlender([Labelled("a", 500), Labelled("b", 500)], weights=[0.7, 0.3])
    sources = _sources(blend)
    assert sources.count("a") == 700 and sources.count("b") == 300
    # every prefix stays within one item of the target share
    running = np.cumsum([source == "a" for source in sources])
    ideal = 0.7 * np.arange(1, 1001)
    assert np.max(np.abs(running - ideal)) <= 1.0


def test_counts_add_up_for_awkward_weights():
    datasets = [Labelled(name, 100) for name in "abc"]
    blend = DatasetBlender(datasets, weights=[1, 1, 1], num_samples=100)
    counts = [_sources(blend).count(name) for name in "abc"]
    assert sum(counts) == 100 and sorted(counts) == [33, 33, 34]


def test_oversampled_dataset_repeats_and_zero_weight_is_left_out():
    blend = DatasetBlender([Labelled("a", 3), Labelled("b", 10), Labelled("c", 10)], weights=[0.5, 0.5, 0])
    items = [blend[i] for i in range(len(blend))]
    assert len(items) == 23
    assert sorted(j for name, j in items if name == "a") == sorted([0, 1, 2] * 4)[:12]
    assert not [item for item in items if item[0] == "c"]


def test_blend_is_deterministic():
    make = lambda: DatasetBlender([Labelled("a", 40), Labelled("b", 17)], weights=[2, 3])  # noqa: E731
    first, second = make(), make()
    assert [first[i] for i in range(len(first))] == [second[i] for i in range(len(second))]


@pytest.mark.parametrize(
    "weights, error, message",
    [
        ([0.5, -0.5], ValueError, r"weights\[1\] = -0.5 is invalid: weights must be finite and non-negative"),
        ([0, 0.0], ValueError, r"weights \[0, 0.0\] are all zero.*positive weight"),
        ([1.0], ValueError, "got 1 weights for 2 datasets"),
        ([1.0, float("nan")], ValueError, r"weights\[1\] = nan is invalid"),
        ([1.0, "x"], TypeError, r"weights\[1\] = 'x' is not a number"),
    ],
)
def test_bad_weights(weights, error, message):
    with pytest.raises(error, match=message):
        DatasetBlender([Labelled("a", 5), Labelled("b", 5)], weights=weights)


def test_empty_inputs():
    with pytest.raises(ValueError, match="datasets is empty"):
        DatasetBlender([])
    with pytest.raises(ValueError, match=r"datasets \[1\] are empty but have weights \[1.0\]"):
        DatasetBlender([Labelled("a", 5), Labelled("b", 0)], weights=[1, 1])
