"""GPT2 parity with transformers at tensor_parallel_size 1, 2 and 4: logits, loss, gradients,
hidden states, attentions and generate() tokens, for every head."""

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
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_lm_head_parity(lm_checkpoint, tp, attn_implementation):
    run_distributed(_lm_parity, tp, lm_checkpoint, attn_implementation)


def _generate_parity(rank, world_size, path):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size, seed=1234)
    input_ids, attention_mask, _ = _batch(batch=3, length=6, left_pad=(0, 2, 4))
    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, pad_token_id=0)
    cases = {
        "greedy": dict(do_sample=False),
        "greedy_no_cache": dict(do_sample=False, use_cache=False),
        "beam_ngram": dict(do_sample=False, num_beams=3, no_repeat_ngram_size=2),
    }
    for name, options in cases.items():
        expected = reference.generate(**common, **options)
        actual = model.generate(**common, **options)
        assert torch.equal(actual, expected), f"{name}: {actual.tolist()} != {expected.tolist()}"

    # Sampling: ranks start from different global RNG states; the model's replicated stream decides.
    torch.manual_seed(1234)
    expected = reference.generate(**common, do_sample=True, top_k=50)
    torch.manual_seed(rank)
    actual = model.generate(**common, do_sample=True, top_k=50)
    assert torch.equal(actual, expected), f"sampling: {actual.tolist()} != {expected.tolist()}"
    return actual.tolist()


@pytest.mark.parametrize("tp", TP_SIZES)
def test_generate_parity(lm_checkpoint, tp):
    results = run_distributed(_generate_parity, tp, lm_checkpoint)
    assert all(r == results[0] for r in results)


HEADS = {
    "GPT2Model": {},
    "GPT2DoubleHeadsModel": {},
    "GPT2ForSequenceClassification": {"num_labels": 3},
    "GPT2ForTokenClassification": {"num_labels": 5},
    "GPT2ForQuestionAnswering": {},
}


def _head_inputs(head):
    input_ids, attention_mask, labels = _batch()
    if head == "GPT2Model":
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
        return inputs, lambda out: out.last_hidden_state.square().mean()
    if head == "GPT2DoubleHeadsModel":
        choices = input_ids.view(3, 1, 12).expand(3, 2, 12).contiguous()
        inputs = dict(input_ids=choices, mc_token_ids=torch.tensor([[11, 10]] * 3), labels=choices,
                      mc_labels=torch.tensor([0, 1, 1]))
        return inputs, lambda out: out.loss + out.mc_loss
    if head == "GPT2ForSequenceClassification":
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 2, 1])), None
    if head == "GPT2ForTokenClassification":
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels.clamp(-100, 4)), None
    return dict(input_ids=input_ids, attention_mask=attention_mask, start_positions=torch.tensor([1, 4, 7]),
                end_positions=torch.tensor([3, 9, 11])), None


def _head_parity(rank, world_size, path, head):
    reference = getattr(transformers, head).from_pretrained(path)
    model = getattr(oslo, head).from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    inputs, objective = _head_inputs(head)
    expected, actual = reference(**inputs), model(**inputs)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(actual[key], value, msg=lambda m, k=key: f"{head}.{k}: {m}")
    objective = objective or (lambda out: out.loss)
    objective(expected).backward()
    objective(actual).backward()
    assert_same_grads(reference, model)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("head", sorted(HEADS))
def test_head_parity(tmp_path, head, tp):
    save_reference(getattr(transformers, head), tiny_gpt2_config(**HEADS[head]), tmp_path)
    run_distributed(_head_parity, tp, str(tmp_path), head)
