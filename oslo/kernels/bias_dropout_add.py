"""Fused bias + dropout + residual add: ``residual + dropout(x + bias, p)``, forward and backward.

Three parts, as for every oslo kernel:

1. Triton kernels: the forward draws the keep-mask from Philox (``tl.rand(seed, offset + index)``)
   and writes only the output; the backward regenerates the same mask from ``(seed, offset)``, so no
   mask is stored between forward and backward.
2. ``_BiasDropoutAddFunction``: the ``torch.autograd.Function`` launching them.
3. ``bias_dropout_add`` / ``FusedBiasDropoutAdd``: the thin entry points; on CPU tensors (or without
   Triton) they run the torch path, which is the unfused math with the unfused RNG stream.

Controlling the mask (tensor parallelism)
-----------------------------------------
Dropout on an activation that every tensor-parallel rank holds in full (replicated: the output of a
row-parallel layer, the residual stream) must draw the *same* mask on every rank; dropout on an
activation split across ranks (column-parallel output, per-rank attention heads) must draw *distinct*
masks. Both paths let the caller decide:

* torch path: the mask is ``torch.empty_like(h).bernoulli_(1 - p, generator=generator)``, exactly what
  ``torch.nn.functional.dropout`` draws on CPU. Pass a ``torch.Generator`` seeded identically on all
  ranks (same mask) or with a per-rank seed (distinct masks). ``generator=None`` uses the default
  generator, so an RNG tracker that forks/sets the global state controls it, and on CPU the result is
  bit-identical to the unfused ``residual + F.dropout(x + bias, p)`` from the same RNG state.
* Triton path: the mask is a pure function of ``(seed, offset, element index)``. Pass equal ``seed`` on
  all ranks for replicated activations and e.g. ``seed = base_seed + tp_rank`` for split ones; use
  ``offset`` to make successive calls with one seed independent (advance it by at least ``numel``).
  With ``seed=None`` a seed is drawn from ``generator`` (or the default generator of the tensor's
  device), so a generator-based RNG tracker controls the Triton path too.

The two paths use different random streams: for the same seed they draw different (equally valid)
masks. Precision: the torch path rounds like the unfused expression (after ``x + bias``, the scaling
and the add); the Triton path computes in fp32 and rounds once, so in fp16/bf16 they can differ by an
ulp of the output.
"""

from __future__ import annotations

import torch
from torch import nn

from oslo.kernels._triton import HAS_TRITON, tl, triton, triton_kernel, use_triton

__all__ = ["FusedBiasDropoutAdd", "bias_dropout_add", "bias_dropout_add_reference"]

_SEED_BOUND = 2**62  # Philox takes a 64-bit key; stay clear of the sign bit when it goes through int64


def _check_inputs(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p={p} is outside [0, 1]; pass the config's dropout rate.")
    if residual.shape != x.shape:
        raise ValueError(
            f"residual of shape {tuple(residual.shape)} does not match x of shape {tuple(x.shape)}: the "
            "residual add needs equal shapes (no broadcasting in the fused op)."
        )
    if bias is not None and (bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not match x of shape {tuple(x.shape)}: bias must be "
            "1-D with x.shape[-1] elements, or None for a bias-free layer."
        )


def bias_dropout_add_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Torch path: ``residual + dropout(x + bias, p)`` with an explicit Bernoulli mask.

    The mask is drawn as ``torch.nn.functional.dropout`` draws it on CPU
    (``empty_like(h).bernoulli_(1 - p)``, scaled by ``1 / (1 - p)``), so with ``generator=None`` the
    result equals the unfused expression bit for bit from the same RNG state.

    Args:
        x: activations, any shape ``[..., hidden]``.
        bias: ``[hidden]`` or None.
        residual: tensor shaped like ``x``.
        p: probability of zeroing an element.
        training: when False (or ``p == 0``), no dropout and no random numbers are drawn.
        generator: random generator on ``x``'s device; None for the default one.

    Returns:
        ``residual + dropout(x + bias)``.
    """
    _check_inputs(x, bias, residual, p)
    hidden = x if bias is None else x + bias
    if not training or p == 0.0 or hidden.numel() == 0:
        return residual + hidden
    if p == 1.0:
        return residual + hidden * torch.zeros((), dtype=hidden.dtype, device=hidden.device)
    noise = torch.empty_like(hidden).bernoulli_(1.0 - p, generator=generator)
    noise.div_(1.0 - p)
    return residual + hidden * noise


if HAS_TRITON:

    @triton_kernel
    def _bias_dropout_add_forward_kernel(
        x_ptr,
        bias_ptr,
        residual_ptr,
        out_ptr,
        n_elements,
        hidden_size,
        p,
        seed,
        philox_offset,
        HAS_BIAS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_range = offsets < n_elements
        hidden = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        if HAS_BIAS:
            hidden += tl.load(bias_ptr + offsets % hidden_size, mask=in_range, other=0.0).to(tl.float32)
        residual = tl.load(residual_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        keep = tl.rand(seed, philox_offset + offsets) >= p
        out = residual + tl.where(keep, hidden / (1.0 - p), 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_range)

    @triton_kernel
    def _dropout_backward_kernel(
        grad_out_ptr,
        grad_in_ptr,
        n_elements,
        p,
        seed,
        philox_offset,
        BLOCK_SIZE: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_range = offsets < n_elements
        grad_out = tl.load(grad_out_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        keep = tl.rand(seed, philox_offset + offsets) >= p
        grad_in = tl.where(keep, grad_out / (1.0 - p), 0.0)
        tl.store(grad_in_ptr + offsets, grad_in.to(grad_in_ptr.dtype.element_ty), mask=in_range)


_BLOCK_SIZE = 1024


class _BiasDropoutAddFunction(torch.autograd.Function):
    """Forward: ``residual + mask * (x + bias) / (1 - p)`` in one kernel, mask from ``(seed, offset)``.
    Backward: regenerate the mask; ``grad_x = mask * grad / (1 - p)``, ``grad_residual = grad``."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        p: float,
        seed: int,
        offset: int,
    ) -> torch.Tensor:
        x = x.contiguous()
        residual = residual.contiguous()
        out = torch.empty_like(x)
        n_elements = x.numel()
        if n_elements > 0:
            grid = (triton.cdiv(n_elements, _BLOCK_SIZE),)
            _bias_dropout_add_forward_kernel[grid](
                x,
                x if bias is None else bias.contiguous(),  # unused pointer when HAS_BIAS is False
                residual,
                out,
                n_elements,
                x.shape[-1],
                p,
                seed,
                offset,
                HAS_BIAS=bias is not None,
                BLOCK_SIZE=_BLOCK_SIZE,
                num_warps=4,
            )
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        ctx.shape, ctx.hidden_size = x.shape, x.shape[-1]
        ctx.dtype = x.dtype
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_out = grad_out.contiguous()
        grad_x = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_out.device)
        n_elements = grad_x.numel()
        if n_elements > 0:
            grid = (triton.cdiv(n_elements, _BLOCK_SIZE),)
            _dropout_backward_kernel[grid](
                grad_out, grad_x, n_elements, ctx.p, ctx.seed, ctx.offset, BLOCK_SIZE=_BLOCK_SIZE, num_warps=4
            )
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_x.reshape(-1, ctx.hidden_size).sum(0)
        return grad_x, grad_bias, grad_out, None, None, None


