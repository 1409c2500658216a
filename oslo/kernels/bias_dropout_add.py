"""Fused bias + dropout + residual add: ``residual + dropout(x + bias, p)``, forward and backward.

Three parts, as for every oslo kernel:

1. Triton kernels: the forward draws the keep-mask from Philox (``tl.randint4x(seed, offset + i)``:
   one Philox call gives the random words of four elements) and writes only the output; the backward
   regenerates the same mask from ``(seed, offset)``, so no mask is stored between forward and backward.
   The seed is read from a one-element device tensor: drawing it needs no host synchronization.
2. The custom ops ``oslo::bias_dropout_add`` and ``oslo::dropout_backward`` launching them
   (``torch.library.custom_op``, opaque to ``torch.compile``, which calls them as they are), with the
   autograd formula and fake implementations registered. On tensors that do not launch Triton they draw
   a Bernoulli mask from a generator seeded with ``seed`` (and the backward draws it again).
3. ``bias_dropout_add`` / ``FusedBiasDropoutAdd``: the thin entry points; on CPU tensors (or without
   Triton), and on CUDA below :data:`~oslo.kernels._triton.TRITON_MIN_ROWS` rows, they run the torch
   path, which is the unfused math with the unfused RNG stream.

Whether the models' ``fuse()`` uses this kernel at all is :func:`fused_bias_dropout_add_pays`'s call: it
must beat what it replaces, torch's ``residual + dropout(linear(x))`` with the bias added by the matmul.

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
import torch.nn.functional as F
from torch import nn

from oslo.kernels._triton import HAS_TRITON, launches_triton, tl, triton, triton_kernel, use_triton

__all__ = ["FusedBiasDropoutAdd", "bias_dropout_add", "bias_dropout_add_reference", "fused_bias_dropout_add_pays"]

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

    With ``generator=None`` this is the unfused expression ``residual + F.dropout(x + bias, p)`` (bit for
    bit from the same RNG state); with a generator, the mask is drawn as ``F.dropout`` draws it on CPU
    (``empty_like(h).bernoulli_(1 - p, generator=generator)``, scaled by ``1 / (1 - p)``).

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
    if generator is None:
        return residual + F.dropout(hidden, p, training=True)
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
        seed_ptr,
        n_elements,
        hidden_size,
        drop_threshold,
        scale,
        philox_offset,
        HAS_BIAS: tl.constexpr,
        QUARTER_BLOCK: tl.constexpr,
    ):
        # A program covers 4 * QUARTER_BLOCK elements; Philox counter (offset + pid * QUARTER_BLOCK + lane)
        # gives four 32-bit words, word k deciding element lane of quarter k.
        pid = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, QUARTER_BLOCK)
        seed = tl.load(seed_ptr)
        words = tl.randint4x(seed, philox_offset + pid * QUARTER_BLOCK + lanes)
        for quarter in tl.static_range(4):
            offsets = (pid * 4 + quarter) * QUARTER_BLOCK + lanes
            in_range = offsets < n_elements
            hidden = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
            if HAS_BIAS:
                hidden += tl.load(bias_ptr + offsets % hidden_size, mask=in_range, other=0.0).to(tl.float32)
            residual = tl.load(residual_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
            # The top 24 bits, uniform on [0, 2**24): drop when below p * 2**24.
            keep = (words[quarter] >> 8).to(tl.int32) >= drop_threshold
            out = residual + tl.where(keep, hidden * scale, 0.0)
            tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_range)

    @triton_kernel
    def _dropout_backward_kernel(
        grad_out_ptr,
        grad_in_ptr,
        seed_ptr,
        n_elements,
        drop_threshold,
        scale,
        philox_offset,
        QUARTER_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, QUARTER_BLOCK)
        seed = tl.load(seed_ptr)
        words = tl.randint4x(seed, philox_offset + pid * QUARTER_BLOCK + lanes)
        for quarter in tl.static_range(4):
            offsets = (pid * 4 + quarter) * QUARTER_BLOCK + lanes
            in_range = offsets < n_elements
            grad_out = tl.load(grad_out_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
            keep = (words[quarter] >> 8).to(tl.int32) >= drop_threshold
            grad_in = tl.where(keep, grad_out * scale, 0.0)
            tl.store(grad_in_ptr + offsets, grad_in.to(grad_in_ptr.dtype.element_ty), mask=in_range)


_QUARTER_BLOCK = 256  # 1024 elements per program


def _kernel_constants(p: float) -> tuple[int, float]:
    """The kernels' integer drop threshold (on 24 random bits) and the scale of kept elements."""
    return round(p * 2**24), 1.0 / (1.0 - p)


