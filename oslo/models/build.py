"""Building an oslo model: on the meta device (each pipeline stage only its layers), then this rank's shards
allocated, loaded (a checkpoint, a state dict) or initialized from the seed, and distributed (DTensors).

:meth:`~oslo.models.base.OsloPreTrainedModel.from_pretrained_with_parallel` and
:meth:`~oslo.models.base.OsloPreTrainedModel.from_config_with_parallel` are the public entries; they delegate here.
No rank ever materializes the whole model.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from oslo import checkpoint as ckpt
from oslo import hub
from oslo.parallel import ties
from oslo.parallel.comm import run_on_all_ranks
from oslo.parallel.context import ParallelContext, validate_parallel_size, validate_virtual_pipeline_size
from oslo.parallel.dtensor import distribute_parameters
from oslo.parallel.plan import parameter_specs

if TYPE_CHECKING:
    from oslo.models.base import OsloPreTrainedModel


def resolve_dtype(dtype, torch_dtype) -> torch.dtype | str | None:
    """``dtype`` (or its older name ``torch_dtype``: not both) as a ``torch.dtype``, ``"auto"`` or ``None``."""
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


def validate_pipeline_size(cls: type[OsloPreTrainedModel], pipeline_parallel_size: int, micro_batch_size: int) -> int:
    """``pipeline_parallel_size``, checked (and ``micro_batch_size``), if ``cls`` supports pipelines."""
    pp = validate_parallel_size("pipeline_parallel_size", pipeline_parallel_size)
    validate_parallel_size("micro_batch_size", micro_batch_size)
    if pp > 1 and not cls._supports_pipeline_parallel:
        raise NotImplementedError(
            f"{cls.__name__} does not support pipeline_parallel_size > 1 yet (got {pp}); use "
            "pipeline_parallel_size=1 with tensor or data parallelism for this model."
        )
    return pp


def parallel_context_for(
    parallel_context: ParallelContext | None, tp: int, pp: int, seed: int | None, timeout=None,
    sequence_parallel: bool = False, virtual_pipeline_size: int = 1,
) -> ParallelContext:
    """``parallel_context`` if its sizes are ``tp`` x ``pp`` and it splits sequences as asked (else ``ValueError``),
    or a new context of those sizes when it is ``None``."""
    if parallel_context is None:
        return ParallelContext(tp, pp, seed=seed, timeout=timeout, sequence_parallel=sequence_parallel,
                               virtual_pipeline_size=virtual_pipeline_size)
    if (parallel_context.tensor_parallel_size, parallel_context.pipeline_parallel_size) != (tp, pp):
        raise ValueError(
            f"parallel_context has tensor_parallel_size={parallel_context.tensor_parallel_size}, "
            f"pipeline_parallel_size={parallel_context.pipeline_parallel_size} but tensor_parallel_size={tp}, "
            f"pipeline_parallel_size={pp} were requested; pass matching sizes."
        )
    if parallel_context.sequence_parallel != (sequence_parallel and tp > 1):
        raise ValueError(
            f"parallel_context was made with sequence_parallel={parallel_context.sequence_parallel} but "
            f"sequence_parallel={sequence_parallel} was requested: the models of one context split sequences "
            "alike. Pass the context's setting, or a context made with ParallelContext(..., sequence_parallel=...)."
        )
    if parallel_context.virtual_pipeline_size != virtual_pipeline_size:
        raise ValueError(
            f"parallel_context was made with virtual_pipeline_size={parallel_context.virtual_pipeline_size} but "
            f"virtual_pipeline_size={virtual_pipeline_size} was requested: the models of one context cut their "
            "stages alike. Pass the context's setting, or a context made with ParallelContext(..., "
            "virtual_pipeline_size=...)."
        )
    return parallel_context


def validate_sequence_parallel(cls: type[OsloPreTrainedModel], sequence_parallel: bool) -> bool:
    """``sequence_parallel``, checked: a bool, and only for the classes that have it."""
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}.")
    if sequence_parallel and not cls._supports_sequence_parallel:
        raise NotImplementedError(
            f"{cls.__name__} does not support sequence_parallel=True yet: oslo's classes (GPT2, GPT-Neo, BERT, T5, "
            "the Llama family) do. Build it with sequence_parallel=False."
        )
    return sequence_parallel


def build_empty(cls: type[OsloPreTrainedModel], config: PretrainedConfig, context: ParallelContext, dtype: torch.dtype,
                attn_implementation: str | None) -> OsloPreTrainedModel:
    """``cls`` built on the meta device (each pipeline stage its layers), then this rank's shards allocated
    (not initialized), its weights tied again, the tie groups of its stages made and its buffers set."""
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = cls(config, parallel_context=context)  # whole, then pruned to its stage: see oslo.models.stages
    # Only this rank's shards are ever allocated. Leaving meta creates new parameter objects,
    # which unties shared weights: tie them again.
    model = model.to(dtype)
    keep_in_float32(model, dtype)
    model = model.to_empty(device=context.device)
    model.tie_weights()
    ties.build_tie_groups(model)
    initialize_buffers(model)
    return model


def keep_in_float32(model: OsloPreTrainedModel, dtype: torch.dtype) -> None:
    """transformers' rule for a model built in half precision: the modules named in ``_keep_in_fp32_modules``
    stay float32 in float16 (T5's ``wo``: real T5 checkpoints overflow float16 there), those in
    ``_keep_in_fp32_modules_strict`` in float16 and bfloat16. A module is named by any part of its path."""
    keep = set(model._keep_in_fp32_modules or ()) if dtype == torch.float16 else set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(model._keep_in_fp32_modules_strict or ())
    if keep:
        for name, module in model.named_modules():
            if keep & set(name.split(".")):
                module.to(torch.float32)


@torch.no_grad()
def initialize_buffers(model: OsloPreTrainedModel) -> None:
    """Run the model's :meth:`_init_buffers` on every module, and refuse a buffer it left unset (neither written
    in place nor replaced: its version counter and identity are unchanged), rather than let
    uninitialized memory reach a forward pass."""
    before = {name: (buffer, buffer._version) for name, buffer in model.named_buffers() if buffer.numel()}
    if not before:
        return
    for module in model.modules():
        model._init_buffers(module)
    after = dict(model.named_buffers())
    unset = [name for name, (buffer, version) in before.items()
             if after.get(name) is buffer and buffer._version == version]
    if unset:
        raise NotImplementedError(
            f"{type(model).__name__} has buffers that nothing initializes after the meta-device build: {unset}. "
            f"Give them their values in {type(model).__name__}._init_buffers(module) (as transformers' "
            "_init_weights does for buffers)."
        )


def distribute(model: OsloPreTrainedModel) -> None:
    """The last step of a build: with several processes the parameters become DTensors on the
    tensor-parallel mesh (see :mod:`oslo.parallel.dtensor`), at tensor_parallel_size 1 too, so that a
    distributed checkpoint holds the same tensors, of the same shapes, at every layout."""
    if model.parallel_context.world_size > 1:
        distribute_parameters(model, model.parallel_context)
    context = model.parallel_context
    if context.tensor_parallel_size > 1 and context.pipeline_parallel_size == 1:
        # transformers' record of how a loaded model is distributed (never saved: to_dict drops it). Its
        # Trainer reads the data-parallel size here once `tp_size` says the model is tensor parallel.
        from transformers.distributed import DistributedConfig

        model.config.distributed_config = DistributedConfig(
            tp_size=context.tensor_parallel_size, dp_replicate_size=context.data_parallel_size)


def from_config_with_parallel(
    cls: type[OsloPreTrainedModel],
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
    """See :meth:`~oslo.models.base.OsloPreTrainedModel.from_config_with_parallel`."""
    if deployment:
        from oslo.deployment import deploy

        return deploy(cls, "from_config_with_parallel", (config,), dict(
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            micro_batch_size=micro_batch_size, resize_token_embeddings=resize_token_embeddings, seed=seed,
            dtype=dtype, torch_dtype=torch_dtype, attn_implementation=attn_implementation,
            parallel_context=parallel_context, timeout=timeout, sequence_parallel=sequence_parallel,
            virtual_pipeline_size=virtual_pipeline_size))
    tp = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
    pp = validate_pipeline_size(cls, pipeline_parallel_size, micro_batch_size)
    sequence_parallel = validate_sequence_parallel(cls, sequence_parallel)
    virtual_pipeline_size = validate_virtual_pipeline_size(virtual_pipeline_size, pp)
    dtype = resolve_dtype(dtype, torch_dtype)
    dtype = torch.float32 if dtype in (None, "auto") else dtype
    if not isinstance(config, cls.config_class):
        raise TypeError(
            f"config must be a {cls.config_class.__name__} for {cls.__name__}, got {type(config).__name__}: "
            f"the architectures differ. Pass a {cls.config_class.__name__}, or use the class for "
            f"{type(config).__name__}."
        )
    config = config.__class__.from_dict(config.to_dict())  # the caller's config stays as it was
    if resize_token_embeddings is not None:
        config.vocab_size = validate_parallel_size("resize_token_embeddings", resize_token_embeddings)
    cls._validate_parallel_config(config, tp)
    context = parallel_context_for(parallel_context, tp, pp, seed, timeout, sequence_parallel,
                                       virtual_pipeline_size)
    model = build_empty(cls, config, context, dtype, attn_implementation)
    model.set_micro_batch_size(micro_batch_size)

    def initialize():
        specs = parameter_specs(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                spec = specs[name]
                global_shape = spec.global_shape(param.shape) if spec else tuple(param.shape)
                param.copy_(model._seeded_local_init(name, spec, global_shape))

    run_on_all_ranks(context, initialize, "initializing the model")
    distribute(model)
    return model


def from_pretrained_with_parallel(
    cls: type[OsloPreTrainedModel],
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
    """See :meth:`~oslo.models.base.OsloPreTrainedModel.from_pretrained_with_parallel`."""
    if deployment:
        from oslo.deployment import deploy

        return deploy(cls, "from_pretrained_with_parallel", (pretrained_model_name_or_path,), dict(
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            micro_batch_size=micro_batch_size, resize_token_embeddings=resize_token_embeddings, seed=seed,
            dtype=dtype, torch_dtype=torch_dtype, attn_implementation=attn_implementation,
            parallel_context=parallel_context, timeout=timeout, config=config, sequence_parallel=sequence_parallel,
            virtual_pipeline_size=virtual_pipeline_size, **kwargs))
    tp = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
    pp = validate_pipeline_size(cls, pipeline_parallel_size, micro_batch_size)
    sequence_parallel = validate_sequence_parallel(cls, sequence_parallel)
    virtual_pipeline_size = validate_virtual_pipeline_size(virtual_pipeline_size, pp)
    dtype = resolve_dtype(dtype, torch_dtype)
    hub_options = {name: kwargs.pop(name) for name in hub.HUB_OPTIONS if name in kwargs}
    loading = _transformers_loading_options(kwargs)
    path = os.fspath(pretrained_model_name_or_path)
    context = None
    if hub.is_hub_name(path):  # every rank resolves it together: the context comes first
        context = parallel_context_for(parallel_context, tp, pp, seed, timeout, sequence_parallel,
                                       virtual_pipeline_size)
    path = hub.resolve_checkpoint(path, context, **hub_options)
    checkpoint = ckpt.inspect_checkpoint(path)
    _check_weights_format(checkpoint, loading.get("use_safetensors"))
    config, unused = load_config(cls, path, config, kwargs)
    if unused:
        raise TypeError(
            f"{cls.__name__}.from_pretrained_with_parallel got unexpected keyword argument(s) "
            f"{sorted(unused)}: they are neither oslo options nor attributes of {type(config).__name__}."
        )
    config.name_or_path = os.fspath(pretrained_model_name_or_path)  # as transformers: what the caller named
    ckpt.complete_legacy_index(checkpoint, cls, config)  # the original OSLO's split files: no index
    if resize_token_embeddings is not None:
        config.vocab_size = validate_parallel_size("resize_token_embeddings", resize_token_embeddings)
    cls._validate_parallel_config(config, tp)
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or ckpt.checkpoint_dtype(checkpoint) or torch.float32
        dtype = resolve_dtype(dtype, None)

    if context is None:
        context = parallel_context_for(parallel_context, tp, pp, seed, timeout, sequence_parallel,
                                       virtual_pipeline_size)
    _check_device_map(loading.get("device_map"), context)
    model = build_empty(cls, config, context, dtype, attn_implementation)
    model.set_micro_batch_size(micro_batch_size)
    info = ckpt.load_checkpoint(
        model, checkpoint, model._seeded_local_init, allow_vocab_resize=resize_token_embeddings is not None
    )
    model.eval()
    distribute(model)
    return (model, info) if loading.get("output_loading_info") else model


_TRANSFORMERS_LOADING = ("low_cpu_mem_usage", "use_safetensors", "device_map", "output_loading_info", "weights_only")


def _transformers_loading_options(kwargs: dict) -> dict:
    """Take transformers' ``from_pretrained`` loading options out of ``kwargs``: ``low_cpu_mem_usage`` (oslo always
    reads only this rank's slices), ``use_safetensors``, ``device_map`` (the device oslo puts the rank on, or none),
    ``output_loading_info`` (return ``(model, info)``) and ``weights_only`` (oslo reads pickled weights with
    ``weights_only=True`` only)."""
    options = {name: kwargs.pop(name) for name in _TRANSFORMERS_LOADING if name in kwargs}
    if options.get("weights_only", True) is not True:
        raise ValueError(
            "weights_only=False: oslo reads pickled checkpoints (pytorch_model.bin) with torch.load(weights_only=True) "
            "only, which never runs code from the file. Leave weights_only out, or convert the checkpoint to "
            "safetensors."
        )
    return options


def _check_weights_format(checkpoint, use_safetensors: bool | None) -> None:
    """transformers' ``use_safetensors``: ``True`` requires safetensors files, ``False`` pickled ones."""
    if use_safetensors is None:
        return
    safetensors = all(name.endswith(".safetensors") for name in checkpoint.files)
    if bool(use_safetensors) != safetensors:
        raise ValueError(
            f"use_safetensors={use_safetensors}, but {checkpoint.directory} holds "
            f"{'safetensors' if safetensors else 'pickled'} weights ({', '.join(checkpoint.files[:3])}"
            f"{', ...' if len(checkpoint.files) > 3 else ''}): leave use_safetensors out to load them."
        )


