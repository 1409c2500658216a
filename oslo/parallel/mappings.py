"""Paired autograd collectives over a tensor-parallel group.

Each function is the forward of an ``autograd.Function`` whose backward is its adjoint, so that a
layer's communication is visible at the layer boundary and gradients are exact. Every function is the
identity when the group has a single rank (or is ``None``: no distributed run).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

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


class _CopyManyToTensorParallel(torch.autograd.Function):
    """Forward: identity of each tensor. Backward: one all-reduce (sum) of all their gradients, flattened together."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        # autograd materializes a missing gradient as zeros; the concatenation is a copy of the incoming ones
        summed = all_reduce(torch.cat([grad.reshape(-1) for grad in grads]), ctx.group)
        return (None, *(part.view_as(grad) for part, grad in zip(summed.split([g.numel() for g in grads]), grads,
                                                                   strict=True)))


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
        whole = all_gather(tensor, group, dim, "gathering the sequence shards over the tensor-parallel group")
        if _KEEPERS and not torch.compiler.is_compiling():
            _KEEPERS[-1].note(tensor, whole, group, dim)
        return whole

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


class _Kept:
    """What the backward keeps of a tensor gathered from sequence shards: this rank's shard, gathered again when
    the backward first unpacks the tensor and shared by the layers that saved it (``uses`` of them left)."""

    __slots__ = ("shard", "version", "group", "dim", "uses", "whole")

    def __init__(self, shard: torch.Tensor, group, dim: int) -> None:
        self.shard, self.version, self.group, self.dim = shard.detach(), shard._version, group, dim
        self.uses, self.whole = 0, None


class _ShardKeeper:
    """Saved-tensor hooks under which autograd keeps the shard of every tensor :func:`gather_sequence` gathered,
    not the whole tensor (see :func:`keep_sequence_shards`). The hooks in force when it was entered (a memory
    probe's, say) still see every tensor saved: the shard in place of a gathered one."""

    def __init__(self) -> None:
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) or None
        self.gathered: dict[int, tuple[weakref.ref, _Kept]] = {}  # storage address: (the whole tensor, its shard)

    def note(self, shard: torch.Tensor, whole: torch.Tensor, group, dim: int) -> None:
        if whole.is_contiguous() and whole.storage_offset() == 0 and whole.device.type != "meta":
            self.gathered[whole.untyped_storage().data_ptr()] = (weakref.ref(whole), _Kept(shard, group, dim))

    def pack(self, tensor: torch.Tensor):
        found = self.gathered.get(tensor.untyped_storage().data_ptr()) if tensor.device.type != "meta" else None
        if found is None or found[0]() is None:  # not a gathered tensor (or its address reused since)
            return None, self.outer[0](tensor) if self.outer else tensor
        kept = found[1]
        kept.uses += 1
        inner = self.outer[0](kept.shard) if self.outer else kept.shard
        return kept, inner, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()

    def unpack(self, packed) -> torch.Tensor:
        kept, inner = packed[0], packed[1]
        value = self.outer[1](inner) if self.outer else inner
        if kept is None:
            return value
        if value._version != kept.version:
            raise RuntimeError(
                "a sequence shard that the backward gathers again was modified in place after the forward used it; "
                "under sequence_parallel=True the layers keep only the shard of their gathered input.")
        if kept.whole is None:
            kept.whole = all_gather(value, kept.group, kept.dim,
                                    "gathering the sequence shards again for the backward").contiguous()
        whole = kept.whole
        kept.uses -= 1
        if kept.uses <= 0:  # every layer that saved it has taken it
            kept.whole = None
        return whole.as_strided(packed[2], packed[3], packed[4])


_KEEPERS: list[_ShardKeeper] = []


@contextlib.contextmanager
def keep_sequence_shards() -> Iterator[None]:
    """Within it, a tensor gathered from sequence shards (:func:`gather_sequence`: a column-parallel layer's input
    under sequence parallelism) is saved for the backward as this rank's shard and gathered again when the
    backward needs it, as Megatron-LM does: the layers' saved inputs take ``1 / tensor_parallel_size`` of the
    memory, for one more all-gather per gathered input in the backward. Nothing changes in a traced call, or
    without gradients."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        yield
        return
    keeper = _ShardKeeper()
    _KEEPERS.append(keeper)
    try:
        with torch.autograd.graph.saved_tensors_hooks(keeper.pack, keeper.unpack):
            yield
    finally:
        _KEEPERS.remove(keeper)


def copy_to_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    if group_size(group) == 1:
        return tensor
    return _CopyToTensorParallel.apply(tensor, group)


def copy_many_to_tensor_parallel(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """:func:`copy_to_tensor_parallel` of several tensors whose gradients arrive together (one module's parameters):
    their gradients summed over the group in one all-reduce. Tensors of one dtype."""
    if group_size(group) == 1 or len(tensors) < 2 or len({t.dtype for t in tensors}) > 1:
        return [copy_to_tensor_parallel(t, group) for t in tensors]
    return list(_CopyManyToTensorParallel.apply(group, *tensors))


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

