"""Tensor parallelism on CUDA tensors over gloo (issue "oslo on a GPU", item 5).

NCCL refuses two ranks on one device, so on a one-GPU machine two ranks share the device over gloo:
the model is built on the CPU context and moved with ``.to("cuda")``; the layers, the vocab-parallel
loss, the DTensor views and the gradient sinks then compute on CUDA tensors while gloo carries the
collectives (sums on the device, gathers through the CPU). The CUDA case is skipped without a device;
its ranks are spawned (a parent that has used CUDA cannot fork CUDA users).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo
from oslo.parallel import ParallelContext
from tests.distributed import run_distributed
from tests.helpers import full_grads, save_reference, tiny_gpt2_config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]


def _train_and_generate(rank, world_size, path, device):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    context = ParallelContext(tensor_parallel_size=2, backend="gloo")
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2, parallel_context=context)
    model = model.to(device)
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).to(device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1001, (4, 12), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    actual = model(input_ids=ids, attention_mask=mask, labels=labels, gather_logits=True)
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    expected.loss.backward()
    actual.loss.backward()
    # The tests' gathering assembles DTensor gradients with torch's own collectives, which gloo runs on the CPU only:
    # the gradients move along with the model, and are compared there.
    model.cpu()
    theirs = {n: p.grad.cpu() for n, p in reference.named_parameters()}
    for name, grad in full_grads(model).items():
        torch.testing.assert_close(grad, theirs[name], msg=lambda m, n=name: f"gradient of {n}: {m}")
    model.to(device)
    prompt = dict(input_ids=ids[:, :6], attention_mask=mask[:, :6], max_new_tokens=8, do_sample=False, pad_token_id=0)
    tokens = model.generate(**prompt)
    assert torch.equal(tokens, reference.generate(**prompt)), tokens.tolist()
    # Whole tensors travel through the CPU too: a merged save, and a resize (drawn on the device, as transformers')
    model.save_pretrained_with_parallel(os.path.join(path, "merged"), save_with_merging=True)
    torch.manual_seed(3)
    reference.resize_token_embeddings(1010, mean_resizing=False)
    torch.manual_seed(3)
    model.resize_token_embeddings(1010, mean_resizing=False)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids + 5).logits, reference(input_ids=ids + 5).logits)
    return True


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_parallel_on_moved_model_over_gloo(tmp_path, device):
    """On "cpu" the same steps without a move: the script itself is checked wherever the suite runs."""
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), str(tmp_path))
    # The parent may have initialized CUDA (an import can): CUDA ranks start as fresh interpreters.
    start_method = "spawn" if device == "cuda" else "fork"
    assert run_distributed(_train_and_generate, 2, str(tmp_path), device, timeout=300,
                           start_method=start_method) == [True, True]
    merged = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    for name, value in transformers.GPT2LMHeadModel.from_pretrained(tmp_path).state_dict().items():
        assert torch.equal(merged.state_dict()[name], value), name
