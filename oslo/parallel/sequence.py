"""Sequence parallelism (Megatron, Korthikanti et al. 2022): between the tensor-parallel regions of a block (its
norms, dropout and residual adds) the activations are split along the sequence across the tensor-parallel ranks
instead of repeated on each, so their memory is divided by the tensor-parallel size for the same bytes on the
wire: a block's column-parallel layers all-gather the shards (reduce-scatter of the gradient) where they copied
the input (all-reduce of the gradient), its row-parallel layers reduce-scatter their partial sums where they
all-reduced them.

:func:`shard_sequences` switches a built model's layers to it (``sequence_parallel=True`` of
``from_pretrained_with_parallel`` / ``from_config_with_parallel``). The body splits its embeddings' output
along the sequence and gathers its final norm's output, so heads and losses see whole sequences; a replicated
parameter applied to shards (a norm's, a row-parallel layer's bias) gets its gradient summed over the
tensor-parallel group, Megatron's rule, and a dropout applied to shards draws its masks from the stream
distinct per rank (:class:`ShardDropout`). What autograd keeps of a gathered input is the shard
(:func:`~oslo.parallel.mappings.keep_sequence_shards`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from oslo.parallel.dtensor import local
from oslo.parallel.layers import ColumnParallelLinear, RowParallelLinear
from oslo.parallel.mappings import copy_to_tensor_parallel
from oslo.parallel.pipeline import StageLayers

__all__ = ["ShardDropout", "added_bias", "dropout_stream", "shard_sequences", "splits_sequences"]


def shard_sequences(model: nn.Module, body: nn.Module, norm: nn.Module | None) -> None:
    """Switch ``model`` (its ``body``'s layers and final ``norm``, on this pipeline stage) to sequence
    parallelism, following its context's :class:`~oslo.parallel.context.SequenceSharding`: every module of the
    layers that has a ``sequence`` attribute (the parallel linear layers, attentions and MLPs reading one input
    in several projections) gets the state, and every replicated parameter of the layers and the norm has its
    gradient summed over the tensor-parallel group."""
    context = model.parallel_context
    if not context.sequence.enabled:
        return
    group = context.tensor_parallel_group
    regions = [layers for layers in body.modules() if isinstance(layers, StageLayers)]
    if norm is not None:
        regions.append(norm)
    for region in regions:
        for module in region.modules():
            if hasattr(module, "sequence"):
                module.sequence = context.sequence
            if replicated := _applied_to_shards(module):
                module.__dict__["_oslo_sequence_summed"] = (replicated, group)
            if type(module) is nn.Dropout:
                module.__class__ = ShardDropout
                module.__dict__["_oslo_sequence"], module.__dict__["_oslo_rng"] = context.sequence, context.rng


class ShardDropout(nn.Dropout):
    """An ``nn.Dropout`` of a block under sequence parallelism: while the block runs on sequence shards its masks
    come from the random stream distinct per tensor-parallel rank, since each rank's shard holds other positions
    (Megatron draws them so); from the replicated one otherwise. A dropout already inside the distinct stream
    (the attention's, over this rank's heads) is unchanged. :func:`shard_sequences` makes a block's dropouts
    this class."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.training and self.p > 0 and self._oslo_sequence.active:
            with self._oslo_rng.split():
                return super().forward(input)
        return super().forward(input)


def added_bias(layer: nn.Module) -> torch.Tensor | None:
    """The bias of ``layer`` (a row-parallel layer called with ``skip_bias_add=True``) for a fused op that adds it
    itself (``fuse()``'s bias + dropout + residual): the tensor the layer's own forward would add, so that its
    gradient is the same. Under sequence parallelism that sums the shards' parts over the tensor-parallel group."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer  # under a PEFT adapter: its layer
    if base.bias is None:
        return None
    bias = local(base.bias, getattr(base, "parallel_specs", {}).get("bias"))
    summed, group = base.__dict__.get("_oslo_sequence_summed", ((), None))
    return copy_to_tensor_parallel(bias, group) if "bias" in summed else bias


def dropout_stream(dropout: nn.Module) -> contextlib.AbstractContextManager:
    """The random stream for a fused op that applies ``dropout``'s probability in its place: the stream distinct
    per rank while ``dropout`` is a :class:`ShardDropout` whose block runs on sequence shards (the masks the module
    itself would draw from), else the current one."""
    if isinstance(dropout, ShardDropout) and dropout.training and dropout._oslo_sequence.active:
        return dropout._oslo_rng.split()
    return contextlib.nullcontext()


def _applied_to_shards(module: nn.Module) -> tuple[str, ...]:
    """The replicated parameters of ``module`` that meet sequence shards: a row-parallel layer's bias (added after
    the reduce-scatter) and a norm's parameters. A plain linear layer of a block (replicated key/value heads) reads
    the gathered input, a column-parallel one its own columns."""
    if isinstance(module, RowParallelLinear):
        return ("bias",) if module.bias is not None else ()
    if isinstance(module, (ColumnParallelLinear, nn.Linear, nn.Embedding)):
        return ()
    specs = getattr(module, "parallel_specs", {})
    return tuple(name for name, param in module.named_parameters(recurse=False)
                 if param is not None and specs.get(name) is None)


def splits_sequences(context, length: int | None) -> bool:
    """Whether a call on sequences of ``length`` splits them under the context's sequence parallelism: when it is
    on and the tensor-parallel size divides the length. A call with gradients and another length is refused
    (every rank, before any collective: the ranks of a model see the same length); one without gradients runs
    such sequences whole (a decoding step)."""
    if length is None or not context.sequence.enabled:
        return False
    tp = context.tensor_parallel_size
    if length % tp and torch.is_grad_enabled():
        raise ValueError(
            f"sequence_parallel=True splits every sequence across the {tp} tensor-parallel ranks: a call with "
            f"gradients needs a length that {tp} divides, got {length}. Pad the batch to a multiple of {tp} (e.g. "
            f"DataCollatorWithPadding(tokenizer, pad_to_multiple_of={tp})), or build the model with "
            "sequence_parallel=False."
        )
    return length % tp == 0

