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
from oslo.parallel.agreement import read_label_bounds
from oslo.parallel.collectives import group_size
from oslo.parallel.dtensor import gradient_sink
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
        # buffer is allocated (a copy of the logits, turned into the softmax the backward pass needs in place by
        # :func:`_chunk_terms`) — none when the caller lets the logits be overwritten (``overwrite``: float32
        # logits nothing else reads) — the padding columns are left out of the maximum and zeroed after exp,
        # never copied; so every rank does the same work whether it holds padding or not.
        # (Not in a traced call: the compiler plans the buffers itself, and refuses a Function that writes
        # into its input.)
        # (float64 logits are computed on in float64, as transformers' cross entropy does; others in float32.)
        full = logits.dtype in (torch.float32, torch.float64)
        overwrite = overwrite and full and not torch.compiler.is_compiling()
        # float() makes a buffer of our own from other dtypes; float32 logits are copied unless they may be overwritten
        softmax = logits if overwrite else logits.clone() if full else logits.float()
        loss, local_target, outside = _chunk_terms(softmax, target, vocab_start, valid_columns, group, ignore_index)
        ctx.save_for_backward(softmax, local_target, outside, target == ignore_index)
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


CUDA_MIN_CHUNK_ROWS = 2048
"""The fewest tokens a chunk of :func:`linear_cross_entropy` takes on a CUDA device (when there are that many).
Each chunk reads the projection's weight twice and adds its gradient into a float32 accumulator of the weight's
size: with fewer rows those products are bound by memory, not arithmetic. Measured on an H100 (GPT2 width 1024,
8 x 1024 tokens, bf16 autocast, ``benchmarks/fused_loss.py --part d``): the step with chunks of 1024 tokens took
1.154x the whole logits' time at a 50,257-token vocabulary, 2048 took 0.983x (0.894x at 128,256)."""


