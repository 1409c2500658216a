"""What is GPT2's own: model.fuse() on its blocks (fused modules give the unfused math, outputs and gradients, for
both of GPT2's GeLUs, eager and sdpa attention), the activations it refuses to fuse, and fused n-gram blocking
in generate() banning what transformers' no_repeat_ngram_size bans. Every head at every layout, training,
generate() and checkpoints: tests/models/test_zoo.py (cases in tests/models/cases_gpt2.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

import oslo
from oslo import GPT2MLP, GPT2Attention
from tests.distributed import run_distributed
from tests.helpers import assert_same_grads, save_reference, tiny_gpt2_config


@pytest.fixture(scope="module", params=["gelu_new", "gelu"])
def lm_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(activation_function=request.param), path)
    return str(path)


def _inputs():
    input_ids = torch.tensor([[0, 0, 7, 99, 512, 1000, 3, 44], [5, 17, 900, 3, 44, 1000, 8, 8]])
    attention_mask = (input_ids != 0).long()
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids.masked_fill(input_ids == 0, -100))


def _fused_parity(rank, world_size, path, attn_implementation, modules):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path, attn_implementation=attn_implementation)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, attn_implementation=attn_implementation
    )
    assert model.fuse(modules) is model
    fused = {type(m).__name__ for m in model.modules() if getattr(m, "fused", False)}
    assert fused == ({c.__name__ for c in modules} if modules else {"GPT2MLP", "GPT2Attention"})
    eager = attn_implementation == "eager"
    expected = reference(**_inputs(), output_attentions=eager, output_hidden_states=True)
    actual = model(**_inputs(), output_attentions=eager, output_hidden_states=True)
    # The fused GeLU is torch's tanh formula, transformers' gelu_new its own: both fp32, within
    # assert_close's default tolerances of each other.
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(ours, theirs)
    if eager:
        for ours, theirs in zip(actual.attentions, expected.attentions, strict=True):
            torch.testing.assert_close(ours, theirs)
    expected.loss.backward()
    actual.loss.backward()
    assert_same_grads(reference, model)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("modules", [None, [GPT2MLP], [GPT2Attention]], ids=["all", "mlp", "attention"])
def test_fused_model_matches_transformers(lm_checkpoint, tp, attn_implementation, modules):
    run_distributed(_fused_parity, tp, lm_checkpoint, attn_implementation, modules)


def _fused_dropout_replicated_in_step(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, resid_pdrop=0.3, attn_pdrop=0.3, embd_pdrop=0.3, seed=5
    ).fuse()
    model.train()
    torch.manual_seed(rank)
    inputs = _inputs()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), model.transformer.ln_f.weight.grad


def test_fused_dropout_stays_in_step_across_ranks(lm_checkpoint):
    (loss_0, grad_0), (loss_1, grad_1) = run_distributed(_fused_dropout_replicated_in_step, 2, lm_checkpoint)
    assert torch.equal(loss_0, loss_1) and torch.equal(grad_0, grad_1)


def test_fuse_rejects_unknown_modules(lm_checkpoint):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint)
    with pytest.raises(ValueError, match=r"cannot fuse \['Linear'\].*\['GPT2Attention', 'GPT2MLP'\]"):
        model.fuse([torch.nn.Linear])


def test_fuse_refuses_activation_it_cannot_compute_exactly(tmp_path):
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(activation_function="relu"), tmp_path)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(str(tmp_path))
    with pytest.raises(ValueError, match="relu"):
        model.fuse([GPT2MLP])
    model.fuse([GPT2Attention])  # attention has no activation: still fusable


def _fused_ngram_generate(rank, world_size, path):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    input_ids = torch.tensor([[0, 0, 7, 99, 512], [5, 17, 900, 3, 44]])
    common = dict(input_ids=input_ids, attention_mask=(input_ids != 0).long(), max_new_tokens=12, pad_token_id=0)
    for n in (1, 2, 3):
        for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3)):
            expected = reference.generate(**common, **options, no_repeat_ngram_size=n)
            actual = model.generate(**common, **options, no_repeat_ngram_size=n, fused_no_repeat_ngram_blocking=True)
            assert torch.equal(actual, expected), (n, options, actual.tolist(), expected.tolist())
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        model.generate(**common, fused_no_repeat_ngram_blocking=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_ngram_blocking_matches_transformers(lm_checkpoint, tp):
    run_distributed(_fused_ngram_generate, tp, lm_checkpoint)


def test_fused_model_blocks_ngrams_with_the_kernel(lm_checkpoint, monkeypatch):
    """After fuse(), generate() applies no_repeat_ngram_size with oslo's kernel (never transformers'
    processor) and bans the same tokens; fuse([...]) of some modules leaves generate() as it is."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    reference = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint)
    input_ids = torch.tensor([[0, 0, 7, 99, 512], [5, 17, 900, 3, 44]])
    common = dict(input_ids=input_ids, attention_mask=(input_ids != 0).long(), max_new_tokens=12, pad_token_id=0,
                  do_sample=False, no_repeat_ngram_size=2)
    expected = reference.generate(**common)
    partly = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint).fuse([GPT2MLP])
    ran = []
    original = NoRepeatNGramLogitsProcessor.__call__
    monkeypatch.setattr(NoRepeatNGramLogitsProcessor, "__call__", lambda *a: ran.append(1) or original(*a))
    assert torch.equal(partly.generate(**common), expected) and ran
    ran.clear()
    fused = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint).fuse()
    assert torch.equal(fused.generate(**common), expected) and not ran


def _triton_fused_parity(rank, world_size, path):
    import os

    pytest.importorskip("triton")
    from oslo.kernels import triton_interpreter_ready

    assert triton_interpreter_ready()
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors now launch the Triton kernels (interpreted)
    _fused_parity(rank, world_size, path, "eager", None)


def test_fused_model_through_triton_kernels(lm_checkpoint):
    """The same parity with every fused op running its Triton kernel (the CPU interpreter)."""
    run_distributed(_triton_fused_parity, 2, lm_checkpoint, timeout=300)
