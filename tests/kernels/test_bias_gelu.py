import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from oslo.kernels import (
    HF_GELU_APPROXIMATIONS,
    FusedBiasGeLU,
    bias_gelu,
    bias_gelu_reference,
    gelu_approximation_for_activation,
)

# numpy warnings from Triton's interpreter, e.g. exp overflow inside sigmoid of large inputs (result exact).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(3, 37), (2, 5, 129)]  # non-powers of two; the second spans two 1024-element blocks


def _inputs(shape, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(shape, generator=generator)
    bias = torch.randn(shape[-1], generator=generator)
    if dtype == torch.bfloat16:
        # Multiples of 1/16 below 8 in magnitude: x + bias is exact in bf16, so Triton's interpreter (which
        # casts fp32 -> bf16 by truncation) and torch (round to nearest) feed GeLU the same value.
        x, bias = (torch.round(t.clamp(-3.9, 3.9) * 16) / 16 for t in (x, bias))
    x = x.to(device=device, dtype=dtype).requires_grad_()
    bias = bias.to(device=device, dtype=dtype).requires_grad_()
    return x, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_torch_path_equals_unfused_gelu(dtype, approximate):
    x, bias = _inputs((4, 3, 37), dtype)
    out = bias_gelu(x, bias, approximate)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, (x, bias), grad)
    expected = F.gelu(x + bias, approximate=approximate)
    expected_grads = torch.autograd.grad(expected, (x, bias), grad)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


@pytest.mark.parametrize("activation", sorted(HF_GELU_APPROXIMATIONS))
def test_hf_activation_names_map_to_the_same_function(activation):
    x, bias = _inputs((8, 301), torch.float32)
    approximate = gelu_approximation_for_activation(activation)
    expected = ACT2FN[activation](x + bias)
    out = bias_gelu(x, bias, approximate)
    if activation in ("gelu", "gelu_pytorch_tanh"):  # the same torch kernel
        assert torch.equal(out, expected)
    else:  # the same formula written in Python: rounding differences only
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert FusedBiasGeLU.from_activation(activation).approximate == approximate


@pytest.mark.parametrize("activation", ["relu", "quick_gelu", "gelu_10", "silu", "not_an_activation"])
def test_non_gelu_activations_are_refused(activation):
    with pytest.raises(ValueError, match=f"'{activation}' cannot be fused") as info:
        gelu_approximation_for_activation(activation)
    assert "gelu_new" in str(info.value)  # names what is supported


def test_bad_arguments_name_the_problem():
    x, bias = _inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="approximate='erf'"):
        bias_gelu(x, bias, "erf")
    with pytest.raises(ValueError, match=r"bias of shape \(7,\) does not match x of shape \(2, 8\)"):
        bias_gelu(x, torch.zeros(7), "none")
    with pytest.raises(ValueError, match="approximate"):
        FusedBiasGeLU("exact")


def test_autocast_keeps_the_dtype_the_unfused_layer_gives():
    generator = torch.Generator().manual_seed(0)
    inputs, weight = torch.randn(3, 16, generator=generator), torch.randn(24, 16, generator=generator)
    bias = torch.randn(24, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = bias_gelu(F.linear(inputs, weight), bias, "tanh")
        unfused = F.gelu(F.linear(inputs, weight, bias), approximate="tanh")
    assert fused.dtype == unfused.dtype == torch.bfloat16
    torch.testing.assert_close(fused, unfused, rtol=2 * 2**-7, atol=1e-2)


def test_reference_and_module_agree():
    x, bias = _inputs((2, 8), torch.float32)
    module = FusedBiasGeLU("tanh")
    assert torch.equal(module(x, bias), bias_gelu_reference(x, bias, "tanh"))
    assert "tanh" in repr(module)


@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_triton_matches_reference(triton_device, assert_close_for_dtype, shape, dtype, approximate):
    x, bias = _inputs(shape, dtype, triton_device)
    out = bias_gelu(x, bias, approximate)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grad_x, grad_bias = torch.autograd.grad(out, (x, bias), grad)

    expected = bias_gelu_reference(x, bias, approximate)
    expected_x, expected_bias = torch.autograd.grad(expected, (x, bias), grad)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_for_dtype(out, expected, dtype, "forward")
    assert_close_for_dtype(grad_x, expected_x, dtype, "grad x")
    # The bias gradient sums `rows` rounded per-element gradients: allow for that many roundings.
    rows = x.numel() // shape[-1]
    scale = expected_bias.abs().max().clamp_min(1).item()
    torch.testing.assert_close(
        grad_bias.float(), expected_bias.float(), rtol=0, atol=rows * 4 * torch.finfo(dtype).eps * scale
    )


@pytest.mark.triton
def test_triton_promotes_mixed_dtypes_like_torch(triton_device):
    x, _ = _inputs((3, 37), torch.float16, triton_device)
    bias = torch.randn(37, device=triton_device)
    out = bias_gelu(x, bias, "none")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, bias_gelu_reference(x, bias, "none"), rtol=1e-5, atol=1e-6)
