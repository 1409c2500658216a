"""The deployment launcher: a model split over worker processes, driven from a plain ``python`` process.

``GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2, pipeline_parallel_size=2,
deployment=True)`` calls :func:`deploy`, which starts ``tensor_parallel_size * pipeline_parallel_size``
worker processes on this machine (gloo on CPU, NCCL with one device per worker on CUDA). Each worker sets
the variables a launcher would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free
``MASTER_PORT``) and calls the ordinary ``from_pretrained_with_parallel``, so it loads only its own shard.
The caller gets a :class:`DeployedModel`: it holds no weights, sends every call (method name, arguments)
to all workers at once over a pipe, and returns global rank 0's result (every rank returns the output at
inference, the pipeline's included).

Tensors travel through shared memory (``torch.multiprocessing``'s ``file_descriptor`` strategy: a segment
is unlinked as soon as it is created, so nothing is left in ``/dev/shm`` whatever happens to a process).
Calls are serialized by a lock, so a threaded web server can share one model. A worker that raises hands
its exception (with its traceback as a note) to the caller and the workers stay usable; a worker that
dies makes the caller raise a ``RuntimeError`` and the others are shut down. Workers end when the caller's
process ends, however it ends (``PR_SET_PDEATHSIG`` on Linux, and a pipe they watch).

Workers start with the ``forkserver`` start method (``START_METHOD``; ``"spawn"`` works too): the script
that deploys must guard its top level with ``if __name__ == "__main__":``, as every multiprocessing
program started with spawn or forkserver must, and must be a file the workers can import again (not a
script read from standard input; ``python -c`` and notebooks, which have no file, work).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import UserDict
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors
from transformers.utils import ModelOutput

logger = logging.getLogger(__name__)

START_METHOD = "forkserver"
"""How workers start: ``"forkserver"`` (the default: one server process imports torch once and forks the
workers from it) or ``"spawn"``. Never ``"fork``": a threaded parent must not fork."""


def _forget_inherited_forkserver() -> None:
    """In a child forked from a process that had started multiprocessing's fork server, forget that server: it is
    not this process's child, so the next deployment's ``ensure_running`` would fail (``waitpid``: no child
    processes) instead of starting the child's own. Registered with ``os.register_at_fork``."""
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


SHARED_MEMORY_PATH = "/dev/shm"
ERROR_GRACE_SECONDS = 30.0
"""After one worker raised, how long the others may take to answer before the pool is shut down."""
CLOSE_GRACE_SECONDS = 5.0
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
_PR_SET_PDEATHSIG = 1


class SharedMemoryTooSmallError(RuntimeError):
    """The tensors of a call do not fit in the free space of ``/dev/shm``."""


def shm_free_bytes() -> int | None:
    """Free bytes of the shared-memory file system (``/dev/shm``), or ``None`` where there is none.

    Module-level so that a test can report a small ``/dev/shm`` (as a default Docker container's 64 MB).
    """
    try:
        stats = os.statvfs(SHARED_MEMORY_PATH)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


