"""Each paired collective forward and backward, each parallel layer against its torch counterpart,
the vocab-parallel loss against F.cross_entropy, and the per-block collective count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import oslo
from oslo.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    clip_grad_norm_,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from tests.distributed import run_distributed
from tests.helpers import tiny_gpt2_config


def _mappings(rank, world_size):
    context = ParallelContext(tensor_parallel_size=world_size)
    group = context.tensor_parallel_group
    x = torch.arange(6.0).view(1, 6).add(rank).requires_grad_()

    y = copy_to_tensor_parallel(x, group)
    y.backward(torch.full_like(y, rank + 1.0))
    assert torch.equal(y, x) and torch.equal(x.grad, torch.full_like(x, sum(range(1, world_size + 1))))

    x.grad = None
    y = reduce_from_tensor_parallel(x * 1, group)
    y.backward(torch.ones_like(y))
    expected = sum(torch.arange(6.0).add(r) for r in range(world_size)).view(1, 6)
    assert torch.equal(y, expected) and torch.equal(x.grad, torch.ones_like(x))

    x.grad = None
    y = scatter_to_tensor_parallel(x, group)
    assert torch.equal(y, x.chunk(world_size, -1)[rank])
    y.backward(torch.full_like(y, float(rank)))
    expected_grad = torch.cat([torch.full((1, 6 // world_size), float(r)) for r in range(world_size)], -1)
    assert torch.equal(x.grad, expected_grad)

    x.grad = None
    y = gather_from_tensor_parallel(x, group, dim=0)
    assert torch.equal(y, torch.cat([torch.arange(6.0).view(1, 6).add(r) for r in range(world_size)]))
    y.backward(torch.arange(float(y.numel())).view_as(y))
    assert torch.equal(x.grad, torch.arange(float(y.numel())).view_as(y)[rank : rank + 1])


def test_mappings():
    run_distributed(_mappings, 2)
    run_distributed(_mappings, 3)


def _layers(rank, world_size):
    context = ParallelContext(tensor_parallel_size=world_size)
    generator = torch.Generator().manual_seed(0)
    weight_up = torch.randn(12, 8, generator=generator)
    bias_up = torch.randn(12, generator=generator)
    weight_down = torch.randn(8, 12, generator=generator)
    bias_down = torch.randn(8, generator=generator)
    x = torch.randn(2, 5, 8, generator=generator)

    up = ColumnParallelLinear(8, 12, parallel_context=context)
    down = RowParallelLinear(12, 8, parallel_context=context)
    with torch.no_grad():
        up.weight.copy_(up.weight_spec.shard(lambda a, b: weight_up[a:b]))
        up.bias.copy_(up.parallel_specs["bias"].shard(lambda a, b: bias_up[a:b]))
        down.weight.copy_(down.parallel_specs["weight"].shard(lambda a, b: weight_down[:, a:b]))
        down.bias.copy_(bias_down)
    ours = down(up(x))
    expected = F.linear(F.linear(x, weight_up, bias_up), weight_down, bias_down)
    torch.testing.assert_close(ours, expected)

    gathered = ColumnParallelLinear(8, 12, gather_output=True, parallel_context=context)
    with torch.no_grad():
        gathered.weight.copy_(up.weight)
        gathered.bias.copy_(up.bias)
    torch.testing.assert_close(gathered(x), F.linear(x, weight_up, bias_up))

    vocab, dim = 11, 4  # 11 is not divisible by the group size: padded rows
    table = torch.randn(vocab, dim, generator=generator)
    embedding = VocabParallelEmbedding(vocab, dim, parallel_context=context)
    head = VocabParallelLMHead(dim, vocab, parallel_context=context)
    with torch.no_grad():
        embedding.weight.copy_(embedding.weight_spec.shard(lambda a, b: table[a:b]))
        head.weight.copy_(embedding.weight)
    ids = torch.tensor([[0, 10, 5, 3], [7, 7, 1, 9]])
    torch.testing.assert_close(embedding(ids), F.embedding(ids, table))
    hidden = torch.randn(2, 4, dim, generator=generator, requires_grad=True)
    logits = head.gather(head(hidden))
    assert logits.shape == (2, 4, vocab)
    torch.testing.assert_close(logits, hidden @ table.T)

    labels = torch.tensor([[3, 10, -100, 0], [7, 2, 9, 10]])
    reference_hidden = hidden.detach().clone().requires_grad_()
    loss = head.causal_lm_loss(head(hidden), labels)
    expected_loss = F.cross_entropy((reference_hidden @ table.T)[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected_loss)
    loss.backward()
    expected_loss.backward()
    torch.testing.assert_close(hidden.grad, reference_hidden.grad)


def test_layers_match_torch():
    for world_size in (1, 2, 3):
        run_distributed(_layers, world_size)


def _count_collectives(rank, world_size, config):
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0)
    counts = {"all_reduce": 0, "other": 0}
    names = ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast",
             "gather")
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def wrapper(*args, **kwargs):  # a small all-reduce on gloo is one all-to-all (oslo.parallel.collectives)
            counts["all_reduce" if name in ("all_reduce", "all_to_all_single") else "other"] += 1
            return originals[name](*args, **kwargs)
        return wrapper

    for name in originals:
        setattr(dist, name, counting(name))
    ids = torch.randint(0, config.vocab_size, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss  # a training call: the logits are not gathered by default
    forward = dict(counts)
    counts.update(all_reduce=0, other=0)
    loss.backward()
    return forward, dict(counts)


def test_megatron_minimum_collectives():
    # Per block 2 all-reduces forward and 2 backward. Forward adds 1 for the embedding and 2 for the
    # loss (row max; target logit and exp-sum fused in one), and 1 all-gather of two int64 per rank
    # before anything else: the check that every rank got the same inputs. Backward adds 1 for the
    # gradient of the hidden states entering the vocab-parallel LM head. Nothing else.
    for layers in (1, 3):
        forward, backward = run_distributed(_count_collectives, 2, tiny_gpt2_config(n_layer=layers))[0]
        assert forward == {"all_reduce": 2 * layers + 1 + 2, "other": 1}
        assert backward == {"all_reduce": 2 * layers + 1, "other": 0}


class _OwnMLP(nn.Module):
    def __init__(self, context=None):
        super().__init__()
        self.up = ColumnParallelLinear(16, 64, parallel_context=context)
        self.down = RowParallelLinear(64, 16, parallel_context=context)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _clip_a_module_of_ones_own(rank, world_size):
    context = ParallelContext(tensor_parallel_size=world_size)
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    ours = _OwnMLP(context)
    for layer, source in ((ours.up, whole[0]), (ours.down, whole[2])):
        for name, param in layer.named_parameters():
            spec = layer.parallel_specs.get(name)
            whole_param = getattr(source, name)
            with torch.no_grad():
                param.copy_(whole_param if spec is None else spec.slice_of(whole_param))
    x = torch.randn(4, 16)
    ours(x).square().sum().backward()
    whole(x).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.5)
    torch.testing.assert_close(clip_grad_norm_(ours, 0.5), expected)
    torch.testing.assert_close(ours.up.weight.grad, ours.up.parallel_specs["weight"].slice_of(whole[0].weight.grad))
    with pytest.raises(TypeError, match=r"clip_grad_norm_\(model, max_norm\), not"):
        clip_grad_norm_(ours.parameters(), 1.0)
    with pytest.warns(UserWarning, match="built without parallel_context while torch.distributed runs 2"):
        unsplit = _OwnMLP()
    assert unsplit.up.weight.shape == (64, 16)
    return True


def test_clip_and_layers_in_a_module_of_ones_own():
    """``clip_grad_norm_`` on a module of the user's built from oslo's layers (no ``parallel_context`` attribute)
    gives torch's norm of the unsplit module and clips alike; its parameters instead of it are refused, saying how
    to call it; a layer built without ``parallel_context`` among several processes warns that it is whole."""
    assert run_distributed(_clip_a_module_of_ones_own, 2) == [True, True]
