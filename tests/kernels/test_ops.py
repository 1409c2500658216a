"""The fused ops as ``torch.library`` custom operators: ``opcheck`` (schema, autograd registration, fake
implementation, AOT dispatch with dynamic shapes) on each, and ``torch.compile(fullgraph=True)`` of a
function calling each equals eager, values and gradients.

On CPU the ops' implementations are the torch references (and, with ``triton_device`` in the
interpreter, the Triton kernels for the eager checks); on CUDA the Triton kernels, traced by Inductor.
"""

from __future__ import annotations

import pytest
import torch

import oslo.kernels  # noqa: F401 - registers torch.ops.oslo.*

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

ops = torch.ops.oslo


def _randn(*shape, device, seed, dtype=torch.float32, requires_grad=True):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
    return tensor.requires_grad_(requires_grad)


def _op_cases(device):
    """(op, args) for every op, at shapes small enough for the interpreter."""
    x, bias, residual = _randn(3, 5, 16, device=device, seed=0), _randn(16, device=device, seed=1), _randn(
        3, 5, 16, device=device, seed=2
    )
    scores = _randn(2, 3, 4, 6, device=device, seed=3)
    boolean = torch.ones(2, 1, 4, 6, dtype=torch.bool, device=device).tril(diagonal=2)
    boolean[1, ..., :2] = False  # padding: the first rows of batch 1 see no key
    additive = torch.zeros(2, 1, 4, 6, device=device).masked_fill(~boolean, torch.finfo(torch.float32).min)
    seed = torch.tensor([1234], device=device)
    history = torch.tensor([[1, 2, 3, 1, 2], [4, 4, 4, 4, 4]], device=device)
    return [
        (ops.bias_gelu, (x, bias, "tanh")),
        (ops.bias_gelu, (x, bias, "none")),
        (ops.bias_gelu_backward, (residual.detach(), x.detach(), bias.detach(), "tanh")),
        (ops.scaled_masked_softmax, (scores, None, 0.5, True, 0)),
        (ops.scaled_masked_softmax, (scores, boolean, 0.5, False, 0)),
        (ops.scaled_masked_softmax, (scores, additive, 1.0, True, 3)),
        (ops.scaled_masked_softmax_backward, (residual.detach()[:2, :4, :6].reshape(2, 1, 4, 6), scores.detach()
                                               .softmax(-1)[:, :1], 0.5)),
        (ops.bias_dropout_add, (x, bias, residual, 0.25, seed, 0)),
        (ops.bias_dropout_add, (x, None, residual, 0.25, seed, 96)),
        (ops.dropout_backward, (residual.detach(), 0.25, seed, 0)),
        (ops.no_repeat_ngram_block_, (history, torch.zeros(2, 8, device=device), 2)),
    ]


def _opcheck_all(device, test_utils):
    for op, args in _op_cases(device):
        torch.library.opcheck(op, args, test_utils=test_utils)


def test_opcheck_torch_paths():
    _opcheck_all("cpu", ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.triton
def test_opcheck_triton_paths(triton_device):
    # In the interpreter, AOT dispatch traces the ops with fake tensors (the torch references): that
    # check compares those with the interpreted kernels, so it runs only where the kernels are compiled.
    test_utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if triton_device == "cuda":
        test_utils.append("test_aot_dispatch_dynamic")
    _opcheck_all(triton_device, tuple(test_utils))


def _every_op(x, bias, residual, scores, mask, seed, history, logits):
    """Calls each fused op once; returns everything they produce."""
    hidden = ops.bias_gelu(x, bias, "tanh")
    out = ops.bias_dropout_add(hidden, bias, residual, 0.2, seed, 0)
    probs = ops.scaled_masked_softmax(scores, mask, 0.5, True, 3)
    banned = logits.clone()
    ops.no_repeat_ngram_block_(history, banned, 2)
    return out, probs, banned


def _compiled_equals_eager(device):
    x, bias, residual = _randn(2, 4, 32, device=device, seed=0), _randn(32, device=device, seed=1), _randn(
        2, 4, 32, device=device, seed=2
    )
    scores = _randn(2, 2, 4, 7, device=device, seed=3)
    mask = torch.ones(2, 1, 4, 7, dtype=torch.bool, device=device)
    mask[0, ..., :2] = False
    inputs = (x, bias, residual, scores, mask, torch.tensor([77], device=device),
              torch.tensor([[5, 6, 5, 6, 5]], device=device).expand(2, 5), torch.zeros(2, 9, device=device))
    torch._dynamo.reset()
    compiled = torch.compile(_every_op, fullgraph=True)
    expected, actual = _every_op(*inputs), compiled(*inputs)
    for want, got in zip(expected, actual, strict=True):
        torch.testing.assert_close(got, want)
    differentiable = (x, bias, residual, scores)
    grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9)).to(t) for t in expected[:2]]
    want = torch.autograd.grad(expected[:2], differentiable, grads)
    got = torch.autograd.grad(actual[:2], differentiable, grads)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w)
    assert torch.isinf(actual[2]).any()  # the n-gram op banned something: [5, 6] -> 5 and [6, 5] -> 6


def test_compile_fullgraph_equals_eager_torch_paths():
    _compiled_equals_eager("cpu")


@pytest.mark.triton
def test_compile_fullgraph_equals_eager_triton(triton_device):
    if triton_device != "cuda":
        pytest.skip("Inductor launches user Triton kernels on CUDA only; the CPU run covers the torch paths")
    _compiled_equals_eager(triton_device)


def test_decode_shapes_take_the_torch_expression(monkeypatch):
    """Below the row threshold, a CUDA-side call never dispatches to the custom op (launch-bound)."""
    import sys

    import oslo.kernels._triton as triton_support
    from oslo.kernels import bias_gelu

    calls = []
    monkeypatch.setattr(triton_support, "HAS_TRITON", True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(sys.modules["oslo.kernels.bias_gelu"], "_bias_gelu_op", lambda *args: calls.append(args))
    x, bias = torch.randn(8, 1, 64), torch.randn(64)
    torch.testing.assert_close(bias_gelu(x, bias, "tanh"), torch.nn.functional.gelu(x + bias, approximate="tanh"))
    assert calls == []
    bias_gelu(torch.randn(triton_support.TRITON_MIN_ROWS, 64), bias, "tanh")
    assert len(calls) == 1