def _seeded_mask(like: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """Torch path of the ops: the keep-mask, scaled, drawn from a generator seeded with ``seed``."""
    generator = torch.Generator(device=like.device).manual_seed(int(seed.item()))
    return torch.empty(like.shape, dtype=like.dtype, device=like.device).bernoulli_(1.0 - p, generator=generator) / (
        1.0 - p
    )


@torch.library.custom_op("oslo::bias_dropout_add", mutates_args=())
def _bias_dropout_add_op(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, seed: torch.Tensor, offset: int
) -> torch.Tensor:
    """``residual + mask * (x + bias) / (1 - p)``; the mask a function of ``(seed, offset)``. One dtype."""
    if not launches_triton(x):
        hidden = x if bias is None else x + bias
        return (residual + hidden * _seeded_mask(hidden, p, seed)).contiguous()
    x = x.contiguous()
    residual = residual.contiguous()
    out = torch.empty_like(x)
    n_elements = x.numel()
    if n_elements > 0:
        threshold, scale = _kernel_constants(p)
        grid = (triton.cdiv(n_elements, 4 * _QUARTER_BLOCK),)
        _bias_dropout_add_forward_kernel[grid](
            x,
            x if bias is None else bias.contiguous(),  # unused pointer when HAS_BIAS is False
            residual,
            out,
            seed,
            n_elements,
            x.shape[-1],
            threshold,
            scale,
            offset,
            HAS_BIAS=bias is not None,
            QUARTER_BLOCK=_QUARTER_BLOCK,
            num_warps=4,
        )
    return out


@_bias_dropout_add_op.register_fake
def _(x, bias, residual, p, seed, offset):
    return x.new_empty(x.shape)


@torch.library.custom_op("oslo::dropout_backward", mutates_args=())
def _dropout_backward_op(grad_out: torch.Tensor, p: float, seed: torch.Tensor, offset: int) -> torch.Tensor:
    """``mask * grad_out / (1 - p)`` with the forward's mask, regenerated from ``(seed, offset)``."""
    if not launches_triton(grad_out):
        return (grad_out * _seeded_mask(grad_out, p, seed)).contiguous()
    grad_out = grad_out.contiguous()
    grad_in = torch.empty_like(grad_out)
    n_elements = grad_in.numel()
    if n_elements > 0:
        threshold, scale = _kernel_constants(p)
        grid = (triton.cdiv(n_elements, 4 * _QUARTER_BLOCK),)
        _dropout_backward_kernel[grid](
            grad_out, grad_in, seed, n_elements, threshold, scale, offset, QUARTER_BLOCK=_QUARTER_BLOCK, num_warps=4
        )
    return grad_in


@_dropout_backward_op.register_fake
def _(grad_out, p, seed, offset):
    return grad_out.new_empty(grad_out.shape)


def _bias_dropout_add_setup_context(ctx, inputs, output) -> None:
    x, bias, _, p, seed, offset = inputs
    ctx.save_for_backward(seed)
    ctx.p, ctx.offset = p, offset
    ctx.has_bias, ctx.hidden_size = bias is not None, x.shape[-1]


def _bias_dropout_add_backward(ctx, grad_out: torch.Tensor):
    (seed,) = ctx.saved_tensors
    grad_x = _dropout_backward_op(grad_out, ctx.p, seed, ctx.offset)
    grad_bias = None
    if ctx.has_bias and ctx.needs_input_grad[1]:
        grad_bias = grad_x.reshape(-1, ctx.hidden_size).sum(0)
    return grad_x, grad_bias, grad_out, None, None, None


_bias_dropout_add_op.register_autograd(_bias_dropout_add_backward, setup_context=_bias_dropout_add_setup_context)


def _seed_tensor(seed: int | None, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The Philox seed as a one-element int64 tensor on ``device``: ``seed``, or drawn from ``generator``
    (or the device's default generator) on the device itself, so no host synchronization."""
    if seed is not None:
        return torch.tensor([seed], dtype=torch.int64, device=device)
    draw_on = generator.device if generator is not None else device
    return torch.randint(0, _SEED_BOUND, (1,), device=draw_on, generator=generator).to(device)


#: Whether the models' ``fuse()`` runs the Triton kernel at all (see :func:`fused_bias_dropout_add_pays`).
#: Off: measured slower than torch's expression (H200, bf16, 8192 x 4096 -> 1024 with p = 0.1, forward and
#: backward with the matmul: 0.87 ms against 0.37 ms; element-wise alone 0.72 against 0.28 ms).
FUSE_USES_KERNEL = False


def fused_bias_dropout_add_pays(x: torch.Tensor, p: float, training: bool) -> bool:
    """Whether a fused model should split the bias off its linear layer and call :func:`bias_dropout_add`
    on the layer's output ``x``, rather than run torch's ``residual + dropout(linear(x))``.

    The torch expression adds the bias inside the matmul for free and runs torch's fused dropout
    kernel; the Triton kernel can only win when dropout is active, on enough rows that its launch cost is
    hidden (:data:`~oslo.kernels._triton.TRITON_MIN_ROWS`), and only where it was measured faster
    (:data:`FUSE_USES_KERNEL`; ``benchmarks/kernels_gpu.py`` measures it at the shapes ``fuse()`` uses).
    CPU tensors take the torch expression (what the torch path computes anyway).

    Args:
        x: the linear layer's input (its rows are the rows of the fused op).
        p: the dropout probability.
        training: whether dropout is active.

    Returns:
        True to fuse bias + dropout + residual, False for the torch expression.
    """
    if not (FUSE_USES_KERNEL and training and 0.0 < p < 1.0) or not x.is_cuda:
        return False
    return use_triton(x, rows=x.numel() // max(x.shape[-1], 1))


def adds_residual(module: nn.Module, x: torch.Tensor, dropout: nn.Dropout) -> bool:
    """Whether a block hands the residual to ``module`` (an attention or an MLP whose ``fuse()`` set ``fused``) for
    the module to add in :func:`bias_dropout_add`: :func:`fused_bias_dropout_add_pays` on the rows of ``x``.
    Otherwise the block adds it, and the module's output is transformers' (forward hooks see the same values)."""
    return bool(getattr(module, "fused", False)) and fused_bias_dropout_add_pays(x, dropout.p, module.training)


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
    """Fused ``residual + dropout(x + bias, p)``: the ``oslo::bias_dropout_add`` op (Triton) on CUDA, the
    torch path on CPU and on CUDA below :data:`~oslo.kernels._triton.TRITON_MIN_ROWS` rows.

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
    rows = x.numel() // max(x.shape[-1], 1)
    if not training or p == 0.0 or p == 1.0 or x.numel() == 0 or not use_triton(*tensors, rows=rows):
        # p == 1 drops everything: no randomness, so the (exact) torch path serves every device.
        return bias_dropout_add_reference(x, bias, residual, p, training, generator)
    dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    dtype = torch.promote_types(dtype, residual.dtype)
    return _bias_dropout_add_op(
        x.to(dtype),
        None if bias is None else bias.to(dtype),
        residual.to(dtype),
        float(p),
        _seed_tensor(seed, generator, x.device),
        offset,
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
