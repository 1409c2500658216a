"""What every oslo model class has: parallel construction, loading, saving, RNG and mpu plumbing."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList
from transformers.utils.hub import convert_file_size_to_int

from oslo import checkpoint as ckpt
from oslo.kernels import FusedNoRepeatNGramLogitsProcessor
from oslo.parallel.clip import clip_grad_norm_
from oslo.parallel.comm import run_on_all_ranks
from oslo.parallel.context import ParallelContext, validate_parallel_size
from oslo.parallel.pipeline import StageLink, pipeline_pass, pipeline_schedule, split_micro_batches
from oslo.parallel.plan import ShardSpec, parameter_specs

logger = logging.getLogger(__name__)


def _resolve_dtype(dtype, torch_dtype) -> torch.dtype | str | None:
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(
            f"got dtype={dtype!r} and torch_dtype={torch_dtype!r}; torch_dtype is the older name of dtype, "
            "pass only one of them."
        )
    dtype = dtype if dtype is not None else torch_dtype
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype={dtype!r} is not a torch dtype; pass e.g. dtype=torch.float16 or dtype='auto'.")


def _validate_pipeline_size(cls, pipeline_parallel_size: int, micro_batch_size: int) -> int:
    pp = validate_parallel_size("pipeline_parallel_size", pipeline_parallel_size)
    validate_parallel_size("micro_batch_size", micro_batch_size)
    if pp > 1 and not cls._supports_pipeline_parallel:
        raise NotImplementedError(
            f"{cls.__name__} does not support pipeline_parallel_size > 1 yet (got {pp}); use "
            "pipeline_parallel_size=1 with tensor or data parallelism for this model."
        )
    return pp


def _gradient_buckets(grads: list[torch.Tensor], bucket_bytes: int = 2**26) -> Iterator[list[torch.Tensor]]:
    """Gradients grouped by dtype into buckets of about ``bucket_bytes``, in parameter order: one
    all-reduce per bucket, and at most one bucket's worth of extra memory."""
    for dtype in sorted({grad.dtype for grad in grads}, key=str):
        bucket, size = [], 0
        for grad in (grad for grad in grads if grad.dtype == dtype):
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


