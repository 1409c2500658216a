"""Tensor-parallel layers with ``nn.Linear`` / ``nn.Embedding`` signatures.

Each layer holds only this rank's shard and declares, in ``parallel_specs``, how each of its
parameters maps onto the global (checkpoint) tensor. Communication happens in the paired autograd
functions of ``mappings.py``, called visibly in ``forward``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from oslo.parallel import failure
from oslo.parallel.context import ParallelContext
from oslo.parallel.dtensor import gradient_sink, local
from oslo.parallel.loss import causal_lm_loss, linear_cross_entropy
from oslo.parallel.mappings import (
    all_reduce,
    gather_from_tensor_parallel,
    gather_sequence,
    group_size,
    reduce_from_tensor_parallel,
    reduce_scatter_sequence,
    scatter_to_tensor_parallel,
)
from oslo.parallel.plan import COLUMN, ROW, VOCAB, ShardSpec


class _SharedOnCopy:
    """``copy.deepcopy`` of a parallel layer (PEFT's ``modules_to_save`` trains a copy of the layer) shares what ties
    the layer to its model's processes: its process group (which cannot be copied) and its sequence-parallel state
    (which the model switches on and off for all its layers). The rest is copied as torch copies a module."""

    def __deepcopy__(self, memo):
        for name in ("group", "sequence"):
            value = self.__dict__.get(name)
            if value is not None:
                memo.setdefault(id(value), value)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if not transposed:
        return F.linear(x, weight, bias)
    # Conv1D layout (in, out), computed exactly as transformers' Conv1D does.
    out_shape = x.shape[:-1] + (weight.size(1),)
    flat = x.reshape(-1, x.size(-1))
    out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return out.view(out_shape)


class _ColumnParallelLinear(torch.autograd.Function):
    """``x @ W (+ b)`` on this rank's output columns. Backward: the input's gradient (a partial sum over this
    rank's columns) is summed over the group when ``reduce_input_grad`` — the all-reduce runs while the weight's
    gradient is computed, as Megatron-LM does — and the weight's gradient goes to the sink of its view when it
    has one (:class:`~oslo.parallel.dtensor.GradientSink`: a tied embedding adds its rows to it in place)."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed, group, reduce_input_grad):
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.group, ctx.reduce_input_grad = transposed, group, reduce_input_grad
        ctx.bias_dtype, ctx.sink = None if bias is None else bias.dtype, gradient_sink(weight)
        # the backward's matmuls run under the forward's autocast, as autograd's own would on its casts
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        out = _linear(x, weight, bias, transposed)
        # Not a view of the 2-d product (as matmul's own output is not): a loss may overwrite these logits.
        # (A traced program has no views to speak of: the compiler decides what aliases what.)
        return torch.ops.aten._unsafe_view(out, out.shape) if not torch.compiler.is_compiling() and out._is_view() \
            else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            flat_grad = grad.reshape(-1, grad.size(-1))
            grad_x = work = None
            if ctx.needs_input_grad[0]:
                grad_x = (flat_grad @ weight.t() if ctx.transposed else flat_grad @ weight).view(x.shape)
                grad_x = grad_x.to(x.dtype)
                if ctx.reduce_input_grad and torch.compiler.is_compiling():  # (no overlap to start in a trace)
                    grad_x = all_reduce(grad_x, ctx.group, "summing the input gradient over the tensor-parallel group")
                elif ctx.reduce_input_grad:
                    work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
            grad_weight = grad_bias = None
            if ctx.needs_input_grad[1]:
                flat_x = x.reshape(-1, x.size(-1))
                # (in, out) for Conv1D's layout, (out, in) for nn.Linear's: contiguous either way
                grad_weight = (flat_x.t() @ flat_grad if ctx.transposed else flat_grad.t() @ flat_x).to(weight.dtype)
                if ctx.sink is not None:
                    ctx.sink.add(grad_weight)
                    grad_weight = None
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_bias = flat_grad.sum(0).to(ctx.bias_dtype)
        if work is not None:
            failure.wait(work, ctx.group, "summing the input gradient over the tensor-parallel group")
        return grad_x, grad_weight, grad_bias, None, None, None


class _VocabParallelEmbedding(torch.autograd.Function):
    """The rows of this rank's ids (zero for ids outside its slice). Backward: the gradient rows are added into
    the sink of the weight's view, in place (the weight must be a view with a sink: see :func:`_embedding`)."""

    @staticmethod
    def forward(ctx, local_ids, outside, weight, padding_idx):
        ctx.save_for_backward(local_ids, outside)
        ctx.padding_idx, ctx.sink, ctx.weight_meta = padding_idx, gradient_sink(weight), weight.detach()
        return _lookup(local_ids, outside, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        local_ids, outside = ctx.saved_tensors
        ids = local_ids.reshape(-1)
        rows = grad.reshape(ids.numel(), -1)
        skip = outside.reshape(-1) if outside is not None else None
        if ctx.padding_idx is not None:
            padding = ids == ctx.padding_idx
            skip = padding if skip is None else skip | padding
        if skip is not None:
            rows = rows.masked_fill(skip.unsqueeze(-1), 0.0)
        ctx.sink.index_add(ids, rows, like=ctx.weight_meta)
        return None, None, None, None


def _lookup(local_ids: torch.Tensor, outside: torch.Tensor | None, weight: torch.Tensor,
            padding_idx: int | None) -> torch.Tensor:
    """``F.embedding`` of ``local_ids`` with the rows of ``outside`` ids zeroed."""
    embedded = F.embedding(local_ids, weight, padding_idx)
    return embedded if outside is None else embedded.masked_fill(outside.unsqueeze(-1), 0.0)


def _embedding(local_ids: torch.Tensor, outside: torch.Tensor | None, weight: torch.Tensor,
               padding_idx: int | None) -> torch.Tensor:
    """:func:`_lookup`; a weight that is a view with a gradient sink gets its gradient rows added there in place
    (no dense vocabulary-sized gradient of its own)."""
    if torch.is_grad_enabled() and weight.requires_grad and gradient_sink(weight) is not None:
        return _VocabParallelEmbedding.apply(local_ids, outside, weight, padding_idx)
    return _lookup(local_ids, outside, weight, padding_idx)


def _tensor_parallel(parallel_context: ParallelContext | None, layer: nn.Module) -> tuple[object, int, int]:
    """(group, size, rank) of the tensor-parallel group; a single rank without a context (with a warning when
    torch.distributed has several: a layer built without the context is whole on every rank)."""
    if parallel_context is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            warnings.warn(
                f"{type(layer).__name__} was built without parallel_context while torch.distributed runs "
                f"{dist.get_world_size()} processes: it holds its whole weight on every rank (tensor_parallel_size "
                "1). Pass parallel_context=ParallelContext(tensor_parallel_size=...) (or the model's "
                "model.parallel_context) to split it.",
                stacklevel=3,
            )
        return None, 1, 0
    return (parallel_context.tensor_parallel_group, parallel_context.tensor_parallel_size,
            parallel_context.tensor_parallel_rank)


class ColumnParallelLinear(_SharedOnCopy, nn.Module):
    """Linear layer whose output features are split across tensor-parallel ranks.

    Forward: identity on the input (its gradient is all-reduced), local matmul, and an all-gather of
    the output only when ``gather_output=True``. Under sequence parallelism the input arrives as sequence
    shards: it is all-gathered (its gradient reduce-scattered) instead.

    Args:
        in_features: Input size (full on every rank).
        out_features: Global output size.
        bias: Whether to learn an additive bias (split like the output).
        gather_output: Return the full output instead of this rank's slice.
        parallel_context: The model's :class:`ParallelContext` (``None``: a single rank).
        chunks: The output is ``chunks`` concatenated blocks (fused q/k/v: 3), each split separately.
        transposed: Store the weight as ``(in, out)``, the layout of transformers' ``Conv1D`` (GPT2).
        pad_vocab: The output is a vocabulary: pad it to a multiple of the tensor-parallel size.
            Padding columns are zero-weight, never returned by ``gather_output`` and masked by the loss.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        *,
        parallel_context: ParallelContext | None = None,
        chunks: int = 1,
        transposed: bool = False,
        pad_vocab: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group, world, rank = _tensor_parallel(parallel_context, self)
        self.sequence = None  # a block's layer under sequence parallelism: see oslo.parallel.sequence
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.transposed = gather_output, transposed
        kind = VOCAB if pad_vocab else COLUMN
        out_dim = 1 if transposed else 0
        self.weight_spec = ShardSpec(kind, out_dim, out_features, world, rank, chunks)
        local_out = self.weight_spec.local_size
        shape = (in_features, local_out) if transposed else (local_out, in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.parallel_specs = {"weight": self.weight_spec}
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out, device=device, dtype=dtype))
            self.parallel_specs["bias"] = ShardSpec(kind, 0, out_features, world, rank, chunks)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, skip_bias_add: bool = False, input_is_copied: bool = False) -> torch.Tensor:
        """``x @ W_local (+ b_local)``; ``skip_bias_add=True`` leaves the bias to the caller (a fused
        bias + activation kernel). ``input_is_copied=True``: ``x`` already went through
        :func:`~oslo.parallel.mappings.copy_to_tensor_parallel` once for several layers reading it (separate
        q, k, v projections), so its gradient is all-reduced once, not once per layer."""
        bias = None if skip_bias_add else self.bias
        reduce_input_grad = not input_is_copied and group_size(self.group) > 1
        if reduce_input_grad and self.sequence is not None and self.sequence.active:
            x, reduce_input_grad = gather_sequence(x, self.group, self.sequence.dim), False
        if torch.is_grad_enabled() and (reduce_input_grad or gradient_sink(self.weight) is not None):
            out = _ColumnParallelLinear.apply(x, self.weight, bias, self.transposed, self.group, reduce_input_grad)
        else:
            out = _linear(x, self.weight, bias, self.transposed)
        if self.gather_output:
            out = gather_from_tensor_parallel(out, self.group, dim=-1)
            if self.weight_spec.kind == VOCAB and out.size(-1) != self.out_features:
                out = out[..., : self.out_features]
        return out

    def resize_vocabulary(self, out_features: int) -> None:
        """A vocabulary's projection (``pad_vocab=True``): ``out_features`` outputs from now on (the caller gives the
        parameters their new shards)."""
        if self.weight_spec.kind != VOCAB:
            raise ValueError(f"{type(self).__name__} splits {self.weight_spec.kind}s, not a vocabulary: it cannot be "
                             "resized")
        self.out_features = out_features
        self.parallel_specs = {name: dataclasses.replace(spec, global_size=out_features)
                               for name, spec in self.parallel_specs.items()}
        self.weight_spec = self.parallel_specs["weight"]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight_spec.local_size}), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}"
        )


class RowParallelLinear(_SharedOnCopy, nn.Module):
    """Linear layer whose input features are split across tensor-parallel ranks.

    Forward: local matmul on this rank's input slice, all-reduce (sum) of the partial outputs, then
    the bias (replicated) is added once. Under sequence parallelism the partial outputs are reduce-scattered
    into sequence shards instead (the bias's gradient is then summed over the ranks: see
    :func:`~oslo.parallel.sequence.shard_sequences`).

    Args:
        in_features: Global input size.
        out_features: Output size (full on every rank).
        bias: Whether to learn an additive bias (replicated).
        input_is_parallel: The input is already this rank's slice (the output of a
            :class:`ColumnParallelLinear`); otherwise it is split here.
        parallel_context: The model's :class:`ParallelContext` (``None``: a single rank).
        transposed: Store the weight as ``(in, out)``, the layout of transformers' ``Conv1D`` (GPT2).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        *,
        parallel_context: ParallelContext | None = None,
        transposed: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group, world, rank = _tensor_parallel(parallel_context, self)
        self.sequence = None  # a block's layer under sequence parallelism: see oslo.parallel.sequence
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.transposed = input_is_parallel, transposed
        self.single_rank = world == 1
        in_dim = 0 if transposed else 1
        spec = ShardSpec(ROW, in_dim, in_features, world, rank)
        local_in = spec.local_size
        shape = (local_in, out_features) if transposed else (out_features, local_in)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.parallel_specs = {"weight": spec}
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, skip_bias_add: bool = False) -> torch.Tensor:
        """Sum over ranks of ``x_local @ W_local``, plus the bias unless ``skip_bias_add=True`` leaves it
        to the caller (a fused bias + dropout + residual kernel)."""
        bias = None if skip_bias_add else self.bias
        if self.single_rank:
            return _linear(x, self.weight, bias, self.transposed)
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group, dim=-1)
        out = _linear(x, self.weight, None, self.transposed)
        if self.sequence is not None and self.sequence.active:
            out = reduce_scatter_sequence(out, self.group, self.sequence.dim)
        else:
            out = reduce_from_tensor_parallel(out, self.group)
        return out + bias if bias is not None else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.parallel_specs['weight'].local_size}), "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )


