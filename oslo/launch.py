"""The one local launcher: ranks on this machine with the environment ``torchrun`` gives them.

Every rank is a process that starts with the launcher's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a ``MASTER_PORT``), so oslo initializes torch.distributed
itself exactly as under ``torchrun``. Two ways to use them:

* :func:`run` runs ``fn(rank, world_size, *args)`` once on every rank and returns the results in rank order
  (``python -m oslo check``, the tests, the benchmarks). A rank that raises fails the run with a
  :class:`RankFailedError` that carries its traceback; the others get ``grace`` seconds (they may wait for
  it inside a collective) and are then killed, so a failure never hangs the caller.
* :class:`RankGroup` keeps its ranks alive and sends them commands (the deployment launcher, the benchmarks
  that time several layouts in turn). A rank's exception is raised by the call, as the same type, with the
  rank's traceback as a note; a rank that dies shuts the group down.

Ranks start with ``fork`` by default: ~0.1 s when this process has imported torch already, where ``spawn``
takes seconds per rank. A forked rank hangs in gloo if this process ran torch ops with its default thread
pool: keep one torch thread here (``OMP_NUM_THREADS=1``) or give ``start_method="spawn"`` /
``"forkserver"``; CUDA also needs them when this process has used it already. Where forked children could not
run a backward (torch 2.14, after this process's first backward ran compiled: :func:`forked_ranks_can_run_autograd`)
the ranks start with ``forkserver`` instead, with a warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
"""The variables a launcher sets; a rank's own replace any this process has (a plain rank has none)."""
LOST_EXIT = 17
"""The exit code of a rank that ends its own process on purpose (``lost=`` of :func:`run`)."""
CLOSE_GRACE_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1


class _FaultLogs:
    """One file per rank where Python's ``faulthandler`` writes every thread's stack when the rank dies of a fatal
    signal (SIGABRT from a C++ abort, SIGSEGV...): such a rank sends no traceback, and the launcher names where it
    was from this file. The files have no name (unlinked at creation): nothing is left behind, even when the
    launcher itself is killed; each rank gets its file's descriptor (inherited, or handed over by
    ``multiprocessing`` under spawn and forkserver) and writes where the launcher reads."""

    LIMIT = 8000  # characters of a dump kept in an error message (its start: the dying thread, innermost frame first)

    def __init__(self, world_size: int) -> None:
        self.files = []
        try:
            for _ in range(world_size):
                self.files.append(tempfile.TemporaryFile())
        except OSError:  # no writable temporary directory: the ranks run without a dump
            self.remove()
            self.files = []

    def for_rank(self, rank: int) -> _FaultFile | None:
        return _FaultFile(self.files[rank].fileno()) if self.files else None

    def read(self, rank: int) -> str:
        """The rank's dump, as a paragraph to append to an error (``""``: none)."""
        if not self.files:
            return ""
        try:
            # pread: the rank shares the file's offset (the same open file), which this read must not move
            data = os.pread(self.files[rank].fileno(), 4 * self.LIMIT, 0)
        except (OSError, ValueError):
            return ""
        text = data.decode(errors="replace").strip()
        if not text:
            return ""
        if len(text) > self.LIMIT:
            text = text[:self.LIMIT] + "\n[...]"
        return f"\nIts Python threads when it died (faulthandler):\n{text}"

    def remove(self) -> None:
        for file in self.files:
            with contextlib.suppress(OSError):
                file.close()


