"""A backward pass that keeps the graph (``retain_graph=True``) leaves the vocab-parallel loss able to run
another one, with the gradients transformers gives: the second backward adds exactly the gradient again. A
backward that stops short of the weights (``torch.autograd.grad`` of one block's weight) leaves nothing behind
in the gradient sinks of the tied embedding and LM head for the next one."""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from oslo.parallel.loss import _graph_is_kept
from tests.distributed import run_distributed
from tests.helpers import full_grads, full_tensors, save_reference, tiny_gpt2_config


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm-retain-graph")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


def _batch():
    ids = torch.randint(3, 1001, (3, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def _reference_grads(path) -> dict[str, torch.Tensor]:
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    ids, labels = _batch()
    reference(input_ids=ids, labels=labels).loss.backward()
    return {name: param.grad for name, param in reference.named_parameters()}


def _twice(rank, world_size, path, how):
    """Two backward passes through one loss on the oslo model; returns the gathered gradients."""
    expected = _reference_grads(path)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size).train()
    ids, labels = _batch()
    loss = model(input_ids=ids, labels=labels).loss
    if how == "backward":
        loss.backward(retain_graph=True)
        once = {name: grad.clone() for name, grad in full_grads(model).items()}  # .grad grows next
        loss.backward()
    elif how == "partial":
        # The head's backward runs (its weight gradient goes to the tied view's sink), the view's does not.
        block = model.transformer.h[0].mlp.c_fc.weight
        partial = torch.autograd.grad(loss, block, retain_graph=True)[0]
        assert all(param.grad is None for param in model.parameters())
        once = full_tensors(model, {"transformer.h.0.mlp.c_fc.weight": partial})
        loss.backward()
    else:
        names, params = zip(*model.named_parameters(), strict=True)
        once = full_tensors(model, dict(zip(names, torch.autograd.grad(loss, params, retain_graph=True),
                                            strict=True)))
        loss.backward()
    for name, grad in once.items():
        torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"first gradient of {n}: {m}")
    factor = 2 if how == "backward" else 1  # the second backward accumulates into .grad
    for name, grad in full_grads(model).items():
        torch.testing.assert_close(grad, factor * expected[name], msg=lambda m, n=name: f"gradient of {n}: {m}")
    return True


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_retain_graph_single_process(lm_checkpoint, how):
    assert _twice(0, 1, lm_checkpoint, how)


@pytest.mark.parametrize("how", ["backward", "autograd.grad", "partial"])
def test_retain_graph_tensor_parallel(lm_checkpoint, how):
    assert run_distributed(_twice, 2, lm_checkpoint, how, timeout=120) == [True, True]


def test_a_freed_graph_still_refuses_a_second_backward(lm_checkpoint):
    """Without retain_graph the gradient is written over the saved softmax (no copy), and a second
    backward fails as torch's always does."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint).train()
    ids, labels = _batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


class _Probe(torch.autograd.Function):
    """Records, in its backward, whether the loss's backward would copy the saved softmax."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append(_graph_is_kept())
        return grad


def test_the_softmax_is_copied_only_when_the_graph_is_kept():
    """Torch's query behind the choice: a plain backward writes the gradient over the saved softmax (no
    second logits-sized tensor); retain_graph, create_graph and autograd.grad(retain_graph=True) copy."""
    x = torch.ones(3, requires_grad=True)
    _Probe.seen.clear()
    _Probe.apply(x).sum().backward()
    out = _Probe.apply(x).sum()
    out.backward(retain_graph=True)
    torch.autograd.grad(out, x, create_graph=True)
    torch.autograd.grad(_Probe.apply(x).sum(), x, retain_graph=True)
    torch.autograd.grad(_Probe.apply(x).sum(), x)
    assert _Probe.seen == [False, True, True, True, False]
