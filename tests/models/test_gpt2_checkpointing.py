"""Activation checkpointing at every layout: the same gradients as without it, dropout included (the
recomputation draws the forward's masks, tensor-parallel heads' too), and the blocks really recomputed."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import oslo
from oslo.models.gpt2 import GPT2Attention
from tests.distributed import run_distributed
from tests.helpers import full_grads, save_reference, tiny_gpt2_config

DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm-ckpt")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=4), path)
    return str(path)


def _gradients(rank, world_size, path, tp, enable, attn_implementation):
    pp = world_size // tp
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=2, seed=3,
        attn_implementation=attn_implementation, **DROPOUT,
    ).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecates the older name
        if enable == "activation_checkpointing_enable":
            model.activation_checkpointing_enable()
        elif enable == "gradient_checkpointing_enable":
            model.gradient_checkpointing_enable()
    calls = []
    for module in model.modules():
        if isinstance(module, GPT2Attention):
            module.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(3, 1001, (4, 10), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(100 + rank)  # the model's own streams decide the masks, not the global RNG
    for _ in range(2):  # the second step starts from streams the first (and its recomputation) moved
        model.zero_grad()
        outputs = model(input_ids=ids, labels=ids)
        for micro_output in outputs if pp > 1 else [outputs]:
            micro_output.loss.backward()
    return full_grads(model), len(calls)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_checkpointing_gives_the_same_gradients_with_dropout(lm_checkpoint, tp, pp, attn_implementation):
    plain = run_distributed(_gradients, tp * pp, lm_checkpoint, tp, None, attn_implementation)
    for enable in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        checkpointed = run_distributed(_gradients, tp * pp, lm_checkpoint, tp, enable, attn_implementation)
        for (expected, plain_calls), (actual, calls) in zip(plain, checkpointed, strict=True):
            assert calls == 2 * plain_calls  # every block ran again in the backward pass
            assert expected.keys() == actual.keys()
            # Default tolerances: the recomputed graph may accumulate a tensor's gradients in another order
            # (measured: 1e-7 relative at tp=2); a different dropout mask would be off by 1e-2.
            for name, grad in expected.items():
                torch.testing.assert_close(actual[name], grad, msg=lambda m, n=name, e=enable: f"{e}: {n}: {m}")
