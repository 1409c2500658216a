"""What is GPT-Neo's own: global and local (sliding-window) layers, unscaled float32 attention, the
attention weights at tensor parallelism, step-by-step decoding past the window with a KV cache, the
fused path (``model.fuse()``), checkpoints holding transformers' old mask buffers, and bad input.
Every head at every layout, pipeline training, generate() and checkpoints: tests/models/test_zoo.py
(cases in tests/models/cases_gpt_neo.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import oslo
from oslo import GPTNeoAttention, GPTNeoMLP
from oslo.models.compat import CACHE_FIELD
from oslo.models.gpt_neo import causal_window
from tests.distributed import run_distributed
from tests.helpers import assert_same_grads, save_reference, tiny_gpt2_config
from tests.models.cases_gpt_neo import WINDOW, lm_batch, tiny_gpt_neo_config


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-neo-lm")
    save_reference(transformers.GPTNeoForCausalLM, tiny_gpt_neo_config(), path)
    return str(path)


def _assert_same_outputs(actual, expected, attentions=True):
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    assert len(actual.hidden_states) == len(expected.hidden_states) == 5
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(ours, theirs)
    if attentions:
        assert len(actual.attentions) == len(expected.attentions) == 4
        for ours, theirs in zip(actual.attentions, expected.attentions, strict=True):
            assert ours.shape == theirs.shape == (4, 4, 10, 10)
            torch.testing.assert_close(ours, theirs)


# ---- the layers, the attention weights and the cache at tensor parallelism ------------------------
def _lm_parity(rank, world_size, path):
    reference = transformers.GPTNeoForCausalLM.from_pretrained(path)
    model = oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    batch = lm_batch()
    expected = reference(**batch, output_hidden_states=True, output_attentions=True)
    actual = model(**batch, output_hidden_states=True, output_attentions=True)
    _assert_same_outputs(actual, expected)
    # The local layers' weights stop WINDOW keys back; the global ones do not.
    assert not actual.attentions[1][:, :, -1, :-WINDOW].any() and actual.attentions[0][0, :, -1, 0].all()
    expected.loss.backward()
    actual.loss.backward()
    assert_same_grads(reference, model)

    # Decoding one token at a time with the cache, well past the window, from a left-padded prompt.
    input_ids, attention_mask = batch["input_ids"][:, :5], batch["attention_mask"][:, :5]
    theirs, ours = None, None
    with torch.no_grad():
        for step in range(9):
            length = input_ids.shape[1]
            new = slice(None) if step == 0 else slice(length - 1, length)
            expected = reference(input_ids=input_ids[:, new], attention_mask=attention_mask, **{CACHE_FIELD: theirs})
            actual = model(input_ids=input_ids[:, new], attention_mask=attention_mask, cache=ours)
            torch.testing.assert_close(actual.logits, expected.logits, msg=lambda m, s=step: f"step {s}: {m}")
            theirs, ours = expected[CACHE_FIELD], actual[CACHE_FIELD]
            input_ids = torch.cat([input_ids, expected.logits[:, -1:].argmax(-1)], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
    assert ours.get_seq_length() == 13 > WINDOW


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lm_matches_transformers_with_attentions_and_cache(lm_checkpoint, tp):
    run_distributed(_lm_parity, tp, lm_checkpoint)


def test_window_is_transformers_bias():
    """No mask buffer: the window computed per call is transformers' ``tril ^ tril(-window)`` buffer,
    sliced as transformers slices it (queries at the end of the keys, as with a KV cache)."""
    positions = 16
    full = torch.tril(torch.ones(positions, positions, dtype=torch.bool))
    for window, bias in ((None, full), (WINDOW, full ^ torch.tril(full, -WINDOW))):
        for q_len, k_len in ((10, 10), (1, 13), (3, 9), (1, 1)):
            expected = bias[k_len - q_len : k_len, :k_len]
            assert torch.equal(causal_window(q_len, k_len, window, torch.device("cpu")), expected)
    model = oslo.GPTNeoForCausalLM.from_config_with_parallel(tiny_gpt_neo_config())  # meta-device build
    assert not list(model.buffers())
    types = [block.attn.attention.window for block in model.transformer.h]
    assert types == [None, WINDOW, None, WINDOW]


# ---- fused kernels ---------------------------------------------------------------------------
def _fused_parity(rank, world_size, path, modules, expected_fused):
    reference = transformers.GPTNeoForCausalLM.from_pretrained(path)
    model = oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    assert model.fuse(modules) is model
    fusable = [m for m in model.modules() if isinstance(m, (GPTNeoAttention, GPTNeoMLP))]
    assert {type(m).__name__ for m in fusable if m.fused} == expected_fused
    batch = lm_batch()
    with torch.no_grad():  # weights asked for: the fused softmax materializes them
        expected = reference(**batch, output_hidden_states=True, output_attentions=True)
        _assert_same_outputs(model(**batch, output_hidden_states=True, output_attentions=True), expected)
    # No weights: the fused attention runs sdpa, with the window and the padding as one mask. Forward
    # equal everywhere; gradients too, except through a padded query that sees only padding: eager's
    # softmax over saturated scores (all float32's minimum: uniform) differentiates as if they were not
    # saturated, while sdpa's kernels keep a logsumexp that the minimum swamps. So no loss is read from
    # such a query here (the first real token is not predicted from padding).
    labels = batch["labels"].clone()
    labels[:, 1:][batch["attention_mask"][:, :-1] == 0] = -100
    expected = reference(**{**batch, "labels": labels}, output_hidden_states=True)
    actual = model(**{**batch, "labels": labels}, output_hidden_states=True)
    _assert_same_outputs(actual, expected, attentions=False)
    expected.loss.backward()
    actual.loss.backward()
    assert_same_grads(reference, model)
    # The fused window with a cache (one query, more keys than the window).
    common = dict(input_ids=batch["input_ids"][:3, :6], attention_mask=batch["attention_mask"][:3, :6],
                  max_new_tokens=8, pad_token_id=0, do_sample=False)
    assert torch.equal(model.generate(**common), reference.generate(**common))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("modules", [None, [GPTNeoMLP], [GPTNeoAttention]], ids=["all", "mlp", "attention"])
def test_fused_model_matches_transformers(lm_checkpoint, tp, modules):
    """Fused equals transformers, which the unfused model equals (above): the fused softmax (window
    included), bias + GeLU and bias + dropout + residual keep the math."""
    fused = {c.__name__ for c in modules} if modules else {"GPTNeoMLP", "GPTNeoAttention"}
    run_distributed(_fused_parity, tp, lm_checkpoint, modules, fused)


def test_fuse_keeps_an_activation_the_kernel_does_not_compute(tmp_path):
    """A ReLU MLP fuses bias + dropout + residual only: its activation keeps its own math."""
    save_reference(transformers.GPTNeoForCausalLM, tiny_gpt_neo_config(activation_function="relu"), tmp_path)
    run_distributed(_fused_parity, 2, str(tmp_path), None, {"GPTNeoMLP", "GPTNeoAttention"})


def _dropout_in_step(rank, world_size, path, fused):
    model = oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size, resid_dropout=0.3, attention_dropout=0.3, embed_dropout=0.3, seed=5)
    if fused:
        model.fuse()
    model.train()
    torch.manual_seed(rank)  # the ranks' global streams differ: the model's own streams decide
    loss = model(**lm_batch()).loss
    loss.backward()
    return loss.detach(), model.transformer.ln_f.weight.grad


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_dropout_stays_in_step_across_ranks(lm_checkpoint, fused):
    (loss_0, grad_0), (loss_1, grad_1) = run_distributed(_dropout_in_step, 2, lm_checkpoint, fused)
    assert torch.equal(loss_0, loss_1) and torch.equal(grad_0, grad_1)


def test_gradient_checkpointing_gives_the_same_gradients(lm_checkpoint):
    grads = []
    for checkpointing in (False, True):
        model = oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(lm_checkpoint)
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert all(block.gradient_checkpointing for block in model.transformer.h)
        model(**lm_batch()).loss.backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=lambda m, n=name: f"{n}: {m}")


# ---- checkpoints -----------------------------------------------------------------------------
def test_old_checkpoint_mask_buffers_are_ignored(lm_checkpoint, tmp_path, caplog):
    """GPT-Neo checkpoints saved by older transformers hold each layer's ``attn.attention.bias`` and
    ``masked_bias``: they load without an unused-weights warning, and the model is the same."""
    state = load_file(f"{lm_checkpoint}/model.safetensors")
    for i in range(4):
        state[f"transformer.h.{i}.attn.attention.bias"] = torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.bool))
        state[f"transformer.h.{i}.attn.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{lm_checkpoint}/config.json").read())
    with caplog.at_level(logging.WARNING):
        model = oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(str(tmp_path))
    assert "Unused weights" not in caplog.text
    expected = transformers.GPTNeoForCausalLM.from_pretrained(lm_checkpoint)(**lm_batch()).logits
    torch.testing.assert_close(model(**lm_batch()).logits, expected)


# ---- bad input -------------------------------------------------------------------------------
def _expect_error(rank, world_size, path, error, fragments, **kwargs):
    with pytest.raises(error) as info:
        oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(path, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"


def test_heads_not_divisible_by_tensor_parallel_size(lm_checkpoint):
    run_distributed(_expect_error, 3, lm_checkpoint, ValueError, ["tensor_parallel_size=3", "num_heads=4", "[1, 2, 4]"],
                    tensor_parallel_size=3)


def test_more_stages_than_layers(tmp_path):
    config = tiny_gpt_neo_config(num_layers=1, attention_types=[[["local"], 1]])
    save_reference(transformers.GPTNeoForCausalLM, config, tmp_path)
    run_distributed(_expect_error, 2, str(tmp_path), ValueError,
                    ["pipeline_parallel_size=2 exceeds the number of layers (1)"], pipeline_parallel_size=2)


def test_gpt2_checkpoint_or_config_is_refused(tmp_path):
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), tmp_path)
    with pytest.raises(ValueError, match="holds a 'gpt2' checkpoint, but GPTNeoForCausalLM is a 'gpt_neo' model"):
        oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(str(tmp_path))
    with pytest.raises(TypeError, match="config must be a GPTNeoConfig for GPTNeoForCausalLM, got GPT2Config"):
        oslo.GPTNeoForCausalLM.from_config_with_parallel(tiny_gpt2_config())


def test_unknown_attention_type_is_refused():
    with pytest.raises(ValueError, match=r"attention types \['sparse'\]"):
        oslo.GPTNeoForCausalLM.from_config_with_parallel(
            tiny_gpt_neo_config(attention_types=[[["global", "sparse"], 2]]))


def test_sdpa_is_refused_as_transformers_does(lm_checkpoint):
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        oslo.GPTNeoForCausalLM.from_pretrained_with_parallel(lm_checkpoint, attn_implementation="sdpa")


def _triton_fused_parity(rank, world_size, path):
    import os

    pytest.importorskip("triton")
    from oslo.kernels import triton_interpreter_ready

    if not triton_interpreter_ready():
        pytest.skip("triton's CPU interpreter is not available in this process")
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors now launch the Triton kernels (interpreted)
    _fused_parity(rank, world_size, path, None, {"GPTNeoMLP", "GPTNeoAttention"})


def test_fused_model_through_triton_kernels(lm_checkpoint):
    """The fused parity with every fused op running its Triton kernel (the CPU interpreter): the
    windowed softmax kernel included, with and without a KV cache."""
    run_distributed(_triton_fused_parity, 1, lm_checkpoint, timeout=300)
