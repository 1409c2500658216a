"""The model's random streams (oslo.parallel.random). By default they follow torch's generator, as transformers'
models do: after ``torch.manual_seed(seed)`` dropout draws the masks transformers draws (one process) and
``generate(do_sample=True)`` the tokens transformers samples (every layout); tensor-parallel ranks whose generators
differ take their first rank's state before they draw. The model's own streams, reseeded:
``parallel_context.manual_seed(seed)`` on every rank makes ``generate(do_sample=True)`` draw what transformers draws
after ``torch.manual_seed(seed)``, whatever each rank's global RNG holds; seeds that differ within a model, or a seed
that is not an integer, raise on every rank."""

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


FAMILIES = {
    "GPT2LMHeadModel": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=64),
    "GPTNeoForCausalLM": lambda: transformers.GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, vocab_size=101, max_position_embeddings=64, window_size=4,
        attention_types=[[["global", "local"], 1]], embed_dropout=0.1, attention_dropout=0.1, resid_dropout=0.1),
    "BertForMaskedLM": lambda: transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                       intermediate_size=64, vocab_size=101),
    "T5ForConditionalGeneration": lambda: transformers.T5Config(
        num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=101, decoder_start_token_id=0,
        dropout_rate=0.1),
    "LlamaForCausalLM": lambda: transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=101, attention_dropout=0.1),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_dropout_draws_the_masks_transformers_draws_after_torch_manual_seed(name, tmp_path):
    """A model built without a seed, in training mode: its dropout draws from torch's generator as transformers'
    model does, mask for mask, so the same seed gives transformers' loss and gradients (with different masks the
    losses part by about 1e-2)."""
    torch.manual_seed(0)
    getattr(transformers, name)(FAMILIES[name]()).save_pretrained(tmp_path)
    results = []
    for model in (getattr(transformers, name).from_pretrained(tmp_path),
                  getattr(oslo, name).from_pretrained_with_parallel(tmp_path)):
        model.train()
        torch.manual_seed(5)
        input_ids = torch.randint(3, 100, (2, 12))
        labels = torch.randint(3, 100, (2, 7)) if name.startswith("T5") else input_ids
        output = model(input_ids=input_ids, labels=labels)
        output.loss.backward()
        results.append((output.loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (expected, expected_grads), (actual, grads) = results
    torch.testing.assert_close(actual, expected)
    assert set(grads) == set(expected_grads)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], msg=key)


def _follows(rank, world_size, path, tp, pp):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=tp,
                                                               pipeline_parallel_size=pp).eval()
    options = dict(max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=100)
    sampled = []
    for each in (reference, model):
        torch.manual_seed(11)
        prompt = torch.randint(1, 100, (2, 5))  # the generator moves on before the sampling, as in a script
        sampled.append([each.generate(prompt, **options) for _ in range(2)])  # the second goes on from the first
    for actual, expected in zip(*reversed(sampled), strict=True):
        assert torch.equal(actual, expected), (actual.tolist(), expected.tolist())
    # A training step with dropout: each pipeline stage draws its own layers' masks, and the stages' generators part
    # ways. Sampling afterwards still picks the same tokens on every rank (the first rank's generator decides).
    model.train()
    labels = torch.randint(1, 100, (4, 8), generator=torch.Generator().manual_seed(1))
    outputs = model(input_ids=labels, labels=labels)
    for output in (outputs if pp > 1 else [outputs]):
        output.loss.backward()
    model.eval()
    return model.generate(labels[:2, :4], **options).tolist()


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_sampling_draws_what_transformers_draws_from_torch_s_generator(checkpoint, tp, pp):
    """``torch.manual_seed(s)``, a prompt drawn, then ``generate(do_sample=True)`` twice: transformers' tokens at
    every layout (the model's own streams ignored the seed: other tokens). After training with dropout, whose
    masks move the stages' generators apart, every rank still samples the same tokens."""
    if tp * pp == 1:
        _follows(0, 1, checkpoint, tp, pp)
        return
    after_training = run_distributed(_follows, tp * pp, checkpoint, tp, pp, timeout=180)
    assert all(tokens == after_training[0] for tokens in after_training), after_training


def _apart(rank, world_size, path, pp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2, pipeline_parallel_size=pp)
    input_ids = torch.randint(1, 100, (4, 8), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(100 + rank)  # each process seeded its own way, as a launcher starts them
    model.eval()
    with torch.no_grad():
        model(input_ids=input_ids)  # no dropout: nothing drawn, nothing shared
    untouched = torch.get_rng_state()
    model.train()
    outputs = model(input_ids=input_ids, labels=input_ids)
    losses = []
    for output in (outputs if pp > 1 else [outputs]):
        output.loss.backward()
        losses.append(output.loss)
    replicated = {name: param.grad.to_local() for name, param in model.named_parameters()
                  if name.endswith(("ln_1.weight", "ln_2.bias", "ln_f.weight", "c_proj.bias", "wpe.weight"))}
    return untouched, [loss.item() for loss in losses], replicated


@pytest.mark.parametrize("pp", [1, 2])
def test_tensor_parallel_ranks_seeded_apart_draw_their_first_rank_s_masks(checkpoint, pp):
    """Dropout on the replicated activations draws from torch's generator on every tensor-parallel rank, and ranks
    seeded differently would drop other elements (silently wrong). Each stage's ranks compare their generators in
    the training call's input check, and the first rank's state goes to the others: the ranks compute the same loss
    and the same gradients of the replicated parameters. A call without dropout leaves the generators alone."""
    ranks = run_distributed(_apart, 2 * pp, checkpoint, pp)
    for stage in range(pp):
        (untouched, losses, grads), (other_untouched, other_losses, other_grads) = ranks[2 * stage:2 * stage + 2]
        assert not torch.equal(untouched, other_untouched)
        assert losses == other_losses
        assert grads and grads.keys() == other_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, rtol=0, atol=0, msg=name)