def loss_chunk_rows(rows: int, hidden_size: int, local_vocab: int, device: torch.device | str | None = None) -> int:
    """How many tokens :func:`linear_cross_entropy` takes at a time: as many as make a float32 logits chunk the
    size of the hidden states (so the loss never holds more than they do), at least 2**24 elements (64 MiB: smaller
    chunks would leave the matrix products too thin to run at full speed) and at least 16 rows (or all of them);
    on a CUDA ``device`` at least :data:`CUDA_MIN_CHUNK_ROWS`."""
    budget = max(rows * hidden_size, 1 << 24)
    floor = CUDA_MIN_CHUNK_ROWS if device is not None and torch.device(device).type == "cuda" else 16
    return max(1, min(rows, max(floor, budget // max(local_vocab, 1))))


# torch.addmm's out_dtype (a float32 sum of half-precision products, on CUDA): torch >= 2.8.
_ADDMM_OUT_DTYPE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def _dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``x @ W (+ b)`` for ``W`` as ``nn.Linear`` stores it (out, in) or as ``Conv1D`` does (in, out)."""
    if transposed:
        return torch.addmm(bias, x, weight) if bias is not None else x @ weight
    return torch.nn.functional.linear(x, weight, bias)


def _chunk_terms(logits, target, vocab_start, valid_columns, group, ignore_index):
    """The cross entropy of one chunk of vocabulary-split float32 ``logits`` (a buffer of the caller's, turned
    into the softmax in place) against ``target``: the per-token losses (0 where ignored), and what the
    gradient needs: ``local_target`` and ``outside`` (the target is not among this rank's columns, or ignored)."""
    padded = valid_columns < logits.size(-1)
    row_max = (logits.narrow(-1, 0, valid_columns) if padded else logits).amax(dim=-1)
    if group_size(group) > 1:
        row_max = all_reduce(row_max, group, "taking the logits' maximum over the tensor-parallel group", "max")
    ignored = target == ignore_index
    local_target = target - vocab_start
    outside = (local_target < 0) | (local_target >= valid_columns) | ignored
    local_target = local_target.masked_fill(outside, 0)
    target_logit = (logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max).masked_fill(outside, 0.0)
    exp = logits.sub_(row_max.unsqueeze(-1)).exp_()
    if padded:
        exp[:, valid_columns:] = 0.0
    sum_exp = exp.sum(dim=-1)
    if group_size(group) > 1:
        both = all_reduce(torch.stack([target_logit, sum_exp]), group,
                          "summing the loss terms over the tensor-parallel group")
        target_logit, sum_exp = both[0], both[1]
    exp.div_(sum_exp.unsqueeze(-1))
    return (sum_exp.log() - target_logit).masked_fill(ignored, 0.0), local_target, outside


def _accumulate_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b``: in place when the dtypes agree, or on CUDA when ``total`` is float32 and the factors
    half precision (the matrix units' float32 sum, ``out_dtype``); else through a cast product (a temporary of
    ``total``'s size, which on a GPU costs more than the product: the reason for the CUDA path)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif (_ADDMM_OUT_DTYPE and total.is_cuda and total.dtype == torch.float32
          and a.dtype in (torch.bfloat16, torch.float16) and not torch.compiler.is_compiling()):
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total.add_((a @ b).to(total.dtype))


def _fused_log_softmax(x: torch.Tensor) -> bool:
    """Whether one rank's chunks go through :func:`_single_rank_chunk` (on a GPU: fewer passes over the chunk, the
    caching allocator hands its new buffer back at once) rather than :func:`_chunk_terms` in place (on the CPU a
    new chunk-sized buffer per chunk costs more in fresh pages than the passes it saves: 1.17x the whole logits'
    step against 0.88x, GPT2 width 128, 8 x 1024 tokens, vocabulary 50,257)."""
    return x.is_cuda


def _single_rank_chunk(logits, target, ignore_index):
    """:func:`_chunk_terms` for a chunk of logits that holds the whole vocabulary (one rank, no padding), in fewer
    passes over it: one fused log-softmax (reading half-precision logits, writing float32), its ``exp`` in place.
    Returns the per-token losses and the float32 softmax (a new buffer: the caller's logits are left alone)."""
    ignored = target == ignore_index
    # (With bfloat16 logits torch casts them to float32 first, a pass of its own: 1.28 ms of an H100's 150 ms step
    # at 8 x 1024 tokens and 50,257 columns. Its kernel reads float16 itself, not bfloat16.)
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    safe_target = target.masked_fill(ignored, 0)
    losses = (-log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)).masked_fill(ignored, 0.0)
    return losses, log_probs.exp_(), safe_target, ignored


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed cross entropy of ``x @ W (+ b)`` over this rank's vocabulary columns, a chunk of tokens
    at a time, and its gradients with respect to ``x``, ``W`` and ``b`` (one chunk's logits live at a time: they
    become its softmax, then the logits' gradient, which the two products of the backward pass read right away).
    Backward: those gradients times the loss's gradient (a scalar); the input's summed over the tensor-parallel
    group, the weight's handed to the sink of its view when it has one (the tied embedding adds its rows there)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, vocab_start, valid_columns, transposed, group, ignore_index,
                chunk_rows, reduce_input_grad, may_ignore):
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        compute = torch.get_autocast_dtype(device) if autocast else weight.dtype
        accumulate = torch.float32 if compute != torch.float64 else compute
        weight_compute = weight.to(compute)
        grad_x_compute = torch.empty(x.shape, dtype=compute, device=x.device)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=accumulate, device=bias.device)
        total = torch.zeros((), dtype=accumulate, device=x.device)
        # The gradients are computed for the mean over the call's tokens (the usual loss: the backward pass then
        # multiplies them by exactly 1), scaled before the products as the unfused cross entropy scales them.
        scale = 1.0 / (target != ignore_index).sum().clamp(min=1).to(torch.float64 if accumulate == torch.float64
                                                                     else torch.float32)
        single = group_size(group) == 1 and valid_columns == weight.size(1 if transposed else 0) \
            and _fused_log_softmax(x)
        fuse_cast = compute != accumulate and not torch.compiler.is_compiling()
        for start in range(0, x.size(0), chunk_rows):
            x_chunk, target_chunk = x[start:start + chunk_rows], target[start:start + chunk_rows]
            logits = _dot(x_chunk, weight, bias, transposed)
            if single and logits.dtype != torch.float64:
                losses, grad, local_target, outside = _single_rank_chunk(logits, target_chunk, ignore_index)
            else:
                logits = logits.float() if logits.dtype != torch.float64 else logits
                losses, local_target, outside = _chunk_terms(logits, target_chunk, vocab_start, valid_columns,
                                                             group, ignore_index)
                grad = logits  # the softmax, made the gradient of the chunk's summed loss in place
            total = total + losses.sum()  # (not +=: torch 2.11's Dynamo then loses the output's backward)
            rows = torch.arange(grad.size(0), device=grad.device)
            grad[rows, local_target] -= (~outside).to(grad.dtype)
            # The factor of each row: the mean's scale, 0 where the target is ignored (when such rows may be
            # here), so that zeroing their gradients costs no pass of its own over the chunk.
            factor = scale.to(grad.dtype)
            if may_ignore:
                factor = factor.expand(grad.size(0)).masked_fill(target_chunk == ignore_index, 0.0).unsqueeze(-1)
            if fuse_cast:  # scaled and cast to the products' dtype in one pass
                grad = torch.mul(grad, factor, out=torch.empty(grad.shape, dtype=compute, device=grad.device))
            else:
                grad = grad.mul_(factor).to(compute)
            x_chunk = x_chunk.to(compute)
            if transposed:  # W (in, out): logits = x @ W
                torch.mm(grad, weight_compute.t(), out=grad_x_compute[start:start + chunk_rows])
                _accumulate_product(grad_weight, x_chunk.t(), grad)
            else:  # W (out, in): logits = x @ W.t()
                torch.mm(grad, weight_compute, out=grad_x_compute[start:start + chunk_rows])
                _accumulate_product(grad_weight, grad.t(), x_chunk)
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0).to(accumulate))
        ctx.save_for_backward(grad_x_compute.to(x.dtype), grad_weight, grad_bias, scale)
        ctx.group, ctx.reduce_input_grad, ctx.sink = group, reduce_input_grad, gradient_sink(weight)
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_weight, grad_bias, scale = ctx.saved_tensors
        # The saved gradients (of the mean) times grad_total / scale, exactly 1 for the mean's own gradient; in
        # place unless the graph is kept for another backward pass.
        kept = _graph_is_kept()
        factor = grad_total.to(scale.dtype) / scale

        def scaled(grad):
            return grad * factor.to(grad.dtype) if kept else grad.mul_(factor.to(grad.dtype))

        grad_x = scaled(grad_x)
        if ctx.reduce_input_grad:
            grad_x = all_reduce(grad_x, ctx.group, "summing the input gradient over the tensor-parallel group")
        grad_weight = scaled(grad_weight).to(ctx.weight_dtype)
        if ctx.sink is not None:  # a tensor of this pass's own (scaled in place, or a new product)
            ctx.sink.add(grad_weight)
            grad_weight = None
        if grad_bias is not None:
            grad_bias = scaled(grad_bias).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None