def _check_device_map(device_map, context: ParallelContext) -> None:
    """transformers' ``device_map``: oslo puts each rank's shard on the rank's device (the CPU, or
    ``cuda:LOCAL_RANK``); a map naming that device (``"cpu"``, ``{"": "cpu"}``) is accepted, any other refused."""
    if device_map is None:
        return
    target = device_map.get("") if isinstance(device_map, dict) and set(device_map) == {""} else device_map
    try:
        device = torch.device(target) if not isinstance(target, int) else torch.device("cuda", target)
    except (TypeError, RuntimeError):
        device = None
    if device is None or device.type != context.device.type or (
            device.index is not None and device.index != context.device.index):
        raise ValueError(
            f"device_map={device_map!r}: oslo places every rank's shard on the rank's own device ({context.device} "
            "here) and cannot spread one rank's layers over devices. Leave device_map out (or move the model with "
            ".to(...) after loading)."
        )


def load_config(
    cls: type[OsloPreTrainedModel], path: str, config: PretrainedConfig | None, overrides: dict
) -> tuple[PretrainedConfig, dict]:
    """The config of the checkpoint at ``path`` (or the one given) with ``overrides`` applied, and the
    overrides that are not config attributes. Refuses a checkpoint of another architecture."""
    expected = cls.config_class.model_type
    if config is None:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"{path!r} has no config.json (a checkpoint saved with save_config=False?): the weights alone "
                f"do not say the model's sizes. Pass config={cls.config_class.__name__}(...) (or "
                f"{cls.config_class.__name__}.from_pretrained(dir_with_config_json)) to "
                "from_pretrained_with_parallel, or copy the model's config.json into the directory."
            )
        found = PretrainedConfig.get_config_dict(path)[0].get("model_type")
        if found is not None and found != expected:
            raise ValueError(
                f"{path!r} holds a {found!r} checkpoint, but {cls.__name__} is a {expected!r} model: the "
                f"architectures differ, so its weights cannot be loaded. Load it with the class for {found!r}."
            )
        return cls.config_class.from_pretrained(path, return_unused_kwargs=True, **overrides)
    if not isinstance(config, cls.config_class):
        raise TypeError(
            f"config must be a {cls.config_class.__name__} for {cls.__name__}, got {type(config).__name__}."
        )
    config = config.__class__.from_dict(config.to_dict())  # the caller's config stays as it was
    unused = {}
    for name, value in overrides.items():
        if hasattr(config, name):
            setattr(config, name, value)
        else:
            unused[name] = value
    return config, unused


