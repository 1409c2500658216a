"""The parallel context: sizes, ranks and process groups of one parallelized model.

Ranks form a grid ``arange(world_size).view(data, pipeline, tensor)``: tensor-parallel peers are
neighbours (fastest-varying), then pipeline stages, then data-parallel replicas. This is the only
module that reads the launcher's environment.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from oslo.parallel.errors import naming_timeouts
from oslo.parallel.random import ParallelRNG

logger = logging.getLogger(__name__)

_LAUNCH_HINT = (
    "Launch one process per rank with `torchrun --nproc_per_node={n} your_script.py` "
    "(or `deepspeed --num_gpus={n} your_script.py`)"
)


def validate_virtual_pipeline_size(value: object, pipeline_parallel_size: int) -> int:
    """``virtual_pipeline_size``, checked: a positive integer, above 1 only with several pipeline stages."""
    value = validate_parallel_size("virtual_pipeline_size", value)
    if value > 1 and pipeline_parallel_size == 1:
        raise ValueError(
            f"virtual_pipeline_size={value} needs pipeline_parallel_size > 1 (got 1): it cuts each pipeline stage "
            "into chunks. Use virtual_pipeline_size=1, or pipeline_parallel_size >= 2."
        )
    return value


def validate_parallel_size(name: str, value: object) -> int:
    """Check that a parallel size given by a user is a positive integer and return it.

    Raises:
        TypeError: ``value`` is not an integer (``bool`` included).
        ValueError: ``value`` is smaller than 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be a positive integer, got {value!r} of type {type(value).__name__}. "
            f"Pass an int such as {name}=2."
        )
    if value < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {value}. Pass e.g. {name}=1.")
    return value


def _launcher_world_size() -> int | None:
    """World size announced by torchrun/deepspeed, or None when no launcher set one."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _ranks_text(ranks: list[int]) -> str:
    """``[0-3, 8]``: ranks, runs of consecutive ones shortened."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "[" + ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) + "]"


def _differing(name: str, values: list, first_rank: int = 0) -> str:
    """``"tensor_parallel_size=2 on ranks [0], tensor_parallel_size=1 on ranks [1]"`` when ``values`` (one per
    rank, from ``first_rank`` on) are not all equal, else ``""``."""
    ranks_of: dict = {}
    for rank, value in enumerate(values, start=first_rank):
        ranks_of.setdefault(value, []).append(rank)
    if len(ranks_of) == 1:
        return ""
    return ", ".join(f"{name}={value} on ranks {_ranks_text(ranks)}" for value, ranks in ranks_of.items())


DEFAULT_TIMEOUT = timedelta(minutes=10)


def validate_timeout(timeout: object) -> timedelta:
    """A collective timeout given by a user (a ``timedelta`` or seconds), as a positive ``timedelta``.

    Raises:
        TypeError: not a ``timedelta`` or a number.
        ValueError: not positive.
    """
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta or a number of seconds, got {timeout!r} of type "
            f"{type(timeout).__name__}. Pass e.g. timeout=datetime.timedelta(minutes=10) or timeout=600."
        )
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}. Pass e.g. timeout=datetime.timedelta(minutes=10).")
    return timeout


class _CreatedGroups:
    """The process groups oslo created in this process, torn down at interpreter exit by
    :func:`destroy_process_group_at_exit` (registered with ``atexit`` when the first one is created).

    ``default`` is the default group when oslo initialized torch.distributed (else ``None``); ``subgroups``
    are the groups of this rank that the parallel contexts created with ``new_group``; ``pid`` is the
    process that created them (a child forked from it inherits this record, never the groups' ownership).
    """

    def __init__(self) -> None:
        self.default: dist.ProcessGroup | None = None
        self.subgroups: list[dist.ProcessGroup] = []
        self.pid: int | None = None

    def add(self, default: dist.ProcessGroup | None = None, subgroup: dist.ProcessGroup | None = None) -> None:
        if self.pid != os.getpid():  # the first group of this process (or of a forked child): start afresh
            self.default, self.subgroups, self.pid = None, [], os.getpid()
            atexit.unregister(destroy_process_group_at_exit)  # a forked child inherits the registration
            atexit.register(destroy_process_group_at_exit)
        if default is not None:
            self.default = default
        if subgroup is not None:
            self.subgroups.append(subgroup)


_created_groups = _CreatedGroups()


