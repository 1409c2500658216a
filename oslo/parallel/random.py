"""Tensor-parallel-aware random streams.

A parallelized model owns two random streams. The *replicated* stream is seeded identically on every
tensor-parallel rank: dropout on replicated activations (embeddings, residual branches after an
all-reduce) and token sampling in ``generate()`` draw from it, so the ranks stay in step whatever the
user does with the global RNG. The *split* stream is seeded differently per tensor-parallel rank:
dropout on split activations (each rank's attention heads) draws from it, so each head gets an
independent mask, as in the unsplit model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TypeVar

import torch

T = TypeVar("T")

# Offset between the replicated and the split seeds (any constant works; Megatron uses 2718).
_SPLIT_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _concrete(device: torch.device) -> torch.device:
    """``cuda`` as the device index it means (the current one), so two spellings compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _seeded_state(seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator.get_state()


class ParallelRNG:
    """The replicated and split random streams of one model on one rank.

    Args:
        seed: Base seed; the split stream uses ``seed + 2718 + tensor_parallel_rank``.
        tensor_parallel_rank: This rank's index in its tensor-parallel group.
        device: Device whose default generator the streams stand in for.

    Under ``torch.compile`` (which cannot trace swapping a generator's state) the streams step aside: a
    compiled call draws its dropout masks from the default generator (inductor: from its own generator, seeded
    from the default one), the same distribution; what changes is that such masks depend on the global RNG,
    not on the model's seed. With several tensor-parallel ranks the replicated masks must still agree: a
    compiled call in training mode compares the default generators' states across the ranks before it
    computes (:func:`~oslo.parallel.agreement.agreed_inputs`), and raises unless they were seeded alike. The
    masks of the split activations are then the same pattern on every rank (each rank's heads get the mask
    the other ranks' heads get), where an eager call draws them independently.
    """

    def __init__(self, seed: int, tensor_parallel_rank: int, device: torch.device) -> None:
        self._tensor_parallel_rank = tensor_parallel_rank
        self._seeds = self._stream_seeds(seed)
        self.device = _concrete(device)
        self._states = {stream: _seeded_state(value, self.device) for stream, value in self._seeds.items()}
        self._active: str | None = None

    def _stream_seeds(self, seed: int) -> dict[str, int]:
        return {"replicated": seed, "split": seed + _SPLIT_SEED_OFFSET + self._tensor_parallel_rank}

    def manual_seed(self, seed: int) -> None:
        """Start both streams afresh from ``seed``, as a build with ``seed`` starts them."""
        if self._active is not None:
            raise RuntimeError("the model's random streams cannot be reseeded inside a forward pass")
        self._seeds = self._stream_seeds(seed)
        self._states = {stream: _seeded_state(value, self.device) for stream, value in self._seeds.items()}

    def to(self, device: torch.device | str) -> None:
        """Make the streams stand in for ``device``'s generator (the model's parameters moved there).

        A CPU generator's state means nothing to a CUDA generator, so the streams start afresh from
        their seeds on the new device: the same masks on every rank that moves, as at a build. Moving to
        the device they already use keeps them where they stand."""
        device = _concrete(torch.device(device))
        if device == self.device or device.type == "meta":
            return
        if self._active is not None:
            raise RuntimeError("the model's parameters cannot move to another device inside a forward pass")
        self.device = device
        self._states = {stream: _seeded_state(value, device) for stream, value in self._seeds.items()}

    @contextmanager
    def fork(self, stream: str) -> Iterator[None]:
        """Run the block with the device's default generator drawing from ``stream``.

        Re-entrant: forking the stream that is already active does nothing. The caller's generator
        state is restored afterwards.
        """
        if stream not in self._states:
            raise ValueError(f"unknown random stream {stream!r}; expected 'replicated' or 'split'")
        if self._active == stream or torch.compiler.is_compiling():
            yield  # compiled: the default generator draws (see the class)
            return
        outer_state = _get_state(self.device)
        outer_active = self._active
        _set_state(self._states[stream], self.device)
        self._active = stream
        try:
            yield
        finally:
            self._states[stream] = _get_state(self.device)
            _set_state(outer_state, self.device)
            self._active = outer_active

    def replicated(self):
        """Stream identical on all tensor-parallel ranks."""
        return self.fork("replicated")

    def split(self):
        """Stream distinct on each tensor-parallel rank."""
        return self.fork("split")

    def recomputable(self, function: Callable[..., T]) -> Callable[..., T]:
        """``function`` for activation checkpointing: when it runs again (the recomputation in the
        backward pass), both streams start where they stood when it first ran, so dropout draws the
        same masks, on replicated and on split activations alike; afterwards the streams are back
        where the recomputation found them.
        """
        snapshot: tuple[dict[str, torch.Tensor], str | None] | None = None

        def run(*args, **kwargs) -> T:
            nonlocal snapshot
            if torch.compiler.is_compiling():
                # A compiled call draws dropout from the default generator, and the compiled checkpoint replays
                # its draws itself; the snapshot (state kept outside the checkpointed region) cannot be traced.
                return function(*args, **kwargs)
            if snapshot is None:
                states = dict(self._states)
                if self._active is not None:  # the active stream lives in the device's generator
                    states[self._active] = _get_state(self.device)
                snapshot = (states, self._active)
                return function(*args, **kwargs)
            states, active = snapshot
            saved = (self._states, self._active)
            self._states, self._active = dict(states), None
            try:
                with self.fork(active) if active is not None else nullcontext():
                    return function(*args, **kwargs)
            finally:
                self._states, self._active = saved

        return run
