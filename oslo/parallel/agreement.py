"""What the ranks of one model must agree on, checked with one small collective each.

* **The inputs.** Every rank of a tensor- and pipeline-parallel group computes on the same batch: each
  tensor-parallel rank holds part of every layer, each pipeline stage part of the layers. Different
  batches on these ranks (a sampler sharded over the whole world instead of the data-parallel group)
  would train on a silent mix, different shapes would end in a collective mismatch deep inside a
  layer. :func:`check_same_inputs` compares a fingerprint of every input across the model-parallel
  group before the model communicates, and raises on every rank, naming the input and the ranks.
* **Non-finite gradients.** A gradient scaler skips the optimizer step when a gradient overflowed.
  Each rank sees only its shards and its stage, so one rank may find an overflow that the others do
  not, skip alone, and let copies of replicated weights (and the stages) drift apart.
  :func:`agree_on_nonfinite_gradients` makes the decision common: if any rank of the group has a
  non-finite gradient, every rank's gradients are made non-finite, so every scaler skips.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from oslo.parallel.comm import naming_timeouts
from oslo.parallel.context import ParallelContext
from oslo.parallel.mappings import group_size

__all__ = ["InputMismatchError", "agree_on_nonfinite_gradients", "check_same_inputs"]

_BLOCK = 1 << 16
_weight_blocks: dict[tuple[str, int], torch.Tensor] = {}


class InputMismatchError(ValueError):
    """Ranks of one model-parallel group were given different inputs."""


def _weights(count: int, device: torch.device) -> torch.Tensor:
    """``count`` fixed pseudo-random int64 weights, the same on every rank: blocks of a seeded stream,
    so the first ``n`` never depend on how many were asked for before."""
    blocks = []
    for block in range((count + _BLOCK - 1) // _BLOCK):
        key = (str(device), block)
        if key not in _weight_blocks:
            generator = torch.Generator().manual_seed(0x5EED + block)
            values = torch.randint(-(2**62), 2**62, (_BLOCK,), dtype=torch.int64, generator=generator)
            _weight_blocks[key] = values.to(device)
        blocks.append(_weight_blocks[key])
    return torch.cat(blocks)[:count] if len(blocks) > 1 else blocks[0][:count]


def _content_hash(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 digest of the tensor's values (a weighted sum, wrapping): equal values give equal digests."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.float().view(torch.int32)  # the exact bits
    elif flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1).float().view(torch.int32)
    flat = flat.to(torch.int64)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    return (flat * _weights(flat.numel(), flat.device)).sum()


def _describe(value: Any) -> tuple[str, torch.Tensor | None]:
    """(what the value is, in words that must match across ranks; the tensor to digest, if any)."""
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} of shape {tuple(value.shape)}", value
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value), None
    if isinstance(value, torch.dtype):
        return str(value), None
    if hasattr(value, "get_seq_length"):  # a KV cache: its length, not its contents (each stage has its own)
        return f"{type(value).__name__} holding {value.get_seq_length()} positions", None
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (list, tuple, dict)) for v in value):
        parts = [_describe(v) for v in value]
        tensors = [t for _, t in parts if t is not None]
        digest = torch.stack([_content_hash(t).to(tensors[0].device) for t in tensors]) if tensors else None
        return f"{type(value).__name__}[{', '.join(text for text, _ in parts)}]", digest
    return type(value).__name__, None


def _inputs(args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    named = [(f"positional argument {i}", value) for i, value in enumerate(args)]
    return named + sorted(kwargs.items())


def check_same_inputs(context: ParallelContext, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`InputMismatchError` on every rank of the model-parallel group unless all of them
    got the same ``args`` and ``kwargs`` (shapes, dtypes, values and options).

    One all-gather of two int64 per rank when they agree (a digest of the structure and one of the
    values); a second, describing every input, only when they do not. Call it on every rank of the
    group before any other communication of the model.
    """
    group = context.model_parallel_group
    if group_size(group) == 1:
        return
    texts, digests = [], []  # per input: its description; its values' digest (None for non-tensors)
    for name, value in _inputs(args, kwargs):
        text, tensor = _describe(value)
        texts.append(f"{name}: {text}")
        digests.append(None if tensor is None else _content_hash(tensor).to(context.device))
    structure = zlib.crc32("\n".join(texts).encode())
    weighted = [digest * (2 * i + 3) for i, digest in enumerate(digests) if digest is not None]
    values = torch.stack(weighted).sum() if weighted else torch.zeros((), dtype=torch.int64, device=context.device)
    mine = torch.stack([torch.tensor(structure, dtype=torch.int64, device=context.device), values])
    gathered = [torch.empty_like(mine) for _ in range(group_size(group))]
    with naming_timeouts(context, "comparing the inputs of a model call across the model-parallel group",
                         "call the model on every rank of its tensor- and pipeline-parallel group"):
        dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return

    # They differ: find out which input, on which ranks (every rank takes this path).
    per_input = [text if digest is None else f"{text}, values digest {int(digest)}"
                 for text, digest in zip(texts, digests, strict=True)]
    described: list[list[str] | None] = [None] * group_size(group)
    with naming_timeouts(context, "describing inputs that differ across the model-parallel group"):
        dist.all_gather_object(described, per_input, group=group)
    raise InputMismatchError(_mismatch_message(context, described))


