"""Eager collectives over a process group, each waited for by the failure watchdog (:func:`oslo.parallel.failure.wait`).

What the paired autograd functions of :mod:`oslo.parallel.mappings` run in an eager call, and what the custom
operators of :mod:`oslo.parallel.traced` run when a compiled program reaches them: one code for both, below both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from oslo.parallel import failure


def group_size(group) -> int:
    """Number of ranks in ``group`` (1 for ``None``: a plain, non-distributed process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


# gloo's ring all-reduce cuts a tensor into 2 x world segments and passes each one around the ring: 4 (world - 1)
# messages a rank, each one a hand-off between gloo's threads, so that a tensor of a few bytes costs what one of a
# MiB costs. A small CPU tensor on a gloo group goes in one round instead: every rank sends its whole tensor to every
# other (one all-to-all, world - 1 messages each way) and reduces the world's copies itself, in rank order (the same
# bits on every rank). As each rank then holds (and receives) world copies, the tensor's bytes times the world size
# must not exceed this: 256 KiB at 4 ranks, 512 KiB at 2. benchmarks/gloo_all_reduce.py measures both ways.
GLOO_ONE_ROUND_BYTES = 1024 * 1024


def _one_round(tensor: torch.Tensor, group, world: int) -> bool:
    return (tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() * world <= GLOO_ONE_ROUND_BYTES
            and dist.get_backend(group) == dist.Backend.GLOO)


def eager_all_reduce(tensor: torch.Tensor, group, what: str, op: str = "sum") -> torch.Tensor:
    """The sum (``op="max"``: the maximum) of ``tensor`` over ``group``, in place of a contiguous ``tensor``, waited
    for as :func:`oslo.parallel.failure.wait` waits (``what``: for its errors)."""
    tensor = tensor.contiguous()
    world = group_size(group)
    if world > 1 and _one_round(tensor, group, world):
        copies = tensor.new_empty((world, *tensor.shape))
        sent = tensor.expand(world, *tensor.shape).contiguous()
        failure.wait(dist.all_to_all_single(copies, sent, group=group, async_op=True), group, what)
        return tensor.copy_(copies.sum(0, dtype=tensor.dtype) if op == "sum" else copies.amax(0))
    failure.wait(dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group, async_op=True), group, what)
    return tensor


def through_cpu(tensor: torch.Tensor, group) -> bool:
    """Whether ``tensor`` must travel through the CPU to be gathered or scattered over ``group``: gloo gathers CPU
    tensors only (it sums and broadcasts CUDA ones), and on one GPU two ranks can only share the device over gloo."""
    return tensor.device.type == "cuda" and dist.get_backend(group) == dist.Backend.GLOO


def eager_all_gather(tensor: torch.Tensor, group, dim: int, what: str) -> torch.Tensor:
    """Every rank's ``tensor`` of ``group``, concatenated along ``dim`` (a new tensor), waited for as
    :func:`eager_all_reduce` is."""
    device = tensor.device
    staged = through_cpu(tensor, group)
    tensor = (tensor.cpu() if staged else tensor).contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
    failure.wait(dist.all_gather(parts, tensor, group=group, async_op=True), group, what)
    gathered = torch.cat(parts, dim=dim)
    return gathered.to(device) if staged else gathered


def eager_reduce_scatter(tensor: torch.Tensor, group, dim: int, what: str) -> torch.Tensor:
    """This rank's equal chunk along ``dim`` of the sum of ``tensor`` over ``group`` (a new tensor), waited for as
    :func:`eager_all_reduce` is."""
    device = tensor.device
    staged = through_cpu(tensor, group)
    rows = (tensor.cpu() if staged else tensor).movedim(dim, 0).contiguous()
    out = rows.new_empty((rows.shape[0] // group_size(group), *rows.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (its older name)
    failure.wait(scatter(out, rows, group=group, async_op=True), group, what)
    out = out.movedim(0, dim)
    return out.to(device) if staged else out

