"""A model follows its parameters' device and dtype, never the context's (issue "oslo on a GPU", item 1).

A GPU is not at hand here, so two stand-ins catch what a move to ``cuda`` would: the context's device is
set to ``meta`` after the build (any tensor the forward, backward, loss or generate path still creates
on ``parallel_context.device`` then meets the parameters' CPU tensors and raises), and the model is moved
with ``.double()`` (any tensor created in float32 would show in the comparison with transformers'
float64 model, whose default tolerances are 1e-7). Every loss has transformers' dtype: float32 where its
``loss_function`` computes on ``logits.float()`` (the causal LMs, the Llama family's token classification), the
logits' dtype where it applies ``nn.CrossEntropyLoss`` to them (BERT's masked LM, T5, GPT2's double heads); each is
compared at the default tolerances of its dtype. The gradients flowing from a float32 loss carry float32's
rounding, so gradients are compared at float32's default tolerances.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo
from tests.helpers import full_grads
from tests.models import zoo

CASES = zoo.all_cases()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("device-dtype")
    for arch in dict.fromkeys(case.arch for case in CASES):
        zoo.save_checkpoints(str(path), arch)
    return str(path)


def _compare(actual, expected, name: str) -> None:
    """Every output field, the losses included, in transformers' dtype, at the default tolerances of that dtype."""
    for key, value in expected.items():
        if key not in ("cache", "past_key_values"):
            zoo._compare(actual[key], value, f"{name}.{key}")


def _as(value, dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.key)
def test_model_follows_its_parameters(root, case):
    path = os.path.join(root, case.key)
    reference = getattr(transformers, case.name).from_pretrained(path).to(torch.float64)
    model = getattr(oslo, case.name).from_pretrained_with_parallel(path).double()
    assert model.dtype == torch.float64
    context = model.parallel_context
    built_on = context.device
    context.device = torch.device("meta")  # nothing of a call may come from here
    try:
        batch = {k: _as(v, torch.float64) for k, v in case.batch().items()}
        expected = reference(**batch, output_hidden_states=True)
        actual = model(**batch, output_hidden_states=True)
        _compare(actual, expected, case.name)
        case.loss(expected).backward()
        case.loss(actual).backward()
        theirs = zoo.reference_grads(reference)
        for name, grad in full_grads(model).items():
            if theirs[name] is None:
                continue
            assert grad.dtype == torch.float64, f"{name}: {grad.dtype}"
            torch.testing.assert_close(grad, theirs[name], rtol=1.3e-6, atol=1e-5,
                                       msg=lambda m, n=name: f"gradient of {n}: {m}")

        model.fuse()  # the fused paths follow the parameters too
        with torch.no_grad():
            _compare(model(**batch, output_hidden_states=True), reference(**batch, output_hidden_states=True),
                     f"{case.name} fused")

        if case.generate:
            sample = case.batch()
            prompt = dict(input_ids=sample["input_ids"][:3, :6], attention_mask=sample["attention_mask"][:3, :6],
                          max_new_tokens=6, do_sample=False, pad_token_id=reference.config.pad_token_id or 0)
            assert torch.equal(model.generate(**prompt), reference.generate(**prompt))
    finally:
        context.device = built_on


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.key)
def test_losses_have_transformers_dtype_in_bfloat16(root, case):
    """Both models moved to bfloat16: every loss has the dtype transformers gives it (float32 from its
    ``loss_function``, bfloat16 from ``nn.CrossEntropyLoss`` on bfloat16 logits) and its value at bfloat16's
    tolerances, in an evaluation call (logits built) and, for the language-modeling heads, a training call (the
    loss from the hidden states, no logits); under autocast a training call's loss is float32, as there."""
    path = os.path.join(root, case.key)
    reference = getattr(transformers, case.name).from_pretrained(path).to(torch.bfloat16)
    model = getattr(oslo, case.name).from_pretrained_with_parallel(path).to(torch.bfloat16)
    batch = {k: _as(v, torch.bfloat16) for k, v in case.batch().items()}
    calls = [("eval", torch.no_grad)]
    if hasattr(model, "_loss_in_logits_dtype") and "labels" in batch:  # no classifier dropout: deterministic
        calls.append(("train", torch.enable_grad))
    for mode, grad_mode in calls:
        reference.train(mode == "train")
        model.train(mode == "train")
        with grad_mode():
            expected, actual = reference(**batch), model(**batch)
        for key, value in expected.items():
            # (in training, the language-modeling loss only: GPT2's multiple-choice head has a dropout of its own)
            if key.endswith("loss") and value is not None and (mode == "eval" or key == "loss"):
                torch.testing.assert_close(actual[key], value, msg=lambda m, k=key, o=mode: f"{case.key} {o} {k}: {m}")
    if "train" in dict(calls):
        plain = {k: _as(v, torch.float32) for k, v in case.batch().items()}
        model.float().train()
        reference.float().train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected, actual = reference(**plain), model(**plain)
        assert actual.loss.dtype == expected.loss.dtype == torch.float32, (actual.loss.dtype, expected.loss.dtype)


def test_half_precision_move_runs():
    """``.half()`` and ``.to(torch.bfloat16)`` on a built model: the call computes in that dtype."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=32)
    for dtype, move in ((torch.float16, lambda m: m.half()), (torch.bfloat16, lambda m: m.to(torch.bfloat16))):
        model = move(oslo.GPT2LMHeadModel.from_config_with_parallel(config))
        ids = torch.randint(0, 101, (2, 8))
        output = model(input_ids=ids, labels=ids, gather_logits=True)
        assert output.logits.dtype == dtype and torch.isfinite(output.loss)
        output.loss.backward()
        assert all(p.grad.dtype == dtype for p in model.parameters() if p.grad is not None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.key)
def test_model_moved_to_cuda(root, case):
    """Built in a plain process (the context's device is the CPU), then ``.to("cuda")``: the forward,
    the training call's loss and gradients, ``fuse()`` and ``generate()`` equal transformers on the same
    device (TF32 off: both sides in true float32)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    path = os.path.join(root, case.key)
    reference = getattr(transformers, case.name).from_pretrained(path).to("cuda")
    model = getattr(oslo, case.name).from_pretrained_with_parallel(path).to("cuda")
    assert model.parallel_context.device.type == "cpu" and model.device.type == "cuda"
    batch = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in case.batch().items()}
    expected = reference(**batch, output_hidden_states=True)
    actual = model(**batch, output_hidden_states=True)
    zoo.compare_outputs(actual, expected, case.name)
    case.loss(expected).backward()
    case.loss(actual).backward()
    zoo.compare_grads(model, reference, case.name)
    model.fuse()
    with torch.no_grad():
        zoo.compare_outputs(model(**batch, output_hidden_states=True), reference(**batch, output_hidden_states=True),
                            f"{case.name} fused")
    if case.generate:
        prompt = dict(input_ids=batch["input_ids"][:3, :6], attention_mask=batch["attention_mask"][:3, :6],
                      max_new_tokens=6, do_sample=False, pad_token_id=reference.config.pad_token_id or 0)
        assert torch.equal(model.generate(**prompt), reference.generate(**prompt))
    saved = os.path.join(root, f"{case.key}-from-cuda")
    model.save_pretrained_with_parallel(saved, save_with_merging=True)
    again = getattr(transformers, case.name).from_pretrained(saved)
    for name, value in again.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name].cpu()), name
