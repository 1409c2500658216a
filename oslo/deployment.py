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
process ends, however it ends (``PR_SET_PDEATHSIG`` on Linux, and a pipe they watch). The workers are a
:class:`oslo.launch.RankGroup`, the package's one local launcher; this module adds the model's side.

Workers start with the ``forkserver`` start method (``START_METHOD``; ``"spawn"`` works too): the script
that deploys must guard its top level with ``if __name__ == "__main__":``, as every multiprocessing
program started with spawn or forkserver must, and must be a file the workers can import again (not a
script read from standard input; ``python -c`` and notebooks, which have no file, work).
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import os
import sys
import threading
from collections import UserDict
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors
from transformers.utils import ModelOutput

from oslo.launch import RankGroup

logger = logging.getLogger(__name__)

START_METHOD = "forkserver"
"""How workers start: ``"forkserver"`` (the default: one server process imports torch once and forks the
workers from it) or ``"spawn"``. Never ``"fork``": a threaded parent must not fork."""


SHARED_MEMORY_PATH = "/dev/shm"
ERROR_GRACE_SECONDS = 30.0
"""After one worker raised, how long the others may take to answer before the pool is shut down."""


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
# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------
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


def _start_worker(rank: int, world_size: int, cls: type, method_name: str, args: tuple,
                  kwargs: dict) -> Callable[[tuple], Any]:
    """A worker's start (run by the launcher in each worker process): build the model; returns the handler of
    the caller's commands ``(name, args, kwargs)``, which answers with global rank 0's result."""
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    model = getattr(cls, method_name)(*args, **kwargs)
    device = next(iter(model.parameters()), torch.empty(0)).device

    def handle(command: tuple) -> Any:
        name, args, kwargs = command
        if name == "__describe__":
            return dict(config=model.config, generation_config=getattr(model, "generation_config", None),
                        can_generate=model.can_generate(), training=model.training,
                        class_name=type(model).__name__, main_input_name=getattr(model, "main_input_name",
                                                                                 "input_ids"))
        result = _run(model, name, _on_device(args, device), _on_device(kwargs, device))
        if rank != 0 or result is None:
            return None
        result = _result_for_parent(result)
        check_shared_memory(_tensor_bytes(result), f"the result of {name}()")
        return result

    return handle


def _run(model, name: str, args: tuple, kwargs: dict) -> Any:
    if name in ("__call__", "forward"):
        with torch.no_grad():  # inference: the caller cannot backpropagate into the workers
            return model(*args, **kwargs)
    if name == "generate":
        return model.generate(*args, **kwargs)
    if name in ("eval", "train", "fuse"):
        getattr(model, name)(*args, **kwargs)
        return model.training
    if name == "resize_token_embeddings":  # the embeddings are the workers' module: the caller gets the new config
        model.resize_token_embeddings(*args, **kwargs)
        return model.config
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
class DeployedModel:
    """A model running in worker processes (made by ``from_pretrained_with_parallel(..., deployment=True)``).

    It behaves like the model: ``model(...)``/``forward``, ``generate``, ``fuse``, ``eval``/``train``,
    ``config``, ``generation_config``, ``save_pretrained_with_parallel``, ``save_pretrained``, ``can_generate``,
    ``resize_token_embeddings``; any
    other method or attribute is looked up on the workers' model. Calls run without gradients and return global rank 0's
    result, tensors in ordinary CPU memory (KV caches stay in the workers: ``cache`` is ``None``).
    Calls from several threads run one after the other.

    ``close()`` (or leaving a ``with`` block, or the end of the interpreter) stops the workers.
    """

    def __init__(self, cls: type, method_name: str, args: tuple, kwargs: dict, world_size: int) -> None:
        if START_METHOD == "forkserver":  # the server imports once what every worker needs
            mp.get_context(START_METHOD).set_forkserver_preload(["oslo.deployment", "oslo.models"])
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        self._lock = threading.Lock()
        self.world_size = world_size
        threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else \
            max(1, (os.cpu_count() or 1) // world_size)
        self._workers = RankGroup(
            _start_worker, world_size, cls, method_name, _to_shared(tuple(args)), _to_shared(dict(kwargs)),
            start_method=START_METHOD, threads=threads, loopback=True, die_with_parent=True,
            error_grace=ERROR_GRACE_SECONDS, label="deployment worker rank",
            start_hint=("A script that deploys a model must create it under `if __name__ == \"__main__\":` "
                        f"(workers start with the {START_METHOD} method and import the main module); the "
                        "worker's own error is printed on stderr above."))
        try:
            info = self._workers.call(("__describe__", (), {}))[0]
        except BaseException:
            self.close()
            raise
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
        return self._workers.pids

    def _command(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``name(*args, **kwargs)`` on every worker; global rank 0's result."""
        check_shared_memory(_tensor_bytes((args, kwargs)), f"the inputs of {name}()")
        with self._lock:
            if self.closed:
                raise RuntimeError("this deployed model was closed: deploy it again to use it.")
            result = self._workers.call((name, _to_shared(args), _to_shared(kwargs)))[0]
        return _to_ordinary(result)

    def close(self) -> None:
        """Stop the workers and release their shared memory. Calls afterwards raise."""
        workers = self.__dict__.get("_workers")
        if workers is not None:
            workers.close()

    @property
    def closed(self) -> bool:
        workers = self.__dict__.get("_workers")
        return workers is None or workers.closed

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

    def save_pretrained(self, save_directory, **kwargs: Any) -> None:
        """transformers' ``save_pretrained``, from this one process: every worker takes part (the model's
        ``save_pretrained`` with ``is_main_process``), and a plain transformers checkpoint is written."""
        kwargs.setdefault("is_main_process", True)
        self._command("save_pretrained", os.path.abspath(save_directory), **kwargs)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> None:
        """The model's ``resize_token_embeddings`` on every worker; ``config`` follows. Returns ``None``: the
        embeddings are the workers' module, which cannot be handed to the caller."""
        self.config = self._command("resize_token_embeddings", new_num_tokens, pad_to_multiple_of, mean_resizing)

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
        state = "closed" if self.closed else f"workers {self.worker_pids}"
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
