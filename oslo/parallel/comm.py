"""Plain (non-autograd) collectives used around the model: loading, saving, error agreement."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from oslo.parallel.collectives import group_size, through_cpu
from oslo.parallel.context import ParallelContext

# Defined in oslo.parallel.errors (under the context, which names its timeouts with them); USAGE.md names them here.
from oslo.parallel.errors import PeerLostError, PeerTimeoutError, RankFailedError, naming_timeouts

__all__ = ["PeerLostError", "PeerTimeoutError", "RankFailedError", "gather_to_first", "run_on_all_ranks"]

T = TypeVar("T")


def run_on_all_ranks(context: ParallelContext, step: Callable[[], T], what: str) -> T:
    """Run ``step`` on every rank; if it fails anywhere, raise everywhere.

    Each rank runs ``step`` locally (no collective inside), then the ranks exchange one status
    message. A rank whose step failed re-raises its own exception; the others raise
    :class:`RankFailedError` naming the failed ranks and their errors. Nobody is left waiting in a
    later collective.

    Args:
        context: Whose world group to agree over.
        step: The local work.
        what: A few words for the error message ("loading the checkpoint").
    """
    error: BaseException | None = None
    result = None
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - every error must be shared with the other ranks
        error = exc
    if context.world_size > 1:
        status = None if error is None else f"{type(error).__name__}: {error}"
        statuses: list[str | None] = [None] * context.world_size
        with naming_timeouts(context, what, "oslo's loading, saving and initialization run on every rank",
                             context.world_group):
            dist.all_gather_object(statuses, status, group=context.world_group)
        failed = [(rank, message) for rank, message in enumerate(statuses) if message is not None]
        if failed and error is None:
            details = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
            raise RankFailedError(f"{what} failed on {len(failed)} rank(s): {details}")
    if error is not None:
        raise error
    return result


def gather_to_first(tensor: torch.Tensor, group, first_global_rank: int) -> list[torch.Tensor] | None:
    """Gather ``tensor`` from every rank of ``group`` onto its first rank (the others get ``None``)."""
    if group_size(group) == 1:
        return [tensor]
    device, staged = tensor.device, through_cpu(tensor, group)
    tensor = (tensor.cpu() if staged else tensor).contiguous()
    is_first = dist.get_rank() == first_global_rank
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))] if is_first else None
    dist.gather(tensor, parts, dst=first_global_rank, group=group)
    return [part.to(device) for part in parts] if staged and parts is not None else parts
