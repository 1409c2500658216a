"""Sharding any sampler across data-parallel replicas."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler, Sampler

# added to ``seed + epoch`` to seed the draw of the wrapped sampler, so that the draw and the
# permutation of its indices (seeded with ``seed + epoch``, as in ``DistributedSampler``) differ
_DRAW_SEED_OFFSET = 0x5DEECE66D


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
    so all replicas get the same number of indices.

    Every replica draws the wrapped sampler itself, so for the shards to be disjoint all replicas
    must draw the *same* indices. The draw is therefore made with a random generator seeded from
    ``seed`` and ``epoch``, identically on every replica, whatever the processes' random states: the
    global CPU random state is seeded for the draw and restored afterwards (samplers made with
    ``generator=None``, such as ``RandomSampler`` or ``WeightedRandomSampler``, draw from it), and
    a ``torch.Generator`` in the wrapped sampler's ``generator`` attribute is set aside for the draw,
    replaced by one seeded the same way, and put back afterwards (it is neither used nor advanced).
    Only that top-level ``generator`` attribute is replaced; a sampler that draws from some other
    generator of its own must be seeded identically on every replica by you. Pass the same ``seed``
    on every replica, and call :meth:`set_epoch` at the start of every epoch
    (:class:`InfiniteDataLoader` does it for you) to get a fresh draw and permutation each epoch.

    Args:
        sampler: the sampler whose indices are split; must support ``len``.
        num_replicas: number of data-parallel replicas, e.g.
            ``model.mpu.get_data_parallel_world_size()`` or ``torch.distributed.get_world_size()``.
        rank: this replica's rank in ``[0, num_replicas)``.
        shuffle: permute the drawn indices (identically on every replica) before splitting.
        seed: seed of the draw and of that permutation; must be the same on every replica.
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

    def _draw(self) -> list[int]:
        """The wrapped sampler's indices, drawn identically on every replica for this seed and epoch."""
        # a different stream from the permutation's, which is seeded with ``seed + epoch``
        draw_seed = (self.seed + self.epoch + _DRAW_SEED_OFFSET) % 2**64
        with torch.random.fork_rng(devices=[]):
            # seed only the CPU default generator (torch.manual_seed would also reseed, and leave
            # reseeded, the accelerators' generators); fork_rng restores its state afterwards
            torch.default_generator.manual_seed(draw_seed)
            own_generator = getattr(self.sampler, "generator", None)
            if not isinstance(own_generator, torch.Generator):
                return list(self.sampler)
            generator = torch.Generator(device=own_generator.device)
            generator.manual_seed(draw_seed)
            self.sampler.generator = generator
            try:
                return list(self.sampler)
            finally:
                self.sampler.generator = own_generator

    def __iter__(self) -> Iterator[int]:
        drawn = self._draw()
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
