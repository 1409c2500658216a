"""Sharding any sampler across data-parallel replicas."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler, Sampler


class _SizedSampler:
    """Gives ``DistributedSampler.__init__`` the ``len`` it asks of its dataset."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)


class DistributedProxySampler(DistributedSampler):
    """Splits the indices drawn by another sampler among data-parallel replicas.

    ``torch.utils.data.DistributedSampler`` shards a dataset's indices ``0..N-1``; this class shards
    whatever another sampler yields (a ``WeightedRandomSampler``, a curriculum, ...). Every epoch it
    draws the wrapped sampler's indices, optionally permutes their positions with ``seed + epoch``,
    and gives replica ``rank`` every ``num_replicas``-th one, starting at ``rank``. The shards are
    disjoint and together hold every drawn index; when the count is not divisible by
    ``num_replicas`` the list is padded by repeating its beginning (or, with ``drop_last``, cut),
    so all replicas get the same number of indices. Call :meth:`set_epoch` at the start of every
    epoch (:class:`InfiniteDataLoader` does it for you) to get a new permutation each epoch.

    Args:
        sampler: the sampler whose indices are split; must support ``len``.
        num_replicas: number of data-parallel replicas, e.g.
            ``model.mpu.get_data_parallel_world_size()`` or ``torch.distributed.get_world_size()``.
        rank: this replica's rank in ``[0, num_replicas)``.
        shuffle: permute the drawn indices (identically on every replica) before splitting.
        seed: seed of that permutation; must be the same on every replica.
        drop_last: cut the tail so the count divides evenly instead of padding it.
    """

    def __init__(
        self,
        sampler: Sampler,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not hasattr(sampler, "__iter__") or not hasattr(sampler, "__len__"):
            raise TypeError(
                f"sampler must be an iterable sampler with len(), got {type(sampler).__name__}; wrap "
                "your indices in a torch.utils.data.Sampler that defines __iter__ and __len__."
            )
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank={rank!r} is outside [0, {num_replicas}); pass this replica's data-parallel "
                "rank, e.g. model.mpu.get_data_parallel_rank()."
            )
        super().__init__(
            _SizedSampler(sampler),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.sampler = sampler

    def _sizes(self, count: int) -> tuple[int, int]:
        """(indices per replica, total indices after padding or cutting)."""
        if self.drop_last:
            per_replica = count // self.num_replicas
        else:
            per_replica = math.ceil(count / self.num_replicas)
        return per_replica, per_replica * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        drawn = list(self.sampler)
        count = len(drawn)
        if count == 0:
            return iter(())
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            positions = torch.randperm(count, generator=generator).tolist()
        else:
            positions = list(range(count))
        _, total = self._sizes(count)
        if total > count:
            repeats = math.ceil((total - count) / count)
            positions += (positions * repeats)[: total - count]
        else:
            positions = positions[:total]
        return iter([drawn[p] for p in positions[self.rank : total : self.num_replicas]])

    def __len__(self) -> int:
        return self._sizes(len(self.sampler))[0]
