"""Gradient-norm clipping that counts every parameter once across model-parallel ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from oslo.parallel.dtensor import plain
from oslo.parallel.plan import parameter_specs


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a parallelized model in place, like ``torch.nn.utils.clip_grad_norm_``.

    The norm is the norm of the *whole* model's gradient: split parameters contribute their shard on
    every tensor-parallel rank, replicated parameters are counted once (not once per rank), and
    pipeline stages add their parameters. Every rank gets the same total norm and scale.

    Args:
        model: An oslo model (it carries its ``parallel_context``).
        max_norm: Maximum norm of the gradients.
        norm_type: Order of the norm; ``float("inf")`` for the max norm.

    Returns:
        The total norm of the gradients before clipping (a float32 scalar tensor).
    """
    context = model.parallel_context
    norm_type = float(norm_type)
    specs = parameter_specs(model)
    # A weight tied across pipeline stages (GPT2's lm_head on the last stage, twin of wte on the first)
    # has the same gradient on both: count it on the stage that holds the tie's source only.
    copies = model.cross_stage_tied_copies() if hasattr(model, "cross_stage_tied_copies") else {}
    grads_split, grads_replicated, grads_copies = [], [], []
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = plain(param.grad)
        if name in copies:
            grads_copies.append(grad)
        else:
            (grads_split if specs[name] is not None else grads_replicated).append(grad)

    # The sum travels on the backend's device; one process keeps it where the gradients are (as torch's).
    grads_all = grads_split + grads_replicated
    device = context.device if context.world_size > 1 or not grads_all else grads_all[0].device
    replicated_counts = context.tensor_parallel_rank == 0
    if math.isinf(norm_type):
        local = [g.detach().abs().max().float() for g in grads_all]
        total = torch.stack(local).max() if local else torch.zeros((), device=device)
        total = total.to(device)
        if context.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=context.model_parallel_group)
    else:
        def power_sum(grads):
            if not grads:
                return torch.zeros((), device=device)
            return sum(g.detach().float().norm(norm_type) ** norm_type for g in grads).to(device)

        total = power_sum(grads_split)
        if replicated_counts:
            total = total + power_sum(grads_replicated)
        if context.world_size > 1:
            dist.all_reduce(total, group=context.model_parallel_group)
        total = total ** (1.0 / norm_type)

    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads_all + grads_copies:
        grad.detach().mul_(clip_coef.to(grad.device, grad.dtype))
    return total

