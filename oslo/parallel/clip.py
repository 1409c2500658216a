"""Gradient-norm clipping that counts every parameter once across model-parallel ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from oslo.parallel.dtensor import plain
from oslo.parallel.plan import parameter_specs


class _LayersGroup:
    """What clipping reads of a parallel context, for a module of the user's built from oslo's layers (which keep
    their tensor-parallel group, not the context): that group is the model-parallel group (no pipeline)."""

    def __init__(self, group) -> None:
        self.model_parallel_group = group
        self.world_size = dist.get_world_size(group)
        self.tensor_parallel_rank = dist.get_rank(group)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                       else torch.device("cpu"))


def _parallel_context_of(model: nn.Module):
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"clip_grad_norm_ takes the model (its modules say which parameters are split across ranks), got "
            f"{type(model).__name__}: call clip_grad_norm_(model, max_norm), not clip_grad_norm_(model.parameters(), "
            "max_norm)."
        )
    context = getattr(model, "parallel_context", None)
    if context is not None:
        return context
    groups = {id(module.group): module.group for module in model.modules()
              if hasattr(module, "parallel_specs") and getattr(module, "group", None) is not None}
    if len(groups) > 1:
        raise ValueError(
            f"{type(model).__name__} holds oslo layers of {len(groups)} different tensor-parallel groups: clipping "
            "needs one. Build its layers with one parallel_context (and set model.parallel_context to it)."
        )
    # No split layer: every rank holds the whole model, and its norm is this process's.
    return _LayersGroup(next(iter(groups.values()))) if groups else _ONE_PROCESS


class _OneProcess:
    model_parallel_group, world_size, tensor_parallel_rank, device = None, 1, 0, torch.device("cpu")


_ONE_PROCESS = _OneProcess()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a parallelized model in place, like ``torch.nn.utils.clip_grad_norm_``.

    The norm is the norm of the *whole* model's gradient: split parameters contribute their shard on
    every tensor-parallel rank, replicated parameters are counted once (not once per rank), and
    pipeline stages add their parameters. Every rank gets the same total norm and scale.

    Args:
        model: An oslo model (it carries its ``parallel_context``), or a module of your own built from oslo's
            layers (their tensor-parallel group is read from them; without a pipeline).
        max_norm: Maximum norm of the gradients.
        norm_type: Order of the norm; ``float("inf")`` for the max norm.

    Returns:
        The total norm of the gradients before clipping (a float32 scalar tensor).
    """
    context = _parallel_context_of(model)
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