def destroy_process_group_at_exit() -> None:
    """Tear down the process groups oslo created, so that the process exits cleanly.

    Registered with ``atexit`` when oslo creates its first group. A process that ends with live gloo
    (or NCCL) groups may die after its last line with ``terminate called without an active exception``
    (exit code -6, torchrun's ``ChildFailedError``) while C++ destroys the groups' threads; torch asks
    for ``dist.destroy_process_group()`` before exit, and this is it:

    * When oslo initialized torch.distributed (a launcher's variables, no group yet), it destroys the
      default group and with it every group (``dist.destroy_process_group()``), unless the user already
      did, or replaced the default group with one of their own.
    * When the user initialized torch.distributed (``dist.init_process_group(...)`` before building a
      model), it destroys only the groups the parallel contexts created; the default group is the user's:
      **call ``dist.destroy_process_group()`` yourself** at the end of the script, as torch asks of any
      program that initializes it.

    ``atexit`` runs handlers in the reverse order of registration: handlers registered after the first
    model was built run before this one, with the groups still alive; those registered earlier run after
    it. Deployment workers (``deployment=True``) end with ``os._exit`` and skip it: their processes end
    without destroying anything, which never aborts. A process forked from this one does nothing here.
    """
    created = _created_groups
    if created.pid != os.getpid() or not (dist.is_available() and dist.is_initialized()):
        return
    default, subgroups = created.default, created.subgroups
    created.default, created.subgroups = None, []
    try:
        if default is not None and dist.group.WORLD is default:
            dist.destroy_process_group()
            return
        for group in reversed(subgroups):
            try:
                dist.destroy_process_group(group)
            except ValueError:  # "Invalid process group specified": the user destroyed it already
                pass
    except Exception:  # noqa: BLE001 - the end of the process must not fail on its clean-up
        logger.debug("tearing down oslo's process groups at exit failed", exc_info=True)


