"""Fused bias + GeLU: ``gelu(x + bias)``, exact (erf) or tanh approximation, forward and backward.

Three parts, as for every oslo kernel:

1. Triton kernels (``_bias_gelu_forward_kernel`` / ``_bias_gelu_backward_kernel``): one pass over
   ``x`` each; the backward recomputes ``gelu'(x + bias)`` from the saved input ``x`` (the linear layer's
   output, which the unfused layer keeps too) instead of saving the activation or ``x + bias``.
2. The custom ops ``oslo::bias_gelu`` and ``oslo::bias_gelu_backward`` launching them (``triton_op``:
   ``torch.compile`` traces into them), with the autograd formula registered; on tensors that do not
   launch Triton their implementation is the torch reference (``gelu(x + bias)`` and aten's
   ``gelu_backward``).
3. ``bias_gelu`` / ``FusedBiasGeLU``: the thin entry points. On CPU tensors (or without Triton), and on
   CUDA below :data:`~oslo.kernels._triton.TRITON_MIN_ROWS` rows (decoding: launch-bound), they run the
   torch expression ``gelu(x + bias)``, which is exactly the unfused math.

The models' ``fuse()`` does not call this op: after a matmul, torch's ``gelu(linear(x, W, b))`` (the
bias added by the matmul, the GeLU one kernel) measured faster (H200, bf16, 8192 x 1024 -> 4096, forward
and backward with the matmul: 0.43 ms against 0.71 ms through this op; transformers' ``gelu_new`` formula
1.12 ms). The op serves a bias that no matmul can take, and ``torch.compile`` traces it.

Hugging Face configs name their activation (``config.activation_function`` / ``config.hidden_act``);
:func:`gelu_approximation_for_activation` maps those names to ``"none"`` (erf) or ``"tanh"`` and refuses
every activation that is not one of these two functions, so fusing never changes the math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oslo.kernels._triton import (
    HAS_TRITON,
    define_op,
    launchable,
    launches_triton,
    tl,
    triton,
    triton_kernel,
    use_triton,
)

__all__ = [
    "HF_GELU_APPROXIMATIONS",
    "FusedBiasGeLU",
    "bias_gelu",
    "bias_gelu_reference",
    "gelu_approximation_for_activation",
]

# Hugging Face activation name -> the GeLU variant it computes (transformers.activations.ACT2CLS).
# "gelu_python" is the erf formula written in Python; "gelu_new", "gelu_fast", "gelu_accurate" and
# "gelu_python_tanh" are 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) written in Python,
# i.e. torch's approximate="tanh" up to rounding (<= 4.8e-7 absolute in fp32; in fp16/bf16 the Python
# formulas round every intermediate, so they differ from torch's fp32-internal kernel by 1 ulp).
HF_GELU_APPROXIMATIONS: dict[str, str] = {
    "gelu": "none",
    "gelu_python": "none",
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu_python_tanh": "tanh",
    "gelu_fast": "tanh",
    "gelu_accurate": "tanh",
}

_APPROXIMATIONS = ("none", "tanh")


def gelu_approximation_for_activation(activation: str) -> str:
    """Map a Hugging Face activation name to the ``approximate`` argument of :func:`bias_gelu`.

    Args:
        activation: a ``transformers.activations.ACT2FN`` key, e.g. ``config.activation_function``
            (GPT-2, GPT-Neo: ``"gelu_new"``) or ``config.hidden_act`` (BERT: ``"gelu"``).

    Returns:
        ``"none"`` for the exact erf GeLU, ``"tanh"`` for the tanh approximation.

    Raises:
        ValueError: the activation is not a plain GeLU (e.g. ``"relu"``, ``"quick_gelu"`` uses a sigmoid,
            ``"gelu_10"`` clips its output), so the fused kernel would change the model's math.
    """
    try:
        return HF_GELU_APPROXIMATIONS[activation]
    except KeyError:
        raise ValueError(
            f"activation {activation!r} cannot be fused into bias+GeLU: the kernel computes only the erf "
            f"GeLU and its tanh approximation, i.e. one of {sorted(HF_GELU_APPROXIMATIONS)}. Leave this "
            "MLP unfused (exclude it from fuse()) so its activation keeps its own math."
        ) from None


def _check_inputs(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> None:
    if approximate not in _APPROXIMATIONS:
        raise ValueError(
            f"approximate={approximate!r} is not a GeLU variant: use 'none' (erf) or 'tanh'; for a Hugging "
            "Face activation name call gelu_approximation_for_activation(name) first."
        )
    if bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]:
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not match x of shape {tuple(x.shape)}: bias must be "
            "1-D with x.shape[-1] elements (the output features of the linear layer before the activation)."
        )


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Torch reference: ``torch.nn.functional.gelu(x + bias, approximate=approximate)``.

    Args:
        x: activations ``[..., hidden]``.
        bias: ``[hidden]``.
        approximate: ``"none"`` (erf) or ``"tanh"``.

    Returns:
        ``gelu(x + bias)`` with the dtype torch's type promotion gives ``x + bias``.
    """
    _check_inputs(x, bias, approximate)
    return F.gelu(x + bias, approximate=approximate)