class VocabParallelEmbedding(_SharedOnCopy, nn.Module):
    """Embedding whose vocabulary rows are split across tensor-parallel ranks.

    Each rank looks up the ids it owns, zeroes the rows of ids it does not, and the partial results
    are summed with one all-reduce. The vocabulary is padded to a multiple of the tensor-parallel size;
    padding rows are never looked up.

    Args:
        num_embeddings: Global vocabulary size.
        embedding_dim: Embedding size.
        padding_idx: As in ``nn.Embedding``: this row gets no gradient.
        parallel_context: The model's :class:`ParallelContext` (``None``: a single rank).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        parallel_context: ParallelContext | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group, world, rank = _tensor_parallel(parallel_context, self)
        self.embedding_dim = embedding_dim
        self.single_rank = world == 1
        self.padding_idx = padding_idx
        self._split_vocabulary(ShardSpec(VOCAB, 0, num_embeddings, world, rank))
        local_rows = self.weight_spec.local_size
        self.weight = nn.Parameter(torch.empty(local_rows, embedding_dim, device=device, dtype=dtype))

    def _split_vocabulary(self, spec: ShardSpec) -> None:
        self.num_embeddings, self.weight_spec = spec.global_size, spec
        self.parallel_specs = {"weight": spec}
        self.vocab_start, self.vocab_end = spec.vocab_range()
        self.local_padding_idx = (
            self.padding_idx - self.vocab_start
            if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end
            else None
        )

    def resize_vocabulary(self, num_embeddings: int) -> None:
        """Hold ``num_embeddings`` rows from now on (the caller gives the weight its new shard). A padding index past
        them is dropped, as transformers' ``resize_token_embeddings`` drops it."""
        if self.padding_idx is not None and self.padding_idx >= num_embeddings:
            self.padding_idx = None
        self._split_vocabulary(dataclasses.replace(self.weight_spec, global_size=num_embeddings))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.single_rank:
            return _embedding(input_ids, None, self.weight, self.padding_idx)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embedded = _embedding(local_ids, outside, self.weight, self.local_padding_idx)
        return reduce_from_tensor_parallel(embedded, self.group)

    def extra_repr(self) -> str:
        padding = self.weight_spec.local_size - (self.vocab_end - self.vocab_start)
        rows = f"[{self.vocab_start}, {self.vocab_end})"
        return f"{self.num_embeddings}, {self.embedding_dim}, local rows {rows} + {padding} padding"


