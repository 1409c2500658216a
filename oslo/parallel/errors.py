"""The errors of a failed collective, and the context manager that names them: the ground floor of
:mod:`oslo.parallel` (torch.distributed only), under the context, the collectives and the failure watchdog."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from oslo.parallel.context import ParallelContext

__all__ = ["PeerLostError", "PeerTimeoutError", "RankFailedError", "comm_error", "naming_timeouts"]


class RankFailedError(RuntimeError):
    """Raised on every rank when some other rank failed during a step they share."""

    follows_another_rank = True  # the launcher (oslo.launch.run) names the rank that failed first as the cause


class PeerTimeoutError(RuntimeError):
    """Raised on a rank whose peers did not join a collective within the context's timeout."""


class PeerLostError(RuntimeError):
    """Raised on a rank whose connection to a peer closed during a collective: the peer's process ended
    (killed, out of memory, crashed) and the step cannot complete."""

    follows_another_rank = True


# How gloo (and NCCL) report a peer whose process ended: its socket closed, was reset, or refuses.
_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|socket closed|connection refused|"
                   r"remote (worker|process)", re.IGNORECASE)


def _backend_detail(exc: BaseException) -> str:
    """The backend's own words, without its source location and advice: ``Connection closed by peer
    [127.0.0.1]:37565`` (the address is the lost peer's)."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(exc).strip())
    return text.split(". ")[0].rstrip(".")


def comm_error(context: ParallelContext, exc: BaseException, what: str, hint: str = "", group=None,
               peer: int | None = None) -> RuntimeError | None:
    """The oslo error for a collective (or transfer) of ``context`` that failed with ``exc``:
    :class:`PeerLostError` for a lost connection, :class:`PeerTimeoutError` for a timeout, ``None`` for
    anything else (oslo's own errors included) or when it is not a backend error.

    Args:
        what: What this rank was doing ("averaging gradients over the data-parallel replicas").
        hint: Why every rank must join, for a timeout.
        group: The collective's group, named in the message (``None``: not named).
        peer: The global rank at the other end of a point-to-point transfer, when known. A group of two
            ranks has one possible peer: the other one.
    """
    if not (type(exc) is RuntimeError or isinstance(exc, dist.DistError)):
        return None
    text = str(exc).lower()
    where = "" if group is None else f" of {context.describe_group(group)}"
    if _LOST.search(text):
        if peer is None and group is not None and dist.get_world_size(group) == 2:
            peer = next(r for r in dist.get_process_group_ranks(group) if r != context.rank)
        lost = (context.describe_rank(peer) if peer is not None else "a peer" if group is None else "a rank") + where
        return PeerLostError(
            f"rank {context.rank} lost its connection to {lost} while {what} ({_backend_detail(exc)}): that "
            "process ended (killed, out of memory or crashed; its own log says why) and the job cannot go on. "
            "Restart every process and resume from the last checkpoint (e.g. torchrun --max-restarts)."
        )
    if "timed out" in text or "timeout" in text:
        return PeerTimeoutError(
            f"rank {context.rank} waited {context.timeout} (the model's timeout=) for the other ranks{where} "
            f"while {what}, and they did not join: every rank must make the same calls"
            f"{' (' + hint + ')' if hint else ''}. A rank that failed or went on to other work leaves "
            f"the others waiting. Original error: {exc}"
        )
    return None


@contextmanager
def naming_timeouts(context: ParallelContext, what: str, hint: str = "", group=None,
                    peer: int | None = None) -> Iterator[None]:
    """Turn a failed collective into an error that says what this rank was doing, over which group
    (and, when known, with which peer): a timeout (gloo's "Timed out waiting ...") becomes
    :class:`PeerTimeoutError`, a lost connection ("Connection closed by peer ...") :class:`PeerLostError`.
    Other errors pass unchanged. See :func:`comm_error` for the arguments."""
    try:
        yield
    except RuntimeError as exc:
        error = comm_error(context, exc, what, hint, group, peer)
        if error is None:
            raise
        raise error from exc
