"""Activation checkpointing at every layout, on GPT2's blocks (each architecture's own test file checks its
blocks): the same gradients as without it, dropout included (the recomputation draws the forward's masks,
tensor-parallel heads' too), and the blocks really recomputed."""

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


def _gradients(rank, world_size, path, tp, attn_implementation):
    """Two steps' gradients without checkpointing, then with each of its two switches: the same model built
    again from the same seed (its dropout streams start over), in the same processes."""
    pp = world_size // tp
    results = []
    for enable in (None, "activation_checkpointing_enable", "gradient_checkpointing_enable"):
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
            path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=2, seed=3,
            attn_implementation=attn_implementation, **DROPOUT,
        ).train()
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecates the older name
                getattr(model, enable)()
        calls = []
        for module in model.modules():
            if isinstance(module, GPT2Attention):
                module.register_forward_hook(lambda *args, calls=calls: calls.append(1))
        ids = torch.randint(3, 1001, (4, 10), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(100 + rank)  # the model's own streams decide the masks, not the global RNG
        for _ in range(2):  # the second step starts from streams the first (and its recomputation) moved
            model.zero_grad()
            outputs = model(input_ids=ids, labels=ids)
            for micro_output in outputs if pp > 1 else [outputs]:
                micro_output.loss.backward()
        results.append((enable, full_grads(model), len(calls)))
    return results


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_checkpointing_gives_the_same_gradients_with_dropout(lm_checkpoint, tp, pp, attn_implementation):
    for (_, expected, plain_calls), *checkpointed in run_distributed(_gradients, tp * pp, lm_checkpoint, tp,
                                                                      attn_implementation):
        for enable, actual, calls in checkpointed:
            assert calls == 2 * plain_calls  # every block ran again in the backward pass
            assert expected.keys() == actual.keys()
            # Default tolerances: the recomputed graph may accumulate a tensor's gradients in another order
            # (measured: 1e-7 relative at tp=2); a different dropout mask would be off by 1e-2.
            for name, grad in expected.items():
                torch.testing.assert_close(actual[name], grad, msg=lambda m, n=name, e=enable: f"{e}: {n}: {m}")
