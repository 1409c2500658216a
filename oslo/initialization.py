"""``oslo.initialize(model, config)``: a transformers model, parallelized, as OSLO's tutorials write it.

::

    model = transformers.GPT2LMHeadModel.from_pretrained("gpt2")
    optimizer = torch.optim.Adam(model.parameters())
    model = oslo.initialize(model, {"model_parallelism": {"tensor_parallel_size": 4}})

The given model is turned into the oslo class of the same name holding only this rank's slices of its
weights; the given model is consumed (its parameters and buffers are moved to the meta device, so its
memory is not kept alive on every rank). An optimizer built over the given model's parameters keeps
working: before its next step, a global optimizer pre-step hook swaps the retired parameters in its
``param_groups`` for the oslo parameters of the same names.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import weakref
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary
from transformers import PretrainedConfig, PreTrainedModel

from oslo.models import oslo_class, supported_classes
from oslo.models.base import OsloPreTrainedModel
from oslo.models.build import from_state_dict_with_parallel, validate_pipeline_size
from oslo.parallel.context import ParallelContext, validate_parallel_size

__all__ = ["initialize"]

logger = logging.getLogger(__name__)

_SECTION = "model_parallelism"
_TOP_LEVEL_KEYS = (_SECTION,)
_SECTION_KEYS = ("enable", "tensor_parallel_size", "pipeline_parallel_size")
_EXAMPLE = '{"model_parallelism": {"enable": true, "tensor_parallel_size": 2, "pipeline_parallel_size": 1}}'

# A retired (consumed) transformers parameter -> a weak reference to the oslo parameter that replaces it, or
# _ELSEWHERE when this rank holds no part of it (another pipeline stage's layer).
_RETIRED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ELSEWHERE = object()
_CONSUMED: weakref.WeakSet = weakref.WeakSet()  # models given to initialize (their weights are gone)
_HOOK_HANDLE = None


def initialize(model: nn.Module, config: Mapping | str | os.PathLike) -> nn.Module:
    """Parallelize a transformers model: the oslo model of the same class, holding this rank's slices.

    Call it on every rank (under ``torchrun``), with the same model and config. The result has the given
    model's weights, a copy of its config, its dtype and its train/eval mode, and is built on the rank's
    device (its GPU under CUDA, else the CPU). A model built on the meta device (no weights) is initialized
    randomly from the seed, as :meth:`~oslo.models.base.OsloPreTrainedModel.from_config_with_parallel` does.

    The given model is consumed: its parameters and buffers are moved to the meta device (the parameters stay
    the same objects), so its memory is not kept alive next to the parallel model. Use the returned model.

    An optimizer created over the given model's parameters before this call keeps working: before its next
    ``step()``, its retired parameters are replaced by the oslo parameters of the same names (those of this
    rank's pipeline stage; the others are dropped from it). Anything that reads the optimizer's parameters
    before its first step (``torch.amp.GradScaler.unscale_``, DeepSpeed, FSDP) sees the retired ones: for
    those, create the optimizer after ``initialize``.

    Args:
        model: A transformers model of a class oslo has (``GPT2LMHeadModel``, ``BertForMaskedLM``,
            ``T5ForConditionalGeneration``, ``GPTNeoForCausalLM``, ...).
        config: A dict, or the path of a json file holding one::

                {"model_parallelism": {"enable": true, "tensor_parallel_size": 2, "pipeline_parallel_size": 1}}

            ``enable`` defaults to true when the section is there; the sizes default to 1. Without the
            section, or with ``enable`` false, the model is returned as it is.

    Returns:
        The oslo model (or ``model`` itself when model parallelism is not enabled).

    Raises:
        FileNotFoundError: The config file does not exist.
        ValueError: The config is not valid json, has an unknown key, or a size that the model cannot be
            split by; the model's class has no oslo counterpart (the message lists the supported classes).
        TypeError: ``config`` or one of its values has the wrong type; ``model`` is no transformers model.
        NotImplementedError: ``pipeline_parallel_size > 1`` for a class that does not support it.
    """
    layout = _read_layout(config)
    if layout is None:
        return model
    tensor_parallel_size, pipeline_parallel_size = layout
    cls, model_config = _parallel_class(model)
    validate_pipeline_size(cls, pipeline_parallel_size, 1)
    named = list(model.named_parameters(remove_duplicate=False))
    if model in _CONSUMED:
        raise ValueError(
            f"this {type(model).__name__} was already given to oslo.initialize, which consumed it (its parameters "
            "are on the meta device). Use the model that oslo.initialize returned."
        )
    config_copy = model_config.__class__.from_dict(model_config.to_dict())
    cls._validate_parallel_config(config_copy, tensor_parallel_size)
    _check_parameter_names(cls, config_copy, model)

    dtype = model.dtype
    attn_implementation = getattr(model.config, "_attn_implementation", None)
    if all(param.is_meta for _, param in named):
        logger.info("oslo.initialize: the %s has no weights (meta device): initializing it from the seed.",
                    type(model).__name__)
        parallel = cls.from_config_with_parallel(
            model_config, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            dtype=dtype, attn_implementation=attn_implementation,
        )
    else:
        # Tied weights once, under the name transformers saves them by; meta ones are initialized from the seed.
        state_dict = {name: param.detach() for name, param in model.named_parameters() if not param.is_meta}
        parallel = from_state_dict_with_parallel(
            cls, model_config, state_dict, tensor_parallel_size, pipeline_parallel_size, dtype, attn_implementation,
            source=f"the {type(model).__name__} given to oslo.initialize",
        )
        del state_dict
    parallel.train(model.training)
    parallel_params = dict(parallel.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):  # frozen layers stay frozen
        if not param.requires_grad and name in parallel_params:
            parallel_params[name].requires_grad_(False)
    if parallel.can_generate() and getattr(model, "generation_config", None) is not None:
        parallel.generation_config = copy.deepcopy(model.generation_config)
    _retire(model, parallel)
    return parallel


# ---------------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------------
def _read_layout(config: Mapping | str | os.PathLike) -> tuple[int, int] | None:
    """``(tensor_parallel_size, pipeline_parallel_size)`` of ``config``, or ``None`` when model parallelism is
    not enabled."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"oslo.initialize: the config file {path!r} does not exist. Pass the path of a json file such as "
                f"{_EXAMPLE}, or the dict itself."
            )
        with open(path) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"oslo.initialize: the config file {path!r} is not valid json ({exc}). It should hold an "
                    f"object such as {_EXAMPLE} (json has no comments and no trailing commas)."
                ) from exc
        where = f"the config file {path!r}"
    elif isinstance(config, Mapping):
        where = "the config"
    else:
        raise TypeError(
            f"oslo.initialize: config must be a dict or the path of a json file, got {type(config).__name__}. "
            f"Pass e.g. config={_EXAMPLE}."
        )
    if not isinstance(config, Mapping):
        raise ValueError(f"oslo.initialize: {where} must hold a json object such as {_EXAMPLE}, got {config!r}.")
    _refuse_unknown_keys(config, _TOP_LEVEL_KEYS, where, "")
    section = config.get(_SECTION)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(
            f"oslo.initialize: {_SECTION!r} of {where} must be an object such as {_EXAMPLE}, got {section!r}."
        )
    _refuse_unknown_keys(section, _SECTION_KEYS, where, f"{_SECTION}.")
    enable = section.get("enable", True)
    if not isinstance(enable, bool):
        raise TypeError(f"oslo.initialize: {_SECTION}.enable must be true or false, got {enable!r}.")
    if not enable:
        return None
    tensor_parallel_size = validate_parallel_size("tensor_parallel_size", section.get("tensor_parallel_size", 1))
    pipeline_parallel_size = validate_parallel_size("pipeline_parallel_size", section.get("pipeline_parallel_size", 1))
    return tensor_parallel_size, pipeline_parallel_size


