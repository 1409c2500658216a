"""The vocabulary-sized buffers of a training step at tp=2.

* The tied embedding and LM head share one gradient buffer: the head's weight gradient, into which the
  embedding adds its rows in place. No dense vocabulary-sized embedding gradient, no second vocabulary-sized
  sum (what plain autograd allocates), and the gradients transformers gives.
* The loss turns the local logits into its softmax in place when nothing else can read them; a forward hook
  that keeps the head's output sees the logits intact (the loss then works on a copy)."""

from __future__ import annotations

import torch
import transformers

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_grads, save_reference, tiny_gpt2_config

# ops that would make, clear or sum a table-sized gradient (the head's matmul makes the one there is; the
# embedding's rows go into it with index_add_). The position embedding's backward is a dense one, but not of
# the vocabulary's size.
_TABLE_SIZED = ("aten::zeros", "aten::zero_", "aten::fill_", "aten::add", "aten::add_", "aten::clone", "aten::copy_",
                "aten::empty_like")


def _batch(config):
    return torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def _step(rank, world_size, path, config):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size).train()
    ids = _batch(config)
    loss = model(input_ids=ids, labels=ids).loss
    with torch.profiler.profile(record_shapes=True) as profile:
        loss.backward()
    local_rows = model.transformer.wte.weight.to_local().size(0)
    table_shapes = [[local_rows, config.n_embd], [local_rows + 1, config.n_embd]]  # with the padding row
    vocab_sized = sorted({event.name for event in profile.events()
                          if event.name in _TABLE_SIZED and any(shape in table_shapes for shape in event.input_shapes)})
    return vocab_sized, full_grads(model)


def test_tied_embedding_and_head_share_one_gradient_buffer(tmp_path):
    config = tiny_gpt2_config(n_embd=64)
    reference = save_reference(transformers.GPT2LMHeadModel, config, tmp_path).train()
    results = run_distributed(_step, 2, str(tmp_path), config)
    vocab_sized, grads = results[0]
    assert results[1][0] == vocab_sized
    assert vocab_sized == [], f"vocabulary-sized buffers made in the backward pass: {vocab_sized}"
    ids = _batch(config)
    reference(input_ids=ids, labels=ids).loss.backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=lambda m, n=name: f"gradient of {n}: {m}")


def _hooked(rank, world_size, path, config):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size).train()
    ids = _batch(config)
    kept = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: kept.append(output))
    loss = model(input_ids=ids, labels=ids).loss
    handle.remove()
    hidden = model.transformer(input_ids=ids).last_hidden_state
    expected = model.lm_head(hidden)
    torch.testing.assert_close(kept[0], expected)  # not the softmax the loss made
    loss.backward()
    return loss.item(), full_grads(model)


def test_a_hook_keeping_the_logits_sees_them_intact(tmp_path):
    config = tiny_gpt2_config(n_embd=64)
    reference = save_reference(transformers.GPT2LMHeadModel, config, tmp_path).train()
    results = run_distributed(_hooked, 2, str(tmp_path), config)
    ids = _batch(config)
    loss = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    for value, grads in results:
        torch.testing.assert_close(value, loss.item())
        torch.testing.assert_close(grads["transformer.wte.weight"], reference.transformer.wte.weight.grad)
