"""The loss from the hidden states (``oslo.parallel.loss.linear_cross_entropy``) against torch's cross entropy of
the whole logits: the summed loss and the gradients of the input, the weight and the bias, in one process and
with the vocabulary split over a real gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import oslo.parallel.loss as loss_module
from oslo.parallel.loss import CUDA_MIN_CHUNK_ROWS, linear_cross_entropy, loss_chunk_rows
from tests.distributed import run_distributed

VOCAB, HIDDEN, TOKENS = 53, 12, 37


def _problem(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype)
    bias = torch.randn(VOCAB, generator=generator, dtype=dtype)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    target[::4] = -100
    return x, weight, bias, target


def _reference(x, weight, bias, target):
    """torch's cross entropy of the whole logits, summed; its gradients."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    bias = None if bias is None else bias.clone().requires_grad_()
    loss = F.cross_entropy(F.linear(x, weight, bias), target, reduction="sum")
    grads = torch.autograd.grad(loss, [t for t in (x, weight, bias) if t is not None])
    return loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk_rows", [1, 5, None], ids=["rows1", "rows5", "auto"])
@pytest.mark.parametrize("padding", [1, 0, "fused"], ids=["padded", "whole", "fused-log-softmax"])
def test_equals_cross_entropy_of_the_logits(monkeypatch, dtype, transposed, with_bias, chunk_rows, padding):
    if padding == "fused":  # one rank's path on a GPU, forced on the CPU
        monkeypatch.setattr(loss_module, "_fused_log_softmax", lambda x: True)
        padding = 0
    x, weight, bias, target = _problem(dtype)
    expected, expected_grads = _reference(x, weight, bias if with_bias else None, target)
    # a padding column, as a vocabulary padded for tensor parallelism has (zero weight, masked by the loss)
    padded = torch.cat([weight, torch.zeros(padding, HIDDEN, dtype=dtype)])
    stored = padded.t().contiguous() if transposed else padded
    inputs = [x.clone().requires_grad_(), stored.requires_grad_()]
    if with_bias:
        inputs.append(torch.cat([bias, torch.zeros(padding, dtype=dtype)]).requires_grad_())
    loss = linear_cross_entropy(inputs[0], inputs[1], inputs[2] if with_bias else None, target, vocab_start=0,
                                valid_columns=VOCAB, group=None, transposed=transposed, chunk_rows=chunk_rows)
    grads = torch.autograd.grad(loss, inputs)
    assert loss.dtype == torch.float32 if dtype == torch.float32 else torch.float64
    torch.testing.assert_close(loss, expected.to(loss.dtype))
    torch.testing.assert_close(grads[0], expected_grads[0])
    grad_weight = grads[1].t() if transposed else grads[1]
    torch.testing.assert_close(grad_weight[:VOCAB], expected_grads[1])
    assert not grad_weight[VOCAB:].any(), "the padding column got a gradient"
    if with_bias:
        torch.testing.assert_close(grads[2][:VOCAB], expected_grads[2])