# ---------------------------------------------------------------------------------------------
# Moving values: tensors to shared memory, results to ordinary memory
# ---------------------------------------------------------------------------------------------
def _map_values(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every leaf of nested dicts, lists, tuples and ModelOutputs."""
    if isinstance(value, ModelOutput):
        fields = {key: _map_values(item, fn) for key, item in value.items()}
        return type(value)(**{key: item for key, item in fields.items() if item is not None})
    if isinstance(value, (dict, UserDict)):
        mapped = {key: _map_values(item, fn) for key, item in value.items()}
        return type(value)(mapped) if type(value) is dict or isinstance(value, UserDict) else mapped
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map_values(item, fn) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_values(item, fn) for item in value)
    return fn(value)


def _tensor_bytes(value: Any) -> int:
    total = 0

    def count(leaf):
        nonlocal total
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
        return leaf

    _map_values(value, count)
    return total


def check_shared_memory(nbytes: int, what: str) -> None:
    """Raise :class:`SharedMemoryTooSmallError` when ``nbytes`` do not fit in ``/dev/shm``'s free space."""
    free = shm_free_bytes()
    if free is None or nbytes <= free:
        return
    raise SharedMemoryTooSmallError(
        f"{what} needs {nbytes / 2**20:.1f} MiB of shared memory but {SHARED_MEMORY_PATH} has "
        f"{free / 2**20:.1f} MiB free. The deployment launcher passes tensors between processes through shared "
        "memory; in a Docker container (64 MB of /dev/shm by default) start it with a larger one, e.g. "
        "`docker run --shm-size=8gb ...`, or share the host's with `docker run --ipc=host ...`."
    )


def _to_shared(value: Any) -> Any:
    """Tensors copied once into fresh shared memory (the caller's tensors stay as they were)."""

    def share(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.detach()
        shared = torch.empty(leaf.shape, dtype=leaf.dtype).share_memory_()
        shared.copy_(leaf)
        return shared

    return _map_values(value, share)


def _to_ordinary(value: Any) -> Any:
    """Received tensors copied out of the shared segments into ordinary CPU memory."""
    return _map_values(value, lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf)


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------
def _die_with_parent(lifeline, set_pdeathsig: bool) -> None:
    """End this process when the deploying process ends, even by SIGKILL."""
    if set_pdeathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch():
        # Only the deploying process holds the pipe's other end: EOF means it is gone.
        with contextlib.suppress(BaseException):
            while True:
                lifeline.recv()
        os._exit(1)

    threading.Thread(target=watch, name="oslo-deployment-lifeline", daemon=True).start()


def _on_device(value: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return value
    return _map_values(value, lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf)


def _result_for_parent(value: Any) -> Any:
    """A result as it can travel: tensors detached on the CPU, KV caches left out (each rank caches only its
    own heads and stage; the cache stays with the workers)."""
    from transformers.cache_utils import Cache

    def convert(leaf):
        if isinstance(leaf, Cache):
            return None
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().cpu()
        return leaf

    return _map_values(value, convert)


def _error_message(exc: BaseException) -> tuple:
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
        return ("error", exc, text)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
        return ("error", None, text)


def _host_store(listener: socket.socket, port: int, world_size: int):
    """Rank 0's rendezvous store on the socket the caller bound to loopback: the ``env://`` rendezvous of
    ``init_process_group`` reuses it (it makes its store ``multi_tenant``), so the store does not listen on
    every interface as one it creates itself would."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False, multi_tenant=True,
                    master_listen_fd=listener.detach())


def _worker(rank: int, world_size: int, port: int, listener: socket.socket | None, cls: type, method_name: str,
            args: tuple, kwargs: dict, conn, lifeline, env: dict, threads: int, set_pdeathsig: bool) -> None:
    _die_with_parent(lifeline, set_pdeathsig)
    store = _host_store(listener, port, world_size) if listener is not None else None  # noqa: F841 - kept alive
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo listens on loopback only
    torch.set_num_threads(threads)
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    try:
        model = getattr(cls, method_name)(*args, **kwargs)
        device = next(iter(model.parameters()), torch.empty(0)).device
        info = None
        if rank == 0:
            info = dict(config=model.config, generation_config=getattr(model, "generation_config", None),
                        can_generate=model.can_generate(), training=model.training, class_name=type(model).__name__,
                        main_input_name=getattr(model, "main_input_name", "input_ids"))
        conn.send(("ready", info))
    except BaseException as exc:  # noqa: BLE001 - everything reaches the parent
        conn.send(_error_message(exc))
        os._exit(1)
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            break
        if command[0] == "close":
            break
        _, name, args, kwargs = command
        try:
            result = _run(model, name, _on_device(args, device), _on_device(kwargs, device))
            if rank != 0:
                result = None
            if result is not None:
                result = _result_for_parent(result)
                check_shared_memory(_tensor_bytes(result), f"the result of {name}()")
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001
            conn.send(_error_message(exc))
    # os._exit skips interpreter teardown (which could wait on gloo); multiprocessing's own clean-up (the
    # temporary directory of the socket that handed result tensors over) still runs.
    with contextlib.suppress(Exception):
        mp.util._run_finalizers()
    os._exit(0)


def _run(model, name: str, args: tuple, kwargs: dict) -> Any:
    if name in ("__call__", "forward"):
        with torch.no_grad():  # inference: the caller cannot backpropagate into the workers
            return model(*args, **kwargs)
    if name == "generate":
        return model.generate(*args, **kwargs)
    if name in ("eval", "train", "fuse"):
        getattr(model, name)(*args, **kwargs)
        return model.training
    if name == "__getattr__":
        value = getattr(model, args[0])
        if callable(value):
            return ("callable", None)
        if isinstance(value, torch.nn.Module):
            raise TypeError(f"{args[0]} is a module of the workers' model: it cannot be handed to the caller.")
        return ("value", value)
    if name == "__setattr__":
        setattr(model, args[0], args[1])
        return None
    return getattr(model, name)(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# The caller's side
# ---------------------------------------------------------------------------------------------
def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _shutdown(processes: list, connections: list, lifeline) -> None:
    """Ask the workers to stop, then end those that do not; close every pipe."""
    for conn in connections:
        with contextlib.suppress(Exception):
            conn.send(("close",))
    deadline = time.monotonic() + CLOSE_GRACE_SECONDS
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=CLOSE_GRACE_SECONDS)
    for conn in [*connections, lifeline]:
        with contextlib.suppress(Exception):
            conn.close()


def _raise_worker_error(rank: int, exc: BaseException | None, text: str, closed: bool = False) -> None:
    note = f"raised in deployment worker rank {rank}:\n{text}"
    if closed:
        note += "\nThe other workers did not answer in time: the deployment was shut down."
    if exc is None:
        raise RuntimeError(f"deployment worker rank {rank} failed:\n{text}")
    exc.add_note(note)
    raise exc


class DeployedModel:
    """A model running in worker processes (made by ``from_pretrained_with_parallel(..., deployment=True)``).

    It behaves like the model: ``model(...)``/``forward``, ``generate``, ``fuse``, ``eval``/``train``,
    ``config``, ``generation_config``, ``save_pretrained_with_parallel``, ``can_generate``; any other method
    or attribute is looked up on the workers' model. Calls run without gradients and return global rank 0's
    result, tensors in ordinary CPU memory (KV caches stay in the workers: ``past_key_values`` is ``None``).
    Calls from several threads run one after the other.

    ``close()`` (or leaving a ``with`` block, or the end of the interpreter) stops the workers.
    """

    def __init__(self, cls: type, method_name: str, args: tuple, kwargs: dict, world_size: int) -> None:
        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(["oslo.deployment", "oslo.models"])  # what every worker imports
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        self._lock = threading.Lock()
        self._closed = False
        self.world_size = world_size
        # Bound here, to loopback, and handed to rank 0's store: no other process can take the port meanwhile.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        env = {name: value for name, value in os.environ.items() if name not in _LAUNCHER_VARIABLES}
        threads = int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit() else \
            max(1, (os.cpu_count() or 1) // world_size)
        # Under spawn the worker's parent is this thread: PDEATHSIG fires when the thread ends, so only the
        # main thread's workers use it (the lifeline pipe covers the others).
        pdeathsig = START_METHOD == "forkserver" or threading.current_thread() is threading.main_thread()
        lifeline_reader, self._lifeline = ctx.Pipe(duplex=False)
        self._processes, self._connections = [], []
        args, kwargs = _to_shared(args), _to_shared(kwargs)
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe()
                process = ctx.Process(
                    target=_worker, name=f"oslo-deployment-{rank}", daemon=True,
                    args=(rank, world_size, port, listener if rank == 0 else None, cls, method_name, args, kwargs,
                          child_conn, lifeline_reader, env, threads, pdeathsig))
                process.start()
                child_conn.close()
                self._processes.append(process)
                self._connections.append(parent_conn)
        except BaseException:
            _shutdown(self._processes, self._connections, self._lifeline)
            raise
        finally:
            lifeline_reader.close()
            listener.close()
        self._finalizer = weakref.finalize(self, _shutdown, self._processes, self._connections, self._lifeline)
        try:
            replies = self._gather(startup=True)
        except BaseException:
            self.close()
            raise
        info = replies[0]
        self.config = info["config"]
        self.generation_config = info["generation_config"]
        self._sent_generation_config = self._generation_config_text()
        self._can_generate = info["can_generate"]
        self.training = info["training"]
        self.main_input_name = info["main_input_name"]
        self._class_name = info["class_name"]

    # ---- plumbing ----------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """The workers' process ids, by global rank."""
        return [process.pid for process in self._processes]

    def _gather(self, startup: bool = False) -> list[Any]:
        """Every worker's reply to the last command (rank order); raises the first error. Interrupted
        (``KeyboardInterrupt``), it shuts the workers down: their replies would answer the next command."""
        completed = False
        try:
            replies, error = self._collect_replies(startup)
            completed = True
        finally:
            if not completed and not self._closed:
                self._abort()
        if error is not None:  # every worker answered: they are in step, the model stays usable
            _raise_worker_error(*error)
        return replies

    def _collect_replies(self, startup: bool) -> tuple[list[Any], tuple | None]:
        replies: dict[int, Any] = {}
        error: tuple | None = None
        deadline = None
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        connections = {conn: rank for rank, conn in enumerate(self._connections)}
        while len(replies) < self.world_size:
            waiting = [c for c, r in connections.items() if r not in replies]
            waiting += [s for s, r in sentinels.items() if r not in replies]
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(waiting, timeout=timeout)
            if not ready:  # a worker raised and the others did not answer: they are out of step
                self._abort()
                _raise_worker_error(error[0], error[1], error[2], closed=True)
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
                                    self._abort()
                                    _raise_worker_error(*error)
                                deadline = time.monotonic() + ERROR_GRACE_SECONDS
                        else:
                            replies[rank] = reply[1]
                        continue
                process = self._processes[rank]
                process.join(timeout=1.0)
                exitcode = process.exitcode
                self._abort()
                hint = ""
                if startup and exitcode == 1:
                    hint = (" A script that deploys a model must create it under `if __name__ == \"__main__\":` "
                            f"(workers start with the {START_METHOD} method and import the main module); the "
                            "worker's own error is printed on stderr above.")
                raise RuntimeError(
                    f"deployment worker rank {rank} (pid {process.pid}) {_describe_exit(exitcode)}"
                    f"{' while starting' if startup else ''}; the other workers were shut down.{hint}"
                )
        return [replies[rank] for rank in range(self.world_size)], error

    def _command(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``name(*args, **kwargs)`` on every worker; global rank 0's result."""
        check_shared_memory(_tensor_bytes((args, kwargs)), f"the inputs of {name}()")
        with self._lock:
            if self._closed:
                raise RuntimeError("this deployed model was closed: deploy it again to use it.")
            args, kwargs = _to_shared(args), _to_shared(kwargs)
            for rank, conn in enumerate(self._connections):
                try:
                    conn.send(("call", name, args, kwargs))
                except (BrokenPipeError, ConnectionResetError, EOFError):
                    process = self._processes[rank]
                    process.join(timeout=1.0)
                    exitcode = process.exitcode
                    self._abort()
                    raise RuntimeError(
                        f"deployment worker rank {rank} (pid {process.pid}) {_describe_exit(exitcode)}; "
                        "the other workers were shut down."
                    ) from None
            result = self._gather()[0]
        return _to_ordinary(result)

    def close(self) -> None:
        """Stop the workers and release their shared memory. Calls afterwards raise."""
        self._closed = True
        finalizer = self.__dict__.get("_finalizer")
        if finalizer is not None:
            finalizer()
        else:
            _shutdown(self._processes, self._connections, self._lifeline)

    def _abort(self) -> None:
        """A worker died: the others may wait for it inside a collective, where no command reaches them."""
        for process in self._processes:
            if process.is_alive():
                process.kill()
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DeployedModel:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- the model's API ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward pass (without gradients): its usual output, one output under pipelines."""
        return self._command("__call__", *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._command("forward", *args, **kwargs)

    def _generation_config_text(self) -> str | None:
        config = self.__dict__.get("generation_config")
        return None if config is None else config.to_json_string()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate()``; changes made to ``self.generation_config`` reach the workers."""
        text = self._generation_config_text()
        if text != self._sent_generation_config:
            self._command("__setattr__", "generation_config", self.generation_config)
            self._sent_generation_config = text
        return self._command("generate", *args, **kwargs)

    def can_generate(self) -> bool:
        return self._can_generate

    def fuse(self, modules=None) -> DeployedModel:
        """Fuse kernels in every worker (see the model's ``fuse``)."""
        self._command("fuse", modules)
        return self

    def eval(self) -> DeployedModel:
        self.training = self._command("eval")
        return self

    def train(self, mode: bool = True) -> DeployedModel:
        self.training = self._command("train", mode)
        return self

    def save_pretrained_with_parallel(self, save_directory, *args: Any, **kwargs: Any) -> None:
        """Save a split or merged checkpoint (every worker writes its part; see the model's method)."""
        # absolute: the workers kept the working directory of the deployment
        self._command("save_pretrained_with_parallel", os.path.abspath(save_directory), *args, **kwargs)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the caller's CPU (the workers move them to their devices)."""
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        kind, value = self._command("__getattr__", name)
        if kind == "callable":
            return lambda *args, **kwargs: self._command(name, *args, **kwargs)
        return value

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"workers {self.worker_pids}"
        return f"DeployedModel({self.__dict__.get('_class_name', '?')}, world_size={self.world_size}, {state})"


def _main_module_problem() -> str | None:
    """Why the workers could not import this process's main module again, or ``None`` when they can.

    A worker started with spawn or forkserver imports the parent's ``__main__`` again, by name (``python -m``)
    or from its file, before it runs anything. Without a file (``python -c``, the interactive interpreter, a
    notebook) nothing is imported; a script read from standard input has the file name ``<stdin>``, which
    the workers would fail to open."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    full = path if os.path.isabs(path) else os.path.join(mp.process.ORIGINAL_DIR or os.getcwd(), path)
    if os.path.isfile(full):
        return None
    where = "read from standard input (`python - < script.py`)" if path == "<stdin>" else \
        f"run from the file {full!r}, which no longer exists"
    return (
        f"deployment=True starts its workers with the {START_METHOD} method, and each worker imports the main "
        f"module of this process again before it runs (multiprocessing does, to find what the script defines); "
        f"this script was {where}, so it cannot be imported again: the workers would fail with "
        f"FileNotFoundError: {full!r}. Save the script to a file and run it with `python script.py`, creating the "
        "model under `if __name__ == \"__main__\":`."
    )


def deploy(cls: type, method_name: str, args: tuple, kwargs: dict) -> DeployedModel:
    """Start ``tensor_parallel_size * pipeline_parallel_size`` workers, each calling
    ``cls.<method_name>(*args, **kwargs)`` under a launcher's variables; the model that drives them.

    Args:
        cls: The oslo model class.
        method_name: ``"from_pretrained_with_parallel"`` or ``"from_config_with_parallel"``.
        args, kwargs: The method's arguments, ``deployment`` left out.

    Raises:
        ValueError: The process is already under a launcher (the model is already distributed), or the
            arguments cannot be deployed (``parallel_context=``, too few CUDA devices).
        RuntimeError: The workers could not import the main module again (a script read from standard
            input), or a worker ended while starting.
    """
    import torch.distributed as dist

    from oslo.parallel.context import validate_parallel_size

    if "RANK" in os.environ or "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{cls.__name__}.{method_name}(..., deployment=True) was called in a process started by a distributed "
            "launcher (RANK/WORLD_SIZE are set or torch.distributed is initialized): the model is already "
            "distributed over the launcher's processes. Drop deployment=True, or run the script with plain "
            "`python script.py` to let the deployment launcher start the processes."
        )
    if START_METHOD not in ("spawn", "forkserver"):
        raise ValueError(f"oslo.deployment.START_METHOD must be 'spawn' or 'forkserver', got {START_METHOD!r}.")
    arguments = inspect.signature(getattr(cls, method_name)).bind(*args, **kwargs).arguments
    if arguments.get("parallel_context") is not None:
        raise ValueError("parallel_context= cannot be used with deployment=True: the workers build their own.")
    tp = validate_parallel_size("tensor_parallel_size", arguments.get("tensor_parallel_size", 1))
    pp = validate_parallel_size("pipeline_parallel_size", arguments.get("pipeline_parallel_size", 1))
    world_size = tp * pp
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"deployment=True with tensor_parallel_size={tp} and pipeline_parallel_size={pp} needs {world_size} "
            f"CUDA devices (one per worker), but {torch.cuda.device_count()} are visible."
        )
    problem = _main_module_problem()
    if problem is not None:
        raise RuntimeError(problem)
    return DeployedModel(cls, method_name, tuple(args), dict(kwargs), world_size)