def _draw_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """Draw a Philox seed from ``generator`` (or ``device``'s default generator)."""
    if generator is not None:
        device = generator.device
    return int(torch.randint(0, _SEED_BOUND, (1,), device=device, generator=generator).item())


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Fused ``residual + dropout(x + bias, p)``: Triton on CUDA, the torch path on CPU.

    See the module docstring for how to make masks identical or distinct across tensor-parallel ranks.

    Args:
        x: activations ``[..., hidden]`` (e.g. the output of a bias-free linear layer).
        bias: ``[hidden]``, or None.
        residual: the residual stream, shaped like ``x``.
        p: probability of zeroing an element, in ``[0, 1]``.
        training: when False (or ``p == 0``) this is ``residual + x + bias`` and draws no random numbers.
        generator: torch path: the generator the Bernoulli mask is drawn from. Triton path with
            ``seed=None``: the generator the Philox seed is drawn from. None: the default generator.
        seed: Triton path only: Philox seed; the mask is a pure function of ``(seed, offset, index)``.
        offset: Triton path only: Philox counter offset added to each element's index.

    Returns:
        ``residual + dropout(x + bias)``, shaped like ``x``; the dtype follows torch's promotion of the
        inputs, with ``bias`` cast to ``x``'s dtype under autocast (as autocast casts ``F.linear``'s bias).
    """
    _check_inputs(x, bias, residual, p)
    if seed is not None and not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed} is outside [0, 2**63): pass a non-negative 63-bit integer.")
    if offset < 0:
        raise ValueError(f"offset={offset} is negative: pass a non-negative Philox counter offset.")
    if bias is not None and torch.is_autocast_enabled(x.device.type):
        # Autocast runs the unfused F.linear(input, weight, bias) with the bias in the autocast dtype.
        bias = bias.to(x.dtype)
    tensors = (x, residual) if bias is None else (x, bias, residual)
    if not training or p == 0.0 or p == 1.0 or x.numel() == 0 or not use_triton(*tensors):
        # p == 1 drops everything: no randomness, so the (exact) torch path serves every device.
        return bias_dropout_add_reference(x, bias, residual, p, training, generator)
    dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    dtype = torch.promote_types(dtype, residual.dtype)
    if seed is None:
        seed = _draw_seed(generator, x.device)
    return _BiasDropoutAddFunction.apply(
        x.to(dtype), None if bias is None else bias.to(dtype), residual.to(dtype), float(p), seed, offset
    )


class FusedBiasDropoutAdd(nn.Module):
    """Module form of :func:`bias_dropout_add`; dropout is active when the module is in training mode.

    Args:
        p: probability of zeroing an element.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} is outside [0, 1]; pass the config's dropout rate.")
        self.p = p

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """Return ``residual + dropout(x + bias)``; see :func:`bias_dropout_add` for the RNG arguments."""
        return bias_dropout_add(x, bias, residual, self.p, self.training, generator, seed, offset)

    def extra_repr(self) -> str:
        return f"p={self.p}"
