"""DistributedProxySampler shards and InfiniteDataLoader repetition."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from oslo.data import DistributedProxySampler, InfiniteDataLoader


def _shards(sampler_factory, replicas, epoch=0, **kwargs):
    shards = []
    for rank in range(replicas):
        sampler = DistributedProxySampler(sampler_factory(), num_replicas=replicas, rank=rank, **kwargs)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        assert len(shards[-1]) == len(sampler)
    return shards


def _replica_shards(sampler_factory, replicas, epoch=0, **kwargs):
    """Like ``_shards``, but every replica iterates from its own global RNG state, as separate processes
    that called ``torch.manual_seed(rank)`` would; ``sampler_factory`` gets the rank."""
    shards = []
    for rank in range(replicas):
        sampler = DistributedProxySampler(sampler_factory(rank), num_replicas=replicas, rank=rank, **kwargs)
        sampler.set_epoch(epoch)
        torch.manual_seed(100 + rank)
        shards.append(list(sampler))
    return shards


def _interleave(shards):
    return [shard[i] for i in range(len(shards[0])) for shard in shards]


def _weighted(generator=None, num_samples=30):
    return WeightedRandomSampler([0.1] * 10 + [5.0] * 2, num_samples=num_samples, generator=generator)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_are_disjoint_and_complete(replicas, shuffle):
    shards = _shards(lambda: SequentialSampler(range(24)), replicas, shuffle=shuffle)
    everything = sum(shards, [])
    assert sorted(everything) == list(range(24))  # each index to exactly one replica
    assert len({len(shard) for shard in shards}) == 1


def test_shards_follow_the_wrapped_sampler():
    # the wrapped sampler draws with replacement; the shards must split exactly what it drew
    drawn = list(DistributedProxySampler(_weighted(), num_replicas=1, rank=0, shuffle=False))
    assert len(drawn) == 30 and sum(i >= 10 for i in drawn) > 20  # the heavy indices dominate
    for shuffle in (False, True):
        shards = _shards(_weighted, 3, shuffle=shuffle)
        assert sorted(sum(shards, [])) == sorted(drawn)
    assert _interleave(_shards(_weighted, 3, shuffle=False)) == drawn


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_replicas_with_different_global_rng_states_get_disjoint_shards(replicas, shuffle):
    # RandomSampler without a generator seeds its draw from the global RNG, which differs per process
    shards = _replica_shards(lambda rank: RandomSampler(range(24)), replicas, shuffle=shuffle)
    for a in range(replicas):
        for b in range(a + 1, replicas):
            assert not set(shards[a]) & set(shards[b]), (a, b)
    assert sorted(sum(shards, [])) == list(range(24))
    assert _interleave(shards) == list(
        DistributedProxySampler(RandomSampler(range(24)), num_replicas=1, rank=0, shuffle=shuffle)
    )


@pytest.mark.parametrize("own_generator", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_replicas_with_differently_seeded_weighted_samplers_split_one_draw(own_generator, shuffle):
    # drawn with replacement, so indices repeat: compare positions, not sets. Each replica's
    # WeightedRandomSampler has its own generator seeded with its rank, or draws from the global RNG
    def factory(rank):
        return _weighted(torch.Generator().manual_seed(rank) if own_generator else None, num_samples=60)

    drawn = list(DistributedProxySampler(factory(0), num_replicas=1, rank=0, shuffle=shuffle))
    for replicas in (2, 3, 4):
        shards = _replica_shards(factory, replicas, shuffle=shuffle)
        assert _interleave(shards) == drawn  # shard r holds positions r, r + replicas, ... of one draw
        assert [len(shard) for shard in shards] == [60 // replicas] * replicas


def test_own_generator_is_set_aside_and_restored():
    generator = torch.Generator().manual_seed(7)
    generator_state = generator.get_state()
    weighted = _weighted(generator)
    sampler = DistributedProxySampler(weighted, num_replicas=2, rank=1)
    global_state = torch.get_rng_state()
    first = list(sampler)
    assert weighted.generator is generator
    assert torch.equal(generator.get_state(), generator_state)  # neither used nor advanced
    assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG is left as it was
    assert list(sampler) == first

    class Failing(Sampler):
        def __init__(self):
            self.generator = generator

        def __iter__(self):
            assert self.generator is not generator
            raise RuntimeError("draw failed")

        def __len__(self):
            return 4

    failing = Failing()
    with pytest.raises(RuntimeError, match="draw failed"):
        list(DistributedProxySampler(failing, num_replicas=2, rank=0))
    assert failing.generator is generator


@pytest.mark.parametrize("own_generator", [False, True])
def test_draws_differ_across_epochs_and_seeds(own_generator):
    def draw(epoch, seed=0):
        generator = torch.Generator().manual_seed(1) if own_generator else None
        sampler = DistributedProxySampler(_weighted(generator), num_replicas=1, rank=0, shuffle=False, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert draw(1, seed=5) != draw(1, seed=6)


def test_deterministic_per_epoch_and_different_across_epochs():
    factory = lambda: SequentialSampler(range(40))  # noqa: E731
    assert _shards(factory, 2, epoch=1) == _shards(factory, 2, epoch=1)
    assert _shards(factory, 2, epoch=1) != _shards(factory, 2, epoch=2)
    assert _shards(factory, 2, epoch=1, seed=5) != _shards(factory, 2, epoch=1, seed=6)


def test_uneven_count_is_padded_or_dropped():
    factory = lambda: SequentialSampler(range(10))  # noqa: E731
    padded = _shards(factory, 4, shuffle=False)
    assert [len(s) for s in padded] == [3, 3, 3, 3]
    assert set(sum(padded, [])) == set(range(10))
    dropped = _shards(factory, 4, shuffle=False, drop_last=True)
    assert [len(s) for s in dropped] == [2, 2, 2, 2]
    everything = sum(dropped, [])
    assert len(set(everything)) == 8


def test_matches_distributed_sampler_on_a_plain_range():
    for rank in range(3):
        ours = DistributedProxySampler(SequentialSampler(range(20)), num_replicas=3, rank=rank, seed=4)
        torch_sampler = DistributedSampler(range(20), num_replicas=3, rank=rank, seed=4)
        ours.set_epoch(2)
        torch_sampler.set_epoch(2)
        assert list(ours) == list(torch_sampler)
    assert isinstance(ours, DistributedSampler)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_replicas": 2, "rank": 2}, ValueError, r"rank=2 is outside \[0, 2\)"),
        ({"num_replicas": 0, "rank": 0}, ValueError, "num_replicas must be a positive int, got 0"),
        ({"num_replicas": 2, "rank": -1}, ValueError, r"rank=-1 is outside \[0, 2\)"),
    ],
)
def test_bad_replica_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        DistributedProxySampler(SequentialSampler(range(4)), **kwargs)


def test_sampler_without_len():
    with pytest.raises(TypeError, match="sampler must be an iterable sampler with len"):
        DistributedProxySampler(iter(range(3)), num_replicas=1, rank=0)


def test_infinite_loader_repeats_and_advances_the_epoch():
    sampler = DistributedProxySampler(SequentialSampler(range(6)), num_replicas=2, rank=0)
    loader = InfiniteDataLoader(DataLoader(range(6), batch_size=3, sampler=sampler))
    batches = [next(loader).tolist() for _ in range(5)]  # 1 batch per epoch: 3 of 6 indices per rank
    assert all(len(batch) == 3 for batch in batches)
    assert sampler.epoch == 4 and loader.epoch == 4
    expected = []
    for epoch in range(5):
        fresh = DistributedProxySampler(SequentialSampler(range(6)), num_replicas=2, rank=0)
        fresh.set_epoch(epoch)
        expected.append(list(fresh))
    assert batches == expected


def test_infinite_loader_over_a_plain_iterable():
    loader = InfiniteDataLoader([1, 2, 3])
    assert [x for _, x in zip(range(7), loader, strict=False)] == [1, 2, 3, 1, 2, 3, 1]


def test_infinite_loader_rejects_an_empty_loader():
    with pytest.raises(ValueError, match="yielded no batches in a whole epoch"):
        next(InfiniteDataLoader(DataLoader([], batch_size=2)))


def test_infinite_loader_rejects_a_non_iterable():
    with pytest.raises(TypeError, match="dataloader must be iterable"):
        InfiniteDataLoader(42)
