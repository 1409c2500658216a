"""Data parallelism around a parallelized model: DistributedDataParallel found and checked, gradients
averaged over the replicas, and item counts summed over them so that every replica's gradient is a
share of the global batch's mean."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from oslo.parallel.context import ParallelContext
from oslo.parallel.errors import naming_timeouts

__all__ = ["active_data_parallel_wrapper", "average_over_replicas", "refuse_dtensor_parameters", "sum_over_replicas"]


def active_data_parallel_wrapper(context: ParallelContext) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` whose forward is running now (``None`` outside one).

    Raises:
        ValueError: it averages over another group than the model's data-parallel group (at tensor or
            pipeline parallelism, e.g. the default group, it would average shards of different layers).
    """
    ddp = getattr(DistributedDataParallel, "_get_active_ddp_module", lambda: None)()
    if ddp is None:
        return None
    ranks = sorted(dist.get_process_group_ranks(ddp.process_group))
    expected = sorted(dist.get_process_group_ranks(context.data_parallel_group))
    if ranks != expected:
        raise ValueError(
            f"DistributedDataParallel averages gradients over ranks {ranks}, but this rank's data-parallel "
            f"replicas are ranks {expected}: averaging over other ranks mixes shards of different layers. Wrap the "
            "model as DistributedDataParallel(model.gpu_modules(), "
            "process_group=model.mpu.get_data_parallel_group())."
        )
    if getattr(ddp, "gradient_as_bucket_view", False):
        raise ValueError(
            "DistributedDataParallel(..., gradient_as_bucket_view=True) is not supported: DDP then moves each "
            "gradient into its buckets after the model's parameters took it, and an optimizer over "
            "model.parameters() would step on the gradients before averaging. Leave gradient_as_bucket_view=False "
            "(the default)."
        )
    return ddp


def refuse_dtensor_parameters(init):
    """``DistributedDataParallel.__init__`` with ``model.gpu_modules()``'s storages frozen as the model's weights are,
    and a clear error, before any collective, for an oslo model whose parameters are DTensors (several processes),
    which DDP cannot reduce: it would fail inside DTensor's dispatch ("Cannot flatten unevenly sharded tensor"), and
    accelerate's ``prepare`` reaches it too."""

    @functools.wraps(init)
    def checked(self, module, *args, **kwargs):
        before_wrap = getattr(module, "_oslo_before_wrap", None)  # model.gpu_modules(): its storages as the model says
        if callable(before_wrap):
            before_wrap()
        if getattr(module, "parallel_context", None) is not None and hasattr(module, "gpu_modules"):
            ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
            if any(isinstance(param, DTensor) for name, param in module.named_parameters() if name not in ignored):
                raise ValueError(
                    f"DistributedDataParallel cannot reduce the parameters of {type(module).__name__}: with several "
                    "processes they are DTensors. Wrap model.gpu_modules() (the same model, its plain shards as the "
                    "parameters DDP averages) over the data-parallel group: DistributedDataParallel("
                    "model.gpu_modules(), process_group=model.mpu.get_data_parallel_group()). accelerate's "
                    "prepare() wraps over every process: hand it model.gpu_modules() at tensor_parallel_size=1 and "
                    "pipeline_parallel_size=1; at larger sizes write the loop with DistributedDataParallel as above "
                    "(USAGE.md, 'Data parallelism'), or use transformers' Trainer (USAGE.md, 'transformers' Trainer')."
                )
        return init(self, module, *args, **kwargs)

    checked._oslo_hook = True
    return checked


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


def average_over_replicas(grads: list[torch.Tensor], context: ParallelContext) -> None:
    """Replace each gradient by its mean over the data-parallel replicas, as ``DistributedDataParallel``
    would (in buckets of 64 MB: no full flat copy of the gradients)."""
    if context.data_parallel_size == 1:
        return
    for bucket in _gradient_buckets(grads):
        flat = torch.cat([grad.reshape(-1) for grad in bucket])
        with naming_timeouts(context, "averaging gradients over the data-parallel replicas",
                             group=context.data_parallel_group):
            dist.all_reduce(flat, group=context.data_parallel_group)
        flat.div_(context.data_parallel_size)
        for grad, value in zip(bucket, flat.split([grad.numel() for grad in bucket]), strict=True):
            grad.copy_(value.view_as(grad))


def sum_over_replicas(counts: dict[str, torch.Tensor], context: ParallelContext) -> dict[str, torch.Tensor]:
    """``counts`` summed over the data-parallel replicas (one all-reduce for all of them)."""
    if context.data_parallel_size == 1 or not counts:
        return counts
    names = sorted(counts)
    flat = torch.cat([counts[name].reshape(-1).to(context.device, torch.int64) for name in names])
    with naming_timeouts(context, "summing the loss's item counts over the data-parallel replicas",
                         group=context.data_parallel_group):
        dist.all_reduce(flat, group=context.data_parallel_group)
    parts = flat.split([counts[name].numel() for name in names])
    return {name: part.view_as(counts[name]) for name, part in zip(names, parts, strict=True)}
