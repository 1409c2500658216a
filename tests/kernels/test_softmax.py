import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import causal_mask_function, eager_mask, sdpa_mask

from oslo.kernels import FusedScaleMaskSoftmax, scaled_masked_softmax, scaled_masked_softmax_reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _scores(shape, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(shape, generator=generator)).to(device=device, dtype=dtype).requires_grad_()


def _left_padded_masks(batch, q_len, k_len, dtype):
    """transformers' sdpa (bool) and eager (additive) causal masks for a left-padded batch.

    Row 0 is unpadded; row 1 has 3 pad tokens, so its first 3 queries see only padding (fully masked).
    The queries are the last q_len positions (as with a KV cache).
    """
    attention_mask = torch.ones(batch, k_len, dtype=torch.bool)  # as create_causal_mask passes it on
    attention_mask[1, :3] = False
    kwargs = {
        "batch_size": batch,
        "q_length": q_len,
        "kv_length": k_len,
        "q_offset": k_len - q_len,
        "mask_function": causal_mask_function,
        "attention_mask": attention_mask,
    }
    boolean = sdpa_mask(allow_is_causal_skip=False, **kwargs)
    additive = eager_mask(dtype=dtype, **kwargs)
    return boolean, additive


# ----------------------------------------------------------------------------- torch path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [6, 2])
def test_reference_equals_transformers_eager_attention(dtype, q_len):
    """The eager path: softmax(scores * scale + additive mask), including fully masked (padded) rows."""
    batch, heads, k_len, scale = 2, 3, 6, 0.37
    scores = _scores((batch, heads, q_len, k_len), dtype)
    _, additive = _left_padded_masks(batch, q_len, k_len, dtype)
    out = scaled_masked_softmax(scores, additive, scale)
    expected = F.softmax(scores * scale + additive, dim=-1)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    else:  # eager's half-precision softmax also computes in fp32: identical up to the final rounding
        torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=torch.finfo(dtype).eps)
    if q_len == k_len:  # padded row 1 starts with 3 fully masked queries: eager makes them uniform
        torch.testing.assert_close(
            out[1, :, :3].float(), torch.full((heads, 3, k_len), 1 / k_len), rtol=0, atol=1e-3
        )
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (got,) = torch.autograd.grad(out, scores, grad)
    (want,) = torch.autograd.grad(expected, scores, grad)
    tolerance = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("q_len", [6, 2])
def test_reference_equals_sdpa_with_boolean_mask(q_len):
    """The sdpa path: boolean mask (True = attend); fully masked rows give zeros, forward and backward."""
    batch, heads, k_len, head_dim = 2, 3, 6, 4
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=generator) for n in (q_len, k_len, k_len))
    q.requires_grad_()
    boolean, _ = _left_padded_masks(batch, q_len, k_len, torch.float32)
    scale = head_dim**-0.5

    out = scaled_masked_softmax(q @ k.transpose(-1, -2), boolean, scale) @ v
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, scale=scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    torch.testing.assert_close(
        torch.autograd.grad(out, q, grad)[0], torch.autograd.grad(expected, q, grad)[0], rtol=1e-5, atol=1e-6
    )
    if q_len == k_len:
        assert torch.equal(out[1, :, :3], torch.zeros(heads, 3, head_dim))


@pytest.mark.parametrize("q_len, k_len", [(5, 5), (2, 7), (7, 4)])
def test_causal_flag_is_bottom_right_aligned(q_len, k_len):
    scores = _scores((2, 2, q_len, k_len))
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
    out = scaled_masked_softmax(scores, None, 0.5, causal=True)
    assert torch.equal(out, scaled_masked_softmax(scores, keep[None, None], 0.5))
    if q_len > k_len:  # the first q_len - k_len queries see no key at all
        assert torch.equal(out[:, :, : q_len - k_len], torch.zeros(2, 2, q_len - k_len, k_len))


def test_causal_flag_equals_sdpa_is_causal():
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 6, 4, generator=generator) for _ in range(2))
    identity = torch.eye(6).expand(2, 3, 6, 6)  # value = identity: sdpa returns its attention weights
    weights = F.scaled_dot_product_attention(q, k, identity, is_causal=True, scale=0.5)
    torch.testing.assert_close(
        scaled_masked_softmax(q @ k.transpose(-1, -2), None, 0.5, causal=True), weights
    )


