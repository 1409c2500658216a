"""Run a function on N ranks in real gloo process groups, as torchrun would: the tests' face of
:func:`oslo.launch.run`.

``run_distributed(fn, world_size, *args)`` forks ``world_size`` processes with the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so oslo initializes torch.distributed itself
exactly as under ``torchrun``. It returns the per-rank results, raises the traceback of the first rank to
fail (:class:`RankError`), and raises ``TimeoutError`` naming the ranks that did not finish in time. After a
failure the other ranks get ``grace`` seconds (they may be stuck in a collective with the dead rank) before
they are killed, so a failing rank fails the test quickly and never hangs it.

Forking is cheap (~0.1 s) because the parent has already imported torch and transformers; the parent keeps
one torch thread (tests/conftest.py) so forked gloo workers do not hang.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from oslo.launch import LOST_EXIT, RankFailedError, run

__all__ = ["DEFAULT_TIMEOUT", "LOST_EXIT", "RankError", "run_distributed"]

DEFAULT_TIMEOUT = 120.0
RankError = RankFailedError


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    grace: float = 5.0,
    lost: Collection[int] = (),
    start_method: str = "fork",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked ranks; return their results.

    ``lost``: ranks that end their own process mid-way (``os._exit(LOST_EXIT)`` inside ``fn``, as a
    killed peer would); their result is ``None``. One of them returning, or ending otherwise, fails.
    ``start_method="spawn"`` starts fresh interpreters instead (slower: each imports torch again), for
    ranks that use CUDA when this process may already have (CUDA cannot be used in a forked child then).
    """
    return run(fn, world_size, args, kwargs, timeout=timeout, grace=grace, lost=lost, start_method=start_method)
