"""A data loader that never runs out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class InfiniteDataLoader:
    """Repeats a data loader forever, for step-based (rather than epoch-based) training loops.

    When the wrapped loader is exhausted it is restarted. Before each restart the epoch counter is
    increased and passed to ``set_epoch`` of the loader's sampler (or batch sampler, or their
    wrapped sampler) when it has one, so a ``DistributedSampler`` or
    :class:`DistributedProxySampler` shuffles differently every epoch, as a hand-written epoch loop
    would.

    Args:
        dataloader: any re-iterable, typically a ``torch.utils.data.DataLoader``.

    Example:
        >>> loader = InfiniteDataLoader(DataLoader(dataset, batch_size=8))  # doctest: +SKIP
        >>> for step, batch in zip(range(num_steps), loader):  # doctest: +SKIP
        ...     ...
    """

    def __init__(self, dataloader: Iterable) -> None:
        if not hasattr(dataloader, "__iter__"):
            raise TypeError(
                f"dataloader must be iterable (e.g. a torch.utils.data.DataLoader), got "
                f"{type(dataloader).__name__}."
            )
        self.dataloader = dataloader
        self.epoch = 0
        self._iterator: Iterator | None = None

    def __iter__(self) -> InfiniteDataLoader:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.dataloader)
        try:
            return next(self._iterator)
        except StopIteration:
            pass
        self.epoch += 1
        self._set_epoch(self.epoch)
        self._iterator = iter(self.dataloader)
        try:
            return next(self._iterator)
        except StopIteration:
            raise ValueError(
                "the wrapped dataloader yielded no batches in a whole epoch, so it cannot be repeated; "
                "check that its dataset is not empty and that drop_last does not drop every batch."
            ) from None

    def _set_epoch(self, epoch: int) -> None:
        seen = set()
        for attribute in ("sampler", "batch_sampler"):
            sampler = getattr(self.dataloader, attribute, None)
            while sampler is not None and id(sampler) not in seen:
                seen.add(id(sampler))
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)
                    break
                sampler = getattr(sampler, "sampler", None)
