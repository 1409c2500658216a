"""A rank that fails in the middle of a model call must not leave the other ranks waiting.

When an exception escapes a call of the model on one rank only (an out-of-memory error, a hook that
raises, a bug that shows on one rank), its tensor-parallel peers are left inside a collective of that
call, waiting for a rank that will never join; if the user catches the exception and calls the model
again, the next collective of the failed rank meets the peers' old one ("collective mismatch"), or
everyone waits until the timeout. gloo offers no way to cancel a collective, so:

* The failing rank writes what happened into the c10d store (a record per model call), then waits
  briefly to learn whether its peers failed too.
* While a rank waits in a collective of the model, it looks for such a record every
  :data:`POLL_SECONDS`; if a peer failed in this call, it stops waiting and raises
  :class:`~oslo.parallel.errors.RankFailedError`, naming the rank and its error.
* If every rank of the model-parallel group failed in the same call (a deterministic error, such as a
  bad argument seen by every rank), nobody was left inside a collective: the model stays usable and
  each rank raises its own error. Otherwise the group's collectives are out of step for good: the
  model is marked unusable on every rank of the group, and each later call raises at once, naming the
  failed rank, instead of hanging or mixing collectives.

Pipeline stages settle their failures between themselves (:mod:`oslo.parallel.pipeline`); their
exceptions arrive here marked as settled and are not recorded.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from oslo.parallel.context import ParallelContext
from oslo.parallel.errors import PeerLostError, RankFailedError, comm_error

__all__ = ["ModelUnusableError", "POLL_SECONDS", "CallWatch", "call_watch", "mark_settled", "wait"]

POLL_SECONDS = 0.2  # how often a waiting rank looks for a peer's failure
_SETTLE_SECONDS = 60.0  # at most this long, a failed rank waits to learn whether its peers failed too
_FAILED, _STOPPED = "failed", "stopped"  # a rank's own exception; a rank that stopped waiting for a failed one
_POLL_EXPIRED = "Operation timed out!"  # what gloo's Work.wait(timeout) raises when the time is up
# id(group) -> (group, its watch); the group is kept so that its id is never reused by another object.
_watches_by_group: dict[int, tuple[object, CallWatch]] = {}
_instances = 0


class ModelUnusableError(RuntimeError):
    """The model's collectives are out of step since a rank failed alone in an earlier call."""


def mark_settled(exc: BaseException) -> BaseException:
    """Mark an exception that every rank concerned already knows about (no record, no waiting)."""
    exc.__oslo_settled__ = True
    return exc


def _is_settled(exc: BaseException) -> bool:
    return bool(getattr(exc, "__oslo_settled__", False))


