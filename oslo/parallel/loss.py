"""Cross entropy over vocabulary-split logits.

Each rank holds the logits of its vocabulary slice. The loss needs two all-reduces of
``batch x seq``-sized tensors (the row max; then the target logit and the exp-sum, stacked into one):
full logits are never gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from oslo.parallel import traced
from oslo.parallel.collectives import group_size
from oslo.parallel.mappings import all_reduce


def _graph_is_kept() -> bool:
    """Whether the running backward pass keeps the graph (``retain_graph=True``, ``create_graph=True``),
    so that its saved tensors are used again. Torch's own compiled backward asks the same; should the
    query ever go away, assume the graph is kept (a copy: correct, one logits-sized tensor more). Under
    ``torch.compile`` the backward is traced before any pass runs it (there is no pass to ask), so the copy is
    assumed; the traced program is functional anyway (the compiler reuses buffers where it can)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None or torch.compiler.is_compiling() else bool(query())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token cross entropy from vocab-split logits. Backward: softmax minus one-hot, locally."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid_columns, group, ignore_index, overwrite):
        # logits: (N, V_local) this rank's columns; columns >= valid_columns are padding. One logits-sized
        # buffer is allocated (the shifted logits, exponentiated and normalized in place into the softmax the
        # backward pass needs) — none when the caller lets the logits be overwritten (``overwrite``: float32
        # logits nothing else reads) — the padding columns are left out of the maximum and zeroed after exp,
        # never copied; so every rank does the same work whether it holds padding or not.
        # (Not in a traced call: the compiler plans the buffers itself, and refuses a Function that writes
        # into its input.)
        overwrite = overwrite and logits.dtype == torch.float32 and not torch.compiler.is_compiling()
        logits = logits.float()
        padded = valid_columns < logits.size(-1)
        row_max = (logits.narrow(-1, 0, valid_columns) if padded else logits).amax(dim=-1)
        if group_size(group) > 1:
            row_max = all_reduce(row_max, group, "taking the logits' maximum over the tensor-parallel group", "max")

        ignored = target == ignore_index
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= valid_columns) | ignored
        local_target = local_target.masked_fill(outside, 0)
        target_logit = (logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max).masked_fill(outside, 0.0)

        exp = (logits.sub_(row_max.unsqueeze(-1)) if overwrite else torch.sub(logits, row_max.unsqueeze(-1))).exp_()
        if padded:
            exp[:, valid_columns:] = 0.0
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            # One all-reduce for both per-token reductions.
            both = all_reduce(torch.stack([target_logit, sum_exp]), group,
                               "summing the loss terms over the tensor-parallel group")
            target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        # The gradient is written over the saved softmax (no second logits-sized tensor), unless the
        # graph is kept for another backward pass (retain_graph / create_graph): that one needs it intact.
        grad = softmax.clone() if _graph_is_kept() else softmax
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        grad.mul_((grad_loss.masked_fill(ignored, 0.0)).unsqueeze(-1))
        return grad, None, None, None, None, None, None


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int = -100, classes: bool = False) -> None:
    """Raise if ``labels`` hold a value outside ``[0, vocab_size)`` other than ``ignore_index``.

    Vocabulary-split logits cannot see such an id (no rank's shard holds it), so without this check
    its loss would silently be computed against a logit of 0; transformers' unsplit loss raises.
    Models call it on every rank before any communication (with pipelines only the last stage
    computes the loss: the others must fail too, not wait). ``classes=True`` words the error for
    class labels (``vocab_size`` is then ``num_labels``).

    Under ``torch.compile``, which cannot branch on the labels' values, the compiled program asserts instead:
    the same message without the value, as a ``RuntimeError`` when it runs.

    Raises:
        ValueError: naming the first offending value, the allowed range and the fix.
    """
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), _labels_message(None, vocab_size, ignore_index, classes))
        return
    if not bad.any():
        return
    raise ValueError(_labels_message(int(labels[bad][0]), vocab_size, ignore_index, classes))


