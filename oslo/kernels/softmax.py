"""Fused scale + mask + softmax over attention scores ``[batch, heads, q_len, k_len]``.

Three parts, as for every oslo kernel:

1. Triton kernels: one program per score row; the forward reads the row once (plus the mask) and
   writes the probabilities; the backward reads probabilities and output gradient once.
2. The custom ops ``oslo::scaled_masked_softmax`` and ``oslo::scaled_masked_softmax_backward``
   launching them (``triton_op``: ``torch.compile`` traces into them), with the autograd formula
   registered; on tensors that do not launch Triton their implementation is the torch reference.
3. ``scaled_masked_softmax`` / ``FusedScaleMaskSoftmax``: thin entry points; on CPU tensors (or
   without Triton) they run ``scaled_masked_softmax_reference``, written with plain torch ops.

Only attention that must materialize its scores uses this (transformers' eager attention, or
``output_attentions=True``); otherwise the models keep ``F.scaled_dot_product_attention`` (flash,
cuDNN, memory-efficient), fused or not. On CUDA below :data:`~oslo.kernels._triton.TRITON_MIN_ROWS`
score rows (decoding: a few rows per step, launch-bound) a call takes torch instead: with an additive mask
(eager attention's) and no ``causal``, transformers' eager expression ``softmax(scores * scale + mask)`` in
float32 (measured on an H200 at 8 x 16 heads x 1 x 256: 24 us against the op's 66 us), its rows masked
entirely with ``-inf`` set to zeros as below; otherwise the torch reference.

Mask semantics (transformers 5)
-------------------------------
* ``mask=None, causal=False``: plain ``softmax(scores * scale)``.
* ``causal=True``: query ``i`` attends keys ``j <= i + (k_len - q_len)``; the causal block is aligned to
  the bottom right, so with a KV cache the ``q_len`` new queries sit at the end of the key sequence
  (transformers' ``causal_mask_function`` with ``q_offset = k_len - q_len``). This is also what sdpa's
  ``is_causal`` means when transformers skips building a mask. Combines with either mask kind below.
* ``causal=True, window=w`` (sliding window, GPT-Neo's "local" layers): query ``i`` attends keys
  ``i_abs - w < j <= i_abs`` with ``i_abs = i + (k_len - q_len)``, i.e. itself and the ``w - 1`` keys
  before it. This is GPT-Neo's ``tril(ones) ^ tril(ones, -window_size)`` bias sliced at
  ``[k_len - q_len : k_len, :k_len]``. Keys outside the window are masked exactly like keys after the
  query (probability 0, gradient 0). ``window >= k_len`` is plain causal. ``window`` requires
  ``causal=True``. (GPT-Neo does not scale its scores: pass ``scale=1.0``.)
* boolean mask (``transformers.masking_utils.sdpa_mask``, what the default sdpa path gets): ``True``
  means *attend*. Broadcastable to the scores, e.g. ``[batch, 1, q_len, k_len]``.
* floating mask (``transformers.masking_utils.eager_mask``, what the eager path gets): *added* to the
  scaled scores; ``0`` attends, ``torch.finfo(dtype).min`` (or ``-inf``) masks.

Precision: as in transformers' eager attention, ``scores * scale`` is rounded to the scores' dtype and
``+ mask`` to the promoted dtype of scores and mask; the softmax itself (max, exp, sum, normalize)
runs in fp32 and the probabilities are returned in the scores' dtype. In fp32 this is the eager
result up to float reassociation.

Fully masked rows (a left-padded query that sees only padding, or ``q_len > k_len`` under ``causal``):

* with a boolean mask or ``causal`` (with or without ``window``): the row is all zeros, forward and
  backward, as in ``torch.nn.functional.scaled_dot_product_attention`` (whose math kernel uses a "safe"
  softmax). The causal and window masks are hard masks: a masked key gets ``-inf``, never ``finfo.min``.
* with an additive ``finfo.min`` mask: every score becomes ``finfo.min`` (the addition saturates in
  fp16/bf16, and ``min + s`` rounds back to ``min`` in fp32), so the row is uniform, ``1 / k_len`` per
  key: exactly what the eager path computes. We do not special-case this; it falls out of matching the
  eager rounding. With ``causal`` (and ``window``) on top, the row is uniform over the keys those leave
  visible, which is also what GPT-Neo's fp32 eager attention computes for such a row.
* with an additive ``-inf`` mask: zeros (eager would produce NaN; sdpa produces zeros).
"""