class ColumnParallelEmbedding(_SharedOnCopy, nn.Module):
    """Embedding whose embedding dimension (columns) is split across tensor-parallel ranks: each rank looks
    up its own columns of every row, with no communication. T5's relative position bias, a table of
    ``(num_buckets, num_heads)``, is one: each rank holds its attention heads' columns.

    Args:
        num_embeddings: Rows (every rank holds all of them).
        embedding_dim: Global number of columns (split; must be divisible by the tensor-parallel size).
        parallel_context: The model's :class:`ParallelContext` (``None``: a single rank).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        parallel_context: ParallelContext | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group, world, rank = _tensor_parallel(parallel_context, self)  # no communication: saving gathers over it
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight_spec = ShardSpec(COLUMN, 1, embedding_dim, world, rank)
        self.parallel_specs = {"weight": self.weight_spec}
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.weight_spec.local_size, device=device,
                                               dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local columns {self.weight_spec.local_size}"


class VocabParallelLMHead(ColumnParallelLinear):
    """Language-model head whose vocabulary columns are split across tensor-parallel ranks.

    Returns this rank's logits; :meth:`causal_lm_loss` computes the loss from them without gathering,
    and :meth:`gather` assembles the full ``vocab_size`` logits (padding dropped) for the user.

    Args:
        in_features: Hidden size.
        vocab_size: Global vocabulary size.
        bias: Whether to learn a bias per token.
        parallel_context: The model's :class:`ParallelContext` (``None``: a single rank).
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        bias: bool = False,
        *,
        parallel_context: ParallelContext | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            in_features, vocab_size, bias, gather_output=False, parallel_context=parallel_context,
            pad_vocab=True, device=device, dtype=dtype,
        )

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """All-gather the vocabulary columns: ``(..., V_local)`` -> ``(..., vocab_size)``."""
        logits = gather_from_tensor_parallel(local_logits, self.group, dim=-1)
        return logits[..., : self.out_features] if logits.size(-1) != self.out_features else logits

    def loss_from_features(self, features: torch.Tensor, labels: torch.Tensor, *, shift: bool = False,
                           chunk_rows: int | None = None, ignore_index: int = -100) -> torch.Tensor:
        """The summed cross entropy of this projection of ``features`` against ``labels`` (shifted for next-token
        prediction when ``shift``), a chunk of tokens at a time: the logits are never built (see
        :func:`~oslo.parallel.loss.linear_cross_entropy`; ``chunk_rows=None`` chooses from the shapes)."""
        if shift:
            labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        start, stop = self.weight_spec.vocab_range()
        bias = None if self.bias is None else local(self.bias, self.parallel_specs["bias"])
        return linear_cross_entropy(features, local(self.weight, self.weight_spec), bias, labels, vocab_start=start,
                                    valid_columns=stop - start, group=self.group, transposed=self.transposed,
                                    ignore_index=ignore_index, chunk_rows=chunk_rows)

    def causal_lm_loss(self, local_logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """Next-token loss of transformers' ``ForCausalLMLoss`` from this rank's logits (see ``loss.py``)."""
        start, stop = self.weight_spec.vocab_range()
        return causal_lm_loss(local_logits, labels, vocab_start=start, valid_columns=stop - start,
                              group=self.group, **kwargs)


def resize_vocabulary(model: nn.Module, size: int) -> None:
    """Every vocabulary split that ``model``'s modules declare holds ``size`` rows from now on: oslo's vocabulary
    layers (:meth:`VocabParallelEmbedding.resize_vocabulary`, :meth:`ColumnParallelLinear.resize_vocabulary`) and the
    modules that declare a vocabulary split of a tied parameter of theirs (BERT's ``cls.predictions.bias``). The
    parameters are the caller's to give their new shards."""
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding | ColumnParallelLinear):
            if module.weight_spec.kind == VOCAB:
                module.resize_vocabulary(size)
        elif any(spec is not None and spec.kind == VOCAB for spec in getattr(module, "parallel_specs", {}).values()):
            module.parallel_specs = {name: dataclasses.replace(spec, global_size=size)
                                     if spec is not None and spec.kind == VOCAB else spec
                                     for name, spec in module.parallel_specs.items()}