def test_fully_masked_rows_without_nan():
    scores = _scores((1, 2, 3, 5))
    boolean = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    boolean[0, 0, 1] = False
    minus_inf = torch.zeros(1, 1, 3, 5).masked_fill(~boolean, float("-inf"))
    finfo_min = torch.zeros(1, 1, 3, 5).masked_fill(~boolean, torch.finfo(torch.float32).min)
    for mask, row in [
        (boolean, torch.zeros(5)),
        (minus_inf, torch.zeros(5)),
        (finfo_min, torch.full((5,), 0.2)),
    ]:
        out = scaled_masked_softmax(scores, mask)
        (grad,) = torch.autograd.grad(out, scores, torch.ones_like(out).cumsum(-1))
        assert not out.isnan().any() and not grad.isnan().any()
        torch.testing.assert_close(out[0, :, 1], row.expand(2, 5))
        if row.sum() == 0:
            assert torch.equal(grad[0, :, 1], torch.zeros(2, 5))


def test_broadcast_padding_mask_and_module_form():
    scores = _scores((2, 3, 4, 5))
    padding = torch.tensor([[True, True, True, False, False], [True] * 5])[:, None, None, :]
    module = FusedScaleMaskSoftmax(scale=0.5, causal=False)
    out = module(scores, padding)
    assert torch.equal(out, scaled_masked_softmax_reference(scores, padding.expand(2, 3, 4, 5), 0.5))
    assert torch.equal(out[0, ..., 3:], torch.zeros(3, 4, 2))
    assert "scale=0.5" in repr(module)


