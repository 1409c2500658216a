"""Resizing the vocabulary of a built model: ``model.resize_token_embeddings(len(tokenizer))``, as transformers does it.

The vocabulary is split across the tensor-parallel ranks (and padded to a multiple of their number), and its tensors
sit on the first and the last pipeline stage. A resize is a collective over the whole model (every rank calls it with
the same arguments):

1. the whole old vocabulary tensors (the input embedding, an untied LM head and its bias, a tied head's bias) are
   gathered onto every rank of the model (:func:`~oslo.checkpoint.whole_state_dict` restricted to vocabulary splits);
2. global rank 0 computes the new rows with transformers' own resizing code on plain ``nn.Embedding`` / ``nn.Linear``
   modules holding those tensors, drawing from its random generators as transformers' model of one process would
   (``mean_resizing``: the old rows' mean and covariance; without it the model's ``_init_weights``), and sends them to
   every rank;
3. every layer that splits the vocabulary is given the new size (:func:`~oslo.parallel.layers.resize_vocabulary`) and
   every parameter its new shard, the same parameter objects (ties, pipeline copies and ``requires_grad`` kept);
   the configs' ``vocab_size`` follows.

The whole vocabulary tensors exist on every rank while it runs; the model's other weights are not gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers import PreTrainedModel

from oslo import checkpoint as ckpt
from oslo.parallel.comm import run_on_all_ranks
from oslo.parallel.dtensor import distribute_parameters, is_distributed, undistribute_parameters
from oslo.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, resize_vocabulary
from oslo.parallel.plan import VOCAB, parameter_specs

__all__ = ["resize_token_embeddings"]


class _TransformersResizing:
    """``self`` for transformers' resizing methods of ``PreTrainedModel``, run on plain modules: the model's
    ``_init_weights`` (that of the transformers class of the same name, when there is one) and no quantizer."""

    hf_quantizer = None
    _get_resized_embeddings = PreTrainedModel._get_resized_embeddings
    _get_resized_lm_head = PreTrainedModel._get_resized_lm_head
    _init_added_embeddings_weights_with_mean = PreTrainedModel._init_added_embeddings_weights_with_mean
    _init_added_lm_head_weights_with_mean = PreTrainedModel._init_added_lm_head_weights_with_mean
    _init_added_lm_head_bias_with_mean = PreTrainedModel._init_added_lm_head_bias_with_mean
    _copy_lm_head_original_to_resized = PreTrainedModel._copy_lm_head_original_to_resized

    def __init__(self, model: nn.Module) -> None:
        reference = next((getattr(transformers, cls.__name__) for cls in type(model).__mro__
                          if isinstance(getattr(transformers, cls.__name__, None), type)
                          and issubclass(getattr(transformers, cls.__name__), PreTrainedModel)), None)
        if reference is None:
            self._init_weights = model._init_weights
        else:  # an empty instance of it (its _init_weights calls super()) that reads the model's config
            shadow = reference.__new__(reference)
            shadow.__dict__["config"] = model.config
            self._init_weights = shadow._init_weights


def _new_size(model: nn.Module, new_num_tokens, pad_to_multiple_of, mean_resizing) -> int:
    """The vocabulary size after the resize (``pad_to_multiple_of`` applied); raises on a bad argument, or when an
    adapter holds a vocabulary layer."""
    if new_num_tokens is not None:
        if isinstance(new_num_tokens, bool) or not isinstance(new_num_tokens, int):
            raise TypeError(f"new_num_tokens must be an integer (the new vocabulary size, e.g. len(tokenizer)) or "
                            f"None, got {new_num_tokens!r}.")
        if new_num_tokens < 1:
            raise ValueError(f"new_num_tokens must be at least 1 (the new vocabulary size, e.g. len(tokenizer)), got "
                             f"{new_num_tokens}.")
    # transformers raises ValueError for a pad_to_multiple_of that is not an integer: so does oslo
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                           or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {pad_to_multiple_of!r}.")
    if not isinstance(mean_resizing, bool):
        raise TypeError(f"mean_resizing must be True or False, got {mean_resizing!r}.")
    size = model.config.vocab_size if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of is not None:
        size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
    _refuse_foreign_vocabulary_layers(model)
    return size


def _is_vocabulary_layer(module: nn.Module) -> bool:
    return isinstance(module, VocabParallelEmbedding) or (
        isinstance(module, ColumnParallelLinear) and module.weight_spec.kind == VOCAB)


def _refuse_foreign_vocabulary_layers(model: nn.Module) -> None:
    """An adapter on a vocabulary layer (PEFT's LoRA on ``lm_head``, ``modules_to_save``) would keep the old size:
    refused, as is any vocabulary-split parameter outside oslo's vocabulary layers."""
    wrapped = sorted(name for name, module in model.named_modules()
                     if callable(getattr(module, "get_base_layer", None)) and module.get_base_layer() is not module
                     and _is_vocabulary_layer(module.get_base_layer()))
    owned = {id(param) for module in model.modules() if _is_vocabulary_layer(module)
             for param in module.parameters(recurse=False)}
    named = dict(model.named_parameters())
    foreign = sorted(name for name, spec in parameter_specs(model).items()
                     if spec is not None and spec.kind == VOCAB and id(named[name]) not in owned)
    if wrapped or foreign:
        raise NotImplementedError(
            f"{type(model).__name__}.resize_token_embeddings() cannot resize {wrapped or foreign}: an adapter wraps "
            "or extends the vocabulary layers and would keep the old size. Resize the model before adding adapters "
            "(get_peft_model), as with transformers' models.")


def _agree(context, arguments: tuple) -> None:
    """Raise ``ValueError`` on every rank unless every rank of the model passed the same ``arguments``."""
    if context.world_size == 1:
        return
    every: list[tuple | None] = [None] * context.world_size
    dist.all_gather_object(every, arguments, group=context.world_group)
    if any(other != every[0] for other in every):
        described = "; ".join(f"rank {rank}: {args}" for rank, args in enumerate(every))
        raise ValueError(
            "resize_token_embeddings() was called with different (new_num_tokens, pad_to_multiple_of, mean_resizing) "
            f"on the ranks ({described}): every rank holds part of one vocabulary, so every rank must resize it "
            "to the same size.")


def _roles(model: nn.Module) -> dict[str, str]:
    """``{"input" | "output" | "output_bias": parameter name}`` of the vocabulary tensors, whichever stage holds
    them (the stages of a pipeline tell each other)."""
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
    mine = {}
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings is not None:
        mine["input"] = names[id(embeddings.weight)]
    if head is not None:
        mine["output"] = names[id(head.weight)]
        if getattr(head, "bias", None) is not None:
            mine["output_bias"] = names[id(head.bias)]
    context = model.parallel_context
    if context.pipeline_parallel_size == 1:
        return mine
    stages: list[dict | None] = [None] * context.pipeline_parallel_size
    dist.all_gather_object(stages, mine, group=context.pipeline_parallel_group)
    return {role: name for stage in stages for role, name in stage.items()}


def _plain(module: nn.Module, **tensors: torch.Tensor | None) -> nn.Module:
    """``module`` (built on the meta device: no random draw) holding ``tensors`` as its parameters."""
    for name, tensor in tensors.items():
        setattr(module, name, None if tensor is None else nn.Parameter(tensor.clone()))
    return module


def _new_rows(model: nn.Module, old: dict[str, torch.Tensor], roles: dict[str, str], size: int,
              mean_resizing: bool) -> dict[str, torch.Tensor]:
    """The rows past the old vocabulary that transformers' resizing gives each tensor named in ``roles``, in the order
    transformers draws them (the input embedding, then an untied LM head)."""
    resizing = _TransformersResizing(model)
    embedding = old[roles["input"]]
    padding_idx = getattr(model.get_input_embeddings(), "padding_idx", None)
    with torch.device("meta"):
        plain_embedding = nn.Embedding(*embedding.shape, padding_idx=padding_idx)
    resized = resizing._get_resized_embeddings(_plain(plain_embedding, weight=embedding), size, None, mean_resizing)
    rows = {"input": resized.weight.detach()[embedding.shape[0]:]}
    drawn = _drawn_roles(old, roles)
    if "output" in drawn:  # an untied head
        weight = old[roles["output"]]
        bias = old[roles["output_bias"]] if "output_bias" in drawn else None
        with torch.device("meta"):
            plain_head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        head = resizing._get_resized_lm_head(_plain(plain_head, weight=weight, bias=bias), size,
                                             mean_resizing=mean_resizing)
        rows["output"] = head.weight.detach()[weight.shape[0]:]
        if bias is not None:
            rows["output_bias"] = head.bias.detach()[bias.shape[0]:]
    return rows


def _drawn_roles(old: dict[str, torch.Tensor], roles: dict[str, str]) -> list[str]:
    """The roles whose new rows transformers draws: the input embedding's, and an untied head's (weight, bias)."""
    drawn = ["input"]
    if "output" in roles and old[roles["output"]] is not old[roles["input"]]:
        drawn += [role for role in ("output", "output_bias") if role in roles]
    return drawn


def _resized_tensors(model: nn.Module, size: int, mean_resizing: bool) -> dict[str, torch.Tensor]:
    """Every vocabulary-split parameter name (tied names included) mapped to its whole new tensor, the same on every
    rank of the model."""
    context = model.parallel_context
    old = ckpt.whole_state_dict(model, split=VOCAB)
    roles = _roles(model)
    old_size = old[roles["input"]].shape[0]
    added = max(size - old_size, 0)
    rows: dict[str, torch.Tensor] = {}
    if context.rank == 0:  # shrinking too: transformers builds the smaller modules, drawing their initial weights
        rows = _new_rows(model, old, roles, size, mean_resizing)
    elif added:  # filled by rank 0's
        rows = {role: old[roles[role]].new_empty((added, *old[roles[role]].shape[1:]))
                for role in _drawn_roles(old, roles)}
    if added and context.world_size > 1:
        for role in sorted(rows):
            dist.broadcast(rows[role], src=0, group=context.world_group)
    role_of: dict[int, str] = {}  # by tensor: tied names share one (a tied head's weight is the input embedding)
    for role in ("input", "output", "output_bias"):
        if role in roles:
            role_of.setdefault(id(old[roles[role]]), role)
    new: dict[int, torch.Tensor] = {}
    for tensor in {id(t): t for t in old.values()}.values():
        kept, role = tensor[:size], role_of.get(id(tensor))
        if not added:
            new[id(tensor)] = kept.clone()
        elif role in rows:
            new[id(tensor)] = torch.cat([kept, rows[role].to(kept.dtype)])
        elif role == "output_bias":  # a tied head's bias: transformers pads it with zeros when it ties the weights
            new[id(tensor)] = torch.cat([kept, kept.new_zeros((added, *kept.shape[1:]))])
        else:
            raise RuntimeError(f"oslo: a vocabulary-split tensor without a role in resizing: "
                               f"{sorted(name for name, t in old.items() if t is tensor)}")
    return {name: new[id(tensor)] for name, tensor in old.items()}


@torch.no_grad()
def resize_token_embeddings(model: nn.Module, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                            mean_resizing: bool = True) -> nn.Module | None:
    """transformers' ``resize_token_embeddings`` for a built oslo model: see this module's docstring. Returns the input
    embeddings (``None`` on a pipeline stage without them)."""
    context = model.parallel_context
    size = run_on_all_ranks(context, lambda: _new_size(model, new_num_tokens, pad_to_multiple_of, mean_resizing),
                            "checking the arguments of resize_token_embeddings()")
    _agree(context, (new_num_tokens, pad_to_multiple_of, mean_resizing))
    if (new_num_tokens is None and pad_to_multiple_of is None) or size == model.config.vocab_size:
        return model.get_input_embeddings()
    whole = _resized_tensors(model, size, mean_resizing)
    old_size = model.config.vocab_size
    distributed = is_distributed(model)
    plain_leaves = undistribute_parameters(model) if distributed else False
    try:
        resize_vocabulary(model, size)
        specs = parameter_specs(model)
        for name, param in model.named_parameters():
            spec = specs[name]
            if spec is not None and spec.kind == VOCAB:
                param.data = spec.slice_of(whole[name].to(param.device, param.dtype))
                param.grad = None
    finally:
        if distributed:
            distribute_parameters(model, context, plain_leaves=plain_leaves)
    for module in model.modules():  # the model's config and its sub-models' (T5's stacks check their inputs)
        config = getattr(module, "config", None)
        if isinstance(module, PreTrainedModel) and getattr(config, "vocab_size", None) == old_size:
            config.vocab_size = size
    model.config.get_text_config().vocab_size = size
    model.vocab_size = size
    return model.get_input_embeddings()
