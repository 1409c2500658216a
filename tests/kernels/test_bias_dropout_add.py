import pytest
import torch
import torch.nn.functional as F

from oslo.kernels import FusedBiasDropoutAdd, bias_dropout_add

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    bias = torch.randn(shape[-1], generator=generator).to(device=device, dtype=dtype).requires_grad_()
    residual = torch.randn(shape, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    return x, bias, residual


def _grads(out, inputs, seed=1):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return torch.autograd.grad(out, inputs, grad)


# ----------------------------------------------------------------------------- torch path


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_equals_unfused_dropout_from_same_rng_state(dtype):
    x, bias, residual = _inputs((4, 9, 37), dtype)
    torch.manual_seed(1234)
    out = bias_dropout_add(x, bias, residual, p=0.2)
    torch.manual_seed(1234)
    expected = residual + F.dropout(x + bias, p=0.2, training=True)
    assert torch.equal(out, expected)
    for got, want in zip(
        _grads(out, (x, bias, residual)), _grads(expected, (x, bias, residual)), strict=True
    ):
        assert torch.equal(got, want)


def test_torch_path_generator_controls_the_mask_without_touching_global_rng():
    x, bias, residual = _inputs((6, 33))
    global_state = torch.get_rng_state()
    same_a = bias_dropout_add(x, bias, residual, 0.5, generator=torch.Generator().manual_seed(7))
    same_b = bias_dropout_add(x, bias, residual, 0.5, generator=torch.Generator().manual_seed(7))
    other = bias_dropout_add(x, bias, residual, 0.5, generator=torch.Generator().manual_seed(8))
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(same_a, same_b)  # e.g. every tp rank, replicated activation
    assert not torch.equal(same_a, other)  # e.g. per-rank seeds, split activation


@pytest.mark.parametrize("p, training", [(0.0, True), (0.3, False)])
def test_no_dropout_is_plain_add_and_draws_no_random_numbers(p, training):
    x, bias, residual = _inputs((3, 17))
    global_state = torch.get_rng_state()
    out = bias_dropout_add(x, bias, residual, p, training=training)
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(out, residual + (x + bias))


def test_p_one_drops_everything():
    x, bias, residual = _inputs((3, 17))
    out = bias_dropout_add(x, bias, residual, 1.0)
    grad_x, grad_residual = _grads(out, (x, residual))
    assert torch.equal(out, residual)
    assert torch.equal(grad_x, torch.zeros_like(x)) and grad_residual.abs().sum() > 0


def test_bias_free_and_module_form():
    x, _, residual = _inputs((3, 17))
    torch.manual_seed(3)
    out = FusedBiasDropoutAdd(0.25).train()(x, None, residual)
    torch.manual_seed(3)
    assert torch.equal(out, residual + F.dropout(x, 0.25, training=True))
    module = FusedBiasDropoutAdd(0.25).eval()
    assert torch.equal(module(x, None, residual), residual + x)
    assert "p=0.25" in repr(module)


def test_autocast_casts_the_bias_like_the_unfused_linear():
    generator = torch.Generator().manual_seed(0)
    inputs, weight = torch.randn(3, 16, generator=generator), torch.randn(24, 16, generator=generator)
    bias, residual = torch.randn(24, generator=generator), torch.randn(3, 24, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = F.linear(inputs, weight)
        fused = bias_dropout_add(hidden, bias, hidden, 0.1, training=False)
        unfused = F.linear(inputs, weight, bias) + hidden
        fp32_residual = bias_dropout_add(hidden, bias, residual, 0.1, training=False)
    assert fused.dtype == unfused.dtype == torch.bfloat16
    torch.testing.assert_close(fused, unfused, rtol=2 * 2**-7, atol=2e-2)
    assert fp32_residual.dtype == torch.float32  # bf16 + fp32 residual promotes, as unfused


def test_bad_arguments_name_the_problem():
    x, bias, residual = _inputs((3, 17))
    with pytest.raises(ValueError, match=r"p=1.5 is outside \[0, 1\]"):
        bias_dropout_add(x, bias, residual, 1.5)
    with pytest.raises(ValueError, match=r"residual of shape \(17,\) does not match x of shape \(3, 17\)"):
        bias_dropout_add(x, bias, residual[0], 0.1)
    with pytest.raises(ValueError, match=r"bias of shape \(16,\)"):
        bias_dropout_add(x, bias[:16], residual, 0.1)
    with pytest.raises(ValueError, match="seed=-1"):
        bias_dropout_add(x, bias, residual, 0.1, seed=-1)
    with pytest.raises(ValueError, match=r"p=-0.1 is outside"):
        FusedBiasDropoutAdd(-0.1)


# ----------------------------------------------------------------------------- Triton


def _triton_keep_mask(shape, p, seed, offset, device):
    """The mask the Triton path draws for (seed, offset): run it on ones with a zero residual."""
    ones = torch.ones(shape, device=device)
    out = bias_dropout_add(ones, None, torch.zeros_like(ones), p, seed=seed, offset=offset)
    kept = out != 0
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    return kept


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_matches_reference_with_the_same_mask(triton_device, assert_close_for_dtype, dtype, with_bias):
    shape, p, seed = (3, 7, 37), 0.3, 2024  # 777 elements: one partial block
    x, bias, residual = _inputs(shape, dtype, triton_device)
    bias = bias if with_bias else None
    inputs = (x, residual) if bias is None else (x, bias, residual)
    out = bias_dropout_add(x, bias, residual, p, seed=seed)
    grads = _grads(out, inputs)

    keep = _triton_keep_mask(shape, p, seed, 0, triton_device)
    # The kernel computes in fp32 and rounds once at the end; so does this reference.
    hidden = x.float() if bias is None else x.float() + bias.float()
    expected = (residual.float() + hidden * keep / (1 - p)).to(dtype)
    expected_grads = _grads(expected, inputs)
    assert out.dtype == dtype
    assert_close_for_dtype(out, expected, dtype, "forward")
    assert_close_for_dtype(grads[0], expected_grads[0], dtype, "grad x")
    assert torch.equal(grads[-1], expected_grads[-1])  # grad residual is the incoming gradient
    if bias is not None:
        rows = x.numel() // shape[-1]
        torch.testing.assert_close(
            grads[1].float(), expected_grads[1].float(), rtol=0, atol=rows * 4 * torch.finfo(dtype).eps * 4
        )


@pytest.mark.triton
def test_triton_mask_is_a_function_of_seed_and_offset(triton_device):
    shape, p = (5, 999), 0.25  # 4995 elements over five blocks
    keep = _triton_keep_mask(shape, p, seed=11, offset=0, device=triton_device)
    assert torch.equal(keep, _triton_keep_mask(shape, p, seed=11, offset=0, device=triton_device))
    assert not torch.equal(keep, _triton_keep_mask(shape, p, seed=12, offset=0, device=triton_device))
    assert not torch.equal(keep, _triton_keep_mask(shape, p, seed=11, offset=4995, device=triton_device))
    # 4995 Bernoulli(0.75) draws: the kept fraction is within 5 standard deviations (0.0061 each).
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / keep.numel()) ** 0.5


@pytest.mark.triton
def test_triton_seed_drawn_from_generator(triton_device):
    x, bias, residual = _inputs((4, 45), device=triton_device)
    out_a = bias_dropout_add(x, bias, residual, 0.4, generator=torch.Generator(triton_device).manual_seed(5))
    out_b = bias_dropout_add(x, bias, residual, 0.4, generator=torch.Generator(triton_device).manual_seed(5))
    out_c = bias_dropout_add(x, bias, residual, 0.4, generator=torch.Generator(triton_device).manual_seed(6))
    assert torch.equal(out_a, out_b)
    assert not torch.equal(out_a, out_c)


@pytest.mark.triton
def test_triton_eval_mode_is_exact_add(triton_device):
    x, bias, residual = _inputs((4, 45), device=triton_device)
    assert torch.equal(bias_dropout_add(x, bias, residual, 0.4, training=False), residual + (x + bias))
