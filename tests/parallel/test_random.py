"""The model's own random streams (oslo.parallel.random), reseeded: ``parallel_context.manual_seed(seed)`` on every
rank makes ``generate(do_sample=True)`` draw what transformers draws after ``torch.manual_seed(seed)``, whatever
each rank's global RNG holds; seeds that differ within a model, or a seed that is not an integer, raise on every
rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import oslo
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=32,
                                     bos_token_id=0, eos_token_id=100)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def _sampled(rank, world_size, path, tp, pp):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                               pipeline_parallel_size=pp).eval()
    prompt = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=100)
    for seed in (5, np.int64(6), 5):
        torch.manual_seed(1000 + rank)  # each rank's global generator elsewhere: the model's streams decide
        model.parallel_context.manual_seed(seed)
        actual = model.generate(prompt, **options)
        torch.manual_seed(int(seed))
        expected = reference.generate(prompt, **options)
        assert torch.equal(actual, expected), (seed, actual.tolist(), expected.tolist())
    return True


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_manual_seed_makes_sampling_what_torch_manual_seed_makes_it(checkpoint, tp, pp):
    if tp * pp == 1:
        assert _sampled(0, 1, checkpoint, tp, pp)
    else:
        assert run_distributed(_sampled, tp * pp, checkpoint, tp, pp) == [True] * (tp * pp)


def _seeded(rank, world_size, path, seeds):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2)
    try:
        model.parallel_context.manual_seed(seeds[rank])
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("seeds, error, message", [
    ((1, 2), "ValueError", "different seeds on the ranks of one model (global rank 0: 1, global rank 1: 2)"),
    ((1, "1"), "TypeError", "takes an integer seed, got global rank 0: 1, global rank 1: '1'"),
], ids=["different", "not-an-integer"])
def test_seeds_that_differ_within_a_model_raise_on_every_rank(checkpoint, seeds, error, message):
    for said in run_distributed(_seeded, 2, checkpoint, seeds):
        assert said is not None and said[0] == error and message in said[1], said