@pytest.mark.parametrize("padding", [1, 0, "fused"], ids=["padded", "whole", "fused-log-softmax"])
def test_bf16_autocast_against_float64(monkeypatch, padding):
    # Under autocast the products run in bfloat16 (the logits' gradient cast once per chunk, the weight's gradient
    # summed in float32); the softmax and the loss in float32. Against float64 on the bfloat16-rounded operands:
    # bfloat16 keeps 8 bits, so a few parts in a thousand.
    if padding == "fused":
        monkeypatch.setattr(loss_module, "_fused_log_softmax", lambda x: True)
        padding = 0
    x, weight, _, target = _problem()
    x, weight = x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float()
    expected, expected_grads = _reference(x.double(), weight.double(), None, target)
    stored = torch.cat([weight, torch.zeros(padding, HIDDEN)]).requires_grad_()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, stored, None, target, vocab_start=0, valid_columns=VOCAB, group=None,
                                    chunk_rows=8)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32 and stored.grad.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.double(), expected_grads[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(stored.grad[:VOCAB].double(), expected_grads[1], rtol=2e-2, atol=2e-2)
    assert not stored.grad[VOCAB:].any()


def test_graph_kept_for_a_second_backward_and_no_grad_value():
    x, weight, bias, target = _problem()
    expected, expected_grads = _reference(x, weight, bias, target)
    x, weight, bias = (t.clone().requires_grad_() for t in (x, weight, bias))
    loss = linear_cross_entropy(x, weight, bias, target, vocab_start=0, valid_columns=VOCAB, group=None,
                                chunk_rows=8)
    (3 * loss).backward(retain_graph=True)  # the saved gradients scaled out of place...
    loss.backward()  # ...so the second pass sees them intact
    for got, want in zip((x.grad, weight.grad, bias.grad), expected_grads, strict=True):
        torch.testing.assert_close(got, 4 * want)
    with torch.no_grad():
        value = linear_cross_entropy(x, weight, bias, target, vocab_start=0, valid_columns=VOCAB, group=None)
    torch.testing.assert_close(value, expected)


@pytest.mark.parametrize("padding", [1, 0], ids=["padded", "whole"])
def test_ignored_tokens_masked_instead_of_dropped(monkeypatch, padding):
    # On CUDA the ignored tokens stay in the chunks (finding them would wait for the device); their gradient rows
    # are masked. The same path on the CPU, forced (with the GPU's fused log-softmax where one rank holds it all):
    monkeypatch.setattr(loss_module, "_drops_ignored_rows", lambda x: False)
    monkeypatch.setattr(loss_module, "_fused_log_softmax", lambda x: True)
    x, weight, bias, target = _problem()
    expected, expected_grads = _reference(x, weight, bias, target)
    stored = torch.cat([weight, torch.zeros(padding, HIDDEN)]).requires_grad_()
    bias = torch.cat([bias, torch.zeros(padding)]).requires_grad_()
    x = x.clone().requires_grad_()
    loss = linear_cross_entropy(x, stored, bias, target, vocab_start=0, valid_columns=VOCAB, group=None,
                                chunk_rows=6)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(x.grad, expected_grads[0])
    assert not x.grad[target == -100].any()
    torch.testing.assert_close(stored.grad[:VOCAB], expected_grads[1])
    torch.testing.assert_close(bias.grad[:VOCAB], expected_grads[2])


def test_every_target_ignored():
    x, weight, _, target = _problem()
    x, weight = x.requires_grad_(), weight.requires_grad_()
    loss = linear_cross_entropy(x, weight, None, torch.full_like(target, -100), vocab_start=0,
                                valid_columns=VOCAB, group=None)
    loss.backward()
    assert loss.item() == 0.0 and not x.grad.any() and not weight.grad.any()


def test_chunk_rows_from_the_shapes():
    # GPT2 at 8 x 1024 tokens: chunks of logits no larger than the hidden states (never below 2**24 elements)
    rows = loss_chunk_rows(8 * 1024, 768, 50257)
    assert rows * 50257 <= max(8 * 1024 * 768, 1 << 24) and rows >= 16
    rows = loss_chunk_rows(8 * 1024, 2048, 50257)  # wider: chunks as large as the hidden states
    assert 8 * 1024 * 2048 - 50257 < rows * 50257 <= 8 * 1024 * 2048
    assert loss_chunk_rows(2048, 128, 128256) * 128256 <= (1 << 24)
    assert loss_chunk_rows(10, 4, 7) == 10  # a small batch is one chunk
    # on a GPU at least CUDA_MIN_CHUNK_ROWS tokens (thinner products are bound by re-reading the weight)
    assert loss_chunk_rows(8 * 1024, 1024, 128256, "cuda") == CUDA_MIN_CHUNK_ROWS == 2048
    assert loss_chunk_rows(8 * 1024, 1024, 128256, torch.device("cpu")) == (1 << 24) // 128256
    assert loss_chunk_rows(300, 1024, 128256, "cuda:1") == 300  # all of them


def _vocab_parallel(rank: int, world_size: int, transposed: bool) -> None:
    dist.init_process_group("gloo")
    x, weight, bias, target = _problem(seed=1)
    expected, expected_grads = _reference(x, weight, bias, target)
    local = -(-VOCAB // world_size)  # columns per rank; the last rank's tail is padding
    start = rank * local
    valid = max(0, min(VOCAB, start + local) - start)
    shard = torch.zeros(local, HIDDEN)
    shard[:valid] = weight[start:start + valid]
    bias_shard = torch.zeros(local)
    bias_shard[:valid] = bias[start:start + valid]
    stored = shard.t().contiguous() if transposed else shard
    x, stored, bias_shard = (t.clone().requires_grad_() for t in (x, stored, bias_shard))
    loss = linear_cross_entropy(x, stored, bias_shard, target, vocab_start=start, valid_columns=valid,
                                group=dist.group.WORLD, transposed=transposed, chunk_rows=6)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(x.grad, expected_grads[0])  # summed over the group in the backward pass
    grad_weight = stored.grad.t() if transposed else stored.grad
    torch.testing.assert_close(grad_weight[:valid], expected_grads[1][start:start + valid])
    torch.testing.assert_close(bias_shard.grad[:valid], expected_grads[2][start:start + valid])
    assert not grad_weight[valid:].any()


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_vocab_split_over_two_ranks(transposed):
    run_distributed(_vocab_parallel, 2, transposed, timeout=60)
