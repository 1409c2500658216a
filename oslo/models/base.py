"""What every oslo model class has: parallel construction, loading, saving, RNG and mpu plumbing."""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList
from transformers.utils.hub import convert_file_size_to_int

from oslo import checkpoint as ckpt
from oslo.integrations import peft as peft_integration
from oslo.integrations import trainer as trainer_integration
from oslo.kernels import FusedNoRepeatNGramLogitsProcessor
from oslo.models import build, resize, runner, stages
from oslo.models.body import StagedBody
from oslo.parallel import sequence, ties, traced
from oslo.parallel.agreement import (
    agreed_inputs,
    check_same_inputs,
    draws_dropout,
    embedding_index_error,
    forget_verified_inputs,
)
from oslo.parallel.clip import clip_grad_norm_
from oslo.parallel.context import ParallelContext, validate_parallel_size
from oslo.parallel.deepspeed_engine import (
    install_deepspeed_hooks,
)
from oslo.parallel.dtensor import (
    device_mesh,
    distribute_parameters,
    follow_storages,
    install_torch_hooks,
    is_distributed,
    local_named_parameters,
    plain_leaves_module,
    relink_storages,
    shared_views,
    trains_plain_leaves,
    undistribute_parameters,
)
from oslo.parallel.failure import call_watch
from oslo.parallel.layers import ColumnParallelEmbedding, VocabParallelEmbedding
from oslo.parallel.pipeline import (
    TimelineEvent,
    close_open_step,
)
from oslo.parallel.plan import ShardSpec

logger = logging.getLogger(__name__)


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def _accelerate_refuses_parallelism_config() -> str | None:
    """The distributed type of this process for which accelerate refuses a ``ParallelismConfig`` (its
    ``Accelerator`` accepts one for the types its ``multi_device`` covers: GPUs and other accelerators, not
    ``MULTI_CPU``), or ``None`` when it takes one (or accelerate is not installed)."""
    try:
        from accelerate import Accelerator
        from accelerate.state import PartialState
    except ImportError:
        return None
    state = PartialState()
    probe = type("Probe", (), {"use_distributed": state.use_distributed, "distributed_type": state.distributed_type})
    if Accelerator.multi_device.fget(probe()):
        return None
    return str(state.distributed_type)


def _install_peft() -> None:
    try:
        peft_integration.install()
    except Exception as exc:  # noqa: BLE001 - an incompatible PEFT must not stop oslo models from being built
        logger.warning("oslo: PEFT is installed but could not be taught oslo's layers (%s: %s); PEFT's adapters on "
                       "oslo models will not work", type(exc).__name__, exc)


def check_split_sizes(tensor_parallel_size: int, heads: tuple[str, int], mlp: tuple[str, int]) -> None:
    """Raise ``ValueError`` unless ``tensor_parallel_size`` divides the attention heads (each rank holds
    whole heads) and the MLP's inner size, naming the config attribute, its value and the sizes that work.

    Args:
        heads: ``(config attribute, value)`` of the head count, e.g. ``("n_head", 12)``.
        mlp: ``(config attribute, value)`` of the MLP's inner size, e.g. ``("d_ff", 2048)``.
    """
    (heads_name, count), (mlp_name, inner) = heads, mlp
    if count % tensor_parallel_size != 0:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the number of attention heads "
            f"({heads_name}={count}): each rank must hold whole heads. Use one of {divisors}."
        )
    if inner % tensor_parallel_size != 0:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the MLP size ({mlp_name}={inner}). "
            f"Use a tensor_parallel_size that divides both {heads_name}={count} and {mlp_name}={inner}."
        )


class _Builds(threading.local):
    depth = 0  # oslo model constructors running in this thread (a body inside its head: 2)


_BUILDS = _Builds()


