"""Pipeline parallelism: which blocks a stage holds, point-to-point transfers, and the 1F1B schedule.

A model split into ``P`` stages runs a batch as ``M`` micro-batches. Training uses the 1F1B
schedule as a generator: stage ``s`` first runs ``P - s`` forward passes (the last stage none), then
alternates one forward with one backward, and ends with the remaining backwards. That is one forward
more ahead than the textbook 1F1B (``P - s - 1``): the next stage then always has its next input
before it needs it, so the time a transfer takes between stages is hidden behind compute instead of
adding to the bubble at every micro-batch (on CPU over gloo a transfer takes about a millisecond);
the price is one micro-batch more of activations held by each stage but the last. Each *backward* is the user's
``micro_output.loss.backward()`` between two ``next()`` calls of the generator, so the usual loop

.. code-block:: python

    for micro_output in model(input_ids=..., labels=...):
        micro_output.loss.backward()

drives the schedule. On every stage ``micro_output.loss`` carries the micro-batch's loss value (the
last stage sends it back with the gradient), and its ``backward()`` runs this stage's part of the
backward pass: the last stage backpropagates the loss, the others backpropagate the gradient received
from the next stage.

With ``virtual_pipeline_size`` = ``v`` > 1 (interleaved 1F1B) each stage holds ``v`` chunks of layers and a
step follows :func:`interleaved_order`; the user's ``backward()`` runs each micro-batch's last chunk on the
stage, the schedule the others. The stages then form a ring (the last stage's chunk feeds the first stage's
next one), several streams share a link, and every rank reads a neighbour's messages in the order the
neighbour sent them (:meth:`StageLink.expect`: no tags, which NCCL lacks).

Transfers are ``isend`` (kept until the step ends) and blocking ``recv`` in the order of the
schedule, which cannot deadlock. The first tensor of a step in each direction is preceded by a small
header (dtype and shape), so the receiver never guesses shapes and a mismatch is an error, not a
hang; the others travel as one message each (see :class:`StageLink`). Peers are the ranks with the
same tensor- and data-parallel rank in the neighbouring stages.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from oslo.parallel import failure
from oslo.parallel.context import ParallelContext
from oslo.parallel.errors import PeerLostError, naming_timeouts

logger = logging.getLogger(__name__)

__all__ = [
    "PipelineAbortedError",
    "PipelineStep",
    "TimelineEvent",
    "close_open_step",
    "check_interleaved",
    "interleaved_order",
    "StageLayers",
    "StageLink",
    "partition_layers",
    "partition_costs",
    "pipeline_pass",
    "pipeline_schedule",
    "split_micro_batches",
]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_MAX_DIMS = 8
_MAX_TENSORS = 4  # tensors in one message (a payload of named tensors between stages)
_SLOT = 2 + _MAX_DIMS  # int64 per tensor in a header: dtype (-1: none), dims, shape...
# int64: code, count, length (of an abort's message that follows; else 1 when one bare tensor was sent, not a
# list), then one slot per tensor
_HEADER = 3 + _MAX_TENSORS * _SLOT
_TRAILER = 32  # bytes after a packed tensor: int64 code, int64 length, 2 x float64 values sent along
_OK = 0
_ABORT = -1  # code: the sender failed, a message follows instead of a tensor
_NONE = -2  # code: no tensor (an output field that is None)
# How a stage ended a step (see StageLink.settle): finished, failed, its loop left, stopped by a neighbour.
STEP_OK, STEP_FAILED, STEP_ABANDONED, STEP_STOPPED = 0, 1, 2, 3


def partition_layers(
    num_layers: int, num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[range]:
    """Contiguous ranges of block indices, one per stage, balancing parameters across stages.

    ``first_extra`` and ``last_extra`` are what the first and last stage hold besides blocks (the
    embeddings; the head, or the tied copy of the embedding), in units of one block's parameters.
    The partition minimizes the largest stage (blocks + extras); among partitions that do, surplus
    blocks are taken from the fullest stages, the later first. Without extras this is the uniform
    split, earlier stages taking one block more when ``num_stages`` does not divide ``num_layers``.

    Raises:
        ValueError: fewer blocks than stages (every stage needs at least one block).
    """
    if num_layers < num_stages:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} exceeds the number of layers ({num_layers}): every stage "
            f"needs at least one layer. Use pipeline_parallel_size <= {num_layers}."
        )
    extras = [0.0] * num_stages
    extras[0] += first_extra
    extras[-1] += last_extra

    def capacities(cap: float) -> list[int]:
        return [max(int(cap - extra + 1e-9), 0) for extra in extras]

    # The smallest cap every stage can meet with at least one block and all blocks placed; the
    # optimum is one of n + extra for a stage's block count n.
    candidates = sorted({n + extra for extra in extras for n in range(1, num_layers + 1)})
    cap = next(c for c in candidates if min(capacities(c)) >= 1 and sum(capacities(c)) >= num_layers)
    counts = capacities(cap)
    for _ in range(sum(counts) - num_layers):
        fullest = max(range(num_stages), key=lambda stage: (counts[stage], stage))
        counts[fullest] -= 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def partition_costs(
    costs: list[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[range]:
    """Contiguous ranges of layer indices, one per stage, for layers of the given ``costs`` (parameter
    counts): the largest stage (its layers + its extra) is as small as it can be. Layers of equal cost
    give :func:`partition_layers`' partition; unequal ones (an encoder-decoder's blocks) are placed
    greedily, each stage taking as many as fit under the smallest feasible cap."""
    num_layers = len(costs)
    if num_layers < num_stages:
        partition_layers(num_layers, num_stages)  # raises the error that says so
    if len(set(costs)) <= 1:
        block = costs[0] if costs and costs[0] > 0 else 1.0
        return partition_layers(num_layers, num_stages, first_extra / block, last_extra / block)
    extras = [0.0] * num_stages
    extras[0] += first_extra
    extras[-1] += last_extra

    def fit(cap: float) -> list[int] | None:
        counts, start = [], 0
        for stage in range(num_stages):
            left = num_stages - stage - 1  # stages after this one, each needing a layer
            load, count = extras[stage], 0
            while start + count < num_layers - left and (count == 0 or load + costs[start + count] <= cap + 1e-9):
                load += costs[start + count]
                count += 1
            if load > cap + 1e-9:
                return None
            counts.append(count)
            start += count
        return counts if start == num_layers else None

    sums = {extra + sum(costs[i:j]) for extra in set(extras) for i in range(num_layers)
            for j in range(i + 1, num_layers + 1)}
    counts = next(counts for cap in sorted(sums) if (counts := fit(cap)) is not None)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


class StageLayers(nn.Module):
    """The blocks of one pipeline stage, registered under their global indices.

    Parameter names stay Hugging Face's (``h.5.attn.c_attn.weight`` on whichever stage holds block 5).
    Iterating yields this stage's blocks in order. Indexing is by global block index, as in the
    unsplit model's ``nn.ModuleList``: ``layers[5]`` is block 5, ``layers[-1]`` the model's last block,
    ``layers[:2]`` an ``nn.ModuleList`` of blocks 0 and 1; an ``IndexError`` names the stage when a
    block asked for lives on another one.

    Args:
        layers: ``{global index: block}`` for this stage.
        num_layers: Blocks in the whole model (for negative indices and slices); default: the last
            index held here + 1.
    """

    def __init__(self, layers: dict[int, nn.Module], num_layers: int | None = None) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)
        self.num_layers = num_layers if num_layers is not None else max(layers, default=-1) + 1

    @classmethod
    def build(cls, num_layers: int, make_layer: Callable[[int], nn.Module]) -> StageLayers:
        """Every layer of a model of ``num_layers``: ``make_layer(index)`` builds layer ``index``. The model is
        built whole; a pipeline stage then keeps its own layers (see :mod:`oslo.models.stages`)."""
        return cls({index: make_layer(index) for index in range(num_layers)}, num_layers=num_layers)

    # Under an interleaved schedule, the layers of the virtual stage running now (global indices): iterating
    # yields only those (see oslo.models.stages.running_stage). None: every layer held.
    running: range | None = None

    def keep(self, own: range | set[int]) -> None:
        """Keep the layers of ``own`` (global indices), dropping the others, and number the kept ones' slots in
        the stage's KV cache from 0: a layer's modules that hold ``cache_idx`` get their layer's position on
        the stage."""
        for index in list(self._modules):
            if int(index) not in own:
                del self._modules[index]
        for slot, layer in enumerate(self._modules.values()):
            for module in layer.modules():
                if hasattr(module, "cache_idx"):
                    module.cache_idx = slot

    def indices(self) -> list[int]:
        """The global indices of the layers held (of the virtual stage running, while one runs)."""
        return [int(index) for index in self._modules if self.running is None or int(index) in self.running]

    def __iter__(self) -> Iterator[nn.Module]:
        if self.running is None:
            return iter(self._modules.values())
        return iter([layer for index, layer in self._modules.items() if int(index) in self.running])

    def __len__(self) -> int:
        if self.running is None:
            return len(self._modules)
        return sum(int(index) in self.running for index in self._modules)

    def _block(self, index: int) -> nn.Module:
        if not -self.num_layers <= index < self.num_layers:
            raise IndexError(f"layer index {index} is out of range for a model of {self.num_layers} layers")
        index %= self.num_layers
        if str(index) not in self._modules:
            raise IndexError(
                f"layer {index} is not on this pipeline stage, which holds layers {list(self._modules)}"
            )
        return self._modules[str(index)]

    def __getitem__(self, index: int | slice) -> nn.Module | nn.ModuleList:
        if isinstance(index, slice):
            return nn.ModuleList([self._block(i) for i in range(*index.indices(self.num_layers))])
        return self._block(int(index))


def split_micro_batches(inputs: dict[str, Any], micro_batch_size: int) -> list[dict[str, Any]]:
    """Split every tensor of ``inputs`` along dim 0 into micro-batches of ``micro_batch_size`` rows.

    Non-tensor values are passed to every micro-batch unchanged.

    Raises:
        ValueError: the batch size is not a multiple of ``micro_batch_size``, or tensors disagree on it.
    """
    sizes = {name: value.shape[0] for name, value in inputs.items() if isinstance(value, torch.Tensor)}
    if not sizes:
        raise ValueError("pipeline parallelism needs tensor inputs (input_ids or inputs_embeds) to split.")
    batch_sizes = set(sizes.values())
    if len(batch_sizes) != 1:
        raise ValueError(f"inputs disagree on the batch size (dim 0): {sizes}; pass tensors of one batch.")
    batch_size = batch_sizes.pop()
    if batch_size == 0:
        raise ValueError(
            f"the batch is empty (dim 0 of {sorted(sizes)} is 0): a pipelined call needs at least one row per "
            "micro-batch. Skip empty batches before calling the model (on every rank alike)."
        )
    if micro_batch_size < 1 or batch_size % micro_batch_size != 0:
        raise ValueError(
            f"batch size {batch_size} is not a multiple of micro_batch_size={micro_batch_size}: pipeline "
            "parallelism splits each batch into equal micro-batches. Use a batch size that micro_batch_size "
            "divides, or change it with model.set_micro_batch_size(n)."
        )
    chunks = batch_size // micro_batch_size
    split = {
        name: value.split(micro_batch_size) if isinstance(value, torch.Tensor) else [value] * chunks
        for name, value in inputs.items()
    }
    return [{name: parts[i] for name, parts in split.items()} for i in range(chunks)]


class PipelineAbortedError(RuntimeError):
    """Raised on a stage whose neighbour failed during the same pipeline step."""

    follows_another_rank = True  # see oslo.launch.run


class StageLink:
    """Point-to-point transfers between this stage and its neighbours (and broadcasts from the last).

    The first tensor a link carries in each direction is preceded by a header (dtype and shape), so
    the receiver never guesses shapes. Within one step every later tensor of that direction has the
    same dtype and shape (micro-batches are equal), so it travels as a single message: the tensor's
    bytes followed by a 32-byte trailer (a status code, a length, and two float64 values that ride
    along, the loss and the backward seed). A message latency is paid once per transfer, not twice
    (or four times for a gradient with its loss), which on CPU is what stretches the 1F1B bubble.
    A failure is sent in place of the next tensor (a header, or a trailer, saying so), followed by
    its message.
    """

    def __init__(self, context: ParallelContext, ring: bool = False) -> None:
        self.context = context
        stage, size = context.pipeline_parallel_rank, context.pipeline_parallel_size
        if ring and size > 1:  # interleaved chunks: the last stage's chunk feeds the first stage's next chunk
            self.prev = context.pipeline_parallel_global_rank((stage - 1) % size)
            self.next = context.pipeline_parallel_global_rank((stage + 1) % size)
        else:
            self.prev = context.pipeline_parallel_global_rank(stage - 1) if stage > 0 else None
            self.next = context.pipeline_parallel_global_rank(stage + 1) if stage < size - 1 else None
        self._pp_ranks = [context.pipeline_parallel_global_rank(i) for i in range(size)]
        self._pending: list[tuple[dist.Work, torch.Tensor, int]] = []  # (send, its buffer, its peer)
        # (direction, peer, stream) -> (dtype, shape) of the tensors that stream carries since its header
        self._shapes: dict[tuple[str, int, int], Any] = {}
        # What went to and came from each neighbour, message by message: a step that ends early on some
        # stage receives (and drops) what its neighbours sent and it never took, see settle().
        self.sent: dict[int, list[int]] = {peer: [] for peer in (self.prev, self.next) if peer is not None}
        self.received: dict[int, int] = {peer: 0 for peer in (self.prev, self.next) if peer is not None}
        # Several streams to one peer (see expect): the order in which each peer sends its streams' messages to
        # this rank, the messages read ahead of their turn, and how many messages of each stream went out.
        self._orders: dict[int, list[int]] = {}
        self._read: dict[int, int] = {}
        self._early: dict[tuple[int, int], list] = {}
        self._send_orders: dict[int, list[int]] = {}
        self._sent_messages: dict[int, int] = {}

    def expect(self, receive_orders: dict[int, list[int]], send_orders: dict[int, list[int]]) -> None:
        """Carry several streams over one link (an interleaved schedule's chunks, its forward and backward
        passes): ``receive_orders[peer]`` lists the stream of every message ``peer`` will send this rank this
        step, in the order it sends them; ``send_orders[peer]`` the same for this rank's messages to ``peer``.

        Messages between two ranks arrive in the order they were sent (NCCL has no tags; this link uses none),
        so :meth:`recv` of one stream reads the peer's earlier messages of other streams first and keeps them
        for their turn. Every rank derives these orders from the same static schedule."""
        self._orders = {peer: list(order) for peer, order in receive_orders.items()}
        self._read = dict.fromkeys(self._orders, 0)
        self._send_orders = {peer: list(order) for peer, order in send_orders.items()}
        self._sent_messages = dict.fromkeys(self._send_orders, 0)

    @staticmethod
    def _header(tensors: list[torch.Tensor | None] | None, code: int = 0, length: int = 0) -> torch.Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = code
        tensors = tensors or []
        if len(tensors) > _MAX_TENSORS:
            raise ValueError(f"cannot send {len(tensors)} tensors in one message between pipeline stages "
                             f"(at most {_MAX_TENSORS}).")
        header[1] = len(tensors)
        header[2] = length
        for i, tensor in enumerate(tensors):
            slot = 3 + i * _SLOT
            if tensor is None:
                header[slot] = -1
                continue
            if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
                raise ValueError(
                    f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims between pipeline stages."
                )
            header[slot] = _DTYPES.index(tensor.dtype)
            header[slot + 1] = tensor.dim()
            header[slot + 2 : slot + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return header

    @staticmethod
    def _described(header: list[int]) -> list[tuple[torch.dtype, tuple[int, ...]] | None]:
        described = []
        for i in range(header[1]):
            slot = 3 + i * _SLOT
            if header[slot] < 0:
                described.append(None)
            else:
                described.append((_DTYPES[header[slot]], tuple(header[slot + 2 : slot + 2 + header[slot + 1]])))
        return described

    @staticmethod
    def _sizes(described: list[tuple[torch.dtype, tuple[int, ...]] | None]) -> list[int]:
        """Bytes each tensor of a message takes, rounded up to 8 so every tensor starts aligned."""
        return [0 if d is None else -(-math.prod(d[1]) * d[0].itemsize // 8) * 8 for d in described]

    def _device_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.context.device)

    def _packed(self, tensors: list[torch.Tensor | None] | None, nbytes: int, code: int, length: int = 0,
                extra: torch.Tensor | None = None) -> torch.Tensor:
        """``nbytes`` of payload (the tensors' bytes, each padded to 8, or zeros) followed by the trailer."""
        device = self.context.device
        trailer = torch.zeros(_TRAILER // 8, dtype=torch.float64, device=device)
        trailer[0:2] = torch.tensor([code, length], dtype=torch.int64, device=device).view(torch.float64)
        if extra is not None:
            trailer[2 : 2 + extra.numel()] = extra.detach().reshape(-1).to(device, torch.float64)
        if tensors is None:
            return torch.cat([torch.zeros(nbytes, dtype=torch.uint8, device=device), trailer.view(torch.uint8)])
        parts = []
        for tensor in tensors:
            if tensor is None:
                continue
            data = tensor.reshape(-1).view(torch.uint8)
            parts.append(data)
            if data.numel() % 8:
                parts.append(torch.zeros(8 - data.numel() % 8, dtype=torch.uint8, device=device))
        return torch.cat([*parts, trailer.view(torch.uint8)])

    def _isend(self, part: torch.Tensor, peer: int) -> None:
        self._pending.append((dist.isend(part, peer), part, peer))
        self.sent[peer].append(part.numel() * part.element_size())

    def _recv(self, buffer: torch.Tensor, peer: int) -> None:
        # A blocking receive: gloo closes the connection when a timed wait on a receive expires, so it
        # cannot poll for failures as collectives do; a failed neighbour sends an abort instead.
        with naming_timeouts(self.context, "receiving from the neighbouring pipeline stage", peer=peer):
            dist.recv(buffer, peer)
        self.received[peer] += 1

    def send(self, tensors: torch.Tensor | list[torch.Tensor | None], peer: int,
             extra: torch.Tensor | None = None, stream: int = 0) -> None:
        """Send a tensor, or a list of up to four tensors (``None`` allowed), to global rank ``peer``
        in one message, without waiting for it to arrive; ``extra`` (at most two numbers, e.g. the loss
        and the backward seed) travels with it. :meth:`recv` returns what was sent, in the same form. ``stream``
        names one of several streams to ``peer`` (see :meth:`expect`)."""
        single = isinstance(tensors, torch.Tensor)
        tensors = [tensors] if single else list(tensors)
        tensors = [None if t is None else self._device_tensor(t.detach().contiguous()) for t in tensors]
        key = ("send", peer, stream)
        described = [None if t is None else (t.dtype, tuple(t.shape)) for t in tensors]
        if key not in self._shapes:
            self._isend(self._device_tensor(self._header(tensors, length=int(single))), peer)
            self._shapes[key] = described
        elif self._shapes[key] != described:
            raise ValueError(
                f"pipeline stage output changed within a step: {described} after {self._shapes[key]}; every "
                "micro-batch of a step must give tensors of one dtype and shape."
            )
        self._isend(self._packed(tensors, sum(self._sizes(described)), _OK, extra=extra), peer)
        if peer in self._sent_messages:
            self._sent_messages[peer] += 1

    def send_abort(self, peer: int, message: str) -> None:
        """Tell ``peer`` that the step failed here, in place of what it would receive next from this rank
        (if it waits for something; otherwise :meth:`settle` drops it). Does not wait."""
        encoded = torch.tensor(list(message.encode()), dtype=torch.uint8)
        order, count = self._send_orders.get(peer, ()), self._sent_messages.get(peer, 0)
        key = ("send", peer, order[count] if count < len(order) else 0)  # the stream the peer reads next
        if key not in self._shapes:
            first = self._header(None, _ABORT, encoded.numel())
        else:
            first = self._packed(None, sum(self._sizes(self._shapes[key])), _ABORT, encoded.numel())
        for part in (first, encoded):
            self._isend(self._device_tensor(part), peer)

    def _raise_abort(self, peer: int, length: int) -> None:
        message = self._device_tensor(torch.empty(length, dtype=torch.uint8))
        self._recv(message, peer)
        raise PipelineAbortedError(bytes(message.tolist()).decode())

    def recv(self, peer: int, with_extra: bool = False, stream: int = 0):
        """Receive the next message global rank ``peer`` sent to this rank (on ``stream``, see :meth:`expect`):
        a tensor, or a list of tensors, as it was sent (with the two ``extra`` numbers sent along, as a float64
        tensor, when ``with_extra``).

        Raises:
            PipelineAbortedError: ``peer`` failed and sent :meth:`send_abort` instead.
        """
        if peer in self._orders:
            early = self._early.get((peer, stream))
            if early:
                result, extra = early.pop(0)
            else:
                while True:
                    order, index = self._orders[peer], self._read[peer]
                    if index >= len(order):
                        raise RuntimeError(f"pipeline link: no message on stream {stream} is due from rank {peer} "
                                           "in this step's schedule.")
                    self._read[peer] += 1
                    result, extra = self._receive(peer, order[index])
                    if order[index] == stream:
                        break
                    self._early.setdefault((peer, order[index]), []).append((result, extra))
        else:
            result, extra = self._receive(peer, stream)
        return (result, extra) if with_extra else result

    def _receive(self, peer: int, stream: int):
        """The next message of ``stream`` from ``peer``, read now: ``(tensors, extra)``."""
        key = ("recv", peer, stream)
        if key not in self._shapes:
            header = self._device_tensor(torch.empty(_HEADER, dtype=torch.int64))
            self._recv(header, peer)
            header = header.tolist()
            if header[0] == _ABORT:
                self._raise_abort(peer, header[2])
            self._shapes[key] = (self._described(header), bool(header[2]))
        described, single = self._shapes[key]
        sizes = self._sizes(described)
        nbytes = sum(sizes)
        packed = self._device_tensor(torch.empty(nbytes + _TRAILER, dtype=torch.uint8))
        self._recv(packed, peer)
        trailer = packed[nbytes:].view(torch.float64)
        code, length = trailer[:2].view(torch.int64).tolist()
        if code == _ABORT:
            self._raise_abort(peer, length)
        tensors, offset = [], 0
        for d, size in zip(described, sizes, strict=True):
            if d is None:
                tensors.append(None)
                continue
            dtype, shape = d
            tensors.append(packed[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
            offset += size
        return (tensors[0] if single else tensors), trailer[2:]

    def broadcast_from_last(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Give every stage the last stage's ``tensor``, or ``None`` if it has none."""
        return self.broadcast_from(self.context.pipeline_parallel_size - 1, tensor)

    def gather_stages(self, local: dict[int, tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...] | None:
        """Every stage's tuple of tensors, concatenated in stage order, on every stage (per-layer outputs such
        as hidden states, whose layers are spread over the stages). ``local`` maps this rank's stages (its
        pipeline rank; under an interleaved schedule its virtual stages) to their tuples; a stage left out
        has none. ``None`` when no stage has a tuple. Every stage calls it, whatever it holds."""
        context = self.context
        size = context.pipeline_parallel_size
        gathered, found = [], False
        for stage in range(size * context.virtual_pipeline_size):
            owner = stage % size
            mine = owner == context.pipeline_parallel_rank
            tensors = local.get(stage) if mine else None
            count = int(self.broadcast_from(owner, torch.tensor(-1 if tensors is None else len(tensors))
                                            if mine else None))
            found = found or count >= 0
            gathered.extend(self.broadcast_from(owner, tensors[i] if mine else None) for i in range(count))
        return tuple(gathered) if found else None

    def broadcast_from(self, stage: int, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Give every stage the ``tensor`` of stage ``stage``, or ``None`` if it has none (the other
        stages' argument is ignored)."""
        context = self.context
        source = context.pipeline_parallel_global_rank(stage)
        group = context.pipeline_parallel_group
        is_source = context.pipeline_parallel_rank == stage
        if is_source:
            if tensor is None:
                header = self._header(None, _NONE)
            else:
                tensor = tensor.detach().contiguous()
                header = self._header([tensor])
            header = self._device_tensor(header)
        else:
            header = self._device_tensor(torch.empty(_HEADER, dtype=torch.int64))
        what = f"receiving pipeline stage {stage}'s outputs"
        # Waited for as the model's collectives are: this runs after the stages settled their pass, so a rank
        # failing here (its exception recorded by the call's watch) must stop the others waiting for it.
        with naming_timeouts(context, what, group=group):
            failure.wait(dist.broadcast(header, source, group=group, async_op=True), group, what)
        values = header.tolist()
        if values[0] == _NONE:
            return None
        if not is_source:
            dtype, shape = self._described(values)[0]
            tensor = torch.empty(shape, dtype=dtype, device=context.device)
        with naming_timeouts(context, what, group=group):
            failure.wait(dist.broadcast(tensor, source, group=group, async_op=True), group, what)
        return tensor

    def wait_all(self) -> None:
        """Wait until every send of this step has been received."""
        for work, _, peer in self._pending:
            with naming_timeouts(self.context, "sending to the neighbouring pipeline stage", peer=peer):
                work.wait()
        self._pending.clear()

    def settle(self, status: int, message: str = "") -> list[tuple[int, int, str]]:
        """End a step (or a pass) on every stage of the pipeline alike, however it ended here.

        ``status`` is :data:`STEP_OK`, or how this stage stopped early (:data:`STEP_FAILED`,
        :data:`STEP_ABANDONED`) with ``message`` saying why. A stage that stops early first tells its
        neighbours (they may be waiting for it), then every stage joins one small all-gather of the
        statuses and of how many messages went each way. When all finished, that is all (one all-gather
        per step). Otherwise every stage also learns the others' messages, receives and drops what its
        neighbours sent it and it never took, and waits for its own sends: the links are empty again,
        and the next step starts clean.

        Returns:
            ``(stage, status, message)`` of every stage that did not finish (empty when all did).
        """
        context = self.context
        if status != STEP_OK:
            for peer in dict.fromkeys((self.prev, self.next)):
                if peer is not None:
                    self.send_abort(peer, message)
        size = context.pipeline_parallel_size
        counts = [len(self.sent.get(peer, ())) for peer in self._pp_ranks] + \
                 [self.received.get(peer, 0) for peer in self._pp_ranks]
        mine = torch.tensor([status, *counts], dtype=torch.int64, device=context.device)
        stages = [torch.empty_like(mine) for _ in range(size)]
        with naming_timeouts(context, "ending a pipeline step", "every stage must run the same steps",
                             context.pipeline_parallel_group):
            dist.all_gather(stages, mine, group=context.pipeline_parallel_group)
        table = [row.tolist() for row in stages]
        # every message stage s sent stage t was taken by t
        complete = all(table[s][1 + t] == table[t][1 + size + s] for s in range(size) for t in range(size))
        if complete and all(row[0] == STEP_OK for row in table):
            self.wait_all()
            return []
        details: list = [None] * context.pipeline_parallel_size
        with naming_timeouts(context, "ending a failed pipeline step", group=context.pipeline_parallel_group):
            dist.all_gather_object(details, (message, self.sent), group=context.pipeline_parallel_group)
        for peer, taken in self.received.items():
            stage = self._pp_ranks.index(peer)
            for nbytes in details[stage][1].get(context.rank, [])[taken:]:
                self._recv(self._device_tensor(torch.empty(nbytes, dtype=torch.uint8)), peer)
        self.wait_all()
        return [(stage, row[0], details[stage][0]) for stage, row in enumerate(table) if row[0] != STEP_OK]


class _ReceivedGradient(torch.autograd.Function):
    """``loss`` of a stage that is not the last: its value is the last stage's loss, and its backward
    feeds the gradients received from the next stage into this stage's outputs."""

    @staticmethod
    def forward(ctx, loss_value, seed, record, count, *outputs_and_gradients):
        ctx.save_for_backward(seed, *outputs_and_gradients[count:])
        ctx.record = record
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        seed, *gradients = ctx.saved_tensors
        ctx.record.append(grad_loss.detach())
        # The gradients already carry the last stage's backward seed (1, or a loss scale); if this
        # stage's backward was seeded differently, rescale to this stage's seed.
        if not torch.equal(grad_loss, seed):
            gradients = [gradient * (grad_loss / seed).to(gradient.dtype) for gradient in gradients]
        return None, None, None, None, *gradients, *([None] * len(gradients))


def _received_loss(loss_value: torch.Tensor, seed: torch.Tensor, record: list,
                   pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The ``loss`` of a stage that is not the last (see :class:`_ReceivedGradient`), from ``pairs`` of this stage's
    outputs and the gradients received for them. A stage none of whose outputs needs a gradient (nothing up to it
    trains: a frozen first stage, or one an adapter leaves untouched) still yields a loss to call ``backward()`` on,
    as the manual's loop does on every stage: its backward records the seed and computes nothing."""
    if not pairs:
        loss_value = loss_value.detach().requires_grad_()
    return _ReceivedGradient.apply(loss_value, seed, record, len(pairs), *(output for output, _ in pairs),
                                   *(gradient for _, gradient in pairs))


def _payload_list(payload: dict[str, torch.Tensor | None], names: tuple[str, ...]) -> list[torch.Tensor | None]:
    """A stage's payload (named tensors) in the order every stage shares."""
    if not isinstance(payload, dict) or set(payload) != set(names):
        got = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"a pipeline stage must pass on the tensors {list(names)}, got {got}.")
    return [payload[name] for name in names]


def _trainable(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())


class TimelineEvent(NamedTuple):
    """One stretch of work of a pipeline stage (``time.perf_counter`` seconds)."""

    micro_batch: int
    phase: str  # "forward" or "backward"
    start: float
    end: float
    chunk: int = 0  # which of the stage's chunks of layers (interleaved schedule)


class PipelineStep(Iterator):
    """What a training call of a pipelined model returns: the micro-batch outputs of one step, in order.

    Iterate over it and call ``micro_output.loss.backward()`` on each output before taking the next;
    that is the backward step of the 1F1B schedule. It is not one model output: asking it for ``.loss``
    or ``[0]`` raises an error saying so.
    """

    def __init__(self, steps: Iterator[Any], context: ParallelContext | None = None) -> None:
        self._steps = steps
        if context is not None:
            context._open_pipeline_step = weakref.ref(self)

    def __iter__(self) -> PipelineStep:
        return self

    def __next__(self) -> Any:
        if self.__dict__.get("_ended_by_call"):
            raise RuntimeError(
                "this pipeline training step was ended early, on every stage, because the model was called "
                "again before its last micro-batch: the stages exchange each call's activations on the same "
                "links, so calls cannot overlap. Finish the loop over the micro-batch outputs before calling "
                "the model again (evaluate after the step)."
            )
        return next(self._steps)

    def close(self) -> None:
        """Stop the step early (as a generator's ``close``)."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()

    @staticmethod
    def _not_an_output(what: str) -> str:
        return (
            f"{what}: with pipeline_parallel_size > 1 a call with labels while gradients are enabled returns the "
            "micro-batch outputs of a training step, not one output. Iterate over them: `for micro_output in "
            "model(...): micro_output.loss.backward()`; each micro_output.loss is its micro-batch's loss. For one "
            "output of the whole batch (logits and all), call the model under torch.no_grad()."
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._not_an_output(f"'PipelineStep' object has no attribute {name!r}"))

    def __getitem__(self, index: Any) -> Any:
        raise TypeError(self._not_an_output("'PipelineStep' object is not subscriptable"))


def close_open_step(context: ParallelContext) -> None:
    """Close the training step of ``context``'s model that is still open (its loop left half-way while a
    reference to it is kept), so that it ends on every stage before the next call communicates."""
    reference = context.__dict__.pop("_open_pipeline_step", None)
    step = reference() if reference is not None else None
    if step is not None and inspect.isgenerator(step._steps) \
            and inspect.getgeneratorstate(step._steps) in (inspect.GEN_CREATED, inspect.GEN_SUSPENDED):
        step._ended_by_call = True
        step.close()


def _stage_failures(context: ParallelContext, failures: list[tuple[int, int, str]]) -> PipelineAbortedError:
    """The error a stage raises when other stages did not finish the step (or pass)."""
    described = []
    for stage, status, message in failures:
        if status == STEP_STOPPED:  # passing on another stage's failure
            continue
        rank = context.pipeline_parallel_global_rank(stage)
        what = "failed" if status == STEP_FAILED else "left the step"
        described.append(f"pipeline stage {stage} (global rank {rank}) {what}: {message}")
    return failure.mark_settled(PipelineAbortedError(
        "; ".join(described) + ". Every stage stopped this step; the links between stages are clear, so the "
        "model can go on with the next batch (the gradients hold the micro-batches backpropagated so far: "
        "call optimizer.zero_grad() to drop them)."
    ))


def _end_failed(context: ParallelContext, link: StageLink, exc: BaseException) -> None:
    """End a step or pass that ``exc`` interrupted on this stage, on every stage (see
    :meth:`StageLink.settle`). Returns to let the caller re-raise ``exc`` (marked settled); raises
    instead the :class:`PipelineAbortedError` naming the stage that failed when ``exc`` only passes on
    a neighbour's failure."""
    if isinstance(exc, PeerLostError):  # a stage's process ended: no settling with it
        return
    if isinstance(exc, PipelineAbortedError):  # a neighbour stopped: settle says who and why
        raise _stage_failures(context, link.settle(STEP_STOPPED, str(exc))) from None
    watch = context.__dict__.get("_call_watch")
    if watch is not None and context.tensor_parallel_size > 1:  # tensor-parallel peers may be waiting
        watch.failed(exc, context._tp_ranks)
    link.settle(STEP_FAILED, f"{type(exc).__name__}: {exc}")
    failure.mark_settled(exc)


def _abandon(link: StageLink, stage: int, done: int, count: int) -> None:
    """End on every stage a step whose loop this stage left after ``done`` of ``count`` micro-batches."""
    link.settle(STEP_ABANDONED, f"its loop over the micro-batch outputs was left after {done} of {count} "
                                "micro-batches")
    logger.warning(
        "pipeline stage %d: the training step was left after %d of %d micro-batches; the other stages stopped it "
        "too. The gradients hold only the micro-batches backpropagated (unreduced): call optimizer.zero_grad() "
        "before the next step.", stage, done, count)


def pipeline_schedule(
    context: ParallelContext,
    num_micro_batches: int,
    stage_forward: Callable[[int, torch.Tensor | None], Any],
    micro_output: Callable[[Any, torch.Tensor], Any],
    last_stage_loss: Callable[[Any], torch.Tensor],
    after_step: Callable[[bool], None],
    timeline: list[TimelineEvent] | None = None,
    payload: tuple[str, ...] = ("hidden_states",),
) -> Iterator[Any]:
    """The 1F1B training schedule of one batch, as a generator of micro-batch outputs.

    A step that stops early on some stage — an exception on that stage (caught by the user or not), a
    micro-batch not backpropagated, a loop left with ``break`` (the generator closed) — ends on every
    stage through :meth:`StageLink.settle`: the others raise :class:`PipelineAbortedError` naming the
    stage, the links are emptied, and the next step runs normally. A stage that left the loop itself
    raises nothing (it asked to stop); ``after_step`` runs only for a complete step.

    Args:
        context: The model's parallel context.
        num_micro_batches: ``M``.
        stage_forward: ``stage_forward(i, received, stage)`` runs stage ``stage`` (this rank's pipeline rank,
            or under an interleaved schedule one of its virtual stages, see :func:`interleaved_order`) on
            micro-batch ``i``; ``received`` is the previous stage's payload, ``{name: tensor}`` (``None`` on the
            first stage). Returns the payload to send on, or on the model's last stage the head's result.
        micro_output: ``micro_output(result, loss)`` builds what is yielded for a micro-batch;
            ``result`` is ``stage_forward``'s return value on the last stage, ``None`` elsewhere.
        last_stage_loss: The loss tensor inside the last stage's result.
        after_step: ``after_step(scaled)`` runs on every stage once all micro-batches are backpropagated
            (e.g. summing the gradients of weights tied across stages); ``scaled`` says whether some
            backward pass of this stage was seeded with something else than 1 (a gradient scaler's scale).
        timeline: If given, every forward and backward of this stage is appended to it.
        payload: The names of the tensors one stage passes the next (a ``None`` value is allowed); each
            floating one gets its gradient back.

    Yields:
        One output per micro-batch, in order; call ``.loss.backward()`` on each before the next.
    """
    if context.virtual_pipeline_size > 1:
        yield from _interleaved_schedule(context, num_micro_batches, stage_forward, micro_output, last_stage_loss,
                                         after_step, timeline, payload)
        return
    link = StageLink(context)
    first, last = context.is_pipeline_first_stage(), context.is_pipeline_last_stage()
    stage = context.pipeline_parallel_rank
    # One forward more ahead than textbook 1F1B (see the module docstring); the last stage runs each
    # micro-batch's backward right after its forward.
    warmup = 0 if last else min(context.pipeline_parallel_size - stage, num_micro_batches)
    received: dict[int, dict[str, torch.Tensor | None] | None] = {}
    results: dict[int, Any] = {}
    scaled = False
    done = 0  # micro-batches backpropagated

    def forward(i: int) -> None:
        inputs = None
        if not first:
            inputs = dict(zip(payload, link.recv(link.prev), strict=True))
            for tensor in inputs.values():
                if _trainable(tensor):
                    tensor.requires_grad_(torch.is_grad_enabled())
        start = time.perf_counter()
        with context.rng.replicated():
            result = stage_forward(i, inputs, stage)
        if not last:
            link.send(_payload_list(result, payload), link.next)
        if timeline is not None:
            timeline.append(TimelineEvent(i, "forward", start, time.perf_counter()))
        received[i], results[i] = inputs, result

    def finish_backward() -> None:
        nonlocal done
        done += 1
        if not first:
            gradients = [
                None if not _trainable(tensor) else tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                for tensor in inputs.values()
            ]
            link.send(gradients, link.prev, extra=torch.stack([loss_value, seeds[0].to(loss_value.dtype)]))

    i, seeds = 0, []
    try:
        for i in range(warmup):
            forward(i)
        for i in range(num_micro_batches):
            if i + warmup < num_micro_batches:
                forward(i + warmup)
            inputs, result = received.pop(i), results.pop(i)
            seeds: list[torch.Tensor] = []
            if last:
                loss = last_stage_loss(result)
                loss.register_hook(lambda grad, seeds=seeds: seeds.append(grad.detach()) or grad)
                loss_value = loss.detach()
                start = time.perf_counter()
                yield micro_output(result, loss)
            else:
                gradients, extra = link.recv(link.next, with_extra=True)
                loss_value, seed = extra.to(torch.float32).unbind()
                pairs = [(output, gradient) for output, gradient in zip(_payload_list(result, payload), gradients,
                                                                        strict=True)
                         if gradient is not None and output.requires_grad]
                loss = _received_loss(loss_value, seed, seeds, pairs)
                start = time.perf_counter()
                yield micro_output(None, loss)
            if timeline is not None:
                timeline.append(TimelineEvent(i, "backward", start, time.perf_counter()))
            if not seeds:
                raise RuntimeError(
                    f"micro-batch {i} was not backpropagated on pipeline stage {stage}: call "
                    "micro_output.loss.backward() on every output of the pipeline before taking the next one "
                    "(all stages must run the same loop)."
                )
            finish_backward()
            scaled = scaled or not bool((seeds[0] == 1).all())
    except GeneratorExit:  # the loop was left (break, or an exception in the user's loop body)
        if seeds and done == i:  # the micro-batch in hand was backpropagated: its gradient goes on
            finish_backward()
        received.clear()
        results.clear()
        _abandon(link, stage, done, num_micro_batches)
        return
    except BaseException as exc:
        received.clear()
        results.clear()
        _end_failed(context, link, exc)
        raise
    failures = link.settle(STEP_OK)
    if failures:
        raise _stage_failures(context, failures)
    after_step(scaled)


def pipeline_pass(
    context: ParallelContext, stage_forward: Callable[[dict | None, int], Any], names: list[str],
    payload: tuple[str, ...] = ("hidden_states",), first_stage: int = 0, last_stage: int | None = None,
) -> dict[str, torch.Tensor | None]:
    """Run one batch through the stages without gradients; every stage gets the last stage's outputs.

    Under an interleaved schedule (``context.virtual_pipeline_size`` = ``v`` > 1) the batch goes round the
    pipeline ``v`` times, through the virtual stages ``0 .. v * P - 1`` (virtual stage ``k`` on pipeline rank
    ``k % P``); stage numbers below are virtual stages then.

    Args:
        context: The model's parallel context.
        stage_forward: ``stage_forward(received, stage)`` runs stage ``stage`` (``received`` is the previous
            stage's payload, ``{name: tensor}``, or ``None`` on the first stage); it returns the payload to send
            on, or on the last stage a mapping of outputs.
        names: The outputs to hand to every stage, in an order all stages share.
        payload: The names of the tensors one stage passes the next.
        first_stage, last_stage: Run only the stages from ``first_stage`` to ``last_stage`` (default: the
            last), the others waiting for the outputs: an encoder-decoder's encoder alone (up to the stage
            of its last layer), or its decoder alone (from the stage of its first layer, the encoder's output
            given).

    Returns:
        ``{name: tensor or None}``, the same on every stage.
    """
    size, chunks = context.pipeline_parallel_size, context.virtual_pipeline_size
    link = StageLink(context, ring=chunks > 1)
    last_stage = size * chunks - 1 if last_stage is None else last_stage
    mine = [chunk * size + context.pipeline_parallel_rank for chunk in range(chunks)]
    result = None
    with torch.no_grad():
        try:
            for stage in mine:
                if not first_stage <= stage <= last_stage:
                    continue
                received = None
                if stage > first_stage:
                    received = dict(zip(payload, link.recv(link.prev, stream=stage - 1), strict=True))
                result = stage_forward(received, stage)
                if stage != last_stage:
                    link.send(_payload_list(result, payload), link.next, stream=stage)
        except BaseException as exc:
            _end_failed(context, link, exc)
            raise
        failures = link.settle(STEP_OK)
        if failures:
            raise _stage_failures(context, failures)
        owner = last_stage % size
        values = {name: link.broadcast_from(owner, result.get(name) if last_stage in mine else None)
                  for name in names}
    return values


def interleaved_order(num_stages: int, num_chunks: int, num_micro_batches: int,
                      stage: int) -> list[tuple[str, int, int]]:
    """The interleaved 1F1B order of pipeline rank ``stage``: ``(phase, chunk, micro_batch)`` for every
    forward and backward it runs in a step, ``phase`` being ``"forward"`` or ``"backward"``.

    Each of the ``P = num_stages`` ranks holds ``v = num_chunks`` chunks of layers: chunk ``c`` of rank ``s`` is
    virtual stage ``c * P + s`` of a pipeline of ``v * P`` stages, so a micro-batch goes round the ranks ``v``
    times. The forwards run in groups of ``P`` micro-batches, chunk by chunk within a group; the backwards the
    same with the chunks in reverse order (Megatron-LM's order, Narayanan et al. 2021; the last group is
    smaller when ``P`` does not divide ``m``). Rank ``s`` first runs ``2 (P - s - 1) + (v - 1) P`` forwards,
    then alternates a forward and a backward, and ends with the remaining backwards: the idle fraction of
    balanced stages is ``(P - 1) / (v m + P - 1)``, against 1F1B's ``(P - 1) / (m + P - 1)``.
    """
    size, chunks, count = num_stages, num_chunks, num_micro_batches
    groups = [range(start, min(start + size, count)) for start in range(0, count, size)]
    forwards = [(chunk, i) for group in groups for chunk in range(chunks) for i in group]
    backwards = [(chunk, i) for group in groups for chunk in reversed(range(chunks)) for i in group]
    total = chunks * count
    warmup = min(2 * (size - stage - 1) + (chunks - 1) * size, total)
    order = [("forward", *forwards[k]) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("forward", *forwards[warmup + k]), ("backward", *backwards[k])]
    order += [("backward", *backwards[k]) for k in range(total - warmup, total)]
    return order


def check_interleaved(num_stages: int, num_chunks: int, num_micro_batches: int) -> None:
    """Refuse a number of micro-batches :func:`interleaved_order` cannot run: every rank's order is followed
    with its dependencies (a forward after the previous virtual stage's, a backward after the next one's) and
    the order must run to its end. It always does when ``num_stages`` divides ``num_micro_batches`` (or
    ``num_micro_batches`` < ``num_stages``); with a last group of another size it may wait forever.

    Raises:
        ValueError: on every rank alike (the check depends on the sizes only), before the step starts.
    """
    size, chunks, count = num_stages, num_chunks, num_micro_batches
    if chunks == 1 or count % size == 0 or count < size:
        return
    orders = [interleaved_order(size, chunks, count, stage) for stage in range(size)]
    last, done, position = size * chunks - 1, set(), [0] * size
    progressed = True
    while progressed:
        progressed = False
        for stage in range(size):
            while position[stage] < len(orders[stage]):
                phase, chunk, i = orders[stage][position[stage]]
                virtual = chunk * size + stage
                if phase == "forward":
                    needs = ("forward", virtual - 1, i) if virtual > 0 else None
                else:
                    needs = ("backward", virtual + 1, i) if virtual < last else None
                if needs is not None and needs not in done:
                    break
                done.add((phase, virtual, i))
                position[stage] += 1
                progressed = True
    if any(position[stage] < len(orders[stage]) for stage in range(size)):
        fits = [n for n in (count - count % size, count - count % size + size) if n > 0]
        raise ValueError(
            f"the interleaved schedule (virtual_pipeline_size={chunks}) cannot run {count} micro-batches on "
            f"pipeline_parallel_size={size} stages: its groups of {size} micro-batches would leave a last group of "
            f"{count % size}, and the stages would wait for each other. Use a number of micro-batches that "
            f"pipeline_parallel_size divides ({' or '.join(map(str, fits))}: batch size = micro-batches x "
            "micro_batch_size), or virtual_pipeline_size=1."
        )


def _interleaved_messages(num_stages: int, num_chunks: int, num_micro_batches: int,
                          stage: int) -> dict[int, list[int]]:
    """The streams of the messages rank ``stage`` sends in an interleaved step, by destination rank, in the
    order it sends them. Stream ``2 k`` carries virtual stage ``k``'s output to stage ``k + 1``, stream
    ``2 k + 1`` the gradient of stage ``k + 1``'s input back to stage ``k``."""
    size, last = num_stages, num_stages * num_chunks - 1
    messages: dict[int, list[int]] = {}
    for phase, chunk, _ in interleaved_order(num_stages, num_chunks, num_micro_batches, stage):
        virtual = chunk * size + stage
        if phase == "forward" and virtual < last:
            messages.setdefault((virtual + 1) % size, []).append(2 * virtual)
        elif phase == "backward" and virtual > 0:
            messages.setdefault((virtual - 1) % size, []).append(2 * (virtual - 1) + 1)
    return messages


def _interleaved_schedule(context, num_micro_batches, stage_forward, micro_output, last_stage_loss, after_step,
                          timeline, payload):
    """:func:`pipeline_schedule` with ``virtual_pipeline_size`` > 1: :func:`interleaved_order`'s order.

    The user's ``micro_output.loss.backward()`` runs the backward of the micro-batch's last chunk on this rank
    (the loss itself on the last rank); the schedule runs the backwards of the other chunks itself, fed the
    gradients received, rescaled to the seed of that micro-batch's ``backward()`` on this rank (a loss scale)."""
    size, chunks, count = context.pipeline_parallel_size, context.virtual_pipeline_size, num_micro_batches
    stage = context.pipeline_parallel_rank
    last_virtual = size * chunks - 1
    link = StageLink(context, ring=True)
    rank_of = context.pipeline_parallel_global_rank
    link.expect(
        {rank_of(peer): _interleaved_messages(size, chunks, count, peer).get(stage, []) for peer in range(size)},
        {rank_of(peer): streams for peer, streams in _interleaved_messages(size, chunks, count, stage).items()})
    received: dict[tuple[int, int], dict | None] = {}
    results: dict[tuple[int, int], Any] = {}
    seeds_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch: (loss value, this rank's seed)
    scaled, done = False, 0
    hand: list = []  # the micro-batch output yielded last: (chunk, i, its seeds, its loss value)

    def forward(chunk: int, i: int) -> None:
        virtual = chunk * size + stage
        inputs = None
        if virtual > 0:
            inputs = dict(zip(payload, link.recv(link.prev, stream=2 * (virtual - 1)), strict=True))
            for tensor in inputs.values():
                if _trainable(tensor):
                    tensor.requires_grad_(torch.is_grad_enabled())
        start = time.perf_counter()
        with context.rng.replicated():
            result = stage_forward(i, inputs, virtual)
        if virtual < last_virtual:
            link.send(_payload_list(result, payload), link.next, stream=2 * virtual)
        if timeline is not None:
            timeline.append(TimelineEvent(i, "forward", start, time.perf_counter(), chunk))
        received[chunk, i], results[chunk, i] = inputs, result

    def received_gradients(chunk: int, i: int):
        """The gradient of this chunk's outputs from the next virtual stage: ``(pairs, loss value, seed)``."""
        virtual = chunk * size + stage
        gradients, extra = link.recv(link.next, with_extra=True, stream=2 * virtual + 1)
        loss_value, seed = extra.to(torch.float32).unbind()
        outputs = _payload_list(results.pop((chunk, i)), payload)
        pairs = [(output, gradient) for output, gradient in zip(outputs, gradients, strict=True)
                 if gradient is not None and output.requires_grad]
        return pairs, loss_value, seed

    def send_gradients(chunk: int, i: int) -> None:
        inputs = received.pop((chunk, i))
        if chunk * size + stage == 0:
            return
        gradients = [None if not _trainable(tensor) else tensor.grad if tensor.grad is not None
                     else torch.zeros_like(tensor) for tensor in inputs.values()]
        loss_value, seed = seeds_of[i]
        link.send(gradients, link.prev, extra=torch.stack([loss_value, seed.to(loss_value.dtype)]),
                  stream=2 * (chunk * size + stage - 1) + 1)

    try:
        for phase, chunk, i in interleaved_order(size, chunks, count, stage):
            if phase == "forward":
                forward(chunk, i)
                continue
            if chunk < chunks - 1:  # the schedule's own backward, seeded as this micro-batch's last chunk was
                pairs, _, seed = received_gradients(chunk, i)
                start = time.perf_counter()
                own = seeds_of[i][1]
                if pairs:
                    factor = None if torch.equal(own.to(seed.dtype), seed) else own.to(seed.dtype) / seed
                    torch.autograd.backward(
                        [output for output, _ in pairs],
                        [gradient if factor is None else gradient * factor.to(gradient.dtype) for _, gradient in pairs])
            else:  # the user's backward
                seeds: list[torch.Tensor] = []
                if chunk * size + stage == last_virtual:
                    result = results.pop((chunk, i))
                    loss = last_stage_loss(result)
                    loss.register_hook(lambda grad, seeds=seeds: seeds.append(grad.detach()) or grad)
                    loss_value = loss.detach()
                    start = time.perf_counter()
                    hand[:] = [chunk, i, seeds, loss_value]
                    yield micro_output(result, loss)
                else:
                    pairs, loss_value, seed = received_gradients(chunk, i)
                    loss = _received_loss(loss_value, seed, seeds, pairs)
                    start = time.perf_counter()
                    hand[:] = [chunk, i, seeds, loss_value]
                    yield micro_output(None, loss)
                hand.clear()
                if not seeds:
                    raise RuntimeError(
                        f"micro-batch {i} was not backpropagated on pipeline stage {stage}: call "
                        "micro_output.loss.backward() on every output of the pipeline before taking the next one "
                        "(all stages must run the same loop)."
                    )
                seeds_of[i] = (loss_value, seeds[0])
                scaled = scaled or not bool((seeds[0] == 1).all())
                done += 1
            if timeline is not None:
                timeline.append(TimelineEvent(i, "backward", start, time.perf_counter(), chunk))
            send_gradients(chunk, i)
    except GeneratorExit:  # the loop was left (break, or an exception in the user's loop body)
        if hand and hand[2]:  # the micro-batch in hand was backpropagated: its gradient goes on
            chunk, i, seeds, loss_value = hand
            seeds_of[i] = (loss_value, seeds[0])
            done += 1
            send_gradients(chunk, i)
        received.clear()
        results.clear()
        _abandon(link, stage, done, count)
        return
    except BaseException as exc:
        received.clear()
        results.clear()
        _end_failed(context, link, exc)
        raise
    failures = link.settle(STEP_OK)
    if failures:
        raise _stage_failures(context, failures)
    after_step(scaled)