def from_state_dict_with_parallel(
    cls: type[OsloPreTrainedModel],
    config: PretrainedConfig,
    state_dict: dict[str, torch.Tensor],
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    source: str = "the given state dict",
):
    """The model split across ranks, each rank copying only its slices of ``state_dict`` (full tensors under
    transformers' names, e.g. a transformers model's parameters: :func:`oslo.initialize`). Parameters the
    dict lacks are initialized from the seed, with a warning naming them (as a checkpoint load does).

    Args:
        config: The model's config (copied; the caller's stays as it was).
        state_dict: ``{name: full tensor}``; every rank reads only its slices of it.
        dtype: Parameter dtype (default float32).
        source: A few words naming where the tensors come from, for messages.

    Returns:
        The model, in training mode (set the mode you need).
    """
    tp = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
    pp = validate_pipeline_size(cls, pipeline_parallel_size, 1)
    dtype = resolve_dtype(dtype, None)
    dtype = torch.float32 if dtype in (None, "auto") else dtype
    if not isinstance(config, cls.config_class):
        raise TypeError(
            f"config must be a {cls.config_class.__name__} for {cls.__name__}, got {type(config).__name__}."
        )
    config = config.__class__.from_dict(config.to_dict())  # the caller's config stays as it was
    cls._validate_parallel_config(config, tp)
    context = parallel_context_for(None, tp, pp, None)
    model = build_empty(cls, config, context, dtype, attn_implementation)
    checkpoint = ckpt.Checkpoint(directory=source, kind="memory", files=[], state_dict=state_dict)
    ckpt.load_checkpoint(model, checkpoint, model._seeded_local_init)
    distribute(model)
    return model