class OsloPreTrainedModel(PreTrainedModel):
    """Base of oslo's model classes: a transformers ``PreTrainedModel`` that knows its parallel layout.

    Construct with :meth:`from_pretrained_with_parallel` or :meth:`from_config_with_parallel`; direct
    construction ``Model(config)`` builds a single-rank model like transformers does.
    """

    _supports_pipeline_parallel = False

    def __init__(self, config: PretrainedConfig, parallel_context: ParallelContext | None = None) -> None:
        super().__init__(config)
        self.parallel_context = parallel_context if parallel_context is not None else ParallelContext()
        self.micro_batch_size = 1

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Rows per micro-batch of pipeline parallelism (no effect without it)."""
        self.micro_batch_size = validate_parallel_size("micro_batch_size", micro_batch_size)

    # ---- weights tied across pipeline stages ---------------------------------------------------
    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # Under pipeline parallelism a tied pair may be split across stages (GPT2's wte on the first,
        # lm_head on the last): only pairs held by this stage are tied by sharing the parameter; the
        # others start equal and get equal gradients (pipeline_gradient_reduction).
        keys = super().get_expanded_tied_weights_keys(all_submodels)
        if self.parallel_context.pipeline_parallel_size == 1:
            return keys
        local = {name for name, _ in self.named_parameters(remove_duplicate=False)}
        return {target: source for target, source in keys.items() if target in local and source in local}

    def cross_stage_tied_weights(self) -> dict[str, str]:
        """``{local parameter: the name of its tied twin on another stage}`` (empty without pipelines).

        The twin of a tie target (``lm_head.weight``) is its source (``transformer.wte.weight``) and
        vice versa. Checkpoints hold the source; both copies start equal and get the same gradients.
        """
        context = self.parallel_context
        if context.pipeline_parallel_size == 1 or not getattr(self.config, "tie_word_embeddings", False):
            return {}
        local = {name for name, _ in self.named_parameters()}
        twins = {}
        for target, source in sorted((self._tied_weights_keys or {}).items()):
            if target in local and source not in local:
                twins[target] = source
            elif source in local and target not in local:
                twins[source] = target
        return twins

    def cross_stage_tied_copies(self) -> dict[str, str]:
        """``{copy: source}`` for this stage's tie targets whose source is on another stage (GPT2's
        ``lm_head.weight`` on the last stage). Merged checkpoints leave them out, as transformers leaves
        out tied weights; gradient clipping counts them once; initialization copies the source."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return {}
        targets = set(self._tied_weights_keys or {})
        return {name: twin for name, twin in self.cross_stage_tied_weights().items() if name in targets}

    def pipeline_gradient_reduction(self) -> Callable[[], None]:
        """What ends a pipeline step once every micro-batch is backpropagated (the schedule calls it).

        Returns a function that (1) sums the gradients a step added to weights tied across the first
        and last stage, so both copies get the gradient the single tied weight would, and (2) averages
        gradients over the data-parallel group, as ``DistributedDataParallel`` would. Gradients
        accumulated before the step (several batches per optimizer step) are not counted twice: the
        snapshot of the tied gradients is taken now, at the start of the step.
        """
        context = self.parallel_context
        parameters = dict(self.named_parameters())
        tied = [parameters[name] for name in sorted(self.cross_stage_tied_weights())]  # same order on both
        before = [param.grad.detach().clone() if param.grad is not None else None for param in tied]

        def reduce() -> None:
            for param, previous in zip(tied, before, strict=True):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                torch.distributed.all_reduce(param.grad, group=context.embedding_group)
                if previous is not None:  # both stages held it, and both added it
                    param.grad.sub_(previous)
            if context.data_parallel_size > 1:
                for bucket in _gradient_buckets([param.grad for param in self.parameters() if param.grad is not None]):
                    flat = torch.cat([grad.reshape(-1) for grad in bucket])
                    torch.distributed.all_reduce(flat, group=context.data_parallel_group)
                    flat.div_(context.data_parallel_size)
                    for grad, value in zip(bucket, flat.split([grad.numel() for grad in bucket]), strict=True):
                        grad.copy_(value.view_as(grad))

        return reduce

    # ---- body + head, with or without pipeline stages ------------------------------------------
    # Inputs of the head that, all given, make a training step under pipeline parallelism (a loss).
    _pipeline_loss_inputs: tuple[str, ...] = ("labels",)
    _PER_LAYER_OUTPUTS = ("past_key_values", "hidden_states", "attentions")

    def _new_cache(self):
        """A fresh KV cache for a pipeline stage (architectures with another cache type override)."""
        return DynamicCache(config=self.config)

    def _forward_with_head(
        self,
        body: Callable,
        inputs: dict,
        head_inputs: dict,
        head: Callable,
        output_class: type,
        past_key_values=None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        body_kwargs: dict | None = None,
    ):
        """Run ``body`` (the transformer) and ``head`` on its last hidden state.

        Without pipeline parallelism this is ``head(body(**inputs).last_hidden_state, ...)``. With it,
        the body runs stage by stage and the head on the last stage: a call that has the loss inputs
        (``_pipeline_loss_inputs``) while gradients are enabled returns the 1F1B generator of micro-batch
        outputs (each holding ``loss``); any other call is one pass without gradients whose outputs
        every stage receives.

        Args:
            body: Called as ``body(**inputs, past_key_values=..., use_cache=..., return_dict=True, ...)``;
                under pipelines also with ``stage_input`` (what the previous stage sent) and
                ``pipeline_stage=True``.
            inputs: The body's batch inputs (``input_ids``, ``attention_mask``, ...; ``None`` allowed).
            head_inputs: Batch tensors only the head uses (``labels``, ``mc_token_ids``, ...).
            head: ``head(hidden_states, inputs, head_inputs, outputs_needed)`` returns the output fields
                other than the per-layer ones; ``outputs_needed=False`` (pipeline training) means only
                ``loss`` is used.
            output_class: The transformers ``ModelOutput`` to return.
        """
        body_kwargs = body_kwargs or {}
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        fields = list(output_class.__dataclass_fields__)
        context = self.parallel_context
        if context.pipeline_parallel_size == 1:
            outputs = body(**inputs, past_key_values=past_key_values, use_cache=use_cache, return_dict=True,
                           **body_kwargs)
            values = head(outputs.last_hidden_state, inputs, head_inputs, True)
            values.update({name: getattr(outputs, name) for name in self._PER_LAYER_OUTPUTS if name in fields})
            output = output_class(**values)
            return output if return_dict else output.to_tuple()

        # Per-layer outputs asked for (hidden states, attentions): each stage has its layers' share.
        per_layer = [
            name for name in ("hidden_states", "attentions")
            if name in fields and (body_kwargs.get(f"output_{name}") if body_kwargs.get(f"output_{name}") is not None
                                   else getattr(self.config, f"output_{name}", False))
        ]
        stage_outputs: dict[str, tuple] = {}
        batch = {name: value for name, value in {**inputs, **head_inputs}.items() if value is not None}

        def run_stage(batch: dict, received, cache, outputs_needed: bool):
            body_inputs = {name: batch.get(name) for name in inputs}
            outputs = body(**body_inputs, past_key_values=cache, use_cache=cache is not None, return_dict=True,
                           stage_input=received, pipeline_stage=True, **body_kwargs)
            stage_outputs.update({name: getattr(outputs, name) for name in per_layer})
            if not context.is_pipeline_last_stage():
                return outputs.last_hidden_state
            return head(outputs.last_hidden_state, body_inputs, {name: batch.get(name) for name in head_inputs},
                        outputs_needed)

        def wrap(output):
            return output if return_dict else output.to_tuple()

        if torch.is_grad_enabled() and all(head_inputs.get(name) is not None for name in self._pipeline_loss_inputs):
            if getattr(DistributedDataParallel, "_get_active_ddp_module", lambda: None)() is not None:
                raise RuntimeError(
                    "with pipeline_parallel_size > 1, do not wrap the model in DistributedDataParallel: DDP "
                    "reduces gradients after the first micro-batch's backward only. The pipeline averages "
                    "gradients over the data-parallel group itself after the last micro-batch; call the "
                    "model directly."
                )
            if past_key_values is not None or per_layer:
                raise NotImplementedError(
                    "past_key_values, output_hidden_states and output_attentions are not supported in a pipeline "
                    "training step (its micro-batch outputs hold the loss); run the model under torch.no_grad() "
                    "for them."
                )
            micro_batches = split_micro_batches(batch, self.micro_batch_size)
            return pipeline_schedule(
                context,
                len(micro_batches),
                lambda i, received: run_stage(micro_batches[i], received, None, False),
                micro_output=lambda values, loss: wrap(output_class(loss=loss)),
                last_stage_loss=lambda values: values["loss"],
                after_step=self.pipeline_gradient_reduction(),
            )

        # One pass without gradients. Each stage caches its own layers' keys and values.
        cache = past_key_values
        use_cache = "past_key_values" in fields and (use_cache if use_cache is not None else self.config.use_cache)
        if use_cache and cache is None:
            cache = self._new_cache()
        names = [name for name in fields if name not in self._PER_LAYER_OUTPUTS]
        values = pipeline_pass(context, lambda received: run_stage(batch, received, cache, True), names)
        link = StageLink(context)
        values.update({name: link.gather_stages(stage_outputs[name]) for name in per_layer})
        if "past_key_values" in fields:
            values["past_key_values"] = cache if use_cache else None
        return wrap(output_class(**values))

    # ---- parallel plumbing -------------------------------------------------------------------
    @property
    def mpu(self) -> ParallelContext:
        """The Megatron/DeepSpeed-style model-parallel unit: ranks, sizes and groups."""
        return self.parallel_context

    def __call__(self, *args, **kwargs):
        # Replicated dropout and anything else drawing from the default generator stays in step
        # across tensor-parallel ranks, whatever the user did with the global RNG.
        with self.parallel_context.rng.replicated():
            return super().__call__(*args, **kwargs)

    def generate(self, *args, fused_no_repeat_ngram_blocking: bool = False, **kwargs):
        """transformers' ``generate``; sampling draws from the replicated stream so every rank picks
        the same tokens.

        Args:
            fused_no_repeat_ngram_blocking: Apply ``no_repeat_ngram_size`` with oslo's n-gram blocking
                kernel (vectorized on CPU, Triton on CUDA) instead of transformers' processor. Bans
                exactly the same tokens.
            *args, **kwargs: As for transformers' ``generate``.
        """
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
        with self.parallel_context.rng.replicated():
            return super().generate(*args, **kwargs)

    def fuse(self, modules: Iterable[type[nn.Module]] | None = None):
        """Switch modules to oslo's fused kernels (Triton on CUDA, the torch reference on CPU).

        Every module that has a ``fuse()`` method (for GPT2: ``GPT2MLP`` — bias + GeLU, bias + dropout +
        residual — and ``GPT2Attention`` — scale + mask + softmax, bias + dropout + residual) switches
        in place: parameters, names and checkpoints are unchanged, and so is the math.

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
        return self

    def gpu_modules(self) -> nn.Module:
        """The module holding this rank's parameters, to wrap in ``DistributedDataParallel`` (not with
        pipeline parallelism, whose schedule averages gradients over data-parallel replicas itself)."""
        return self

    def gpu_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, for the optimizer."""
        return self.parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the norm of the whole (unsplit) model; see :func:`oslo.parallel.clip_grad_norm_`."""
        return clip_grad_norm_(self, max_norm, norm_type)

    @classmethod
    def _validate_parallel_config(cls, config: PretrainedConfig, tensor_parallel_size: int) -> None:
        """Raise if ``config`` cannot be split ``tensor_parallel_size`` ways (architectures override)."""

    # ---- initialization ----------------------------------------------------------------------
    def _init_std(self, module_name: str) -> float:
        return self.config.initializer_range

    def _init_rule(self, module_name: str, module: nn.Module, param_name: str) -> tuple[str, float]:
        """How a parameter is initialized: ``("normal", std)``, ``("ones", 0)`` or ``("zeros", 0)``."""
        if isinstance(module, nn.LayerNorm) or "LayerNorm" in type(module).__name__:
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
        # Direct construction (``Model(config)``): initialize the local shards in place.
        module_name = self._module_names.get(id(module), "")
        for param_name, param in module.named_parameters(recurse=False):
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
        seed_name = self.cross_stage_tied_copies().get(name, name) if name in (self._tied_weights_keys or {}) else name
        generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(seed_name.encode())) % (2**63))
        return torch.empty(global_shape).normal_(0.0, std, generator=generator)

    def _seeded_local_init(self, name: str, spec: ShardSpec | None, global_shape: tuple[int, ...]) -> torch.Tensor:
        full = self._seeded_global_init(name, global_shape, self.parallel_context.seed)
        if spec is None:
            return full
        return spec.shard(lambda start, stop: full.narrow(spec.dim, start, stop - start))

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def _build(cls, config: PretrainedConfig, context: ParallelContext, dtype: torch.dtype,
               attn_implementation: str | None):
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        with torch.device("meta"):
            model = cls(config, parallel_context=context)
        # Only this rank's shards are ever allocated. Leaving meta creates new parameter objects,
        # which unties shared weights: tie them again.
        model = model.to(dtype).to_empty(device=context.device)
        model.tie_weights()
        return model

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
    ):
        """A randomly initialized model, split across ranks.

        The same ``seed`` gives the same merged weights at any ``tensor_parallel_size``. Each rank
        allocates only its shards.

        Args:
            config: The model's transformers config (never modified to hold local sizes).
            tensor_parallel_size: Ranks each layer is split across.
            pipeline_parallel_size: Pipeline stages (only 1 for now).
            micro_batch_size: Micro-batch size of pipeline parallelism (no effect without it).
            resize_token_embeddings: Vocabulary size to build with instead of ``config.vocab_size``.
            seed: Seed of initialization and of the model's dropout/sampling streams.
            dtype: Parameter dtype (default float32); ``torch_dtype`` is its older name.
            attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
            parallel_context: An existing context to share (sizes must match).

        Returns:
            The model, in training mode as transformers' ``from_config`` leaves it.
        """
        tp = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
        pp = _validate_pipeline_size(cls, pipeline_parallel_size, micro_batch_size)
        dtype = _resolve_dtype(dtype, torch_dtype)
        dtype = torch.float32 if dtype in (None, "auto") else dtype
        config = config.__class__.from_dict(config.to_dict())  # the caller's config stays as it was
        if resize_token_embeddings is not None:
            config.vocab_size = validate_parallel_size("resize_token_embeddings", resize_token_embeddings)
        cls._validate_parallel_config(config, tp)
        context = cls._context(parallel_context, tp, pp, seed)
        model = cls._build(config, context, dtype, attn_implementation)
        model.set_micro_batch_size(micro_batch_size)

        def initialize():
            specs = parameter_specs(model)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    spec = specs[name]
                    global_shape = spec.global_shape(param.shape) if spec else tuple(param.shape)
                    param.copy_(model._seeded_local_init(name, spec, global_shape))

        run_on_all_ranks(context, initialize, "initializing the model")
        return model

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
        **kwargs,
    ):
        """Load a checkpoint split across ranks; each rank reads only its own slices.

        Reads a merged Hugging Face checkpoint (safetensors, sharded or not, or ``pytorch_model.bin``
        loaded with ``weights_only=True``) or a split checkpoint written by
        :meth:`save_pretrained_with_parallel` with the same layout.

        Args:
            pretrained_model_name_or_path: Directory of the checkpoint.
            tensor_parallel_size: Ranks each layer is split across (must divide the attention heads).
            pipeline_parallel_size: Pipeline stages (only 1 for now).
            micro_batch_size: Micro-batch size of pipeline parallelism (no effect without it).
            resize_token_embeddings: New vocabulary size; added rows are initialized like new weights.
            seed: Seed of the model's dropout/sampling streams and of any newly initialized weights.
            dtype: Parameter dtype; ``"auto"`` or ``None`` keeps the checkpoint's (``torch_dtype`` is
                its older name).
            attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
            parallel_context: An existing context to share (sizes must match).
            **kwargs: Config overrides, as in transformers (``pad_token_id=0``, ``dropout=...``).

        Returns:
            The model in evaluation mode, as transformers' ``from_pretrained`` returns it.
        """
        tp = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
        pp = _validate_pipeline_size(cls, pipeline_parallel_size, micro_batch_size)
        dtype = _resolve_dtype(dtype, torch_dtype)
        path = os.fspath(pretrained_model_name_or_path)
        checkpoint = ckpt.inspect_checkpoint(path)
        config, unused = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **kwargs)
        if unused:
            raise TypeError(
                f"{cls.__name__}.from_pretrained_with_parallel got unexpected keyword argument(s) "
                f"{sorted(unused)}: they are neither oslo options nor attributes of {type(config).__name__}."
            )
        ckpt.check_split_layout(checkpoint, tp, pp)
        if resize_token_embeddings is not None:
            if checkpoint.kind == "split":
                raise NotImplementedError(
                    "resize_token_embeddings is supported when loading merged checkpoints only; save this "
                    "checkpoint with save_with_merging=True first."
                )
            config.vocab_size = validate_parallel_size("resize_token_embeddings", resize_token_embeddings)
        cls._validate_parallel_config(config, tp)
        if dtype in (None, "auto"):
            dtype = getattr(config, "dtype", None) or ckpt.checkpoint_dtype(checkpoint) or torch.float32
            dtype = _resolve_dtype(dtype, None)

        context = cls._context(parallel_context, tp, pp, seed)
        model = cls._build(config, context, dtype, attn_implementation)
        model.set_micro_batch_size(micro_batch_size)
        ckpt.load_checkpoint(
            model, checkpoint, model._seeded_local_init, allow_vocab_resize=resize_token_embeddings is not None
        )
        model.eval()
        return model

    @staticmethod
    def _context(parallel_context: ParallelContext | None, tp: int, pp: int, seed: int | None) -> ParallelContext:
        if parallel_context is None:
            return ParallelContext(tp, pp, seed=seed)
        if (parallel_context.tensor_parallel_size, parallel_context.pipeline_parallel_size) != (tp, pp):
            raise ValueError(
                f"parallel_context has tensor_parallel_size={parallel_context.tensor_parallel_size}, "
                f"pipeline_parallel_size={parallel_context.pipeline_parallel_size} but tensor_parallel_size={tp}, "
                f"pipeline_parallel_size={pp} were requested; pass matching sizes."
            )
        return parallel_context

    # ---- saving ------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, for unsplit models only (use
        :meth:`save_pretrained_with_parallel` otherwise)."""
        context = self.parallel_context
        if context.tensor_parallel_size * context.pipeline_parallel_size > 1:
            raise RuntimeError(
                "save_pretrained would write this rank's shard under the full model's names. Call "
                "save_pretrained_with_parallel(save_directory, save_with_merging=True) on every rank for a "
                "plain transformers checkpoint (or without save_with_merging for a split one)."
            )
        return super().save_pretrained(save_directory, *args, **kwargs)

    def save_pretrained_with_parallel(
        self,
        save_directory: str | os.PathLike,
        save_with_merging: bool = False,
        save_config: bool = True,
        safe_serialization: bool = True,
        max_shard_size: int | str = "5GB",
    ) -> None:
        """Save a split or a merged checkpoint. Call it on every rank.

        Split (default): one ``model_tp={t}_pp={p}.safetensors`` per model-parallel rank, with
        ``config.json`` and ``model_parallel.index.json`` (layout, global shapes, dtypes, file
        contents). Merged: a plain Hugging Face checkpoint that ``transformers`` loads as is (sharded by
        ``max_shard_size``; ``safe_serialization=False`` writes ``pytorch_model.bin``).

        Files are written to a staging folder and moved into place only when every rank has
        finished, so an interrupted save leaves the previous checkpoint intact.

        Args:
            save_directory: Target directory (created if needed).
            save_with_merging: Write a merged (plain transformers) checkpoint.
            save_config: Also write ``config.json`` (and ``generation_config.json``).
            safe_serialization: safetensors (default) or pickle-free ``torch.save`` files.
            max_shard_size: Largest merged shard, as in transformers (``"5GB"``, ``"200MB"`` or bytes).
        """
        directory = os.fspath(save_directory)
        if save_with_merging:
            size = convert_file_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
            ckpt.save_merged(self, directory, safe_serialization, size, save_config)
        else:
            ckpt.save_split(self, directory, safe_serialization, save_config)