def _refuse_unknown_keys(values: Mapping, known: tuple[str, ...], where: str, prefix: str) -> None:
    unknown = [key for key in values if key not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.8)  # a typo, not another feature
        hints.append(f"{prefix}{key}" + (f" (did you mean '{prefix}{close[0]}'?)" if close else ""))
    raise ValueError(
        f"oslo.initialize: unknown key(s) in {where}: {', '.join(hints)}. The known keys"
        f"{' of ' + prefix.rstrip('.') if prefix else ''} are {list(known)}."
    )


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
def _parallel_class(model: nn.Module) -> tuple[type, PretrainedConfig]:
    """The oslo class for ``model`` and the model's config; raises (listing the classes oslo has) otherwise."""
    if isinstance(model, OsloPreTrainedModel):
        raise TypeError(
            f"oslo.initialize got an oslo {type(model).__name__}, which is parallel already: pass the transformers "
            "model (or use this one as it is)."
        )
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"oslo.initialize parallelizes transformers models of the classes oslo has; got a "
            f"{type(model).__module__}.{type(model).__name__}, which is no transformers PreTrainedModel. The "
            f"supported classes are {supported_classes()}."
        )
    try:
        cls, config = oslo_class(model)
    except ValueError as exc:
        raise ValueError(f"oslo.initialize cannot parallelize this model: {exc}") from exc
    import transformers  # noqa: PLC0415 - the lazy module: resolve one class only

    reference = getattr(transformers, cls.__name__, None)
    if reference is None or not isinstance(model, reference) or not isinstance(config, cls.config_class):
        raise ValueError(
            f"oslo.initialize cannot parallelize this {type(model).__module__}.{type(model).__name__}: it is not "
            f"transformers' {cls.__name__} with a {cls.config_class.__name__}, whose parallel version oslo has. "
            f"The supported classes are {supported_classes()}."
        )
    return cls, config