from __future__ import annotations

import torch
from torch import nn

from oslo.kernels._triton import (
    HAS_TRITON,
    define_op,
    launchable,
    launches_triton,
    next_power_of_2,
    num_warps_for,
    tl,
    triton_kernel,
    use_triton,
)

__all__ = ["FusedScaleMaskSoftmax", "scaled_masked_softmax", "scaled_masked_softmax_reference"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_inputs(scores: torch.Tensor, mask: torch.Tensor | None) -> None:
    if scores.dim() != 4:
        raise ValueError(
            f"scores of shape {tuple(scores.shape)} must be 4-D [batch, heads, q_len, k_len]; reshape "
            "other layouts before calling the fused softmax."
        )
    if not scores.is_floating_point():
        raise ValueError(
            f"scores dtype {scores.dtype} is not floating point; pass fp32, fp16 or bf16 scores."
        )
    if mask is None:
        return
    if mask.dim() != 4:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} must be 4-D, broadcastable to the scores "
            f"{tuple(scores.shape)} (e.g. [batch, 1, q_len, k_len] from transformers.masking_utils); add the "
            "missing dims with "
            "mask[:, None, None, :] for a [batch, k_len] padding mask."
        )
    for dim, (m, s) in enumerate(zip(mask.shape, scores.shape, strict=True)):
        if m not in (1, s):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to scores {tuple(scores.shape)} "
                f"(dim {dim}: {m} vs {s}); each mask dim must be 1 or equal the scores dim."
            )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(
            f"mask dtype {mask.dtype} is neither bool (True = attend) nor floating (additive); convert it, "
            "e.g. mask.bool() for a 0/1 keep-mask."
        )


def _check_window(window: int | None, causal: bool) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window={window!r} must be a positive int (the number of keys each query sees, itself "
            "included, e.g. GPT-Neo's config.window_size) or None for no sliding window."
        )
    if not causal:
        raise ValueError(
            f"window={window} needs causal=True: the sliding window counts back from each query's "
            "(bottom-right aligned) causal position. Pass causal=True with it, or window=None."
        )