def test_bad_arguments_name_the_problem():
    scores = _scores((2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"scores of shape \(3, 4, 5\) must be 4-D"):
        scaled_masked_softmax(scores[0])
    with pytest.raises(ValueError, match=r"does not broadcast.*dim 3: 4 vs 5"):
        scaled_masked_softmax(scores, torch.ones(2, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 5\) must be 4-D"):
        scaled_masked_softmax(scores, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask dtype torch.int64"):
        scaled_masked_softmax(scores, torch.ones(2, 1, 4, 5, dtype=torch.long))


# ----------------------------------------------------------------------------- sliding window (GPT-Neo local)

# (q_len, k_len, window): q_len == k_len and a KV cache (q_len < k_len); window 1, smaller than k_len,
# and larger than k_len (the same as plain causal).
WINDOW_SHAPES = [(6, 6, 1), (6, 6, 3), (6, 6, 9), (2, 6, 1), (2, 6, 3), (2, 6, 9)]
WINDOW_MASKS = ["none", "bool", "additive"]


def _gpt_neo_reference(scores, window, mask=None):
    """Independent oracle: GPT-Neo's local attention (``GPTNeoSelfAttention._attn``) written out.

    Its ``tril ^ tril(-window)`` bias buffer over absolute positions, sliced at the last q_len rows;
    ``torch.where`` with ``finfo.min`` on fp32 scores (GPT-Neo upcasts, and does not scale); ``+ mask``;
    softmax. A boolean mask (sdpa-style; GPT-Neo's eager path never gets one) is made additive, and the
    rows that then see no key at all are zeroed: sdpa's safe-softmax convention, which oslo documents.
    """
    q_len, k_len = scores.shape[-2:]
    max_positions = k_len + 4  # GPT-Neo's buffer is max_position_embeddings long, longer than k_len
    bias = torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
    bias = torch.bitwise_xor(bias, torch.tril(bias, -window))[None, None]
    local = bias[:, :, k_len - q_len : k_len, :k_len]
    weights = torch.where(local, scores.float(), torch.tensor(torch.finfo(torch.float32).min))
    if mask is None:
        return F.softmax(weights, dim=-1)
    if mask.dtype != torch.bool:
        return F.softmax(weights + mask, dim=-1)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = F.softmax(weights + additive, dim=-1)
    sees_a_key = (local & mask).any(dim=-1, keepdim=True)
    return torch.where(sees_a_key, probs, torch.zeros_like(probs))


def test_gpt_neo_reference_is_transformers_local_attention():
    """The oracle above is what transformers' GPTNeoSelfAttention("local") computes, KV cache included."""
    from transformers import GPTNeoConfig
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    config = GPTNeoConfig(hidden_size=8, num_heads=2, window_size=3, max_position_embeddings=16)
    attention = GPTNeoSelfAttention(config, "local")
    generator = torch.Generator().manual_seed(0)
    for q_len, k_len in [(6, 6), (2, 6)]:
        q = torch.randn(2, 2, q_len, 4, generator=generator)
        k = torch.randn(2, 2, k_len, 4, generator=generator)
        _, additive = _left_padded_masks(2, q_len, k_len, torch.float32)
        _, weights = attention._attn(q, k, torch.zeros(2, 2, k_len, 4), additive)
        torch.testing.assert_close(_gpt_neo_reference(q @ k.transpose(-1, -2), 3, additive), weights)


def _window_mask(kind, q_len, k_len, device):
    """None, or transformers' sdpa (bool) / eager (additive, fp32 as GPT-Neo's fp32 scores get it) causal
    mask for a left-padded batch of 2: row 1 has 3 pad tokens, so its queries at absolute positions 0..2
    see only padding (boolean: zeros; additive: uniform over the window, as in GPT-Neo)."""
    if kind == "none":
        return None
    boolean, additive = _left_padded_masks(2, q_len, k_len, torch.float32)
    return (boolean if kind == "bool" else additive).to(device)


def _check_window_against_gpt_neo(device, dtype, q_len, k_len, window, kind):
    """Forward and gradient of ``scaled_masked_softmax(..., causal=True, window=window)`` on ``device``
    against the GPT-Neo oracle, in fp32 on CPU. Returns the probabilities and gradient (CPU, fp32)."""
    scores = _scores((2, 2, q_len, k_len), dtype, device)
    mask = _window_mask(kind, q_len, k_len, device)
    out = scaled_masked_softmax(scores, mask, 1.0, causal=True, window=window)
    reference_scores = scores.detach().cpu().float().requires_grad_()  # exact: a widening conversion
    expected = _gpt_neo_reference(reference_scores, window, None if mask is None else mask.cpu())
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (got,) = torch.autograd.grad(out, scores, grad.to(out))
    # The oracle runs on the CPU: the same gradient, rounded to the dtype, kept there.
    (want,) = torch.autograd.grad(expected, reference_scores, grad.to(out.dtype).float())
    out, got = out.detach().cpu().float(), got.cpu().float()
    assert scores.dtype == dtype and not out.isnan().any() and not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(got, want)
    else:
        # The same fp32 softmax of the same scores, with only the output rounded to the dtype: under one
        # ulp, <= eps for probabilities <= 1 (one ulp: the interpreter truncates to bf16). The gradient
        # p * (g - sum(p * g)) is formed from dtype-rounded p (Triton) and rounded once more: with |g| < 2.4
        # here, a few eps at most (measured: 0.8 eps fp16, 1.3 eps bf16 in the interpreter), so 4 eps.
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out, expected, rtol=0, atol=eps)
        torch.testing.assert_close(got, want, rtol=0, atol=4 * eps)
    return out, got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", WINDOW_MASKS)
@pytest.mark.parametrize("q_len, k_len, window", WINDOW_SHAPES)
def test_window_equals_gpt_neo_local_attention(dtype, kind, q_len, k_len, window):
    out, grad = _check_window_against_gpt_neo("cpu", dtype, q_len, k_len, window, kind)
    if kind == "bool" and q_len == k_len:  # padded queries see no key: zeros, forward and backward
        assert torch.equal(out[1, :, :3], torch.zeros(2, 3, k_len))
        assert torch.equal(grad[1, :, :3], torch.zeros(2, 3, k_len))


def test_window_edge_sizes():
    scores = _scores((2, 3, 5, 8))
    q_abs = torch.arange(5) + 3
    one = scaled_masked_softmax(scores, None, 0.5, causal=True, window=1)  # each query sees only itself
    assert torch.equal(one, F.one_hot(q_abs, 8).float().expand(2, 3, 5, 8))
    (grad,) = torch.autograd.grad(one, scores, torch.randn(one.shape))
    assert torch.equal(grad, torch.zeros_like(grad))
    causal = scaled_masked_softmax(scores, None, 0.5, causal=True)
    for window in (8, 9, 10**12):  # windows reaching back past key 0 change nothing
        assert torch.equal(scaled_masked_softmax(scores, None, 0.5, causal=True, window=window), causal)
    # more queries than keys: the first ones see no key, window or not
    wide = scaled_masked_softmax(_scores((1, 2, 7, 4)), None, 1.0, causal=True, window=2)
    assert torch.equal(wide[:, :, :3], torch.zeros(1, 2, 3, 4))
    torch.testing.assert_close(wide[0, 0, 3:].sum(-1), torch.ones(4))


def test_window_module_form():
    scores = _scores((2, 2, 4, 6))
    module = FusedScaleMaskSoftmax(scale=1.0, causal=True, window=2)
    assert torch.equal(module(scores), scaled_masked_softmax_reference(scores, None, 1.0, True, window=2))
    assert "window=2" in repr(module) and "window" not in repr(FusedScaleMaskSoftmax(causal=True))


@pytest.mark.parametrize("window", [0, -3, 2.0, True, "4"])
def test_bad_window_names_the_problem(window):
    scores = _scores((1, 1, 3, 3))
    for call in (
        lambda: scaled_masked_softmax(scores, None, 1.0, causal=True, window=window),
        lambda: scaled_masked_softmax_reference(scores, None, 1.0, causal=True, window=window),
        lambda: FusedScaleMaskSoftmax(causal=True, window=window),
    ):
        with pytest.raises(ValueError, match=rf"window={window!r} must be a positive int.*or None"):
            call()


def test_window_without_causal_names_the_fix():
    scores = _scores((1, 1, 3, 3))
    for call in (
        lambda: scaled_masked_softmax(scores, window=2),
        lambda: scaled_masked_softmax_reference(scores, None, 1.0, causal=False, window=2),
        lambda: FusedScaleMaskSoftmax(scale=1.0, window=2),
    ):
        with pytest.raises(ValueError, match=r"window=2 needs causal=True.*Pass causal=True"):
            call()


# ----------------------------------------------------------------------------- Triton

MASK_CASES = [
    "none",
    "causal",
    "bool",
    "bool+causal",
    "eager-min+causal",
    "additive-inf",
    "padding-broadcast",
]


def _mask_for(case, batch, q_len, k_len, dtype, device):
    boolean, additive = _left_padded_masks(batch, q_len, k_len, dtype)
    if case in ("none", "causal"):
        return None, case == "causal"
    if case == "bool":
        return boolean.to(device), False
    if case == "bool+causal":
        return boolean.to(device), True
    if case == "eager-min+causal":
        return additive.to(device), True
    if case == "additive-inf":  # fp32 mask on any scores dtype: promotion keeps the sum in fp32
        return torch.zeros(boolean.shape).masked_fill(~boolean, float("-inf")).to(device), False
    padding = torch.ones(batch, 1, 1, k_len, dtype=torch.bool)
    padding[0, ..., -2:] = False
    return padding.to(device), False


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MASK_CASES)
def test_triton_matches_reference(triton_device, assert_close_for_dtype, dtype, case):
    batch, heads, q_len, k_len, scale = 2, 2, 5, 7, 0.3  # non-powers of two; row 1 has masked rows
    scores = _scores((batch, heads, q_len, k_len), dtype, triton_device)
    mask, causal = _mask_for(case, batch, q_len, k_len, dtype, triton_device)
    out = scaled_masked_softmax(scores, mask, scale, causal)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (grad_scores,) = torch.autograd.grad(out, scores, grad)

    expected = scaled_masked_softmax_reference(scores, mask, scale, causal)
    (expected_grad,) = torch.autograd.grad(expected, scores, grad)
    assert out.dtype == dtype
    assert_close_for_dtype(out, expected, dtype, "forward")
    assert_close_for_dtype(grad_scores, expected_grad, dtype, "grad scores")
    assert not out.isnan().any() and not grad_scores.isnan().any()


@pytest.mark.triton
@pytest.mark.parametrize("q_len, k_len", [(7, 4), (1, 1000)])
def test_triton_causal_shapes(triton_device, assert_close_for_dtype, q_len, k_len):
    """More queries than keys (fully masked leading rows), and one decode step over a long odd cache."""
    scores = _scores((1, 2, q_len, k_len), torch.float32, triton_device)
    out = scaled_masked_softmax(scores, None, 0.125, causal=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    expected = scaled_masked_softmax_reference(scores, None, 0.125, causal=True)
    assert_close_for_dtype(out, expected, torch.float32, "forward")
    assert_close_for_dtype(
        torch.autograd.grad(out, scores, grad)[0],
        torch.autograd.grad(expected, scores, grad)[0],
        torch.float32,
    )


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", WINDOW_MASKS)
@pytest.mark.parametrize("q_len, k_len, window", WINDOW_SHAPES)
def test_triton_window_equals_gpt_neo_local_attention(triton_device, dtype, kind, q_len, k_len, window):
    """The Triton kernels (forward and backward) against the GPT-Neo oracle."""
    out, grad = _check_window_against_gpt_neo(triton_device, dtype, q_len, k_len, window, kind)
    if kind == "bool" and q_len == k_len:
        assert torch.equal(out[1, :, :3], torch.zeros(2, 3, k_len))
        assert torch.equal(grad[1, :, :3], torch.zeros(2, 3, k_len))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len, k_len, window", [(5, 7, 3), (7, 4, 2), (1, 1000, 256)])
def test_triton_window_matches_reference(triton_device, assert_close_for_dtype, dtype, q_len, k_len, window):
    """Triton vs the torch path with a scale, an eager mask in the scores' dtype (the rounded sum), more
    queries than keys (leading rows fully masked), and one decode step over a long cache."""
    scores = _scores((2, 2, q_len, k_len), dtype, triton_device)
    if q_len <= k_len:
        _, mask = _left_padded_masks(2, q_len, k_len, dtype)
        mask = mask.to(triton_device)
    else:
        mask = None
    out = scaled_masked_softmax(scores, mask, 0.3, causal=True, window=window)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    expected = scaled_masked_softmax_reference(scores, mask, 0.3, causal=True, window=window)
    assert_close_for_dtype(out, expected, dtype, "forward")
    assert_close_for_dtype(
        torch.autograd.grad(out, scores, grad)[0], torch.autograd.grad(expected, scores, grad)[0], dtype, "grad"
    )
    assert int((out[0, 0, -1] > 0).sum()) == min(window, k_len)  # unpadded last query: exactly its window


# ----------------------------------------------------------------------------- decode shapes


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_expression_for_few_rows_equals_reference(dtype):
    """Below the row threshold a CUDA call takes transformers' eager expression: the reference's values,
    rows masked entirely by -inf included (zeros, not NaN), finfo.min-masked rows uniform."""
    from oslo.kernels.softmax import _eager_softmax

    scores = _scores((2, 3, 1, 9), dtype)
    additive = torch.zeros(2, 1, 1, 9, dtype=dtype)
    additive[0, ..., :4] = torch.finfo(dtype).min
    additive[1] = float("-inf")  # batch 1: every key masked
    for mask in (None, additive):
        got = _eager_softmax(scores, mask, 0.3)
        want = scaled_masked_softmax_reference(scores, mask, 0.3)
        assert got.dtype == dtype and not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=0, atol=torch.finfo(dtype).eps)


def test_decode_rows_on_cuda_take_torch(monkeypatch):
    import sys

    import oslo.kernels._triton as triton_support

    softmax_module = sys.modules["oslo.kernels.softmax"]
    calls = []
    monkeypatch.setattr(triton_support, "HAS_TRITON", True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(softmax_module, "_scaled_masked_softmax_op", lambda *args: calls.append(args))
    decode = _scores((8, 16, 1, 40))
    additive = torch.zeros(8, 1, 1, 40)
    torch.testing.assert_close(scaled_masked_softmax(decode, additive, 0.5),
                               scaled_masked_softmax_reference(decode, additive, 0.5))
    torch.testing.assert_close(scaled_masked_softmax(decode, None, 0.5, causal=True),
                               scaled_masked_softmax_reference(decode, None, 0.5, causal=True))
    assert calls == []
    scaled_masked_softmax(_scores((1, 16, 128, 40)), additive[:1], 0.5)  # 2048 rows: the kernel
    assert len(calls) == 1