if HAS_TRITON:

    @triton_kernel
    def _bias_gelu_forward_kernel(
        x_ptr,
        bias_ptr,
        out_ptr,
        n_elements,
        hidden_size,
        APPROXIMATE_TANH: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_range = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + offsets % hidden_size, mask=in_range, other=0.0).to(tl.float32)
        # Round x + bias to the storage dtype first, as the unfused `gelu(x + bias)` does.
        z = (x + bias).to(out_ptr.dtype.element_ty).to(tl.float32)
        if APPROXIMATE_TANH:
            # 0.5 * (1 + tanh(u)) == sigmoid(2u); u = sqrt(2/pi) * (z + 0.044715 z^3)
            inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            y = z * tl.sigmoid(2.0 * inner)
        else:
            y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=in_range)

    @triton_kernel
    def _bias_gelu_backward_kernel(
        grad_out_ptr,
        x_ptr,
        bias_ptr,
        grad_in_ptr,
        n_elements,
        hidden_size,
        APPROXIMATE_TANH: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_range = offsets < n_elements
        grad_out = tl.load(grad_out_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + offsets % hidden_size, mask=in_range, other=0.0).to(tl.float32)
        z = (x + bias).to(grad_in_ptr.dtype.element_ty).to(tl.float32)
        if APPROXIMATE_TANH:
            inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            s = tl.sigmoid(2.0 * inner)
            # d/dz [z * sigmoid(2u)] = s + z * 2 s (1 - s) * du/dz
            d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
            derivative = s + 2.0 * z * s * (1.0 - s) * d_inner
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
            pdf = 0.3989422804014327 * tl.exp(-0.5 * z * z)
            derivative = cdf + z * pdf
        tl.store(
            grad_in_ptr + offsets, (grad_out * derivative).to(grad_in_ptr.dtype.element_ty), mask=in_range
        )


_BLOCK_SIZE = 1024


def _launch(kernel, *tensors: torch.Tensor, n_elements: int, hidden_size: int, approximate: str) -> None:
    grid = (triton.cdiv(n_elements, _BLOCK_SIZE),)
    launchable(kernel)[grid](
        *tensors,
        n_elements,
        hidden_size,
        APPROXIMATE_TANH=approximate == "tanh",
        BLOCK_SIZE=_BLOCK_SIZE,
        num_warps=4,
    )


@define_op("oslo::bias_gelu")
def _bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """``gelu(x + bias)`` in one kernel; ``x`` and ``bias`` of one dtype."""
    if not launches_triton(x):
        return F.gelu(x + bias, approximate=approximate)
    x = x.contiguous()
    bias = bias.contiguous()
    out = torch.empty_like(x)
    if x.numel() > 0:
        _launch(
            _bias_gelu_forward_kernel, x, bias, out, n_elements=x.numel(), hidden_size=x.shape[-1],
            approximate=approximate,
        )
    return out


@define_op("oslo::bias_gelu_backward")
def _bias_gelu_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str
) -> torch.Tensor:
    """``grad_out * gelu'(x + bias)`` in one kernel (the gradient of ``x``)."""
    if not launches_triton(x):
        return torch.ops.aten.gelu_backward(grad_out, x + bias, approximate=approximate)
    grad_out = grad_out.contiguous()
    x = x.contiguous()
    bias = bias.contiguous()
    grad_in = torch.empty_like(x)
    if x.numel() > 0:
        _launch(
            _bias_gelu_backward_kernel, grad_out, x, bias, grad_in, n_elements=x.numel(),
            hidden_size=x.shape[-1], approximate=approximate,
        )
    return grad_in


def _bias_gelu_setup_context(ctx, inputs, output) -> None:
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _bias_gelu_backward(ctx, grad_out: torch.Tensor):
    x, bias = ctx.saved_tensors
    grad_in = _bias_gelu_backward_op(grad_out, x, bias, ctx.approximate)
    grad_bias = grad_in.reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
    return grad_in, grad_bias, None


_bias_gelu_op.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup_context)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Fused ``gelu(x + bias)``: the ``oslo::bias_gelu`` op (Triton) on CUDA, the torch expression on CPU
    and on CUDA below :data:`~oslo.kernels._triton.TRITON_MIN_ROWS` rows.

    The output matches the unfused ``torch.nn.functional.gelu(x + bias, approximate=...)``: ``x + bias``
    is rounded to the storage dtype before the activation, which is then computed in fp32. When ``x``
    and ``bias`` dtypes differ, torch's type promotion picks the output dtype, except under autocast,
    where ``bias`` is cast to ``x``'s dtype as autocast casts ``F.linear``'s bias in the unfused layer.

    Args:
        x: activations ``[..., hidden]``, typically the output of a bias-free linear layer.
        bias: ``[hidden]``, the linear layer's bias.
        approximate: ``"none"`` for the exact erf GeLU, ``"tanh"`` for the tanh approximation; get it
            from a Hugging Face activation name with :func:`gelu_approximation_for_activation`.

    Returns:
        ``gelu(x + bias)``, shaped like ``x``. Differentiable w.r.t. ``x`` and ``bias``.
    """
    _check_inputs(x, bias, approximate)
    if torch.is_autocast_enabled(x.device.type):
        # Autocast runs the unfused F.linear(input, weight, bias) with the bias in the autocast dtype.
        bias = bias.to(x.dtype)
    if not use_triton(x, bias, rows=x.numel() // max(x.shape[-1], 1)):
        return F.gelu(x + bias, approximate=approximate)
    dtype = torch.promote_types(x.dtype, bias.dtype)
    return _bias_gelu_op(x.to(dtype), bias.to(dtype), approximate)


class FusedBiasGeLU(nn.Module):
    """Module form of :func:`bias_gelu`; holds only the GeLU variant.

    Args:
        approximate: ``"none"`` (erf) or ``"tanh"``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in _APPROXIMATIONS:
            raise ValueError(
                f"approximate={approximate!r} is not a GeLU variant: use 'none' (erf) or 'tanh'."
            )
        self.approximate = approximate

    @classmethod
    def from_activation(cls, activation: str) -> FusedBiasGeLU:
        """Build from a Hugging Face activation name (raises for activations that cannot be fused)."""
        return cls(gelu_approximation_for_activation(activation))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Return ``gelu(x + bias)``."""
        return bias_gelu(x, bias, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