def _drops_ignored_rows(x: torch.Tensor) -> bool:
    """Whether :func:`linear_cross_entropy` leaves the tokens whose target is ignored out before the products (on
    the CPU: less work where a batch is padded) rather than masking their gradients (a traced call, which cannot
    take a data-dependent shape; and a CUDA tensor, where finding them would wait for the GPU to finish the
    forward pass, and leave it idle while the chunks are launched)."""
    return not (torch.compiler.is_compiling() or x.is_cuda)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    vocab_start: int,
    valid_columns: int,
    group,
    transposed: bool = False,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The summed cross entropy of the vocabulary-split logits ``x @ W (+ b)`` against ``target``, computed a
    chunk of tokens at a time, so that the logits of the whole batch never exist (the loss of
    :func:`vocab_parallel_cross_entropy` applied to :class:`~oslo.parallel.layers.VocabParallelLMHead`'s output,
    summed, with the same gradients).

    With gradients enabled each chunk's gradients are computed as soon as its loss is (no second pass over the
    vocabulary), so the call holds one float32 chunk of logits, the input's and the weight's gradients. Tokens
    whose target is ``ignore_index`` are left out before any product on the CPU (elsewhere their gradients are
    masked: no wait for the device). Per chunk the tensor-parallel group runs Megatron's two all-reduces (the row
    maximum; the target logit and the exp-sum), with one rank on a GPU a fused log-softmax instead; the backward
    pass one all-reduce (the input's gradient).

    Args:
        x: ``(..., H)`` the projection's input, the same on every rank of ``group``.
        weight: This rank's vocabulary slice of the projection: ``(V_local, H)``, or ``(H, V_local)`` when
            ``transposed`` (``Conv1D``'s layout).
        bias: ``(V_local,)`` or ``None``.
        target: ``(...)`` global token ids.
        vocab_start, valid_columns, group, ignore_index: as for :func:`vocab_parallel_cross_entropy`.
        chunk_rows: Tokens per chunk (``None``: :func:`loss_chunk_rows` of the shapes).

    Returns:
        A float32 scalar (float64 for a float64 input), the same on every rank of the group.
    """
    x = x.reshape(-1, x.size(-1))
    target = target.reshape(-1).to(x.device)
    keep = target != ignore_index
    may_ignore = not _drops_ignored_rows(x)
    if not may_ignore and not bool(keep.all()):
        x, target = x[keep], target[keep]
    local_vocab = weight.size(1 if transposed else 0)
    rows = chunk_rows if chunk_rows is not None else loss_chunk_rows(x.size(0), x.size(-1), local_vocab, x.device)
    if rows < 1:
        raise ValueError(f"chunk_rows must be a positive number of tokens, got {rows}.")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    if needs_grad:
        return _LinearCrossEntropy.apply(x, weight, bias, target, vocab_start, valid_columns, transposed, group,
                                         ignore_index, rows, group_size(group) > 1, may_ignore)
    total = torch.zeros((), dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    for start in range(0, x.size(0), rows):
        logits = _dot(x[start:start + rows], weight, bias, transposed)
        logits = logits.float() if logits.dtype != torch.float64 else logits
        total += _chunk_terms(logits, target[start:start + rows], vocab_start, valid_columns, group,
                              ignore_index)[0].sum()
    return total


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
    if not torch.compiler.is_compiling() and ignore_index == -100:
        bounds = read_label_bounds(labels)  # read with the call's ids: no second wait for a GPU
        if bounds is not None and 0 <= bounds[0] and bounds[1] < vocab_size:
            return
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
        ``(...)`` losses, identical on every rank of the group: float32 (float64 for float64 logits).
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
    dtype: torch.dtype | None = None  # the averaged loss's dtype, as transformers returns it (None: the sums')


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
    # The terms' weights as Python numbers times the sums: a tensor made of them on a GPU would be a copy from the
    # host, which waits for the device (and leaves it idle while the rest of the step is launched).
    weighted = sums if all(weight == 1 for weight in loss.weights) else torch.stack(
        [term * weight for term, weight in zip(sums.unbind(0), loss.weights, strict=True)])
    if torch.is_tensor(items):
        items = items.to(sums.device)
    if torch.is_tensor(divisor):
        divisor = divisor.to(sums.device)
    dtype = weighted.dtype if loss.dtype is None else loss.dtype
    if divisor is None and on_backward is None:
        return (weighted / items).sum().to(dtype)
    value = (weighted.detach() / items).sum().to(dtype)
    differentiable = (weighted / (items if divisor is None else divisor)).sum().to(dtype)
    if isinstance(on_backward, traced.Hook):
        return _TracedMeanLoss.apply(differentiable, value, *on_backward)
    return _MeanLoss.apply(differentiable, value, on_backward)