def _labels_message(value: int | None, vocab_size: int, ignore_index: int, classes: bool) -> str:
    """What :func:`check_labels` says about ``value`` (``None``: some value, under ``torch.compile``)."""
    if classes:
        found = "a class" if value is None else f"the class {value}"
        return (
            f"labels hold {found}, outside [0, {vocab_size}) for num_labels={vocab_size}: pass class "
            f"indices below num_labels, or {ignore_index} to ignore a position (or load the model with "
            "num_labels=N for N classes)."
        )
    found = "a token id" if value is None else f"the token id {value}"
    return (
        f"labels hold {found}, outside the vocabulary [0, {vocab_size}): every label must be a "
        f"token id below vocab_size={vocab_size}, or {ignore_index} to ignore the position. Check that the "
        "tokenizer matches the model (or build it with resize_token_embeddings=len(tokenizer))."
    )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    valid_columns: int,
    group,
    ignore_index: int = -100,
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """Per-token cross entropy (no reduction) of vocabulary-split logits.

    Args:
        logits: ``(..., V_local)``: this rank's vocabulary columns.
        target: ``(...)`` global token ids; ``ignore_index`` entries get loss 0 and no gradient.
        vocab_start: First global id of this rank's columns.
        valid_columns: Number of this rank's columns that are real tokens (the rest is padding).
        group: The tensor-parallel group (``None``: a single rank).
        ignore_index: Target value to ignore.
        overwrite_logits: The logits are read by nothing else (not returned, not gathered): float32 logits
            are turned into the softmax in place instead of into a new logits-sized buffer. Their values are
            garbage afterwards; the gradients are the same.

    Returns:
        ``(...)`` float32 losses, identical on every rank of the group.
    """
    shape = target.shape
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1), vocab_start, valid_columns, group, ignore_index,
        overwrite_logits,
    )
    return loss.view(shape)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    valid_columns: int,
    group,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    reduction: str = "mean",
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """Next-token loss with the reduction of transformers' ``ForCausalLMLoss``, on vocab-split logits.

    Labels are shifted inside (position ``t`` predicts label ``t + 1``) unless ``shift_labels`` is
    given; the mean runs over non-ignored tokens, or the sum is divided by ``num_items_in_batch``.
    ``reduction="sum"`` returns the plain sum of the per-token losses. ``overwrite_logits``: as for
    :func:`vocab_parallel_cross_entropy`.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}.")
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(logits.device)
    per_token = vocab_parallel_cross_entropy(
        logits, shift_labels, vocab_start=vocab_start, valid_columns=valid_columns, group=group,
        ignore_index=ignore_index, overwrite_logits=overwrite_logits,
    )
    if reduction == "sum":
        return per_token.sum()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(per_token.device)
        return per_token.sum() / num_items_in_batch
    return per_token.sum() / (shift_labels != ignore_index).sum()


def causal_lm_items(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The number of tokens a causal LM loss averages over: labels after the first position (each is
    predicted from the ones before it) that are not ``ignore_index``."""
    return (labels[..., 1:] != ignore_index).sum()


class LossSum(NamedTuple):
    """A head's loss before averaging: ``sum(weights[t] * sums[t] / items[t])`` over its terms ``t``.

    transformers averages each term of a loss over its items: the label tokens that are not ``-100``
    (language modeling, token classification), the labelled rows (classification), the answer
    positions inside the input (question answering: two terms, weights 1/2). A head gives the sums;
    :func:`average_loss` divides them by the items, so that the gradient can average over the items of
    a larger batch than the one at hand (all micro-batches of a pipeline, all data-parallel replicas).
    """

    sums: torch.Tensor  # (terms,) or a scalar for one term; differentiable
    weights: tuple[float, ...] = (1.0,)


class _MeanLoss(torch.autograd.Function):
    """Forward: the loss value to report. Backward: the gradient flows into ``differentiable`` (the same
    sums over another divisor) and ``on_backward(grad)`` is called first."""

    @staticmethod
    def forward(ctx, differentiable, value, on_backward):
        ctx.on_backward = on_backward
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_backward is not None:
            ctx.on_backward(grad)
        return grad, None, None


class _TracedMeanLoss(torch.autograd.Function):
    """:class:`_MeanLoss` in a traced call: what runs when the backward pass reaches the loss is a
    :class:`~oslo.parallel.traced.Hook` (eager code the compiled backward calls), not a Python callback."""

    @staticmethod
    def forward(ctx, differentiable, value, name, key, spec):
        ctx.hook = traced.Hook(name, key, spec)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        (grad,) = traced.run(ctx.hook, [grad])
        return grad, None, None, None, None


def average_loss(
    loss: LossSum,
    items: torch.Tensor | float,
    divisor: torch.Tensor | None = None,
    on_backward: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The value of ``loss`` averaged over ``items`` (per term, or one number for every term).

    With ``divisor`` the returned tensor still has that value (the batch's own loss, for logging), but its
    gradient is the one of the sums averaged over ``divisor`` instead: the items of the whole batch the
    step trains on. ``on_backward(grad)`` runs when the backward pass reaches the loss (a
    :class:`~oslo.parallel.traced.Hook` in a traced call: run with ``[grad]``).
    """
    sums = loss.sums.reshape(-1)
    if torch.is_tensor(items):
        items = items.reshape(-1)
    if torch.is_tensor(divisor):
        divisor = divisor.reshape(-1)
    weights = torch.tensor(loss.weights, dtype=sums.dtype, device=sums.device)
    if torch.is_tensor(items):
        items = items.to(sums.device)
    if torch.is_tensor(divisor):
        divisor = divisor.to(sums.device)
    if divisor is None and on_backward is None:
        return (weights * sums / items).sum()
    value = (weights * sums.detach() / items).sum()
    differentiable = (weights * sums / (items if divisor is None else divisor)).sum()
    if isinstance(on_backward, traced.Hook):
        return _TracedMeanLoss.apply(differentiable, value, *on_backward)
    return _MeanLoss.apply(differentiable, value, on_backward)
