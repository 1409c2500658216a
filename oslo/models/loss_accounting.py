"""Loss accounting: what a loss's value and its gradient average over, and what the end of its backward pass
does.

A head returns each loss as a :class:`~oslo.parallel.loss.LossSum`; :func:`average_losses` turns it into the
loss tensor, whose value is the mean over its own (micro-)batch's items and whose gradient is its share of the
whole step's items (:func:`step_divisors`: every micro-batch, every data-parallel replica whose gradients are
averaged). The callbacks a loss runs when the backward pass reaches it make the tensor-parallel ranks agree on
non-finite gradients (:func:`overflow_agreement`) and, where nobody else does, average the gradients over the
data-parallel replicas (:func:`replica_averaging`); a compiled call gets the same as one hook
(:func:`traced_on_backward`).

Every function that takes a model takes an :class:`~oslo.models.base.OsloPreTrainedModel`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from oslo.parallel import traced
from oslo.parallel.agreement import agree_on_nonfinite_gradients
from oslo.parallel.context import ParallelContext
from oslo.parallel.data_parallel import average_over_replicas, sum_over_replicas
from oslo.parallel.dtensor import plain
from oslo.parallel.loss import LossSum, average_loss


def computes_in_half(model) -> bool:
    """Whether this call computes in float16 (autocast or float16 weights): gradients may overflow."""
    device_type = model.device.type
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16
    return autocast or model.dtype == torch.float16


def overflow_agreement(model, half: bool) -> Callable[[torch.Tensor], None] | None:
    """``on_backward`` for a loss at tensor parallelism without pipelines: at the end of the backward
    pass the tensor-parallel ranks agree on non-finite gradients (see
    :func:`~oslo.parallel.agreement.agree_on_nonfinite_gradients`), so a gradient scaler skips the
    step on every rank or on none. They look (and exchange one flag) when computing in float16 or when
    the backward is seeded by a loss scale, as with a gradient scaler; other backward passes cost
    nothing."""
    if model.parallel_context.tensor_parallel_size == 1 or not torch.is_grad_enabled():
        return None
    model._overflow_check_pending = False  # a backward that failed before its check must not block this one
    return overflow_callback(model, half)


def overflow_callback(model, half: bool) -> Callable[[torch.Tensor], None]:
    """The callback of :func:`overflow_agreement`, whatever the sizes (a compiled call's hook runs it too)."""
    engine = torch.autograd.Variable._execution_engine

    def check(scan: bool) -> None:
        try:
            agree_on_nonfinite_gradients([plain(p.grad) for p in model.parameters()], model.parallel_context, scan)
        finally:
            model._overflow_check_pending = False

    def on_backward(grad: torch.Tensor) -> None:
        if model._overflow_check_pending:  # two losses of this model in one backward: check once
            return
        model._overflow_check_pending = True
        scan = half or not bool((grad == 1).all())
        # Queued by a callback, so it runs after every callback queued during the backward pass
        # (DistributedDataParallel copies its averaged gradients into .grad in one of those).
        engine.queue_callback(lambda: engine.queue_callback(lambda: check(scan)))

    return on_backward


def _accelerate_prepared(model) -> bool:
    """Whether accelerate prepared ``model``, or the module that wraps it (``_oslo_wrapper``: a PEFT model, which
    the ``Trainer`` hands accelerate in its place)."""
    if getattr(model, "_is_accelerate_prepared", False):
        return True
    wrapper = model.__dict__.get("_oslo_wrapper")
    wrapper = None if wrapper is None else wrapper()
    return wrapper is not None and getattr(wrapper, "_is_accelerate_prepared", False)


def averages_replicas_itself(model, ddp, fsdp: bool) -> bool:
    """Whether this call's gradients are averaged over the data-parallel replicas by oslo at the end of the
    backward pass: at pipeline_parallel_size 1 only for a model that accelerate prepared as tensor parallel
    (transformers' ``Trainer``), which it leaves unwrapped and whose replicas nobody else averages."""
    context = model.parallel_context
    return (ddp is None and not fsdp and context.data_parallel_size > 1 and context.tensor_parallel_size > 1
            and torch.is_grad_enabled() and _accelerate_prepared(model))


def replica_averaging(model) -> Callable[[torch.Tensor], None]:
    """``on_backward`` for a loss whose gradients oslo averages over the data-parallel replicas once the
    backward pass ends (as ``DistributedDataParallel`` would); several losses in one backward average once.
    Averaging again gradients accumulated over several batches leaves the earlier (equal) shares as they are."""
    engine = torch.autograd.Variable._execution_engine

    def average() -> None:
        try:
            grads = [plain(p.grad) for p in model.parameters() if p.grad is not None]
            average_over_replicas(grads, model.parallel_context)
        finally:
            model._replica_averaging_pending = False

    def on_backward(grad: torch.Tensor) -> None:
        if model.__dict__.get("_replica_averaging_pending"):
            return
        model._replica_averaging_pending = True
        engine.queue_callback(average)

    return on_backward


def both(first: Callable, second: Callable | None) -> Callable:
    """Two ``on_backward`` callbacks as one (``second`` may be ``None``)."""
    if second is None:
        return first

    def both(grad: torch.Tensor) -> None:
        first(grad)
        second(grad)

    return both


@traced.eager("loss_backward")
def _loss_backward(model, grads: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """What a traced call's loss runs when the backward pass reaches it (``spec``: which of the overflow
    agreement, in half precision or not, and the replica averaging), as an eager call's callbacks do."""
    flags = spec.split(",")
    if "average" in flags:
        replica_averaging(model)(grads[0])
    if "overflow" in flags:
        overflow_callback(model, "half" in flags)(grads[0])
    return grads


def traced_on_backward(model, has_loss_inputs: bool, averages_itself: bool) -> traced.Hook | None:
    """What :func:`overflow_agreement` and :func:`replica_averaging` give an eager call, for a traced one:
    a hook that the compiled backward runs (see :func:`_loss_backward`)."""
    overflow = has_loss_inputs and model.parallel_context.tensor_parallel_size > 1 and torch.is_grad_enabled()
    if not (overflow or averages_itself):
        return None
    spec = ",".join(name for name, on in (("overflow", overflow), ("half", computes_in_half(model)),
                                           ("average", averages_itself)) if on)
    return traced.hook("loss_backward", model, spec)


def average_losses(
    values: dict,
    batch: dict,
    loss_items: Callable[[dict], dict[str, torch.Tensor]] | None,
    num_items_in_batch,
    divisors: dict[str, torch.Tensor] | None = None,
    on_backward: Callable[[torch.Tensor], None] | None = None,
) -> dict:
    """Replace each :class:`~oslo.parallel.loss.LossSum` of a head's ``values`` by the loss tensor.

    Its value is the mean over the items of ``batch`` (transformers' loss of that batch), or the sum
    divided by ``num_items_in_batch`` when the caller gives one, as transformers does. Its gradient
    averages over ``divisors`` when given: the items of the whole batch this step trains on.
    """
    losses = {name: value for name, value in values.items() if isinstance(value, LossSum)}
    if not losses:
        return values
    items = loss_items(batch) if num_items_in_batch is None else {}
    for name, loss in losses.items():
        count = num_items_in_batch if num_items_in_batch is not None else items[name]
        divisor = divisors.get(name) if divisors is not None else None
        values[name] = average_loss(loss, count, divisor, on_backward)
    return values


def step_divisors(context: ParallelContext, loss_items, batches: list[dict]) -> dict[str, torch.Tensor]:
    """Items of each loss over ``batches`` and every data-parallel replica's batches, divided by the
    number of replicas (whose gradients are then averaged): the divisors that make each replica's
    gradient its share of the global batch's mean, as one process would compute it."""
    counts: dict[str, torch.Tensor] = {}
    for batch in batches:
        for name, count in loss_items(batch).items():
            counts[name] = counts[name] + count if name in counts else count
    counts = sum_over_replicas(counts, context)
    return {name: count / context.data_parallel_size for name, count in counts.items()}