class _FaultFile:
    """A rank's fault file as a descriptor: pickled (spawn, forkserver) as a duplicate handed to the child."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _FaultFile._received, (DupFd(self.fd),)

    @staticmethod
    def _received(duplicate) -> _FaultFile:
        return _FaultFile(duplicate.detach())


_fault_file: _FaultFile | None = None  # in a rank: the file faulthandler writes to (open for the process's life)


def _log_faults(file: _FaultFile | None) -> None:
    global _fault_file
    if file is None:
        return
    with contextlib.suppress(OSError, ValueError):
        faulthandler.enable(file.fd, all_threads=True)
        _fault_file = file


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (another process may take it before you do)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankFailedError(RuntimeError):
    """A rank failed: ``rank``, its traceback as ``text``, and the ranks that failed after it as ``others``."""

    def __init__(self, rank: int, text: str, others: Collection[int] = ()) -> None:
        self.rank, self.text, self.others = rank, text, sorted(others)
        later = f" (then ranks {self.others} failed too)" if self.others else ""
        super().__init__(f"rank {rank} failed{later}:\n{text}")


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, in words (``"was killed by signal SIGKILL"``)."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


# ---------------------------------------------------------------------------------------------
# Starting ranks
# ---------------------------------------------------------------------------------------------
def _forget_inherited_forkserver() -> None:
    """In a child forked from a process that had started multiprocessing's fork server, forget that server: it is
    not this process's child, so the next ``forkserver`` start's ``ensure_running`` would fail (``waitpid``: no
    child processes) instead of starting the child's own. Registered with ``os.register_at_fork``."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if getattr(server, "_forkserver_pid", None) is None:
        return
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)  # the parent's server exits when its own processes let go of it
    server._forkserver_pid = None
    server._forkserver_address = None
    server._forkserver_alive_fd = None


os.register_at_fork(after_in_child=_forget_inherited_forkserver)


def _die_with_parent(lifeline: Connection, set_pdeathsig: bool) -> None:
    """End this process when the launching process ends, even by SIGKILL."""
    if set_pdeathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch():
        # Only the launching process holds the pipe's other end: EOF means it is gone.
        with contextlib.suppress(BaseException):
            while True:
                lifeline.recv()
        os._exit(1)

    threading.Thread(target=watch, name="oslo-launch-lifeline", daemon=True).start()