def _causal_keep(q_len: int, k_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[q_len, k_len]`` boolean, True where query ``i`` may attend key ``j`` (bottom-right aligned)."""
    rows = torch.arange(q_len, device=device).unsqueeze(-1) + (k_len - q_len)
    cols = torch.arange(k_len, device=device)
    keep = cols <= rows
    if window is not None:
        keep = keep & (cols > rows - window)
    return keep


def scaled_masked_softmax_reference(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Torch path: ``softmax(scores * scale [+ mask])`` with transformers' mask semantics.

    See the module docstring for the mask kinds and fully masked rows. Differentiable w.r.t. ``scores``.

    Args:
        scores: ``[batch, heads, q_len, k_len]`` attention scores (``q @ k^T``).
        mask: None, a boolean mask (True = attend) or an additive floating mask, broadcastable to scores.
        scale: multiplier applied to the scores before masking (e.g. ``head_dim ** -0.5``).
        causal: additionally mask keys after each query (bottom-right aligned).
        window: with ``causal``, also mask keys ``window`` or more positions before each query (a sliding
            window of ``window`` keys, the query's own included); None for plain causal.

    Returns:
        Attention probabilities shaped and typed like ``scores``.
    """
    _check_inputs(scores, mask)
    _check_window(window, causal)
    logits = scores * scale
    if mask is not None and mask.dtype != torch.bool:
        logits = logits + mask
    logits = logits.float()
    if causal:
        q_len, k_len = scores.shape[-2:]
        logits = logits.masked_fill(~_causal_keep(q_len, k_len, window, scores.device), float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    # A row masked everywhere has max -inf: shift by 0 instead, so exp() gives 0 rather than NaN.
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max).detach()
    exp = torch.exp(logits - row_max)
    denominator = exp.sum(dim=-1, keepdim=True)
    denominator = torch.where(denominator == 0, torch.ones_like(denominator), denominator)
    return (exp / denominator).to(scores.dtype)


if HAS_TRITON:

    @triton_kernel
    def _scaled_masked_softmax_forward_kernel(
        scores_ptr,
        mask_ptr,
        out_ptr,
        heads,
        q_len,
        k_len,
        mask_stride_batch,
        mask_stride_head,
        mask_stride_q,
        mask_stride_k,
        scale,
        window,
        MASK_KIND: tl.constexpr,  # 0: none, 1: boolean, 2: additive
        ROUND_SUM: tl.constexpr,  # round scores * scale + mask to the scores' dtype, like eager does
        CAUSAL: tl.constexpr,
        WINDOWED: tl.constexpr,  # with CAUSAL: also mask keys j <= i_abs - window
        BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        q_index = row % q_len
        head = (row // q_len) % heads
        batch = row // (q_len * heads)
        cols = tl.arange(0, BLOCK_K)
        in_range = cols < k_len

        scores = tl.load(scores_ptr + row * k_len + cols, mask=in_range, other=0.0).to(tl.float32)
        logits = (scores * scale).to(scores_ptr.dtype.element_ty).to(tl.float32)
        keep = in_range
        if MASK_KIND != 0:
            mask_offsets = (
                batch * mask_stride_batch
                + head * mask_stride_head
                + q_index * mask_stride_q
                + cols * mask_stride_k
            )
            if MASK_KIND == 1:
                keep = keep & (tl.load(mask_ptr + mask_offsets, mask=in_range, other=0) != 0)
            else:
                logits += tl.load(mask_ptr + mask_offsets, mask=in_range, other=0.0).to(tl.float32)
                if ROUND_SUM:
                    logits = logits.to(scores_ptr.dtype.element_ty).to(tl.float32)
        if CAUSAL:
            q_absolute = q_index + (k_len - q_len)  # bottom-right aligned, as with a KV cache
            keep = keep & (cols <= q_absolute)
            if WINDOWED:
                keep = keep & (cols > q_absolute - window)
        logits = tl.where(keep, logits, float("-inf"))

        row_max = tl.max(logits, axis=0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        exp = tl.exp(logits - row_max)
        denominator = tl.sum(exp, axis=0)
        inverse = tl.where(denominator > 0.0, 1.0 / denominator, 0.0)
        tl.store(out_ptr + row * k_len + cols, (exp * inverse).to(out_ptr.dtype.element_ty), mask=in_range)

    @triton_kernel
    def _scaled_masked_softmax_backward_kernel(
        grad_out_ptr,
        probs_ptr,
        grad_in_ptr,
        k_len,
        scale,
        BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        in_range = cols < k_len
        probs = tl.load(probs_ptr + row * k_len + cols, mask=in_range, other=0.0).to(tl.float32)
        grad_out = tl.load(grad_out_ptr + row * k_len + cols, mask=in_range, other=0.0).to(tl.float32)
        # d softmax: p * (g - sum(p * g)); the scale comes from d(scores * scale) / d scores.
        grad_in = scale * probs * (grad_out - tl.sum(probs * grad_out, axis=0))
        tl.store(grad_in_ptr + row * k_len + cols, grad_in.to(grad_in_ptr.dtype.element_ty), mask=in_range)


@define_op("oslo::scaled_masked_softmax")
def _scaled_masked_softmax_op(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool, window: int
) -> torch.Tensor:
    """One kernel per row computing ``softmax(mask(scores * scale))``; ``window`` 0 means none."""
    if not launches_triton(scores):
        return scaled_masked_softmax_reference(scores, mask, scale, causal, window=window or None)
    scores = scores.contiguous()
    batch, heads, q_len, k_len = scores.shape
    probs = torch.empty_like(scores)
    block_k = next_power_of_2(k_len)
    # window >= k_len cuts nothing (every key j >= 0 > i_abs - window): run the plain causal kernel.
    windowed = causal and 0 < window < k_len
    if mask is None:
        mask_kind, mask_arg, strides, round_sum = 0, scores, (0, 0, 0, 0), False
    else:
        expanded = mask.expand(batch, heads, q_len, k_len)
        strides = expanded.stride()
        if mask.dtype == torch.bool:  # loaded as such (no uint8 view: Inductor cannot lower one of bool)
            mask_kind, mask_arg, round_sum = 1, expanded, False
        else:
            mask_kind, mask_arg = 2, expanded
            promoted = torch.promote_types(scores.dtype, mask.dtype)
            round_sum = promoted == scores.dtype and scores.dtype in _LOW_PRECISION
    if probs.numel() > 0:
        launchable(_scaled_masked_softmax_forward_kernel)[(batch * heads * q_len,)](
            scores,
            mask_arg,
            probs,
            heads,
            q_len,
            k_len,
            *strides,
            float(scale),
            window if windowed else 0,
            MASK_KIND=mask_kind,
            ROUND_SUM=round_sum,
            CAUSAL=causal,
            WINDOWED=windowed,
            BLOCK_K=block_k,
            num_warps=num_warps_for(block_k),
        )
    return probs


@define_op("oslo::scaled_masked_softmax_backward")
def _scaled_masked_softmax_backward_op(grad_out: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """One kernel per row computing ``scale * p * (g - sum(p * g))``."""
    if not launches_triton(probs):
        p, g = probs.float(), grad_out.float()
        return (scale * p * (g - (p * g).sum(-1, keepdim=True))).to(probs.dtype)
    grad_out = grad_out.contiguous()
    probs = probs.contiguous()
    grad_in = torch.empty_like(probs)
    k_len = probs.shape[-1]
    block_k = next_power_of_2(k_len)
    if probs.numel() > 0:
        launchable(_scaled_masked_softmax_backward_kernel)[(probs.numel() // k_len,)](
            grad_out, probs, grad_in, k_len, float(scale), BLOCK_K=block_k, num_warps=num_warps_for(block_k)
        )
    return grad_in


def _softmax_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output)
    ctx.scale = float(inputs[2])


def _softmax_backward(ctx, grad_out: torch.Tensor):
    # The mask gets no gradient; keys masked by it, by causality or by the window have p = 0, hence 0.
    (probs,) = ctx.saved_tensors
    return _scaled_masked_softmax_backward_op(grad_out, probs, ctx.scale), None, None, None, None


_scaled_masked_softmax_op.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


def scaled_masked_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Fused ``softmax(scores * scale [+ mask])``: the ``oslo::scaled_masked_softmax`` op (Triton) on CUDA,
    the torch reference on CPU.

    Mask kinds, precision and fully masked rows are described in the module docstring.

    Args:
        scores: ``[batch, heads, q_len, k_len]`` attention scores (``q @ k^T``), fp32, fp16 or bf16.
        mask: None; a boolean mask, True = attend (sdpa-style); or a floating mask added to the scaled
            scores (eager-style). Broadcastable to ``scores``, e.g. ``[batch, 1, q_len, k_len]``.
        scale: multiplier applied to the scores first (e.g. ``head_dim ** -0.5``, or 1.0 for GPT-Neo).
        causal: additionally mask keys after each query (bottom-right aligned: ``j <= i + k_len - q_len``).
        window: sliding causal window (GPT-Neo's local attention, ``config.window_size``); needs
            ``causal=True``. Query ``i`` then attends only keys ``i_abs - window < j <= i_abs``, where
            ``i_abs = i + k_len - q_len``. None (default): plain causal.

    Returns:
        Attention probabilities shaped and typed like ``scores``; differentiable w.r.t. ``scores``.

    Raises:
        ValueError: bad shapes or dtypes, ``window`` not a positive int, or ``window`` without ``causal``.
    """
    _check_inputs(scores, mask)
    _check_window(window, causal)
    tensors = (scores,) if mask is None else (scores, mask)
    if use_triton(*tensors, rows=scores.numel() // max(scores.shape[-1], 1)):
        return _scaled_masked_softmax_op(scores, mask, float(scale), causal, window or 0)
    if use_triton(*tensors) and not causal and (mask is None or mask.dtype != torch.bool):
        return _eager_softmax(scores, mask, scale)  # a few rows on CUDA: fewer launches than the reference
    return scaled_masked_softmax_reference(scores, mask, scale, causal, window=window)


def _eager_softmax(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """transformers' eager ``softmax(scores * scale + mask)`` in float32 (rounded as the reference rounds),
    with rows masked entirely by ``-inf`` (NaN there) set to zeros, as the reference and the kernel do."""
    logits = scores * scale
    if mask is not None:
        logits = logits + mask
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.nan_to_num(probs, nan=0.0).to(scores.dtype)


class FusedScaleMaskSoftmax(nn.Module):
    """Module form of :func:`scaled_masked_softmax` with a fixed scale, causality and window.

    Args:
        scale: multiplier applied to the scores before masking.
        causal: whether to apply the (bottom-right aligned) causal mask.
        window: sliding causal window size (GPT-Neo's local layers); needs ``causal=True``.
    """

    def __init__(self, scale: float = 1.0, causal: bool = False, *, window: int | None = None) -> None:
        super().__init__()
        _check_window(window, causal)
        self.scale = scale
        self.causal = causal
        self.window = window

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Return ``softmax(scores * scale [+ mask])`` over the last dim."""
        return scaled_masked_softmax(scores, mask, self.scale, self.causal, window=self.window)

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return f"scale={self.scale}, causal={self.causal}{window}"
