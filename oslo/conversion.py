"""A rank's slices of a transformers state dict, without building the model or starting processes.

:func:`convert_state_dict` is the ``tensor_parallel`` library's helper of the same name for oslo models: given
a full or partial state dict of a transformers model (one file of a sharded checkpoint is enough), it returns
what tensor-parallel rank ``rank`` of ``tensor_parallel_size`` holds of each tensor — in the layout of oslo's
split checkpoint files and of the plain shards ``model.gpu_modules()`` trains (a vocabulary padded with zero
rows to a multiple of the size, GPT2's fused ``c_attn`` as this rank's heads of q, k and v). The model is
built on the meta device only to read how each parameter splits; no tensor of it is allocated.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig

from oslo.checkpoint import resolve_key
from oslo.models import oslo_class
from oslo.parallel.context import validate_parallel_size
from oslo.parallel.plan import ShardSpec, specs_by_name

__all__ = ["convert_state_dict"]


def convert_state_dict(
    state_dict: dict[str, torch.Tensor],
    model_or_config: nn.Module | PretrainedConfig,
    tensor_parallel_size: int,
    rank: int,
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of ``state_dict`` at ``tensor_parallel_size``, under the same keys.

    Args:
        state_dict: Tensors of a transformers model (all of them, or any part: one shard file of a checkpoint).
            Keys with or without the base-model prefix (``transformer.``) are understood.
        model_or_config: The model (a transformers or oslo instance, any device, meta included) or its config
            with ``architectures`` naming the class (``GPT2LMHeadModel``...).
        tensor_parallel_size: Number of tensor-parallel ranks.
        rank: The tensor-parallel rank whose slices to return (``0 <= rank < tensor_parallel_size``).

    Returns:
        ``{key: slice}`` for every key of ``state_dict``: a split weight's slice (a copy; a vocabulary padded
        with zero rows to a multiple of the size, as oslo's split files hold it), a replicated one as given.
        Keys transformers ignores on load (GPT2's attention-mask buffers) are left out.

    Raises:
        ValueError: an invalid size or rank, a key that is no parameter of the model, or a tensor whose shape
            is not the model's.
    """
    tensor_parallel_size = validate_parallel_size("tensor_parallel_size", tensor_parallel_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tensor_parallel_size:
        raise ValueError(f"rank must be an int in [0, {tensor_parallel_size}) for tensor_parallel_size="
                         f"{tensor_parallel_size}, got {rank!r}")
    cls, config = oslo_class(model_or_config)
    model, specs = specs_by_name(cls, config, tensor_parallel_size, rank)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    prefix = getattr(model, "base_model_prefix", "")
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    out, unknown, names = {}, [], set(specs)
    for key, tensor in state_dict.items():
        name = resolve_key(key, names, prefix)  # with or without the base-model prefix
        if name is None:
            if not any(p.search(key) for p in ignore):
                unknown.append(key)
            continue
        spec: ShardSpec | None = specs[name]
        local_shape = shapes[name]
        expected = spec.global_shape(local_shape) if spec is not None else local_shape
        if tuple(tensor.shape) != tuple(expected):
            raise ValueError(f"{key!r} has shape {tuple(tensor.shape)}, but {cls.__name__} with this config "
                             f"expects {tuple(expected)} for {name!r}")
        if spec is None:
            out[key] = tensor
        else:
            out[key] = spec.slice_of(tensor).clone()
    if unknown:
        raise ValueError(f"{len(unknown)} key(s) of the state dict are no parameters of {cls.__name__}: "
                         f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}. Pass the model (or config) the "
                         "state dict belongs to.")
    return out
