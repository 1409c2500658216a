"""GPT2LMHeadModel with eager attention at tensor_parallel_size 1, 2 and 4: logits, loss, gradients, hidden
states and attentions. Every head, sdpa and generate() are in tests/models/test_zoo.py."""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from tests.distributed import run_distributed
from tests.helpers import assert_same_grads, save_reference, tiny_gpt2_config

TP_SIZES = [1, 2, 4]


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


def _batch(seed=1, batch=3, length=12, vocab=1001, left_pad=(0, 3, 5)):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate(left_pad[:batch]):
        input_ids[row, :pad] = 0
        attention_mask[row, :pad] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


def _lm_parity(rank, world_size, path, attn_implementation):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path, attn_implementation=attn_implementation)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, attn_implementation=attn_implementation
    )
    input_ids, attention_mask, labels = _batch()
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True,
                  output_attentions=attn_implementation == "eager")
    expected = reference(**kwargs)
    actual = model(**kwargs)
    assert actual.logits.shape == expected.logits.shape == (3, 12, 1001)
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    assert len(actual.hidden_states) == len(expected.hidden_states)
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(ours, theirs)
    if attn_implementation == "eager":
        assert len(actual.attentions) == len(expected.attentions)
        for ours, theirs in zip(actual.attentions, expected.attentions, strict=True):
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs)
    expected.loss.backward()
    actual.loss.backward()
    assert_same_grads(reference, model)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("attn_implementation", ["eager"])  # sdpa, every head, generate: test_zoo.py
def test_lm_head_parity(lm_checkpoint, tp, attn_implementation):
    run_distributed(_lm_parity, tp, lm_checkpoint, attn_implementation)