def _building(init: Callable) -> Callable:
    """``init`` (an oslo model class's ``__init__``) counting the constructors running, so that the outermost
    model knows it is (its stage is assigned once it is whole), and assigning it at the end when its own
    ``post_init`` ran inside another constructor (a subclass that builds more after ``super().__init__``)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        _BUILDS.depth += 1
        try:
            init(self, *args, **kwargs)
        finally:
            _BUILDS.depth -= 1
        if _BUILDS.depth == 0 and self.pipeline_stages is None:
            self._assign_stage()
            PreTrainedModel.post_init(self)  # the ties and init of what the stage kept

    return __init__


class OsloPreTrainedModel(PreTrainedModel):
    """Base of oslo's model classes: a transformers ``PreTrainedModel`` that knows its parallel layout.

    Construct with :meth:`from_pretrained_with_parallel` or :meth:`from_config_with_parallel`; direct
    construction ``Model(config)`` builds a single-rank model like transformers does.
    """

    _supports_pipeline_parallel = False
    _supports_sequence_parallel = False  # sequence_parallel=True: its layers run on shards (oslo.parallel.sequence)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _building(cls.__dict__["__init__"])
        # The output classes of a training call without gathered logits (see heads.output_class_for), made with
        # the class rather than in its first call, which torch.compile may be tracing.
        for name in ("_lm_output_class", "_masked_lm_output_class"):
            if isinstance(getattr(cls, name, None), type):
                runner.logits_not_gathered(getattr(cls, name))

    def __init__(self, config: PretrainedConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config)
        self.parallel_context = parallel_context if parallel_context is not None else ParallelContext()
        traced.register(self)  # compiled calls refer to the model by this key (see oslo.parallel.traced)
        install_torch_hooks()  # torch's clipping and state-dict functions, adjusted to oslo models
        _install_peft()  # PEFT's LoRA and (IA)^3 wrap oslo's linear layers (when PEFT is installed)
        trainer_integration.install()  # transformers' Trainer saves and resumes split models (once it is imported)
        self.micro_batch_size = 1
        # Set to a list to record this stage's forward and backward passes in pipeline training steps
        # (``oslo.parallel.pipeline.TimelineEvent``; benchmarks/pipeline_timeline.py draws them).
        self.pipeline_timeline: list[TimelineEvent] | None = None
        self._overflow_check_pending = False

    # Every stage's layers (one ``range`` of global layer indices per pipeline stage), set when the model is built
    # (see oslo.models.stages).
    pipeline_stages: list[range] | None = None

    def post_init(self):
        # The outermost model, built whole, keeps its pipeline stage's part before its weights are initialized
        # and its ties read (a body built inside a head is pruned with it).
        if _BUILDS.depth == 1 and self.pipeline_stages is None:
            self._assign_stage()
        super().post_init()

    def _assign_stage(self) -> None:
        """Prune the whole model to its pipeline stage (see oslo.models.stages); the bodies built inside it,
        whose ``post_init`` read their ties before, read them again from what the stage kept. Under sequence
        parallelism, the layers of the stage then split sequences (see oslo.parallel.sequence)."""
        stages.assign_stage(self)
        if self.parallel_context.sequence_parallel:
            if not self._supports_sequence_parallel:
                raise NotImplementedError(
                    f"{type(self).__name__} does not support sequence parallelism yet (its parallel_context was made "
                    "with sequence_parallel=True): oslo's classes (GPT2, GPT-Neo, BERT, T5, the Llama family) do. "
                    "Use a context made with sequence_parallel=False."
                )
            body = self.base_model
            norm_attribute = getattr(body, "norm_attribute", None)  # BERT's layers end with their own norms
            sequence.shard_sequences(self, body, getattr(body, norm_attribute, None) if norm_attribute else None)
        if self.parallel_context.pipeline_parallel_size == 1:
            return
        for module in reversed(list(self.modules())):  # a body before the model holding it
            if module is not self and isinstance(module, PreTrainedModel):
                keys = module.get_expanded_tied_weights_keys(all_submodels=False)
                for name, child in module.named_children():
                    keys.update({f"{name}.{k}": f"{name}.{v}"
                                 for k, v in (getattr(child, "all_tied_weights_keys", None) or {}).items()})
                module.all_tied_weights_keys = keys

    @classmethod
    def pipeline_partition(cls, config: PretrainedConfig, pipeline_parallel_size: int) -> list[range]:
        """The layers each pipeline stage of this class holds, balancing parameters: the class is built on the
        meta device without pipelines and measured as a pipelined build measures itself (see
        :mod:`oslo.models.stages`). Nothing is allocated.

        Returns:
            One ``range`` of global layer indices per stage (over every :class:`StageLayers` of the model,
            in construction order).
        """
        with torch.device("meta"):
            model = cls(config, parallel_context=ParallelContext.planning())
        return stages.stage_ranges(model, pipeline_parallel_size)

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Rows per micro-batch of pipeline parallelism (no effect without it)."""
        self.micro_batch_size = validate_parallel_size("micro_batch_size", micro_batch_size)

    # ---- weights tied across pipeline stages (see oslo.parallel.ties) ---------------------------
    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # A tie may span pipeline stages: each stage ties only the members it holds (see oslo.parallel.ties).
        if self.parallel_context.pipeline_parallel_size == 1 or all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels)
        return ties.stage_tied_weights_keys(self)

    def cross_stage_tied_weights(self) -> dict[str, str]:
        """``{local parameter: the name of a tied twin on another stage}``; see
        :func:`oslo.parallel.ties.cross_stage_tied_weights`."""
        return ties.cross_stage_tied_weights(self)

    def cross_stage_tied_copies(self) -> dict[str, str]:
        """``{copy: source}`` for this stage's tie targets whose source is on another stage; see
        :func:`oslo.parallel.ties.cross_stage_tied_copies`."""
        return ties.cross_stage_tied_copies(self)

    def pipeline_gradient_reduction(self, average_replicas: bool = True, half: bool = False) -> Callable[[bool], None]:
        """What ends a pipeline step once every micro-batch is backpropagated (the schedule calls it); see
        :func:`oslo.parallel.ties.pipeline_gradient_reduction`."""
        return ties.pipeline_gradient_reduction(self, average_replicas, half)

    # ---- body + head, with or without pipeline stages (see oslo.models.runner) ---------------
    # Inputs of the head that, all given, make a training step under pipeline parallelism (a loss).
    _pipeline_loss_inputs: tuple[str, ...] = ("labels",)

    def _new_cache(self):
        """A fresh KV cache for a pipeline stage (architectures with another cache type override)."""
        return DynamicCache(config=self.config)

    # ---- parallel plumbing -------------------------------------------------------------------
    @property
    def mpu(self) -> ParallelContext:
        """The Megatron/DeepSpeed-style model-parallel unit: ranks, sizes and groups."""
        return self.parallel_context

    @property
    def tp_size(self) -> int | None:
        """The tensor-parallel size as transformers and accelerate read it (``None`` at size 1, as for a model
        that is not tensor parallel). Seeing it, transformers' ``Trainer`` hands accelerate a
        ``ParallelismConfig(tp_size=T, dp_shard_size=D)``, so accelerate gives the ranks of a tensor-parallel
        group the same batches, splits the data over the data-parallel replicas only and leaves the model
        unwrapped; oslo then averages the gradients over the replicas itself
        (see :func:`oslo.models.runner.forward_with_head`).

        Raises:
            NotImplementedError: with pipelines: transformers' ``Trainer`` and accelerate call the model once per
                batch and take one loss, while a pipeline step is a loop over micro-batch outputs.
        """
        trainer_integration.install()  # the Trainer reads this: its saves and resumes of split models
        context = self.parallel_context
        if context.pipeline_parallel_size > 1:
            raise NotImplementedError(
                f"transformers' Trainer and accelerate cannot train {type(self).__name__} at pipeline_parallel_size="
                f"{context.pipeline_parallel_size}: they call the model once per batch and take one loss, while a "
                "pipeline training step is a loop over micro-batch outputs. Write the loop (`for micro_output in "
                "model(**batch): micro_output.loss.backward()`, then model.clip_grad_norm_ and optimizer.step()), see "
                "USAGE.md, 'Pipeline parallelism'; the Trainer works at pipeline_parallel_size=1."
            )
        if context.tensor_parallel_size == 1:
            if context.data_parallel_size > 1 and is_distributed(self) and not trains_plain_leaves(self):
                raise NotImplementedError(
                    f"transformers' Trainer cannot train {type(self).__name__} itself with "
                    f"{context.data_parallel_size} data-parallel replicas: accelerate wraps the model in "
                    "DistributedDataParallel, which cannot reduce its DTensor parameters. Hand the Trainer "
                    "model.gpu_modules() (the same model, its plain shards as the parameters DDP averages): "
                    "Trainer(model=model.gpu_modules(), args=..., ...)."
                )
            return None
        refusal = _accelerate_refuses_parallelism_config()
        if refusal is not None:
            raise NotImplementedError(
                f"transformers' Trainer cannot train the tensor-parallel {type(self).__name__} here: it hands "
                f"accelerate a ParallelismConfig(tp_size={context.tensor_parallel_size}) so that the ranks of a "
                f"tensor-parallel group get the same batches, and accelerate {_accelerate_version()} accepts one "
                f"only in processes on GPUs and other accelerators (this process: {refusal}). Write the training "
                "loop (USAGE.md, 'Training' and 'Data parallelism': DistributedDataParallel(model.gpu_modules(), "
                "process_group=model.mpu.get_data_parallel_group()) with a DistributedSampler over "
                "model.mpu.get_data_parallel_world_size() replicas), or use DeepSpeed (USAGE.md, 'DeepSpeed')."
            )
        return context.tensor_parallel_size

    @property
    def device_mesh(self):
        """The ``DeviceMesh`` of this rank's pipeline stage, dimensions ``("dp", "tp")``, on the model's own
        groups: the parameters are DTensors on ``device_mesh["tp"]``; FSDP2 shards over ``device_mesh["dp"]``
        (``fully_shard(model, mesh=model.device_mesh["dp"])``). ``None`` in a single process."""
        if self.parallel_context.world_size == 1:
            return None
        return device_mesh(self.parallel_context)

    @contextmanager
    def _model_call(self) -> Iterator[bool]:
        """Mark a call of this model (or of a part of it: a pipeline stage's body); yields whether it
        is the outermost one."""
        context = self.parallel_context
        outermost = not context.in_model_call
        context.in_model_call = True
        try:
            with shared_views():  # one local view per parameter for the whole call (see GradientSink)
                yield outermost
        finally:
            if outermost:
                context.in_model_call = False
                if not torch.compiler.is_compiling():
                    forget_verified_inputs()

    @contextmanager
    def _user_call(self, args: tuple, kwargs: dict, samples: bool = False) -> Iterator[bool]:
        """Around a call of the model (``__call__``, ``generate``): the outermost one first checks that
        every rank of the tensor/pipeline-parallel group got the same inputs (the first communication
        of the call; calls nested in it, such as the body's or generate()'s steps, are not checked),
        and everything runs on the replicated stream, so replicated dropout and sampling (``samples``: a
        ``generate()`` call that samples) stay in step across the ranks. A model without a seed of its own
        draws them from torch's generator: the same check compares the generators of the ranks that draw alike,
        and where they differ the first rank's state is given to the others.

        Token ids and positions outside the embeddings raise transformers' ``IndexError`` on every rank
        (a vocabulary-split embedding would embed them as zeros): the outermost call hands the verdict
        to the input check, whose all-gather carries it, so ranks given other ids raise too; a nested
        call (generate()'s steps), whose inputs every rank shares, raises before it communicates."""
        context = self.parallel_context
        if is_distributed(self) and trains_plain_leaves(self) and not torch.compiler.is_compiling():
            # DeepSpeed's ZeRO may have moved the trained storages. Not traced: a compiled call (of a DDP wrapper)
            # computes on the storages themselves, and the DTensors follow at the next eager call or state_dict().
            follow_storages(self)
        with self._model_call() as outermost:
            # (A traced call begins its watch when the compiled program runs: see agreement.agreed_inputs.)
            watch = call_watch(context) if outermost and not torch.compiler.is_compiling() else None
            if watch is not None:  # refuses the call if an earlier one left the ranks out of step
                watch.begin_call()
            if outermost and context.pipeline_parallel_size > 1:
                close_open_step(context)  # a step left half-way ends on every stage before this call communicates
            error = embedding_index_error(self, args, kwargs, nested=not outermost)
            if outermost and context.tensor_parallel_size * context.pipeline_parallel_size > 1 \
                    and not torch.compiler.is_compiling():  # a traced call checked them in __call__
                # Drawing from torch's generator (no seed of the model's own), the ranks that draw alike must hold
                # the same state: every rank of the model to sample, each tensor-parallel group for dropout.
                follows = context.rng.follows_default
                dropout = follows and context.tensor_parallel_size > 1 and draws_dropout(self)
                draws_on = context.rng.device if (follows and samples) or dropout else None
                check_same_inputs(context, args, kwargs, error, draws_on, "model" if samples else "tensor")
            elif error is not None:
                raise error
            try:
                with context.rng.replicated():
                    yield outermost
            except BaseException as exc:
                if watch is not None:  # a failure past the input check: see oslo.parallel.failure
                    watch.failed(exc)
                raise

    def __deepcopy__(self, memo):
        """Another model on the same ranks and process groups (an EMA copy, say): its own parameters and
        buffers, the parallel context shared (process groups cannot be copied, and need not be); each copied
        DTensor computes on its own copied storage."""
        memo[id(self.parallel_context)] = self.parallel_context
        for _, group in self.__dict__.get("_tie_groups", {}).values():
            memo[id(group)] = group
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        relink_storages(twin)
        return twin

    def __getstate__(self):
        # A copy (copy.deepcopy, pickle) is another model: it takes its own key for compiled calls (__setstate__).
        state = self.__dict__.copy()  # (object.__getstate__ is Python 3.11's)
        state.pop("_oslo_traced_key", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        traced.register(self)

    def __call__(self, *args, **kwargs):
        context = self.parallel_context
        if torch.compiler.is_compiling() and not context.in_model_call \
                and context.tensor_parallel_size * context.pipeline_parallel_size > 1:
            # The compiled program compares the inputs across the ranks first, and the range checks of
            # _user_call read the copies it returns: no rank asserts on its own before the others agree.
            args, kwargs = agreed_inputs(self, args, kwargs)
        with self._user_call(args, kwargs) as outermost:
            if outermost and isinstance(self, StagedBody) and not self.head_runs_stages \
                    and self.parallel_context.pipeline_parallel_size > 1:
                return runner.pipelined_body_call(self, *args, **kwargs)
            return super().__call__(*args, **kwargs)

    def generate(self, *args, fused_no_repeat_ngram_blocking: bool | None = None, **kwargs):
        """transformers' ``generate``; sampling draws from the replicated stream (torch's generator unless the model
        has a seed of its own, every rank given the first rank's state) so every rank picks the same tokens. The
        prompt and options must be the same on every rank of the model (checked once per call, see
        :func:`~oslo.parallel.agreement.check_same_inputs`).

        Args:
            fused_no_repeat_ngram_blocking: Apply ``no_repeat_ngram_size`` with oslo's n-gram blocking
                kernel (vectorized on CPU, Triton on CUDA) instead of transformers' processor. Bans
                exactly the same tokens. None (default): after ``fuse()`` (all modules), whenever an n-gram
                size is set; otherwise not.
            *args, **kwargs: As for transformers' ``generate``.
        """
        if fused_no_repeat_ngram_blocking is None:
            generation_config = kwargs.get("generation_config") or self.generation_config
            ngram_size = kwargs.get("no_repeat_ngram_size", generation_config.no_repeat_ngram_size)
            fused_no_repeat_ngram_blocking = getattr(self, "_fused_ngram_blocking", False) and bool(ngram_size)
        if fused_no_repeat_ngram_blocking:
            generation_config = kwargs.get("generation_config") or self.generation_config
            ngram_size = kwargs.get("no_repeat_ngram_size", generation_config.no_repeat_ngram_size)
            if not ngram_size:
                raise ValueError(
                    "fused_no_repeat_ngram_blocking=True needs an n-gram size: pass no_repeat_ngram_size=n "
                    "(n >= 1) as well, or set it in the generation config."
                )
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            # In place saves a copy of the scores per step; unsafe only when the raw logits are returned.
            keep_logits = kwargs.get("output_logits", generation_config.output_logits)
            processors.append(FusedNoRepeatNGramLogitsProcessor(ngram_size, inplace=not keep_logits))
            kwargs.update(logits_processor=processors, no_repeat_ngram_size=0)  # 0: transformers' own is off
        # The prompt and options are checked once; the steps' inputs follow from them on every rank
        # alike (sampling draws from the replicated stream), so the steps are not checked again.
        generation_config = kwargs.get("generation_config") or self.generation_config
        samples = bool(kwargs.get("do_sample", generation_config.do_sample))
        with self._user_call(args, kwargs, samples):
            return super().generate(*args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers compiles the decoding step itself when a compilable cache (``cache_implementation=
        "static"``) is used on a GPU, or as ``compile_config`` asks: not with pipelines, whose calls cannot be
        traced (their stages exchange activations point to point); those steps run eagerly."""
        if self.parallel_context.pipeline_parallel_size > 1:
            if generation_config.compile_config is not None:
                logger.warning(
                    "oslo: generate() ignores compile_config with pipeline_parallel_size=%d: a pipelined call "
                    "cannot be traced by torch.compile, so the decoding steps run eagerly.",
                    self.parallel_context.pipeline_parallel_size)
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def fuse(self, modules: Iterable[type[nn.Module]] | None = None):
        """Switch modules to oslo's fused kernels (Triton on CUDA, the torch reference on CPU).

        Every module that has a ``fuse()`` method (for GPT2: ``GPT2MLP`` — bias + GeLU — and
        ``GPT2Attention`` — scale + mask + softmax where the scores are materialized; sdpa stays sdpa)
        switches in place: parameters, names and checkpoints are unchanged, and so is the math. Bias +
        dropout + residual is fused only where the kernel beats torch's expression
        (:func:`~oslo.kernels.fused_bias_dropout_add_pays`); shapes with few rows (decoding) take the torch
        expressions. Without ``modules``, ``generate()`` also blocks repeated n-grams
        (``no_repeat_ngram_size``) with oslo's kernel.

        Args:
            modules: Classes to fuse, e.g. ``[GPT2MLP]``; ``None`` fuses all of them.

        Returns:
            The model itself, so that ``model = model.fuse()`` works.
        """
        fusable = {
            type(m) for m in self.modules()
            if not isinstance(m, OsloPreTrainedModel) and callable(getattr(m, "fuse", None))
        }
        selected = fusable if modules is None else set(modules)
        unknown = selected - fusable
        if unknown:
            raise ValueError(
                f"cannot fuse {sorted(c.__name__ for c in unknown)}: {type(self).__name__} has fusable modules "
                f"{sorted(c.__name__ for c in fusable)}; pass some of those, or nothing to fuse them all."
            )
        for module in self.modules():
            if type(module) in selected:
                module.fuse()
        if modules is None:  # generate() then blocks repeated n-grams with oslo's kernel too
            self._fused_ngram_blocking = True
        return self

    def gpu_modules(self) -> nn.Module:
        """The module holding this rank's parameters, to wrap in ``DistributedDataParallel`` over
        ``model.mpu.get_data_parallel_group()``. With pipeline parallelism the schedule averages the
        gradients over the replicas itself after the last micro-batch (DDP would after the first): a
        wrapped model works as well, and DDP's ``no_sync()`` still skips the averaging.

        With several processes the parameters are DTensors, which DDP cannot reduce: the module returned
        calls this model and holds this rank's plain shards (Megatron attributes set) as its parameters;
        from then on the model trains those, and each gradient they get is mirrored into its DTensor's
        ``.grad`` (same memory). Build the optimizer over ``model.parameters()`` (DTensors: stock clipping
        sees the whole model) or over the wrapper's (plain shards). ``torch.autograd.grad`` with respect to
        ``model.parameters()`` is not available once the storages train (DDP does not support it either)."""
        if is_distributed(self):
            module = plain_leaves_module(self)
            install_deepspeed_hooks()
            # DeepSpeed's gradient norm (ZeRO) counts a weight once across pipeline stages by this mark on
            # its copies (GPT2's lm_head on the last stage, a copy of wte on the first).
            copies = self.cross_stage_tied_copies() if self.parallel_context.pipeline_parallel_size > 1 else {}
            for name, storage in local_named_parameters(self, remove_duplicate=False):
                if name in copies:
                    storage.ds_pipe_replicated = True
            return module
        return self

    def gpu_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, for the optimizer: the DTensors (with several processes), or, once
        :meth:`gpu_modules` made the plain shards the trained tensors (DDP, DeepSpeed), those shards."""
        if is_distributed(self) and trains_plain_leaves(self):
            return (storage for _, storage in local_named_parameters(self))
        return self.parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the norm of the whole (unsplit) model; see :func:`oslo.parallel.clip_grad_norm_`."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def state_dict(self, *args, **kwargs):
        """This rank's parameters under the full model's names, as ``nn.Module.state_dict``. With several
        processes every parameter is a DTensor that says how it is split: ``.full_tensor()`` gives the
        whole weight in transformers' shape, ``torch.distributed.checkpoint`` saves and reshards it, and
        ``load_state_dict`` of such a dict works at the same layout. With pipelines only this stage's weights
        are there. For a checkpoint of the whole model use :meth:`save_pretrained_with_parallel`
        (``save_with_merging=True``: plain transformers files)."""
        if ckpt.saving_whole(self):  # inside oslo.save_tensor_parallel(model): the whole model, on every rank
            destination = kwargs.get("destination", args[0] if args else None)
            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            whole = {prefix + name: tensor for name, tensor in ckpt.whole_state_dict(self).items()}
            if destination is None:
                return whole
            destination.update(whole)
            return destination
        if is_distributed(self) and trains_plain_leaves(self):
            follow_storages(self)
        return super().state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() convert the plain storages; the DTensors are rebuilt around them.
        if not is_distributed(self):
            applied = super()._apply(fn, recurse)
        else:
            plain_leaves = undistribute_parameters(self)
            try:
                applied = super()._apply(fn, recurse)
            finally:
                distribute_parameters(self, self.parallel_context, plain_leaves=plain_leaves)
        # Dropout draws from the generator of the device the parameters now live on.
        parameter = next(self.parameters(), None)
        if parameter is not None:
            self.parallel_context.rng.to(parameter.device)
        return applied

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Module | None:
        """transformers' ``resize_token_embeddings`` (e.g. to ``len(tokenizer)`` after adding tokens): the input
        embeddings, an untied LM head (and its bias) get ``new_num_tokens`` rows (rounded up to a multiple of
        ``pad_to_multiple_of``), the new ones drawn as transformers draws them (``mean_resizing``: from the old rows'
        mean and covariance), and ``config.vocab_size`` follows. Collective: every rank of the model calls it with the
        same arguments; the vocabulary stays split and padded across the tensor-parallel ranks. Build the optimizer
        (and add adapters) after resizing, as with transformers' models.

        Returns:
            The input embeddings (``None`` on a pipeline stage that does not hold them).
        """
        return resize.resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of, mean_resizing)

    # ---- activation checkpointing ------------------------------------------------------------
    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint, every_n_layers: int = 1
    ) -> None:
        # transformers' activation_checkpointing_enable() / gradient_checkpointing_enable() land here.
        # The recomputation in the backward pass must draw the dropout masks of the forward pass from
        # the model's own streams too (tensor-parallel heads draw from the split stream, which torch's
        # checkpoint does not know about).
        rng = self.parallel_context.rng

        def checkpoint_with_model_streams(function, *args, **kwargs):
            return gradient_checkpointing_func(rng.recomputable(function), *args, **kwargs)

        super()._set_gradient_checkpointing(enable, checkpoint_with_model_streams, every_n_layers)

    def enable_input_require_grads(self):
        # A later pipeline stage has no input embeddings: what it receives already requires grad.
        if self.get_input_embeddings() is None:
            self._require_grads_hooks = []
            return
        super().enable_input_require_grads()

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' count (this stage's parameters, each with its whole shape), whose ``exclude_embeddings``
        leaves out the ``nn.Embedding`` weights: oslo's embedding layers (split by vocabulary or by columns) are
        embeddings too."""
        if not exclude_embeddings:
            return super().num_parameters(only_trainable=only_trainable)
        embeddings = {id(module.weight) for module in self.modules()
                      if isinstance(module, nn.Embedding | VocabParallelEmbedding | ColumnParallelEmbedding)}
        return sum(parameter.numel() for parameter in self.parameters()
                   if id(parameter) not in embeddings and (parameter.requires_grad or not only_trainable))

    @classmethod
    def _validate_parallel_config(cls, config: PretrainedConfig, tensor_parallel_size: int) -> None:
        """Raise if ``config`` cannot be split ``tensor_parallel_size`` ways (architectures override)."""

    # ---- initialization ----------------------------------------------------------------------
    def _init_std(self, module_name: str) -> float:
        return self.config.initializer_range

    def _init_rule(self, module_name: str, module: nn.Module, param_name: str) -> tuple[str, float]:
        """How a parameter is initialized: ``("normal", std)``, ``("ones", 0)`` or ``("zeros", 0)``."""
        if isinstance(module, nn.LayerNorm) or any(norm in type(module).__name__ for norm in ("LayerNorm", "RMSNorm")):
            return ("ones", 0.0) if param_name == "weight" else ("zeros", 0.0)
        if param_name == "bias":
            return ("zeros", 0.0)
        return ("normal", self._init_std(module_name))

    def initialize_weights(self):
        # transformers calls _init_weights once per module: name the modules once, not per call.
        self._module_names = {id(m): n for n, m in self.named_modules()}
        try:
            super().initialize_weights()
        finally:
            del self._module_names

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Direct construction (``Model(config)``), or a module transformers' loading left uninitialized:
        # initialize the local shards (and the buffers) in place.
        self._init_buffers(module)
        params = list(module.named_parameters(recurse=False))
        if not params:
            return
        names = self.__dict__.get("_module_names")
        if names is None:  # a body's own init, which transformers dispatches to it inside its head's
            names = {id(m): n for n, m in self.named_modules()}
        module_name = names.get(id(module), "")
        for param_name, param in params:
            kind, std = self._init_rule(module_name, module, param_name)
            if kind == "normal":
                param.normal_(0.0, std)
            elif kind == "ones":
                param.fill_(1.0)
            else:
                param.zero_()

    def _seeded_global_init(self, name: str, global_shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The full initial value of parameter ``name``: a function of (seed, name) only, so the merged
        weights are the same at every tensor-parallel size."""
        module_name, _, param_name = name.rpartition(".")
        kind, std = self._init_rule(module_name, self.get_submodule(module_name), param_name)
        if kind == "ones":
            return torch.ones(global_shape)
        if kind == "zeros":
            return torch.zeros(global_shape)
        # A tie target on another stage than its source (lm_head.weight) starts as the source does.
        # (Only tie targets can be copies: the map walks every parameter, so do not build it for each.)
        seed_name = self.cross_stage_tied_copies().get(name, name) if name in ties.tie_targets(self) else name
        generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(seed_name.encode())) % (2**63))
        return torch.empty(global_shape).normal_(0.0, std, generator=generator)

    def _seeded_local_init(self, name: str, spec: ShardSpec | None, global_shape: tuple[int, ...]) -> torch.Tensor:
        full = self._seeded_global_init(name, global_shape, self.parallel_context.seed)
        if spec is None:
            return full
        return spec.slice_of(full)

    # ---- construction (see oslo.models.build) ------------------------------------------------
    def _init_buffers(self, module: nn.Module) -> None:
        """Give ``module``'s own buffers their values (an architecture with buffers overrides this, as
        transformers' ``_init_weights`` does for them: BERT's ``position_ids``, GPT-Neo's attention masks).

        The model is built on the meta device, where a buffer computed in ``__init__`` (``torch.arange``)
        gets no values; leaving meta allocates it uninitialized. Called once per module after the build.
        """

    @classmethod
    def from_config_with_parallel(
        cls,
        config: PretrainedConfig,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        micro_batch_size: int = 1,
        resize_token_embeddings: int | None = None,
        seed: int | None = None,
        dtype: torch.dtype | str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        parallel_context: ParallelContext | None = None,
        timeout: timedelta | float | None = None,
        deployment: bool = False,
        sequence_parallel: bool = False,
        virtual_pipeline_size: int = 1,
    ):
        """A randomly initialized model, split across ranks.

        The same ``seed`` gives the same merged weights at any ``tensor_parallel_size``. Each rank
        allocates only its shards.

        Args:
            config: The model's transformers config (never modified to hold local sizes).
            tensor_parallel_size: Ranks each layer is split across.
            pipeline_parallel_size: Pipeline stages (contiguous ranges of blocks).
            micro_batch_size: Micro-batch size of pipeline parallelism (no effect without it).
            resize_token_embeddings: Vocabulary size to build with instead of ``config.vocab_size``.
            seed: Seed of initialization and of the model's dropout/sampling streams.
            dtype: Parameter dtype (default float32); ``torch_dtype`` is its older name.
            attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
            parallel_context: An existing context to share (sizes must match).
            timeout: How long a collective waits for the other ranks before failing with an error
                (``timedelta`` or seconds; default 10 minutes). See :class:`~oslo.parallel.ParallelContext`.
            deployment: Run the model in ``tensor_parallel_size * pipeline_parallel_size`` worker processes
                that this call starts (from a plain ``python`` process, no launcher), and return a
                :class:`~oslo.deployment.DeployedModel` that drives them. See :mod:`oslo.deployment`.
            sequence_parallel: Megatron's sequence parallelism at ``tensor_parallel_size`` > 1: the activations
                between the tensor-parallel regions of each block (norms, dropout, residual adds) are split along
                the sequence across the tensor-parallel ranks. Every oslo class has it. See
                :mod:`oslo.parallel.sequence`.
            virtual_pipeline_size: Chunks of layers per pipeline stage (interleaved 1F1B): each stage holds
                ``virtual_pipeline_size`` non-contiguous pieces of the model and a training step runs the
                interleaved schedule, whose idle time is about ``1 / virtual_pipeline_size`` of 1F1B's. Needs
                ``pipeline_parallel_size`` > 1. See :func:`oslo.parallel.pipeline.interleaved_order`.

        Returns:
            The model, in training mode as transformers' ``from_config`` leaves it (with ``deployment=True``:
            a :class:`~oslo.deployment.DeployedModel`).
        """
        return build.from_config_with_parallel(
            cls, config, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            micro_batch_size=micro_batch_size, resize_token_embeddings=resize_token_embeddings, seed=seed,
            dtype=dtype, torch_dtype=torch_dtype, attn_implementation=attn_implementation,
            parallel_context=parallel_context, timeout=timeout, deployment=deployment,
            sequence_parallel=sequence_parallel, virtual_pipeline_size=virtual_pipeline_size)

    @classmethod
    def from_pretrained_with_parallel(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        micro_batch_size: int = 1,
        resize_token_embeddings: int | None = None,
        seed: int | None = None,
        dtype: torch.dtype | str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        parallel_context: ParallelContext | None = None,
        timeout: timedelta | float | None = None,
        config: PretrainedConfig | None = None,
        deployment: bool = False,
        sequence_parallel: bool = False,
        virtual_pipeline_size: int = 1,
        **kwargs,
    ):
        """Load a checkpoint split across ranks; each rank reads only its own slices.

        Reads a merged Hugging Face checkpoint (safetensors, sharded or not, or ``pytorch_model.bin``
        loaded with ``weights_only=True``) or a split checkpoint written by
        :meth:`save_pretrained_with_parallel` at any layout (at another one, each rank reads the parts of
        the saved slices that make up its own), or the original OSLO's split files
        (``pytorch_model_tp_0_pp_0.bin``).

        A name that is not a local path (``"gpt2"``, ``"org/name"``) is resolved through the Hugging Face cache
        as transformers' ``from_pretrained`` resolves it (downloading what is missing; offline, with
        ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``, only the cache is read): one process per machine
        (``LOCAL_RANK`` 0) downloads, the others wait for it and read the cache, and a failure raises on every
        rank. See :mod:`oslo.hub`.

        Args:
            pretrained_model_name_or_path: Directory of the checkpoint, or a Hub repository id (a path that
                exists wins, as in transformers).
            tensor_parallel_size: Ranks each layer is split across (must divide the attention heads).
            pipeline_parallel_size: Pipeline stages (contiguous ranges of blocks).
            micro_batch_size: Micro-batch size of pipeline parallelism (no effect without it).
            resize_token_embeddings: New vocabulary size; added rows are initialized like new weights.
            seed: Seed of the model's dropout/sampling streams and of any newly initialized weights.
            dtype: Parameter dtype; ``"auto"`` or ``None`` keeps the checkpoint's (``torch_dtype`` is
                its older name).
            attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
            parallel_context: An existing context to share (sizes must match).
            timeout: How long a collective waits for the other ranks before failing with an error
                (``timedelta`` or seconds; default 10 minutes). See :class:`~oslo.parallel.ParallelContext`.
            config: The model's config, instead of the directory's ``config.json`` (as in transformers;
                needed for a checkpoint saved with ``save_config=False``).
            revision, cache_dir, token, local_files_only, force_download, proxies, subfolder: For a Hub
                name, as in transformers: the branch, tag or commit (default ``"main"``), the cache (default
                ``HF_HUB_CACHE``), the token of a private or gated repository, reading the cache only,
                downloading again, proxies (huggingface_hub ignores them: set ``HTTPS_PROXY``), and the
                repository's folder holding the checkpoint (``subfolder`` also applies to a local directory).
            deployment: Run the model in ``tensor_parallel_size * pipeline_parallel_size`` worker processes
                that this call starts (from a plain ``python`` process, no launcher), each loading only its
                shard, and return a :class:`~oslo.deployment.DeployedModel` that drives them. Refused with a
                ``ValueError`` under a launcher. See :mod:`oslo.deployment`.
            sequence_parallel: Megatron's sequence parallelism at ``tensor_parallel_size`` > 1: the activations
                between the tensor-parallel regions of each block (norms, dropout, residual adds) are split along
                the sequence across the tensor-parallel ranks. Every oslo class has it. See
                :mod:`oslo.parallel.sequence`.
            virtual_pipeline_size: Chunks of layers per pipeline stage (interleaved 1F1B): each stage holds
                ``virtual_pipeline_size`` non-contiguous pieces of the model and a training step runs the
                interleaved schedule, whose idle time is about ``1 / virtual_pipeline_size`` of 1F1B's. Needs
                ``pipeline_parallel_size`` > 1. See :func:`oslo.parallel.pipeline.interleaved_order`.
            **kwargs: Config overrides, as in transformers (``pad_token_id=0``, ``dropout=...``).

        Returns:
            The model in evaluation mode, as transformers' ``from_pretrained`` returns it (with
            ``deployment=True``: a :class:`~oslo.deployment.DeployedModel`).
        """
        return build.from_pretrained_with_parallel(
            cls, pretrained_model_name_or_path, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, micro_batch_size=micro_batch_size,
            resize_token_embeddings=resize_token_embeddings, seed=seed, dtype=dtype, torch_dtype=torch_dtype,
            attn_implementation=attn_implementation, parallel_context=parallel_context, timeout=timeout,
            config=config, deployment=deployment, sequence_parallel=sequence_parallel,
            virtual_pipeline_size=virtual_pipeline_size, **kwargs)

    # ---- saving ------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``.

        A model split over several processes (tensor or pipeline parallel) saves as transformers saves a model it
        split itself: every rank calls it, ``is_main_process`` says which one writes (accelerate's recipe:
        ``save_pretrained(dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)``),
        and the files are a plain transformers checkpoint (:meth:`save_pretrained_with_parallel` with
        ``save_with_merging=True``, written by rank 0; ``max_shard_size``, ``safe_serialization`` and
        ``save_function`` as there). Without ``is_main_process`` it raises: called on the main process alone, as
        one saves a data-parallel replica, it would wait for the other ranks.

        Raises:
            RuntimeError: a split model, without ``is_main_process``.
            ValueError: a split model with ``state_dict`` (its tensors are gathered from the ranks) or
                ``push_to_hub`` (oslo has no hub access).
        """
        context = self.parallel_context
        if context.tensor_parallel_size * context.pipeline_parallel_size > 1 or ckpt.saving_whole(self):
            if args or ("is_main_process" not in kwargs and not ckpt.saving_whole(self)):
                raise RuntimeError(
                    f"save_pretrained of a model split over {context.world_size} processes gathers its weights from "
                    "every rank. Call it on every rank with is_main_process=(rank == 0), as transformers saves a "
                    "tensor-parallel model (the main process writes a plain transformers checkpoint), or call "
                    "save_pretrained_with_parallel(save_directory, save_with_merging=True) on every rank (without "
                    "save_with_merging for a split checkpoint)."
                )
            refused = [name for name in ("state_dict", "push_to_hub") if kwargs.get(name)]
            if refused:
                raise ValueError(
                    f"save_pretrained of a split model does not take {', '.join(refused)}: it gathers the model's "
                    "own weights from every rank and writes them to save_directory. Call it without them."
                )
            options = {name: kwargs[name] for name in ("max_shard_size", "safe_serialization", "save_function")
                       if kwargs.get(name) is not None}
            self.save_pretrained_with_parallel(save_directory, save_with_merging=True, **options)
            return None
        if is_distributed(self) and kwargs.get("state_dict") is None:
            # Data-parallel replicas of an unsplit model: its DTensors hold the whole weights (what safetensors
            # cannot write as DTensors): the plain tensors under the same names.
            kwargs["state_dict"] = {name: tensor.to_local() if isinstance(tensor, DTensor) else tensor
                                    for name, tensor in self.state_dict().items()}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; under pipelines a copy of a weight tied across stages (GPT2's
        ``lm_head`` on the last stage) that the state dict lacks takes its twin's value when the state dict has
        that: transformers' files never hold the tied copy, which in one process is the same parameter."""
        if is_distributed(self) and trains_plain_leaves(self):
            follow_storages(self)  # the DTensors must view the storages that train (moved by DeepSpeed, `.to()`)
        copies = self.cross_stage_tied_copies() if self.parallel_context.pipeline_parallel_size > 1 else {}
        missing = {copy: twin for copy, twin in copies.items() if copy not in state_dict and twin in state_dict}
        if missing:
            state_dict = {**state_dict, **{copy: state_dict[twin] for copy, twin in missing.items()}}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def save_pretrained_with_parallel(
        self,
        save_directory: str | os.PathLike,
        save_with_merging: bool = False,
        save_config: bool = True,
        safe_serialization: bool | None = None,
        max_shard_size: int | str = "5GB",
        save_function: Callable[[dict, str], None] | None = None,
        is_main_process: bool = True,
        push_to_hub: bool = False,
        variant: str | None = None,
        token: str | bool | None = None,
    ) -> None:
        """Save a split or a merged checkpoint. Call it on every rank.

        Split (default): one ``model_tp={t}_pp={p}.safetensors`` per model-parallel rank, with
        ``config.json`` and ``model_parallel.index.json`` (layout, global shapes, dtypes, file
        contents). Merged: a plain Hugging Face checkpoint that ``transformers`` loads as is (sharded by
        ``max_shard_size``; ``safe_serialization=False`` writes ``pytorch_model.bin``).

        The checkpoint is written to a staging directory beside ``save_directory`` and, once every rank
        has finished, swapped in with one atomic rename (other files of ``save_directory`` are carried
        over), so a save killed at any instant leaves the complete old checkpoint or the complete new
        one. The files' sizes and SHA-256 digests are recorded (split index; ``oslo_checkpoint.json``
        beside a merged one) and checked when oslo loads them.

        Args:
            save_directory: Target directory (created if needed).
            save_with_merging: Write a merged (plain transformers) checkpoint.
            save_config: Also write ``config.json`` (and ``generation_config.json``). A checkpoint
                without it loads only with ``config=`` given to :meth:`from_pretrained_with_parallel`.
            safe_serialization: safetensors (the default) or ``.bin`` files of tensors (``torch.save``).
            max_shard_size: Largest merged shard, as in transformers (``"5GB"``, ``"200MB"`` or bytes).
            save_function: ``save_function(tensors, path)`` writes each ``.bin`` weight file instead of
                ``torch.save`` (as in transformers' ``save_pretrained``); it implies
                ``safe_serialization=False``.
            is_main_process: transformers' flag (``accelerator.is_main_process``, say), taken and not needed:
                every rank calls this save and oslo picks the ranks that write.
            push_to_hub, variant, token: transformers' options; only their defaults are taken (a ``ValueError``
                otherwise): save, then upload the directory with ``huggingface_hub``'s ``upload_folder``.
        """
        del is_main_process, token  # every rank saves together; nothing is uploaded
        if push_to_hub or variant is not None:
            raise ValueError(
                f"save_pretrained_with_parallel does not take push_to_hub={push_to_hub!r} or variant={variant!r}: it "
                "writes the weights under transformers' default names, on this machine. Save, then upload the "
                "directory with huggingface_hub.upload_folder(folder_path=..., repo_id=...) from one process."
            )
        if save_function is not None:
            if safe_serialization:
                raise ValueError(
                    "save_function writes .bin weight files, safe_serialization=True writes safetensors with "
                    "safetensors' own writer: pass one of them (save_function alone implies safe_serialization=False)."
                )
            if not callable(save_function):
                raise TypeError(f"save_function must be callable as save_function(tensors, path): {save_function!r}")
            safe_serialization = False
        elif safe_serialization is None:
            safe_serialization = True
        directory = os.fspath(save_directory)
        if save_with_merging:
            size = convert_file_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
            ckpt.save_merged(self, directory, safe_serialization, size, save_config, save_function)
        else:
            ckpt.save_split(self, directory, safe_serialization, save_config, save_function)

    def save_parallelized(self, save_directory: str | os.PathLike, merge_checkpoints: bool = False, **kwargs) -> None:
        """Save this model's checkpoint, as OSLO's tutorials do (the model of :func:`oslo.initialize`). Call it on
        every rank.

        The same as :meth:`save_pretrained_with_parallel` with ``save_with_merging=merge_checkpoints``: a split
        checkpoint (one ``model_tp={t}_pp={p}.safetensors`` per model-parallel rank and its index), or, with
        ``merge_checkpoints=True``, a plain transformers checkpoint that ``from_pretrained`` loads as is.

        Args:
            save_directory: Target directory (created if needed).
            merge_checkpoints: Write a merged (plain transformers) checkpoint instead of a split one.
            **kwargs: ``save_config``, ``safe_serialization``, ``max_shard_size``, ``save_function`` and transformers'
                ``is_main_process``, as for :meth:`save_pretrained_with_parallel`.
        """
        self.save_pretrained_with_parallel(save_directory, save_with_merging=merge_checkpoints, **kwargs)

    def from_parallelized(self, path: str | os.PathLike):
        """Load a checkpoint into this model's parameters, in place. Call it on every rank.

        Reads a split checkpoint (:meth:`save_parallelized`, :meth:`save_pretrained_with_parallel`, at any layout;
        the original OSLO's ``pytorch_model_tp_0_pp_0.bin`` files too) or a merged one (a plain transformers
        checkpoint); each rank reads only its slices. The parameters stay the same objects, so an optimizer built
        over them keeps training them. Parameters the checkpoint lacks are initialized from the seed, with a
        warning naming them, as :meth:`from_pretrained_with_parallel` does.

        Args:
            path: Directory of the checkpoint.

        Returns:
            The model itself, so that ``model = model.from_parallelized(path)`` works.

        Raises:
            FileNotFoundError: ``path`` holds no checkpoint.
            ValueError: The checkpoint is of another architecture (its ``config.json``), or a tensor's shape
                differs from this model's.
        """
        path = os.fspath(path)
        checkpoint = ckpt.inspect_checkpoint(path)
        expected = type(self).config_class.model_type
        if os.path.isfile(os.path.join(path, "config.json")):
            found = PretrainedConfig.get_config_dict(path)[0].get("model_type")
            if found is not None and found != expected:
                raise ValueError(
                    f"{path!r} holds a {found!r} checkpoint, but {type(self).__name__} is a {expected!r} model: the "
                    f"architectures differ, so its weights cannot be loaded. Load it into a {found!r} model."
                )
        ckpt.complete_legacy_index(checkpoint, type(self), self.config)  # the original OSLO's split files: no index
        ckpt.load_checkpoint(self, checkpoint, self._seeded_local_init)
        return self