def _check_parameter_names(cls: type, config: PretrainedConfig, model: nn.Module) -> None:
    """Refuse a model whose parameters are not those of the oslo class built from its config (a feature of
    the config that oslo does not have), before any process group is made: never a half-copied model."""
    with torch.device("meta"):
        planned = cls(config, parallel_context=ParallelContext.planning())
    ours = {name for name, _ in planned.named_parameters(remove_duplicate=False)}
    theirs = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if ours != theirs:
        raise ValueError(
            f"oslo.initialize cannot parallelize this {type(model).__name__}: its parameters differ from those of "
            f"oslo's {cls.__name__} for the same config (only in the given model: {sorted(theirs - ours)[:8]}; only "
            f"in oslo's: {sorted(ours - theirs)[:8]}). The model was changed after it was built, or its config uses "
            "a feature oslo does not support."
        )


# ---------------------------------------------------------------------------------------------
# The consumed model and optimizers built over it
# ---------------------------------------------------------------------------------------------
def _retire(model: nn.Module, parallel: nn.Module) -> None:
    """Move ``model``'s parameters (in place: the same objects) and buffers to the meta device, and record, for
    each parameter, the oslo parameter that replaces it on this rank."""
    global _HOOK_HANDLE
    replacements = dict(parallel.named_parameters(remove_duplicate=False))
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # a tied parameter: all its names
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    for key, param in params.items():
        try:  # the same Python object, now on meta: an optimizer holding it holds no memory
            torch.utils.swap_tensors(
                param, nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad))
        except RuntimeError as exc:  # a weak reference to it (torch.compile), or a graph holding it
            logger.debug("oslo.initialize: %s stays allocated until the optimizer's next step (%s)", names[key], exc)
        target = next((replacements[n] for n in names[key] if n in replacements), None)
        _RETIRED[param] = _ELSEWHERE if target is None else weakref.ref(target)
    model.to("meta")  # the buffers (and any parameter the swap left: the module then holds a meta one)
    _CONSUMED.add(model)
    if _HOOK_HANDLE is None:
        _HOOK_HANDLE = register_optimizer_step_pre_hook(_replace_retired_parameters)


def _replace_retired_parameters(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer pre-step hook: swap parameters consumed by :func:`initialize` for their oslo replacements
    (dropping those another pipeline stage trains), moving their optimizer state along. Everything is checked
    before the optimizer is changed, so an error leaves it as it was."""
    if not len(_RETIRED):
        return
    groups = optimizer.param_groups
    if not any(param in _RETIRED for group in groups for param in group["params"]):
        return
    present = {id(param) for group in groups for param in group["params"] if param not in _RETIRED}
    new_params, moves = [], []
    for group in groups:
        params = []
        for param in group["params"]:
            ref = _RETIRED.get(param)
            if ref is None:
                params.append(param)
                continue
            replacement = None if ref is _ELSEWHERE else ref()
            if ref is not _ELSEWHERE and replacement is None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameters of a model given to oslo.initialize, but the "
                    "parallel model that replaced them no longer exists (deleted, or its parameters were replaced, "
                    "e.g. by .to()/.half() after initialize). Create the optimizer after oslo.initialize, over the "
                    "returned model's parameters: optimizer = torch.optim.Adam(model.parameters())."
                )
            state = optimizer.state.get(param)
            if replacement is not None and state:
                _check_state_fits(optimizer, state, replacement)
            moves.append((param, replacement))
            if replacement is not None and id(replacement) not in present:
                present.add(id(replacement))
                params.append(replacement)
        new_params.append(params)
    for param, replacement in moves:
        state = optimizer.state.pop(param, None)
        if replacement is not None and state:
            optimizer.state[replacement] = state
    for group, params in zip(groups, new_params, strict=True):
        group["params"] = params


def _check_state_fits(optimizer: torch.optim.Optimizer, state: dict, replacement: torch.Tensor) -> None:
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and (
                value.shape != replacement.shape or isinstance(value, DTensor) != isinstance(replacement, DTensor)):
            raise RuntimeError(
                f"{type(optimizer).__name__} took steps before oslo.initialize: its state (shape "
                f"{tuple(value.shape)}) is that of the whole weight, not of this rank's parallel parameter "
                f"({tuple(replacement.shape)}). Create the optimizer after oslo.initialize, or take no step before it."
            )