def _host_store(listener: socket.socket, port: int, world_size: int):
    """Rank 0's rendezvous store on the socket the launcher bound to loopback: the ``env://`` rendezvous of
    ``init_process_group`` reuses it (it makes its store ``multi_tenant``), so the store does not listen on
    every interface as one it creates itself would."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False, multi_tenant=True,
                    master_listen_fd=listener.detach())


def _renew_thread_pool() -> None:
    """In a forked rank, before any thread starts: let torch replace the thread pool it inherited (its threads did
    not survive the fork) now. torch replaces it at the first ``set_num_threads`` after a fork, which every new
    native thread calls (gloo's workers, two per process group, start together): two at once could read the pool
    while it is being replaced and abort the process ("pool INTERNAL ASSERT FAILED ... Invalid thread pool!",
    SIGABRT; seen under torch 2.11 and 2.13)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            torch.set_num_threads(torch.get_num_threads())


def _bootstrap(target: Callable[..., int | None], rank: int, world_size: int, port: int | None,
               listener: socket.socket | None, environment: dict[str, str], threads: int | None,
               lifeline: tuple | None, fault_file: _FaultFile | None, conn: Connection, args: tuple) -> None:
    """A rank's process: the launcher's environment, then ``target(rank, world_size, conn, *args)``, then
    ``os._exit`` with its return value (interpreter teardown could wait on gloo forever)."""
    _log_faults(fault_file)
    _renew_thread_pool()
    if lifeline is not None:
        reader, writer, set_pdeathsig = lifeline
        if writer is not None:
            writer.close()  # forked: this process's copy of the launcher's end would hide the launcher's end
        _die_with_parent(reader, set_pdeathsig)
    store = _host_store(listener, port, world_size) if listener is not None else None  # noqa: F841 - kept alive
    os.environ.clear()
    os.environ.update(environment)
    if port is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if listener is not None and "GLOO_SOCKET_IFNAME" not in environment and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo listens on loopback only
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    code = 1
    try:
        code = target(rank, world_size, conn, *args) or 0
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        # multiprocessing's own clean-up (the temporary directory of the socket that handed tensors over)
        with contextlib.suppress(Exception):
            mp.util._run_finalizers()
        os._exit(code)


_autograd_survives_fork: bool | None = None  # measured once torch is imported (see below)


def _one_plain_backward(torch) -> None:
    """A CPU backward of one element, whatever grad mode the caller is in (``no_grad``, ``inference_mode``)."""
    with torch.inference_mode(False), torch.enable_grad():
        torch.ones(1, requires_grad=True).sum().backward()


def prime_autograd_for_fork() -> None:
    """Run one plain CPU backward in this process, so that a later compiled one cannot make forked children unable
    to run autograd (see :func:`forked_ranks_can_run_autograd`). Free when a backward has run already."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    with contextlib.suppress(Exception):
        _one_plain_backward(torch)


def forked_ranks_can_run_autograd() -> bool:
    """Whether a child forked from this process can run a backward.

    Measured under torch 2.14: in a process whose *first* backward runs under ``FakeTensorMode`` (a
    ``torch.compile``'d training step, ``torch.library.opcheck``), every later forked child's backward raises
    "Unable to handle autograd's threading in combination with fork-based multiprocessing"; after one plain CPU
    backward first, it does not (torch 2.13: never). So this runs that plain backward (a no-op for the answer when
    one ran already), then forks one child that tries a backward (~40 ms). Either answer stays true for the process's
    life (autograd sets its threads up once), so it is measured once: the first time it is asked with torch imported."""
    global _autograd_survives_fork
    torch = sys.modules.get("torch")
    if torch is None:
        return True  # the ranks import torch themselves: nothing inherited
    if _autograd_survives_fork is None:
        prime_autograd_for_fork()
        pid = os.fork()
        if pid == 0:  # the child: one backward, then out without any clean-up of the parent's state
            code = 1
            with contextlib.suppress(BaseException):
                _one_plain_backward(torch)  # a launch from inside no_grad must not read as a refusal
                code = 0
            os._exit(code)
        deadline = time.monotonic() + 30.0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if not done:  # a child that hangs is no better than one that fails
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        _autograd_survives_fork = os.waitstatus_to_exitcode(status) == 0
    return _autograd_survives_fork


def _start(target: Callable[..., int | None], world_size: int, args: tuple, *, start_method: str,
           threads: int | None, launcher_variables: bool, loopback: bool, die_with_parent: bool, name: str,
           duplex: bool, daemon: bool) -> tuple[list, list[Connection], Connection | None, _FaultLogs]:
    """Start ``world_size`` processes running ``target(rank, world_size, conn, *args)``; returns (processes,
    this side's connections, the lifeline's end this process keeps or ``None``, the ranks' fault logs)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if start_method == "fork" and not forked_ranks_can_run_autograd():
        warnings.warn(
            "oslo.launch: a process forked from this one cannot run a backward (this process's first backward ran "
            "compiled, or under FakeTensorMode, and torch then refuses autograd in forked children): the ranks "
            "start with 'forkserver' instead (slower; what they run must be picklable). Run one plain backward "
            "before the first compiled one (oslo.launch.prime_autograd_for_fork()) to keep 'fork'.",
            RuntimeWarning, stacklevel=3)
        start_method = "forkserver"
    ctx = mp.get_context(start_method)
    environment = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    listener = None
    if not launcher_variables:
        port = None
    elif loopback:
        # Bound here, to loopback, and handed to rank 0's store: no other process can take the port meanwhile.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
    else:
        port = free_port()
    lifeline_reader, lifeline = ctx.Pipe(duplex=False) if die_with_parent else (None, None)
    # PDEATHSIG fires when the *thread* that started the process ends: only the main thread's ranks use it
    # (the lifeline pipe covers the others); under forkserver the server is the parent.
    pdeathsig = start_method == "forkserver" or threading.current_thread() is threading.main_thread()
    sys.stdout.flush()  # a forked rank would print this process's buffered output again
    sys.stderr.flush()
    processes, connections = [], []
    faults = _FaultLogs(world_size)
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=duplex)  # not duplex: (reader, writer), the rank writes
            rank_lifeline = None if lifeline is None else \
                (lifeline_reader, lifeline if start_method == "fork" else None, pdeathsig)
            process = ctx.Process(
                target=_bootstrap, name=f"{name}-{rank}", daemon=daemon,
                args=(target, rank, world_size, port, listener if rank == 0 else None, environment, threads,
                      rank_lifeline, faults.for_rank(rank), child_conn, args))
            process.start()
            child_conn.close()
            processes.append(process)
            connections.append(parent_conn)
    except BaseException:
        _shutdown(processes, connections, lifeline, faults)
        raise
    finally:
        if lifeline_reader is not None:
            lifeline_reader.close()
        if listener is not None:
            listener.close()
    return processes, connections, lifeline, faults


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=CLOSE_GRACE_SECONDS)


def _shutdown(processes: list, connections: list, lifeline: Connection | None, faults: _FaultLogs) -> None:
    """Ask the ranks to stop (``None`` on their pipe), end those that do not; close every pipe."""
    for conn in connections:
        with contextlib.suppress(Exception):
            conn.send(None)
    deadline = time.monotonic() + CLOSE_GRACE_SECONDS
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    _kill(processes)
    for conn in [*connections, lifeline]:
        with contextlib.suppress(Exception):
            conn.close()
    faults.remove()


# ---------------------------------------------------------------------------------------------
# run(): every rank once, results in rank order
# ---------------------------------------------------------------------------------------------
_to_launcher: Connection | None = None  # in a rank started by run(): its pipe to the launcher


def report(value: Any) -> None:
    """In a rank started by :func:`run`: hand ``value`` to the launcher's ``on_message(rank, value)`` now
    (a progress line, a moment to act on), before the rank's result."""
    if _to_launcher is None:
        raise RuntimeError("oslo.launch.report() is for a rank started by oslo.launch.run()")
    _to_launcher.send_bytes(pickle.dumps(("message", value)))


def _portable(value: Any) -> Any:
    """A result as it can travel: tensors detached, a DTensor as its local tensor (it cannot travel without
    its process group)."""
    if "torch" not in sys.modules:
        return value
    import torch
    from torch.utils._pytree import tree_map

    def plain(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        from torch.distributed.tensor import DTensor

        return (leaf._local_tensor if isinstance(leaf, DTensor) else leaf).detach()

    return tree_map(plain, value)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


def _run_once(rank: int, world_size: int, conn: Connection, fn: Callable[..., Any], args: tuple,
              kwargs: dict) -> None:
    global _to_launcher
    _to_launcher = conn
    try:
        # Plain pickle copies tensor data into the message (no shared memory outliving this process).
        conn.send_bytes(pickle.dumps(("ok", _portable(fn(rank, world_size, *args, **kwargs)))))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the launcher
        status = "follows" if getattr(exc, "follows_another_rank", False) else "error"
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps((status, _error_text(exc))))
    finally:
        _to_launcher = None


def run(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None, *,
        timeout: float | None = None, grace: float = 5.0, lost: Collection[int] = (), start_method: str = "fork",
        threads: int | None = None, launcher_variables: bool = True,
        on_message: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    Args:
        fn: What every rank runs (picklable by reference, a module-level function, for spawn and forkserver).
        world_size: How many ranks.
        args, kwargs: ``fn``'s further arguments.
        timeout: Seconds for the whole run (``None``: no limit); ranks still running then are killed.
        grace: After a rank failed, seconds the others get to finish before they are killed.
        lost: Ranks that end their own process mid-way (``os._exit(LOST_EXIT)`` inside ``fn``, as a killed peer
            would); their result is ``None``. One of them returning, or ending otherwise, fails.
        start_method: ``"fork"`` (fast: the ranks inherit this process's imports), ``"spawn"`` or
            ``"forkserver"`` (fresh interpreters; needed for CUDA when this process has used it).
        threads: torch threads of each rank (``None``: as inherited).
        launcher_variables: ``False`` starts plain processes without the launcher's variables, as a user's
            single-process run would be.
        on_message: Called in this process as ``on_message(rank, value)`` for each :func:`report` of a rank.

    Returns:
        Each rank's result, tensors detached (a DTensor as its local tensor).

    Raises:
        RankFailedError: A rank raised or ended without a result: the first to fail, with its traceback. An error
            that only passes on another rank's failure (its class has ``follows_another_rank = True``: oslo's
            ``PeerLostError``, ``RankFailedError``, ``PipelineAbortedError``) is the cause only when no rank failed
            otherwise: a rank killed mid-collective is named, not the peer that lost it, whichever reported first.
        TimeoutError: Ranks did not finish within ``timeout``; names them.
    """
    kwargs = {} if kwargs is None else kwargs
    processes, connections, _, faults = _start(
        _run_once, world_size, (fn, tuple(args), kwargs), start_method=start_method, threads=threads,
        # The rendezvous port is bound here and handed to rank 0's store (loopback): a launch running beside this
        # one (another test, another check) cannot take it between choosing it and listening on it.
        launcher_variables=launcher_variables, loopback=True, die_with_parent=False, name="oslo-rank",
        duplex=False, daemon=False)  # not daemons: a rank may start processes of its own (a deployment)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    following: set[int] = set()  # ranks whose error passes on another rank's failure
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if failures:
                    break
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            pending = [c for r, c in enumerate(connections) if r not in results and r not in failures]
            for conn in wait(pending, timeout=None if remaining == float("inf") else remaining):
                rank = connections.index(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    processes[rank].join(timeout=5)
                    if rank in lost and processes[rank].exitcode == LOST_EXIT:
                        results[rank] = None
                        continue
                    exitcode = processes[rank].exitcode
                    how = describe_exit(exitcode) if exitcode is None or exitcode < 0 else f"exit code {exitcode}"
                    status, payload = "error", f"exited without a result ({how}){faults.read(rank)}"
                if status == "message":
                    if on_message is not None:
                        on_message(rank, payload)
                    continue
                if status == "ok" and rank in lost:
                    status, payload = "error", f"was to end its process (os._exit(LOST_EXIT)) but returned {payload!r}"
                if status in ("error", "follows"):
                    failures[rank] = payload
                    if status == "follows":
                        following.add(rank)
                    # The others may be stuck in a collective with this rank: they get `grace` s, then are killed.
                    deadline = min(deadline, time.monotonic() + grace)
                else:
                    results[rank] = payload
        if failures:
            # The first failure to arrive that is not only another's passed on is the cause.
            rank = next((r for r in failures if r not in following), next(iter(failures)))
            raise RankFailedError(rank, failures[rank], set(failures) - {rank})
    finally:
        _kill(processes)
        for conn in connections:
            conn.close()
        faults.remove()
    return [results[rank] for rank in range(world_size)]


# ---------------------------------------------------------------------------------------------
# RankGroup: long-lived ranks that answer commands
# ---------------------------------------------------------------------------------------------
def _error_reply(exc: BaseException) -> tuple:
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
        return ("error", exc, text)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
        return ("error", None, text)


def _serve(rank: int, world_size: int, conn: Connection, setup: Callable[..., Callable[[Any], Any]],
           args: tuple) -> int:
    try:
        handle = setup(rank, world_size, *args)
        conn.send(("ok", None))
    except BaseException as exc:  # noqa: BLE001 - everything reaches the launcher
        with contextlib.suppress(OSError):
            conn.send(_error_reply(exc))
        return 1
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            break
        if command is None:
            break
        try:
            conn.send(("ok", handle(command)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(_error_reply(exc))
    return 0


class RankGroup:
    """Long-lived ranks that keep their state between commands.

    ``setup(rank, world_size, *args)`` runs once in each rank and returns ``handle(command)``; :meth:`call`
    sends a command to every rank and returns their answers in rank order. A rank's exception is raised by
    the call (its own type when it pickles, else :class:`RankFailedError`) with its traceback as a note; when
    every rank answered, the group stays usable; when the others do not answer within ``error_grace`` s, or a
    rank dies, or a call is interrupted (their answers would answer the next command), the group is shut down
    and the call raises. ``close()``, leaving a ``with`` block, garbage collection or the end of the
    interpreter stops the ranks.

    Args:
        setup: Run once per rank; returns the rank's command handler (picklable by reference for spawn and
            forkserver; the handler never leaves its rank).
        world_size, args: How many ranks; ``setup``'s further arguments.
        start_method, threads, launcher_variables: As for :func:`run`.
        loopback: The rendezvous store (on a port bound in this process and handed to rank 0, so no other
            process takes it) and gloo listen on loopback only.
        die_with_parent: The ranks exit when this process ends, even by SIGKILL (``PR_SET_PDEATHSIG`` on Linux,
            and a pipe they watch).
        timeout: Seconds a command (and the start) may take before the group is shut down (``None``: no limit).
        error_grace: After a rank raised, seconds the others get to answer before the group is shut down.
        label: How errors name a rank (``"rank"``: ``"rank 1 (pid 123) was killed by signal SIGKILL"``).
        start_hint: Added to the error when a rank exits with code 1 while starting (its own error went to
            stderr: typically a spawned rank that could not import the main module).
    """

    def __init__(self, setup: Callable[..., Callable[[Any], Any]], world_size: int, *args: Any,
                 start_method: str = "fork", threads: int | None = None, launcher_variables: bool = True,
                 loopback: bool = False, die_with_parent: bool = False, timeout: float | None = None,
                 error_grace: float = 30.0, label: str = "rank", start_hint: str = "") -> None:
        self.world_size = world_size
        self.timeout, self.error_grace, self.label, self.start_hint = timeout, error_grace, label, start_hint
        self._closed = False
        self._processes, self._connections, self._lifeline, self._faults = _start(
            _serve, world_size, (setup, args), start_method=start_method, threads=threads,
            launcher_variables=launcher_variables, loopback=loopback, die_with_parent=die_with_parent,
            name=f"oslo-{label.replace(' ', '-')}", duplex=True, daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown, self._processes, self._connections, self._lifeline,
                                           self._faults)
        self._gather(startup=True)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank."""
        return [process.pid for process in self._processes]

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, command: Any) -> list[Any]:
        """``handle(command)`` on every rank; their answers in rank order (``command`` must not be ``None``)."""
        if self._closed:
            raise RuntimeError(f"this group of ranks was closed: start a new one ({self.label}s {self.pids}).")
        for rank, conn in enumerate(self._connections):
            try:
                conn.send(command)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self._lost(rank, startup=False)
        return self._gather()

    def close(self) -> None:
        """Stop the ranks. Calls afterwards raise."""
        self._closed = True
        self._finalizer()

    def kill(self) -> None:
        """End the ranks at once (they may wait for a dead peer inside a collective, where no command reaches
        them) and close the group."""
        _kill(self._processes)
        self.close()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _lost(self, rank: int, startup: bool) -> None:
        process = self._processes[rank]
        process.join(timeout=1.0)
        exitcode = process.exitcode
        dump = self._faults.read(rank)  # before kill(): closing the group closes the file
        self.kill()
        hint = f" {self.start_hint}" if startup and exitcode == 1 and self.start_hint else ""
        raise RuntimeError(f"{self.label} {rank} (pid {process.pid}) {describe_exit(exitcode)}"
                           f"{' while starting' if startup else ''}; the others were shut down.{hint}{dump}")

    def _raise(self, rank: int, exc: BaseException | None, text: str, closed: bool = False) -> None:
        note = f"raised in {self.label} {rank}:\n{text}"
        if closed:
            note += "\nThe other ranks did not answer in time: they were shut down."
        if exc is None:
            raise RankFailedError(rank, text)
        exc.add_note(note)
        raise exc

    def _gather(self, startup: bool = False) -> list[Any]:
        """Every rank's answer to the last command (rank order); raises the first error."""
        completed = False
        try:
            replies, error = self._collect(startup)
            completed = True
        finally:
            if not completed and not self._closed:
                self.kill()
        if error is not None:  # every rank answered: they are in step, the group stays usable
            self._raise(*error)
        return replies

    def _collect(self, startup: bool) -> tuple[list[Any], tuple | None]:
        replies: dict[int, Any] = {}
        error: tuple | None = None
        limit = float("inf") if self.timeout is None else time.monotonic() + self.timeout
        deadline = limit
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        connections = {conn: rank for rank, conn in enumerate(self._connections)}
        while len(replies) < self.world_size:
            waiting = [c for c, r in connections.items() if r not in replies]
            waiting += [s for s, r in sentinels.items() if r not in replies]
            timeout = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
            ready = wait(waiting, timeout=timeout)
            if not ready:
                self.kill()
                if error is not None:  # a rank raised and the others did not answer: they are out of step
                    self._raise(*error, closed=True)
                missing = sorted(set(range(self.world_size)) - set(replies))
                raise TimeoutError(f"{self.label}s {missing} did not answer within {self.timeout:.0f} s; the group "
                                   "was shut down.")
            for handle in sorted(ready, key=lambda h: h in sentinels):  # answers before deaths
                rank = connections.get(handle, sentinels.get(handle))
                if rank in replies:
                    continue
                if handle in connections:
                    try:
                        reply = handle.recv()
                    except (EOFError, OSError):
                        reply = None
                    if reply is not None:
                        if reply[0] == "error":
                            replies[rank] = None
                            if error is None:
                                error = (rank, reply[1], reply[2])
                                if startup:  # nothing to keep: fail at once
                                    self.kill()
                                    self._raise(*error)
                                deadline = min(limit, time.monotonic() + self.error_grace)
                        else:
                            replies[rank] = reply[1]
                        continue
                self._lost(rank, startup)
        return [replies[rank] for rank in range(self.world_size)], error