def _init_distributed(backend: str | None, timeout: timedelta) -> None:
    """Initialize torch.distributed from the launcher's environment variables; the default group is then
    oslo's, destroyed at interpreter exit (:func:`destroy_process_group_at_exit`)."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    _created_groups.add(default=dist.group.WORLD)


class SequenceSharding:
    """Sequence parallelism's state, shared by a context's layers: whether the activations between the
    tensor-parallel regions of a block (its norms, dropout and residual adds) are split along the sequence
    (``dim``) across the tensor-parallel ranks (``enabled``), and whether the current call runs them whole
    instead (``suspended``: a call without gradients whose length the tensor-parallel size does not divide, a
    decoding step). A plain object with no process group, so that a model copies with its layers."""

    dim = 1  # (batch, sequence, hidden)

    def __init__(self, enabled: bool = False) -> None:
        self.enabled, self.suspended = enabled, False

    @property
    def active(self) -> bool:
        """Activations are split along the sequence in this call."""
        return self.enabled and not self.suspended


class ParallelContext:
    """Sizes, ranks and process groups for tensor, pipeline and data parallelism.

    Created once per model (``from_pretrained_with_parallel`` does it) and passed to every parallel
    layer. When ``torch.distributed`` is not initialized yet, it is initialized from the variables
    that ``torchrun`` and ``deepspeed`` set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), with gloo
    on CPU and NCCL on CUDA. With ``tensor_parallel_size = pipeline_parallel_size = 1`` in a plain
    process no launcher is needed: the context is a single rank and every collective is skipped.

    The groups oslo creates are destroyed when the interpreter exits (the default group too when oslo
    initialized torch.distributed), so the processes end cleanly under ``torchrun``. A script that calls
    ``dist.init_process_group`` itself owns the default group and must call ``dist.destroy_process_group()``
    at its end, as torch asks (see :func:`destroy_process_group_at_exit`).

    The Megatron/DeepSpeed ``mpu`` accessors (``get_tensor_parallel_rank``, ``get_data_parallel_group``,
    ``get_model_parallel_world_size``...) are methods of this object, so ``model.mpu`` can be handed to
    DeepSpeed or used to build a ``DistributedSampler``.

    Args:
        tensor_parallel_size: Number of ranks each layer is split across.
        pipeline_parallel_size: Number of pipeline stages.
        seed: Seed of the model's own random streams (dropout, sampling), which then do not depend on torch's
            generator. ``None`` (default): dropout and sampling draw from torch's default generator of the
            model's device, as transformers' models do, so ``torch.manual_seed`` and ``transformers.set_seed``
            decide them (ranks that draw alike and hold different states take their first rank's: see
            :mod:`oslo.parallel.random`); the model's other random choices start from rank 0's
            ``torch.initial_seed()``.
        backend: ``torch.distributed`` backend to initialize with; default gloo on CPU, NCCL on CUDA.
        timeout: How long a collective of this model waits for the other ranks before it fails (a
            ``timedelta`` or seconds; default 10 minutes, gloo's own default is 30). Every process
            group the context creates uses it, and so does ``init_process_group`` when the context
            initializes ``torch.distributed``. A rank that never joins a collective (say, a save called
            on rank 0 only) then fails in that time with an error instead of waiting.
        sequence_parallel: Split the activations between the tensor-parallel regions of each block along the
            sequence across the tensor-parallel ranks (Megatron's sequence parallelism; no effect at
            ``tensor_parallel_size=1``). The models built on this context follow it.
        virtual_pipeline_size: Chunks of layers each pipeline stage holds (interleaved 1F1B, Megatron's virtual
            pipeline stages): at ``v`` > 1 a model of ``L`` layers is cut into ``v x pipeline_parallel_size``
            contiguous pieces, stage ``s`` holding pieces ``s, s + P, s + 2P, ...``, and a training step runs
            :func:`~oslo.parallel.pipeline.interleaved_order`: the pipeline's idle time shrinks by about ``v``.
            Needs ``pipeline_parallel_size`` > 1 and at least ``v x pipeline_parallel_size`` layers.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        seed: int | None = None,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        sequence_parallel: bool = False,
        virtual_pipeline_size: int = 1,
    ) -> None:
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}.")
        tp = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
        timeout = DEFAULT_TIMEOUT if timeout is None else validate_timeout(timeout)
        pp = validate_parallel_size("pipeline_parallel_size", pipeline_parallel_size)
        vpp = validate_virtual_pipeline_size(virtual_pipeline_size, pp)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an integer or None, got {seed!r}. Pass e.g. seed=42.")

        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            world_size = _launcher_world_size() or 1
        model_parallel = tp * pp
        if world_size == 1 and model_parallel > 1:
            raise RuntimeError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {model_parallel} processes, "
                "but this is a single process with no distributed launcher (RANK/WORLD_SIZE are not set "
                f"and torch.distributed is not initialized). {_LAUNCH_HINT.format(n=model_parallel)}, "
                "or use tensor_parallel_size=1 and pipeline_parallel_size=1 in a plain process."
            )

        if world_size > 1 and not dist.is_initialized():
            _init_distributed(backend, timeout)
        self.world_size = world_size
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.timeout = timeout
        self.device = self._default_device()
        # oslo's own group over every rank (not WORLD): agreement messages of this model never meet
        # collectives that the user, or another model, runs on the default group. It is the same on every
        # rank whatever they asked for, so it comes first; the layout's groups only once the ranks agree.
        self.world_group = self._new_groups([list(range(world_size))])
        if world_size > 1:  # ranks asking for other layouts would create other groups and wait forever
            self._agree_on_layout(tp, pp, seed, (sequence_parallel, vpp))
        if world_size % model_parallel != 0:
            raise ValueError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} = {model_parallel} must divide the "
                f"world size {world_size} (and be at most {world_size}). Choose sizes whose product divides "
                f"{world_size}, or launch a multiple of {model_parallel} processes."
            )

        self.tensor_parallel_size = tp
        self.pipeline_parallel_size = pp
        self.virtual_pipeline_size = vpp
        self.data_parallel_size = world_size // model_parallel
        self.in_model_call = False  # set while a model of this context runs (its inputs are checked once)

        # Grid (data, pipeline, tensor), tensor fastest: rank = (d * pp + p) * tp + t.
        dp = self.data_parallel_size

        self.data_parallel_rank, rest = divmod(self.rank, pp * tp)
        self.pipeline_parallel_rank, self.tensor_parallel_rank = divmod(rest, tp)
        self.model_parallel_rank = rest
        d, p, t = self.data_parallel_rank, self.pipeline_parallel_rank, self.tensor_parallel_rank
        self._tp_ranks = [self.global_rank(d, p, i) for i in range(tp)]
        self._pp_ranks = [self.global_rank(d, i, t) for i in range(pp)]
        self._dp_ranks = [self.global_rank(i, p, t) for i in range(dp)]
        self._mp_ranks = [self.global_rank(d, 0, 0) + i for i in range(pp * tp)]
        self._embedding_ranks = [self.global_rank(d, 0, t), self.global_rank(d, pp - 1, t)]
        self.tensor_parallel_group = self._new_groups(
            [[self.global_rank(i, j, k) for k in range(tp)] for i in range(dp) for j in range(pp)])
        self.pipeline_parallel_group = self._new_groups(
            [[self.global_rank(i, j, k) for j in range(pp)] for i in range(dp) for k in range(tp)])
        self.data_parallel_group = self._new_groups(
            [[self.global_rank(i, j, k) for i in range(dp)] for j in range(pp) for k in range(tp)])
        self.model_parallel_group = self._new_groups(
            [[self.global_rank(i, 0, 0) + j for j in range(pp * tp)] for i in range(dp)])
        # First and last stage of one pipeline: weights tied across them (GPT2's wte and lm_head) sum
        # their gradients over this group.
        self.embedding_group = self._new_groups(
            [[self.global_rank(i, 0, k), self.global_rank(i, pp - 1, k)] for i in range(dp) for k in range(tp)]
        ) if pp > 1 else None

        self._stage_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

        follows_default = seed is None  # dropout and sampling draw from torch's generator, as transformers'
        if seed is None:
            seed = self._broadcast_seed(torch.initial_seed() % (2**63))
        self.seed = seed
        self.rng = ParallelRNG(seed, self.tensor_parallel_rank, self.device, tp, follows_default)
        self.sequence = SequenceSharding(sequence_parallel and tp > 1)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the models of this context split their activations along the sequence (see
        :class:`SequenceSharding`)."""
        return self.sequence.enabled

    @classmethod
    def planning(cls) -> ParallelContext:
        """A single-rank context that never communicates, whatever the process's distributed state: for
        building a model on the meta device to measure it (pipeline stage costs), not for running one."""
        context = cls.__new__(cls)
        context.world_size, context.rank, context.timeout = 1, 0, DEFAULT_TIMEOUT
        context.device = torch.device("cpu")
        context.tensor_parallel_size = context.pipeline_parallel_size = context.data_parallel_size = 1
        context.virtual_pipeline_size = 1
        context.tensor_parallel_rank = context.pipeline_parallel_rank = context.data_parallel_rank = 0
        context.model_parallel_rank = 0
        context.in_model_call = False
        context._tp_ranks = context._pp_ranks = context._dp_ranks = context._mp_ranks = [0]
        context._embedding_ranks = [0, 0]
        context.world_group = context.tensor_parallel_group = context.pipeline_parallel_group = None
        context.data_parallel_group = context.model_parallel_group = context.embedding_group = None
        context._stage_groups = {}
        context.seed = 0
        context.rng = ParallelRNG(0, 0, context.device)
        context.sequence = SequenceSharding()
        return context

    def global_rank(self, data_parallel_rank: int, pipeline_parallel_rank: int, tensor_parallel_rank: int) -> int:
        """The global rank at a place of the (data, pipeline, tensor) grid (tensor fastest)."""
        return ((data_parallel_rank * self.pipeline_parallel_size + pipeline_parallel_rank)
                * self.tensor_parallel_size + tensor_parallel_rank)

    def stage_group(self, stages: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The group of this rank's counterparts (same tensor- and data-parallel rank) on the pipeline
        ``stages``: weights tied across those stages (T5's ``shared`` embedding on the first stage, its
        decoder's copy on the stage where the decoder starts, ``lm_head`` on the last) sum their gradients
        over it. Collective: every rank must ask for the same stage sets in the same order (the models'
        builds do), and gets ``None`` for a set without its own stage. The first and last stage's group is
        :attr:`embedding_group`."""
        stages = tuple(sorted(set(stages)))
        if stages == (0, self.pipeline_parallel_size - 1):
            return self.embedding_group
        if stages not in self._stage_groups:
            ranks = [[self.global_rank(d, p, t) for p in stages]
                     for d in range(self.data_parallel_size) for t in range(self.tensor_parallel_size)]
            self._stage_groups[stages] = self._new_groups(ranks)
        return self._stage_groups[stages]

    def _default_device(self) -> torch.device:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _new_groups(self, rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
        """Create one group per rank list (every rank creates all of them) and return this rank's."""
        if not dist.is_initialized():
            return None
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.rank in ranks:
                mine = group
                _created_groups.add(subgroup=group)
        return mine

    def _agree_on_layout(self, tp: int, pp: int, seed: int | None, options: tuple[bool, int] = (False, 1)) -> None:
        """Check that every rank asked for the same layout, with one all-gather of seven int64 per rank
        over the world group, before any group of the layout exists: the sizes, the timeout, whether a
        seed was given, and the seed (the same within each model-parallel group, whose ranks build one
        model from it), and ``options``: ``(sequence_parallel, virtual_pipeline_size)``. Ranks that disagree would
        create different groups, or run different collectives, and wait for each other.

        Raises:
            ValueError: on every rank, naming each value that differs and the ranks that passed it.
        """
        timeout_ms = round(self.timeout.total_seconds() * 1000)
        seed_bits = 0 if seed is None else (seed + 2**63) % 2**64 - 2**63  # any int64-wrapped seed
        mine = torch.tensor([tp, pp, timeout_ms, seed is not None, seed_bits, *options], dtype=torch.int64,
                            device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        with naming_timeouts(self, "comparing tensor_parallel_size, pipeline_parallel_size, seed and timeout "
                             "across ranks before building the model", "every rank must build the model",
                             self.world_group):
            dist.all_gather(gathered, mine, group=self.world_group)
        rows = torch.stack(gathered).tolist()
        seeds = [row[4] if row[3] else None for row in rows]
        problems = [
            _differing("tensor_parallel_size", [row[0] for row in rows]),
            _differing("pipeline_parallel_size", [row[1] for row in rows]),
            _differing("timeout", [timedelta(milliseconds=row[2]) for row in rows]),
            _differing("seed", seeds) if len({row[3] for row in rows}) > 1 else "",
            _differing("sequence_parallel", [bool(row[5]) for row in rows]),
            _differing("virtual_pipeline_size", [row[6] for row in rows]),
        ]
        if not any(problems):  # one layout: each model-parallel group must share one seed
            size = tp * pp
            problems = [_differing("seed", seeds[start : start + size], start) for start in range(0, len(rows), size)]
        problems = [problem for problem in problems if problem]
        if problems:
            raise ValueError(
                "the ranks were given different parallel settings: " + "; ".join(problems) + ". Pass the same "
                "tensor_parallel_size, pipeline_parallel_size, sequence_parallel, virtual_pipeline_size and timeout "
                "on every rank, and seed on every rank "
                "or on none (the same seed on the ranks of one tensor/pipeline-parallel group); ranks that "
                "build different layouts would wait for each other forever."
            )

    def _broadcast_seed(self, seed: int) -> int:
        if not dist.is_initialized() or self.world_size == 1:
            return seed
        value = torch.tensor([seed], dtype=torch.int64, device=self.device)
        dist.broadcast(value, src=0, group=self.world_group)
        return int(value.item())

    def manual_seed(self, seed: int) -> None:
        """Reseed the model's random streams (dropout, sampling in ``generate()``), as ``torch.manual_seed`` reseeds
        torch's: the streams start afresh from ``seed``, as a model built with ``seed=seed`` starts them (streams of
        the model's own from then on, not torch's generator). Call it
        on every rank of the model with the same seed (the ranks of one tensor/pipeline-parallel group compare
        theirs and all raise ``ValueError`` if they differ: the replicated activations' dropout masks would part
        ways); data-parallel replicas may use different seeds."""
        if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
            seed = int(seed)  # a NumPy integer too, as torch.manual_seed takes
        group = self.model_parallel_group
        seeds, ranks = [seed], [self.rank]
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            seeds = [None] * dist.get_world_size(group)
            with naming_timeouts(self, "comparing the seeds of manual_seed", "manual_seed runs on every rank", group):
                dist.all_gather_object(seeds, seed, group=group)  # first: a bad seed on one rank raises on all
            ranks = dist.get_process_group_ranks(group)
        given = ", ".join(f"global rank {rank}: {value!r}" for rank, value in zip(ranks, seeds, strict=True))
        if any(isinstance(value, bool) or not isinstance(value, int) for value in seeds):
            raise TypeError(f"manual_seed takes an integer seed, got {given if len(seeds) > 1 else repr(seed)}. "
                            "Pass e.g. 42 on every rank.")
        if len(set(seeds)) > 1:
            raise ValueError(
                f"manual_seed was given different seeds on the ranks of one model ({given}). Pass the same seed on "
                "every rank of a tensor/pipeline-parallel group: the replicated activations must draw the same "
                "dropout masks on all of them.")
        self.seed = seed
        self.rng.manual_seed(seed)

    def describe_rank(self, global_rank: int) -> str:
        """``"global rank 3 (pipeline stage 1, tensor-parallel rank 1)"``: where a rank sits in the grid."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        data, rest = divmod(global_rank, tp * pp)
        stage, tensor = divmod(rest, tp)
        where = [f"{name} {index}" for name, index, size in (
            ("pipeline stage", stage, pp), ("tensor-parallel rank", tensor, tp),
            ("data-parallel replica", data, self.data_parallel_size)) if size > 1]
        return f"global rank {global_rank}" + (f" ({', '.join(where)})" if where else "")

    def describe_group(self, group) -> str:
        """``"the tensor-parallel group (global ranks [0-1])"``: which of this context's groups ``group`` is
        (``None`` is the default group), and its members."""
        if group is None or group is dist.GroupMember.WORLD:
            name, ranks = "default", list(range(self.world_size))
        else:
            known = [
                ("tensor_parallel_group", "tensor-parallel", "_tp_ranks"),
                ("pipeline_parallel_group", "pipeline-parallel", "_pp_ranks"),
                ("data_parallel_group", "data-parallel", "_dp_ranks"),
                ("model_parallel_group", "model-parallel", "_mp_ranks"),
                ("embedding_group", "first-and-last-stage", "_embedding_ranks"),
            ]
            name, ranks = next(((name, getattr(self, ranks)) for attribute, name, ranks in known
                                if getattr(self, attribute, None) is group), ("process", None))
            if group is getattr(self, "world_group", None):
                name, ranks = "oslo world", list(range(self.world_size))
            ranks = ranks if ranks is not None else dist.get_process_group_ranks(group)
        return f"the {name} group (global ranks {_ranks_text(ranks)})"

    def __repr__(self) -> str:
        return (
            f"ParallelContext(rank={self.rank}, world_size={self.world_size}, "
            f"tensor_parallel={self.tensor_parallel_rank}/{self.tensor_parallel_size}, "
            f"pipeline_parallel={self.pipeline_parallel_rank}/{self.pipeline_parallel_size}, "
            f"data_parallel={self.data_parallel_rank}/{self.data_parallel_size}, device={self.device})"
        )

    # ---- tensor-parallel rank arithmetic -------------------------------------------------------
    def tensor_parallel_global_rank(self, tensor_parallel_rank: int) -> int:
        """Global rank of the tensor-parallel peer ``tensor_parallel_rank`` of this rank."""
        return self._tp_ranks[tensor_parallel_rank]

    # ---- pipeline stages --------------------------------------------------------------------------
    def pipeline_parallel_global_rank(self, stage: int) -> int:
        """Global rank of stage ``stage`` in this rank's pipeline (same data and tensor-parallel rank)."""
        return self._pp_ranks[stage]

    def is_pipeline_first_stage(self) -> bool:
        return self.pipeline_parallel_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pipeline_parallel_rank == self.pipeline_parallel_size - 1

    def get_embedding_group(self):
        """Group of this pipeline's first and last stage (``None`` without pipeline parallelism)."""
        return self.embedding_group

    # ---- Megatron / DeepSpeed mpu interface ----------------------------------------------------
    def get_tensor_parallel_rank(self) -> int:
        return self.tensor_parallel_rank

    def get_tensor_parallel_world_size(self) -> int:
        return self.tensor_parallel_size

    def get_tensor_parallel_group(self):
        return self.tensor_parallel_group

    def get_tensor_parallel_src_rank(self) -> int:
        return self._tp_ranks[0]

    def get_pipeline_parallel_rank(self) -> int:
        return self.pipeline_parallel_rank

    def get_pipeline_parallel_world_size(self) -> int:
        return self.pipeline_parallel_size

    def get_pipeline_parallel_group(self):
        return self.pipeline_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.data_parallel_group

    def get_data_parallel_src_rank(self) -> int:
        return self._dp_ranks[0]

    def get_model_parallel_rank(self) -> int:
        return self.model_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def get_model_parallel_group(self):
        return self.model_parallel_group

    def get_model_parallel_src_rank(self) -> int:
        return self._mp_ranks[0]

    # Megatron-LM spells the same accessors with "model" inside; DeepSpeed looks for these.
    get_tensor_model_parallel_rank = get_tensor_parallel_rank
    get_tensor_model_parallel_world_size = get_tensor_parallel_world_size
    get_tensor_model_parallel_group = get_tensor_parallel_group
    get_tensor_model_parallel_src_rank = get_tensor_parallel_src_rank
    get_pipeline_model_parallel_rank = get_pipeline_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipeline_parallel_world_size
    get_pipeline_model_parallel_group = get_pipeline_parallel_group
