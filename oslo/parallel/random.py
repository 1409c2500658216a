"""Tensor-parallel-aware random streams.

A parallelized model draws from two random streams. The *replicated* stream is the same on every
tensor-parallel rank: dropout on replicated activations (embeddings, residual branches after an
all-reduce) and token sampling in ``generate()`` draw from it. The *split* stream differs per
tensor-parallel rank: dropout on split activations (each rank's attention heads) draws from it, so each
head gets an independent mask, as in the unsplit model.

By default (no ``seed`` given to the model) the streams follow torch's generator, as transformers' models
do: the replicated stream *is* the default generator of the model's device, so ``torch.manual_seed`` and
``transformers.set_seed`` decide dropout and sampling, and a model of one process draws exactly what
transformers' draws. The split stream of a tensor-parallel rank is a generator of its own, seeded at the
first split draw of each model call from a draw of the replicated stream (so the same on every rank)
plus the rank. The ranks' default generators must then agree where they draw alike: the model compares
them in each call's input check and, where they differ (processes not seeded alike), gives the first rank's
state to the others (see :func:`oslo.parallel.agreement.check_same_inputs`).

With a ``seed`` (or after :meth:`ParallelRNG.manual_seed`) both streams are generators of the model's
own, seeded from it: the ranks stay in step whatever the user does with the global generator, and the
model's draws do not move it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TypeVar

import torch

T = TypeVar("T")

# Offset between the replicated and the split seeds (any constant works; Megatron uses 2718).
_SPLIT_SEED_OFFSET = 2718


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of the default random generator of ``device`` (a CPU tensor)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_generator_state(state: torch.Tensor, device: torch.device) -> None:
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
        tensor_parallel_size: The size of that group (``None``: unknown, taken as more than one).
        follows_default: The replicated stream is the device's default generator and the split stream is
            seeded from it at each model call (see the module); ``seed`` then only names the seed the
            model's other random choices start from.

    Under ``torch.compile`` (which cannot trace swapping a generator's state) the streams step aside: a
    compiled call draws its dropout masks from the default generator (inductor: from its own generator, seeded
    from the default one), the same distribution; what changes is that such masks depend on the global RNG,
    not on the model's seed. With several tensor-parallel ranks the replicated masks must still agree: a
    compiled call in training mode compares the default generators' states across the ranks before it
    computes (:func:`~oslo.parallel.agreement.agreed_inputs`), and raises unless they were seeded alike. The
    masks of the split activations are then the same pattern on every rank (each rank's heads get the mask
    the other ranks' heads get), where an eager call draws them independently.
    """

    def __init__(self, seed: int, tensor_parallel_rank: int, device: torch.device,
                 tensor_parallel_size: int | None = None, follows_default: bool = False) -> None:
        self._tensor_parallel_rank = tensor_parallel_rank
        self._tensor_parallel_size = tensor_parallel_size
        self.device = _concrete(device)
        self._active: str | None = None
        self._start(seed, follows_default)

    def _stream_seeds(self, seed: int) -> dict[str, int]:
        return {"replicated": seed, "split": seed + _SPLIT_SEED_OFFSET + self._tensor_parallel_rank}

    def _start(self, seed: int, follows_default: bool) -> None:
        self.follows_default = follows_default
        self._seeds = self._stream_seeds(seed)
        # Where a stream is not active its state is kept here. Following the default generator, the
        # replicated stream lives in the device's generator (kept here only while the split stream is active)
        # and the split stream is seeded anew at each model call.
        self._states = {} if follows_default else {stream: _seeded_state(value, self.device)
                                                    for stream, value in self._seeds.items()}

    def manual_seed(self, seed: int) -> None:
        """Start both streams afresh from ``seed``, as a build with ``seed`` starts them: generators of the model's
        own from now on, whatever the default generator does."""
        if self._active is not None:
            raise RuntimeError("the model's random streams cannot be reseeded inside a forward pass")
        self._start(seed, False)

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
        self._states = {} if self.follows_default else {stream: _seeded_state(value, device)
                                                         for stream, value in self._seeds.items()}

    def states(self) -> dict[str, torch.Tensor]:
        """The states of both streams as they stand (for a saved training state). Following the default generator,
        the replicated stream's is the device generator's, and the split stream's a placeholder: each model call
        seeds its own."""
        states = dict(self._states)
        holder = self._in_generator()
        if holder is not None:
            states[holder] = generator_state(self.device)
        if "split" not in states:
            states["split"] = _seeded_state(self._seeds["split"], self.device)
        return states

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Set the streams to ``states`` (as :meth:`states` gave them; either stream may be left out). Following the
        default generator, the replicated state goes to the device's generator and the split one is not used."""
        if self._active is not None:
            raise RuntimeError("the model's random streams cannot be set inside a forward pass")
        for stream, state in states.items():
            if self.follows_default and stream == "replicated":
                set_generator_state(state, self.device)
            elif not self.follows_default:
                self._states[self._name(stream)] = state

    def _in_generator(self) -> str | None:
        """The stream whose state the device's default generator holds now (``None``: the user's)."""
        if self._active is not None:
            return self._active
        return "replicated" if self.follows_default else None

    def _name(self, stream: str) -> str:
        if stream not in ("replicated", "split"):
            raise ValueError(f"unknown random stream {stream!r}; expected 'replicated' or 'split'")
        if stream == "split" and self.follows_default and self._tensor_parallel_size == 1:
            return "replicated"  # one rank holds all the heads: they draw what the unsplit model draws
        return stream

    def _split_state(self) -> torch.Tensor:
        """Following the default generator: the split stream of this call, seeded from one draw of the replicated
        stream (the device's generator, which it advances) plus this rank."""
        if self.device.type == "cuda":
            generator = torch.cuda.default_generators[self.device.index]
            offset = generator.get_offset()
            generator.set_offset(offset + 4)  # one Philox draw: the host-side state moves, no device sync
            drawn = zlib.crc32(f"{generator.initial_seed()}:{offset}".encode())
        else:
            drawn = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        return _seeded_state((drawn + _SPLIT_SEED_OFFSET + self._tensor_parallel_rank) % (2**63), self.device)

    @contextmanager
    def fork(self, stream: str) -> Iterator[None]:
        """Run the block with the device's default generator drawing from ``stream``.

        Re-entrant: forking the stream that is already active does nothing. The caller's generator
        state is restored afterwards. Following the default generator, entering the replicated stream from
        outside every stream begins a model call: the split stream is seeded anew at its first draw.
        """
        stream = self._name(stream)
        if torch.compiler.is_compiling():
            yield  # compiled: the default generator draws (see the class)
            return
        holder = self._in_generator()
        if holder == stream:
            if self._active is None:  # following the default generator: a model call begins
                self._states.pop("split", None)
                self._active = stream
                try:
                    yield
                finally:
                    self._active = None
                return
            yield
            return
        if stream not in self._states:  # following the default generator: the split stream of this call
            self._states[stream] = self._split_state()
        outer_active, user_state = self._active, None
        if holder is None:
            user_state = generator_state(self.device)
        else:
            self._states[holder] = generator_state(self.device)
        set_generator_state(self._states[stream], self.device)
        self._active = stream
        try:
            yield
        finally:
            self._states[stream] = generator_state(self.device)
            if holder is None:
                set_generator_state(user_state, self.device)
            elif self.follows_default and holder == "replicated":  # back in the generator, kept nowhere else
                set_generator_state(self._states.pop(holder), self.device)
            else:
                set_generator_state(self._states[holder], self.device)
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
                holder = self._in_generator()
                if holder is not None:  # the stream the device's generator holds
                    states[holder] = generator_state(self.device)
                snapshot = (states, self._active)
                return function(*args, **kwargs)
            states, active = snapshot
            saved, user_state = (self._states, self._active), generator_state(self.device)
            self._states, self._active = dict(states), None
            try:
                if self.follows_default:  # the generator plays the replicated stream from where it stood
                    set_generator_state(self._states.pop("replicated"), self.device)
                    self._active = "replicated"
                with self.fork(active) if active is not None else nullcontext():
                    return function(*args, **kwargs)
            finally:
                set_generator_state(user_state, self.device)
                self._states, self._active = saved

        return run
