"""Run a function on N ranks in real gloo process groups, as torchrun would.

``run_distributed(fn, world_size, *args)`` forks ``world_size`` processes with the launcher's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so oslo initializes
torch.distributed itself exactly as under ``torchrun``. It returns the per-rank results, raises the
traceback of the first rank to fail, and raises ``TimeoutError`` naming the ranks that did not
finish in time. After a failure the other ranks get ``grace`` seconds (they may be stuck in a
collective with the dead rank) before they are killed, so a failing rank fails the test quickly and
never hangs it.

Forking is cheap (~0.1 s) because the parent has already imported torch and transformers; the
parent keeps one torch thread (tests/conftest.py) so forked gloo workers do not hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.utils._pytree import tree_map

DEFAULT_TIMEOUT = 120.0
LOST_EXIT = 17  # the exit code of a rank that ends its own process on purpose (``lost=`` below)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _worker(fn, rank, world_size, port, args, kwargs, conn) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        # A DTensor cannot travel without its process group: its local tensor does (this rank's values).
        result = tree_map(lambda x: _plain(x).detach() if isinstance(x, torch.Tensor) else x,
                          fn(rank, world_size, *args, **kwargs))
        # Plain pickle copies tensor data into the message (no shared memory outliving this process).
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    finally:
        conn.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        os._exit(0)


class RankError(AssertionError):
    """A rank failed; the message carries its traceback."""


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
    ctx = mp.get_context(start_method)
    port = _free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, kwargs, child_conn), daemon=False)
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)

    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if failures:
                    break
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            pending = [c for r, c in enumerate(conns) if r not in results and r not in failures]
            for conn in mp.connection.wait(pending, timeout=remaining):
                rank = conns.index(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=5)
                    if rank in lost and procs[rank].exitcode == LOST_EXIT:
                        results[rank] = None
                        continue
                    status, payload = "error", f"exited without a result (exit code {procs[rank].exitcode})"
                if status == "ok" and rank in lost:
                    status, payload = "error", f"was to end its process (os._exit(LOST_EXIT)) but returned {payload!r}"
                if status == "error":
                    failures[rank] = payload
                    # The other ranks get a short grace period to finish (and clean up), then are killed.
                    deadline = min(deadline, time.monotonic() + grace)
                else:
                    results[rank] = payload
        if failures:
            # The first failure to arrive is the cause; ranks that failed later usually lost their peer.
            rank = next(iter(failures))
            others = f" (then ranks {sorted(set(failures) - {rank})} failed too)" if len(failures) > 1 else ""
            raise RankError(f"rank {rank} failed{others}:\n{failures[rank]}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        for conn in conns:
            conn.close()
    return [results[rank] for rank in range(world_size)]