def _rank_name(context: ParallelContext, index: int) -> str:
    stage, tensor_rank = divmod(index, context.tensor_parallel_size)
    where = []
    if context.tensor_parallel_size > 1:
        where.append(f"tensor-parallel rank {tensor_rank}")
    if context.pipeline_parallel_size > 1:
        where.append(f"pipeline stage {stage}")
    return f"global rank {context.get_model_parallel_src_rank() + index} ({', '.join(where)})"


def _mismatch_message(context: ParallelContext, described: list[list[str]]) -> str:
    reference = described[0]
    lines = []
    for index, inputs in enumerate(described[1:], start=1):
        if inputs == reference:
            continue
        differing = [(a, b) for a, b in zip(reference, inputs, strict=False) if a != b]
        if len(inputs) != len(reference) and not differing:
            differing = [(" / ".join(reference), " / ".join(inputs))]
        ours, theirs = differing[0]
        lines.append(f"{_rank_name(context, index)} got [{theirs}] where {_rank_name(context, 0)} got [{ours}]")
    return (
        "the ranks of one tensor/pipeline-parallel group were given different inputs: "
        + "; ".join(lines)
        + ". Every rank of a model-parallel group must get the same batch (each holds part of the model): "
        "shard the data over the data-parallel group only, e.g. DistributedSampler(dataset, "
        "num_replicas=model.mpu.get_data_parallel_world_size(), rank=model.mpu.get_data_parallel_rank()), "
        "and pass the same options on every rank."
    )


def agree_on_nonfinite_gradients(
    gradients: Iterable[torch.Tensor], context: ParallelContext, scan: bool = True
) -> bool:
    """Make one decision for the whole model-parallel group about non-finite gradients.

    Each rank looks at its own ``gradients``, then one all-reduce of a flag tells every rank whether any
    rank found an ``inf`` or ``nan``. If one did, every rank fills its gradients with ``nan``, so that a
    gradient scaler skips the step on every rank (and lowers its scale alike), as it would on one
    process. With ``scan=False`` nothing happens (no look, no communication): the ranks must take the
    same decision, from what they share (the loss scale seeding the backward pass, the compute dtype).

    Returns:
        Whether some rank of the group had a non-finite gradient.
    """
    if not scan:
        return False
    gradients = [g for g in gradients if g is not None]
    found = torch.zeros(1, device=context.device)
    if gradients:
        total = torch.nn.utils.get_total_norm(gradients, norm_type=float("inf"))
        found.fill_(float(not bool(torch.isfinite(total))))
    if group_size(context.model_parallel_group) > 1:
        with naming_timeouts(context, "agreeing on non-finite gradients at the end of a backward pass"):
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=context.model_parallel_group)
    if not bool(found):
        return False
    for gradient in gradients:
        gradient.detach().fill_(float("nan"))
    return True