class CallWatch:
    """Failure records of one parallel context's model calls, kept in the c10d store."""

    def __init__(self, context: ParallelContext, name: str) -> None:
        self.context = context
        self.store = dist.PrefixStore(f"oslo/{name}", dist.distributed_c10d._get_default_store())
        self.call = 0  # the model calls begun on this rank (the same count on every rank of the group)
        self.unusable: str | None = None
        self.store_lost = False
        self.group_ranks = list(context._mp_ranks)

    # ---- the failing rank ---------------------------------------------------------------------
    def begin_call(self) -> None:
        """Before any communication of a new model call: refuse it if the model is unusable."""
        self.call += 1
        if self.unusable is not None:
            try:  # ranks of the group that did not see the failure stop waiting for this one
                self.store.set(f"{self.call}/rank{self.context.rank}", f"{_FAILED}|ModelUnusableError: {self.unusable}")
                self.store.add(f"{self.call}/records", 1)
            except (RuntimeError, OSError):
                pass
            raise ModelUnusableError(self.unusable)

    def failed(self, exc: BaseException, peers: list[int] | None = None) -> None:
        """``exc`` escaped model call :attr:`call` on this rank: record it, and find out whether the
        ``peers`` (global ranks that may share a collective with this one; default the whole
        model-parallel group) failed in this call too, in which case nothing is out of step."""
        if _is_settled(exc) or isinstance(exc, ModelUnusableError):
            return
        if isinstance(exc, PeerLostError):  # a rank's process ended: nobody to wait for, no way back
            self.unusable = self._unusable_message(str(exc))
            return
        try:
            self._record(exc, self.group_ranks if peers is None else peers)
        except (RuntimeError, OSError) as store_error:  # the store went away (rank 0 ended): assume the worst
            self.unusable = self._unusable_message(
                f"rank {self.context.rank} failed with {type(exc).__name__}: {exc} (and the c10d store could not "
                f"be reached to learn about the other ranks: {store_error})")

    def _record(self, exc: BaseException, peers: list[int]) -> None:
        rank = self.context.rank
        kind = _STOPPED if isinstance(exc, RankFailedError) else _FAILED
        text = f"{type(exc).__name__}: {exc}"
        self.store.set(f"{self.call}/rank{rank}", f"{kind}|{text[:2000]}")
        self.store.add(f"{self.call}/records", 1)
        if kind == _STOPPED:
            self.unusable = self._unusable_message(str(exc))
            return
        deadline = time.monotonic() + min(_SETTLE_SECONDS, self.context.timeout.total_seconds())
        while time.monotonic() < deadline:
            kinds = [self._kind(peer) for peer in peers if peer != rank]
            if _STOPPED in kinds:
                break  # a peer was waiting in a collective of this call
            if all(k == _FAILED for k in kinds):
                return  # every peer failed in this call: all left it at the same collective
            time.sleep(POLL_SECONDS / 4)
        self.unusable = self._unusable_message(f"rank {rank} failed with {text}")

    def _kind(self, rank: int) -> str | None:
        key = f"{self.call}/rank{rank}"
        return self.store.get(key).decode().split("|", 1)[0] if self.store.check([key]) else None

    def _unusable_message(self, what: str) -> str:
        return (
            f"this model cannot run any more: in model call {self.call}, {what} while other ranks of its "
            f"tensor/pipeline-parallel group (global ranks {self.group_ranks}) were still inside a collective "
            "of that call; their collectives are out of step and gloo/NCCL cannot cancel one. Restart the "
            "processes (e.g. torchrun --max-restarts) and resume from the last checkpoint; to skip bad batches, "
            "make the decision on every rank alike (the same check on every rank, before the model call)."
        )

    # ---- the waiting ranks ----------------------------------------------------------------------
    def check_peers(self, what: str) -> None:
        """Raise :class:`RankFailedError` if another rank of the group recorded a failure in this call."""
        if self.store_lost:
            return
        try:
            if self.store.add(f"{self.call}/records", 0) == 0:
                return
            failures = []
            for rank in self.group_ranks:
                key = f"{self.call}/rank{rank}"
                if rank != self.context.rank and self.store.check([key]):
                    kind, text = self.store.get(key).decode().split("|", 1)
                    if kind == _FAILED:
                        failures.append(f"rank {rank}: {text}")
        except (RuntimeError, OSError):  # the store's server (rank 0's process) has ended: wait as before
            self.store_lost = True
            return
        if failures:
            self.unusable = self._unusable_message("; ".join(failures))
            raise RankFailedError(
                f"rank {self.context.rank} stopped waiting while {what}: "
                + "; ".join(failures)
                + " (it failed in this model call while this rank was waiting for it)."
            )


def call_watch(context: ParallelContext) -> CallWatch | None:
    """The context's :class:`CallWatch` (created on first use), or ``None`` when the model has a single
    model-parallel rank or torch.distributed is not running."""
    watch = context.__dict__.get("_call_watch")
    if watch is not None:
        return watch
    if context.tensor_parallel_size * context.pipeline_parallel_size == 1 or not dist.is_initialized():
        return None
    global _instances
    _instances += 1
    watch = CallWatch(context, f"context{_instances}-dp{context.data_parallel_rank}")
    context._call_watch = watch
    for group in (context.tensor_parallel_group, context.pipeline_parallel_group, context.model_parallel_group):
        if group is not None:
            _watches_by_group[id(group)] = (group, watch)
    return watch


def wait(work: dist.Work, group, what: str, watch: CallWatch | None = None) -> None:
    """Wait for an asynchronous collective (or transfer) of a model call over ``group``; stop with
    :class:`RankFailedError` if a peer failed in this call meanwhile. gloo only: NCCL work runs on
    the device stream, and its own watchdog handles a peer that never comes."""
    watch = watch or _watches_by_group.get(id(group), (None, None))[1]
    if watch is None or dist.get_backend(group) != "gloo":
        work.wait()
        return
    poll = timedelta(seconds=POLL_SECONDS)
    deadline = time.monotonic() + watch.context.timeout.total_seconds()
    while time.monotonic() < deadline:
        try:
            work.wait(poll)
            return
        except RuntimeError as exc:
            if str(exc) != _POLL_EXPIRED:  # the transfer itself failed: a lost peer is named
                lost = comm_error(watch.context, exc, what, group=group)
                if lost is None:
                    raise
                raise lost from exc
        watch.check_peers(what)
    work.wait()  # the group's own timeout ends it now
