"""Paired autograd collectives over a tensor-parallel group.

Each function is the forward of an ``autograd.Function`` whose backward is its adjoint, so that a
layer's communication is visible at the layer boundary and gradients are exact. Every function is the
identity when the group has a single rank (or is ``None``: no distributed run).
"""

from __future__ import annotations

import torch

from oslo.parallel import traced
from oslo.parallel.collectives import eager_all_gather, eager_all_reduce, eager_reduce_scatter, group_rank, group_size


def all_reduce(tensor: torch.Tensor, group, what: str = "summing over the tensor-parallel group",
               op: str = "sum") -> torch.Tensor:
    """The sum (``op="max"``: the maximum) of ``tensor`` over ``group``, in place of a contiguous ``tensor``, waited
    for as :func:`oslo.parallel.failure.wait` waits (``what``: for its errors). In a traced call, oslo's custom
    operator, which runs this same code when the compiled program runs (see :mod:`oslo.parallel.traced`)."""
    if torch.compiler.is_compiling():
        return traced.all_reduce(tensor, group, what, op)
    return eager_all_reduce(tensor, group, what, op)


def _split(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    chunks = tensor.chunk(group_size(group), dim=dim)
    return chunks[group_rank(group)].contiguous()


def all_gather(tensor: torch.Tensor, group, dim: int, what: str = "gathering over the tensor-parallel group"
               ) -> torch.Tensor:
    """Every rank's ``tensor`` of ``group``, concatenated along ``dim`` (a new tensor); traced as :func:`all_reduce`
    is."""
    if torch.compiler.is_compiling():
        return traced.all_gather(tensor, group, dim, what)
    return eager_all_gather(tensor, group, dim, what)


def reduce_scatter(tensor: torch.Tensor, group, dim: int,
                   what: str = "summing and scattering over the tensor-parallel group") -> torch.Tensor:
    """This rank's equal chunk along ``dim`` of the sum of ``tensor`` over ``group``; traced as :func:`all_reduce`
    is."""
    if torch.compiler.is_compiling():
        return traced.reduce_scatter(tensor, group, dim, what)
    return eager_reduce_scatter(tensor, group, dim, what)


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad):
        # The incoming gradient may be shared with another branch of the graph: reduce a copy.
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx, tensor, group):
        return all_reduce(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Forward: keep this rank's chunk along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, tensor, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(tensor, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: keep this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, tensor, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(tensor, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather along ``dim`` (the sequence shards of every rank). Backward: reduce-scatter of the
    gradient (each rank's layers read the whole sequence; its shard gets the sum)."""

    @staticmethod
    def forward(ctx, tensor, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(tensor, group, dim, "gathering the sequence shards over the tensor-parallel group")

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim`` (partial sums of the whole sequence to this rank's shard of the
    sum). Backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, tensor, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(tensor, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), ctx.group, ctx.dim), None, None


def copy_to_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    if group_size(group) == 1:
        return tensor
    return _CopyToTensorParallel.apply(tensor, group)


def reduce_from_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward, identity backward."""
    if group_size(group) == 1:
        return tensor
    return _ReduceFromTensorParallel.apply(tensor, group)


def scatter_to_tensor_parallel(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's equal chunk along ``dim`` forward; all-gather the gradient backward."""
    if group_size(group) == 1:
        return tensor
    return _ScatterToTensorParallel.apply(tensor, group, dim)


def gather_from_tensor_parallel(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` forward; keep this rank's gradient chunk backward."""
    if group_size(group) == 1:
        return tensor
    return _GatherFromTensorParallel.apply(tensor, group, dim)


def gather_sequence(tensor: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Enter a tensor-parallel region from sequence shards (sequence parallelism): all-gather along ``dim``
    forward, reduce-scatter of the gradient backward."""
    if group_size(group) == 1:
        return tensor
    return _GatherSequence.apply(tensor, group, dim)


def reduce_scatter_sequence(tensor: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Leave a tensor-parallel region into sequence shards (sequence parallelism): the partial results summed
    and this rank's shard along ``dim`` kept forward, all-gather of the gradient backward."""
    if group_size(group) == 1:
        return tensor
    return _ReduceScatterSequence.apply(tensor, group, dim)


def enter_tensor_parallel(tensor: torch.Tensor, group, sequence=None) -> torch.Tensor:
    """The input of several column-parallel layers reading one tensor (separate q, k and v projections): the
    sequence shards gathered when ``sequence`` (a :class:`~oslo.parallel.context.SequenceSharding`) is active,
    else :func:`copy_to_tensor_parallel`. Their layers then take ``input_is_copied=True``."""
    if sequence is not None and sequence.active:
        return gather_sequence(tensor, group, sequence.dim)
    return copy_to_tensor_parallel(tensor, group)

