"""``model.resize_token_embeddings(...)`` on a built model, at every layout, against transformers' own resize of the
same weights: the new rows (drawn from global rank 0's generator as transformers draws them, with and without
``mean_resizing``, ``pad_to_multiple_of``, shrinking), then outputs, losses, gradients (pipeline micro-batches
included) on a batch holding the new ids, a training step's weights, ``generate()`` of the resized model and the
merged checkpoint (bit for bit transformers' resized weights: loading and generating from a checkpoint at every
layout is test_zoo's). Every case at (1, 1), (2, 1) and (1, 2), the anchors at (2, 2), as the zoo runs them."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_params
from tests.models import zoo

# Every architecture's anchor, an untied head (Llama) beside tied ones, a head on a body without output embeddings,
# BERT's pre-training heads (a tied decoder's bias) and T5's v1.1 config.
KEYS = ["GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPTNeoForCausalLM", "BertForMaskedLM",
        "BertForPreTraining", "T5ForConditionalGeneration", "T5ForConditionalGeneration-v1.1", "LlamaForCausalLM",
        "LlamaForCausalLM-tied", "Qwen2ForCausalLM", "MistralForCausalLM"]
CASES = [case for case in zoo.all_cases() if case.key in KEYS]
# (new_num_tokens as an offset from the vocabulary, pad_to_multiple_of, mean_resizing), applied in turn
STEPS = [(5, None, False), (9, 8, True), (-3, None, True)]
ID_INPUTS = ("input_ids", "decoder_input_ids", "labels")


def _with_new_ids(batch: dict, start: int, stop: int) -> dict:
    """``batch`` with ids in ``[start, stop)`` (the rows a resize added) in column 1 of its id inputs."""
    batch = dict(batch)
    for name in ID_INPUTS:
        ids = batch.get(name)
        if ids is not None and ids.dim() == 2:
            ids = ids.clone()
            new = start + torch.arange(ids.shape[0]) % (stop - start)
            ids[:, 1] = torch.where(ids[:, 1] == -100, ids[:, 1], new)
            batch[name] = ids
    return batch


def _same_weights(model, reference, what: str) -> None:
    ours = full_params(model)
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    for name, value in ours.items():
        assert torch.equal(value, theirs[name].detach()), f"{what}: {name} differs from transformers'"


def _cases_at(tp: int, pp: int) -> list[zoo.Case]:
    """The cases resized at (tp, pp): all of them at the zoo's layouts for every class, the anchors at its anchor
    layouts (as tests/models/test_zoo.py runs them)."""
    return [case for case in CASES if case.runs_at(tp, pp)]


def _resize_and_compare(rank, world_size, tp, pp, paths, scratch):
    checked = []
    for case in _cases_at(tp, pp):
        path = paths[case.key]
        reference = getattr(transformers, case.name).from_pretrained(path)
        model = getattr(oslo, case.name).from_pretrained_with_parallel(
            path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=zoo.MICRO_BATCH_SIZE)
        size = reference.config.vocab_size
        for offset, multiple, mean_resizing in STEPS:
            # Only rank 0's generator draws the new rows (every rank then gets them): the others start elsewhere.
            torch.manual_seed(11)
            returned = reference.resize_token_embeddings(size + offset, multiple, mean_resizing)
            drawn = torch.get_rng_state()
            torch.manual_seed(11 if rank == 0 else 100 + rank)
            embeddings = model.resize_token_embeddings(size + offset, multiple, mean_resizing)
            what = f"{case.key} after resizing to {size + offset} (multiple {multiple}, mean {mean_resizing})"
            assert model.config.vocab_size == reference.config.vocab_size, what
            assert (embeddings is None) == (model.get_input_embeddings() is None), what
            if embeddings is not None:
                assert embeddings.num_embeddings == returned.num_embeddings, what
            _same_weights(model, reference, what)
            if rank == 0:  # its generator drew what transformers' did, no more
                assert torch.equal(torch.get_rng_state(), drawn), what
            size = reference.config.vocab_size
        grown = reference.config.vocab_size
        # Grow again so that the batch can hold ids the resize added; then outputs, losses and gradients.
        torch.manual_seed(11)
        reference.resize_token_embeddings(grown + 4)
        torch.manual_seed(11 if rank == 0 else 100 + rank)
        model.resize_token_embeddings(grown + 4)
        batch = _with_new_ids(case.batch(), grown, grown + 4)
        zoo.check_parity(case, None, tp, pp, models=(reference, model), batch=batch)
        if case.generate:  # the resized model itself, prompts holding the new ids
            prompt = {name: batch[name][:2, :5] for name in ("input_ids", "attention_mask") if name in batch}
            options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, **case.generate_kwargs)
            expected = reference.generate(**prompt, **options)
            assert torch.equal(model.generate(**prompt, **options), expected), f"{case.key}: generate"
        merged = os.path.join(scratch, f"{case.key}-{tp}-{pp}")
        model.save_pretrained_with_parallel(merged, save_with_merging=True)
        if rank == 0:
            loaded = getattr(transformers, case.name).from_pretrained(merged)
            for name, value in reference.state_dict().items():
                assert torch.equal(loaded.state_dict()[name], value), f"{case.key}: {name} in the merged checkpoint"
        checked.append(case.key)
    return checked


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda v: str(v))
def test_resized_model_equals_transformers(zoo_checkpoints, tmp_path, tp, pp):
    paths = {case.key: os.path.join(zoo_checkpoints(case.arch), case.key) for case in CASES}
    results = run_distributed(_resize_and_compare, tp * pp, tp, pp, paths, str(tmp_path), timeout=600)
    assert results == [[case.key for case in _cases_at(tp, pp)]] * (tp * pp)


CONFIG = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=1001, n_positions=32)


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(CONFIG)


def _oslo_gpt2():
    return oslo.GPT2LMHeadModel.from_config_with_parallel(CONFIG, seed=0)


@pytest.mark.parametrize("arguments, error, message", [
    ((0,), ValueError, r"new_num_tokens must be at least 1 .* got 0"),
    (("1010",), TypeError, r"new_num_tokens must be an integer .* got '1010'"),
    ((True,), TypeError, r"got True"),
    ((1010, 0), ValueError, r"pad_to_multiple_of must be a positive integer or None, got 0"),
    ((1010, 8.0), ValueError, r"got 8.0"),
    ((1010, None, "yes"), TypeError, r"mean_resizing must be True or False, got 'yes'"),
])
def test_bad_arguments_are_named(arguments, error, message):
    model = _oslo_gpt2()
    with pytest.raises(error, match=message):
        model.resize_token_embeddings(*arguments)
    assert model.config.vocab_size == 1001 and model.lm_head.weight.shape[0] == 1001


def test_an_adapter_on_the_vocabulary_is_refused():
    """LoRA on the LM head would keep the old vocabulary: resizing is refused, naming the adapter's weights (resize
    first, then add adapters, as with transformers); an adapter elsewhere does not stand in the way."""
    import peft

    model = peft.get_peft_model(_oslo_gpt2(), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(NotImplementedError, match=r"cannot resize \['lm_head'\]: an adapter wraps.*adding adapters"):
        model.resize_token_embeddings(1010)
    elsewhere = peft.get_peft_model(_oslo_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"]))
    elsewhere.resize_token_embeddings(1010)
    assert elsewhere.get_input_embeddings().num_embeddings == 1010
    assert elsewhere(input_ids=torch.tensor([[1009, 3]])).logits.shape == (1, 2, 1010)


def _replicas(rank, world_size, path):
    """Data parallel 2: both replicas resize alike (rank 0's draws) and train on; then different sizes on the ranks
    raise on both, before any change."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=1)
    torch.manual_seed(11 if rank == 0 else 5)
    model.resize_token_embeddings(1010, mean_resizing=False)
    try:
        model.resize_token_embeddings(1020 + rank)
    except ValueError as error:
        assert model.config.vocab_size == 1010
        return full_params(model), str(error)
    raise AssertionError("different sizes on the ranks were not refused")


def test_data_parallel_replicas_resize_alike_and_must_agree(tmp_path):
    reference = _gpt2()
    reference.save_pretrained(tmp_path)
    torch.manual_seed(11)
    reference.resize_token_embeddings(1010, mean_resizing=False)
    results = run_distributed(_replicas, 2, str(tmp_path))
    for params, message in results:
        for name, value in params.items():
            assert torch.equal(value, reference.get_parameter(name).detach()), name
        assert "different (new_num_tokens, pad_to_multiple_of, mean_resizing) on the ranks" in message
        assert "rank 0: (1020, None, True); rank 1: (1021, None, True)" in message
