"""Sequence parallelism (``sequence_parallel=True``) against transformers, for the anchor class of every
architecture that has it (the decoder-only ones and BERT): outputs, losses, gradients and pipeline micro-batch
losses (tests/models/zoo.py's check), the weights after the manual's step, and generate(), at tp=2 and tp2 x pp2;
the collectives of a block; what a block keeps for the backward; and the calls it refuses."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo
from tests.distributed import run_distributed
from tests.helpers import save_reference
from tests.models import zoo

ARCHS = ["gpt2", "gpt_neo", "bert", "llama", "qwen2", "mistral"]
# Replicated parameters of one block applied to sequence shards have their gradients summed over the
# tensor-parallel group, one all-reduce per module: the two norms (a LayerNorm's weight and bias together) and the
# two row-parallel layers' biases; RMSNorm's weights only in the Llama family.
SUMMED_PER_BLOCK = {"gpt2": 4, "gpt_neo": 4, "bert": 4, "llama": 2, "qwen2": 2, "mistral": 2}


def _anchor(arch: str) -> zoo.Case:
    return next(case for case in zoo.cases_of(arch) if case.anchor)


def _shard_lengths(case: zoo.Case, path: str, tp: int, pp: int) -> set[int]:
    """The sequence lengths the layers of this stage receive in a training call."""
    from oslo.parallel.pipeline import StageLayers

    model = getattr(oslo, case.name).from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=zoo.MICRO_BATCH_SIZE,
        sequence_parallel=True).train()
    lengths = set()
    for layers in [m for m in model.modules() if isinstance(m, StageLayers)]:  # T5: the encoder's and the decoder's
        for layer in layers:
            layer.register_forward_pre_hook(lambda module, args: lengths.add(args[0].shape[1]))
    batch = case.batch()
    if pp == 1:
        case.loss(model(**batch)).backward()
    else:
        for micro_output in model(**batch):
            micro_output.loss.backward()
    return lengths


def _check(rank, world_size, arch, path, tp, pp):
    case = _anchor(arch)
    lengths = _shard_lengths(case, path, tp, pp)  # the encoder's and the decoder's (labels) sequences, split
    whole = {value.shape[-1] for name, value in case.batch().items() if name in ("input_ids", "labels")}
    assert lengths and lengths <= {length // tp for length in whole}, (lengths, whole)
    zoo.check_parity(case, path, tp, pp, sequence_parallel=True)
    if case.generate:
        zoo.check_generate(case, path, tp, pp, rank, sequence_parallel=True)  # decoding steps (length 1) run whole
    return zoo.run_training(rank, world_size, case.key, path, tp, pp, zoo.MICRO_BATCH_SIZE, False,
                            sequence_parallel=True)


@pytest.mark.parametrize("arch", [*ARCHS, "t5"])
@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2-pp2"])
def test_sequence_parallel_equals_one_process(zoo_checkpoints, arch, tp, pp):
    case = _anchor(arch)
    path = os.path.join(zoo_checkpoints(arch), case.key)
    zoo.check_training(case, path, pp, run_distributed(_check, tp * pp, arch, path, tp, pp, timeout=240))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_with_data_parallelism_and_activation_checkpointing(zoo_checkpoints, arch):
    """tp=2 x dp=2 under DistributedDataParallel, blocks recomputed in the backward (still on shards): the
    weights after the manual's step are one process's."""
    case = _anchor(arch)
    path = os.path.join(zoo_checkpoints(arch), case.key)
    results = run_distributed(zoo.run_training, 4, case.key, path, 2, 1, zoo.MICRO_BATCH_SIZE, True, True,
                              sequence_parallel=True, timeout=240)
    zoo.check_training(case, path, 1, results)


class CountCollectives:
    """Counts the all-reduces, all-gathers and reduce-scatters torch.distributed runs while entered (a small
    all-reduce on gloo is one all-to-all: :func:`oslo.parallel.collectives.eager_all_reduce`)."""

    NAMES = {"all_reduce": "all_reduce", "all_to_all_single": "all_reduce", "all_gather": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}

    def __enter__(self):
        self.counts = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
        self.originals = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}

        def counting(name, original):
            def call(*args, **kwargs):
                self.counts[self.NAMES[name]] += 1
                return original(*args, **kwargs)
            return call

        for name, original in self.originals.items():
            setattr(dist, name, counting(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _block_collectives(rank, world_size, arch):
    from oslo.parallel.pipeline import StageLayers

    case = _anchor(arch)
    model = getattr(oslo, case.name).from_config_with_parallel(
        case.config(), tensor_parallel_size=world_size, seed=0, sequence_parallel=True)
    block = next(iter(next(m for m in model.modules() if isinstance(m, StageLayers))))
    shard = torch.randn(2, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(3 + rank))
    shard.requires_grad_()
    extra = {}
    if arch in ("llama", "qwen2", "mistral"):  # rotary: the body computes them for the whole sequence
        extra["position_embeddings"] = model.base_model.rotary_emb(shard, torch.arange(4 * world_size)[None])
    with CountCollectives() as forward:
        out = block(shard, **extra)
        out = out[0] if isinstance(out, tuple) else out
    assert out.shape == shard.shape
    with CountCollectives() as backward:
        out.square().sum().backward()
    return forward.counts, backward.counts


@pytest.mark.parametrize("arch", ARCHS)
def test_a_block_gathers_and_reduce_scatters(arch):
    """Megatron's sequence parallelism: per block, 2 all-gathers and 2 reduce-scatters each way where tensor
    parallelism has 2 all-reduces each way; the backward also sums the gradients of the replicated parameters
    the shards met (norms, row-parallel biases) over the group."""
    results = run_distributed(_block_collectives, 2, arch)
    expected_backward = {"all_reduce": SUMMED_PER_BLOCK[arch], "all_gather": 2, "reduce_scatter": 2}
    assert results == [({"all_reduce": 0, "all_gather": 2, "reduce_scatter": 2}, expected_backward)] * 2, results


def _saved_in_blocks(rank, world_size, arch, sequence_parallel):
    """Shapes of what autograd saves inside the blocks during a training call at tp=2 (every storage once), and the
    all-gathers of its backward."""
    from oslo.parallel.pipeline import StageLayers

    case = _anchor(arch)
    config = case.config()
    for field in ("intermediate_size", "d_ff"):  # (BERT's, T5's): an MLP activation of the model's width would
        if getattr(config, field, None) == world_size * config.hidden_size:  # pass for a gathered input
            setattr(config, field, 3 * config.hidden_size)
    model = getattr(oslo, case.name).from_config_with_parallel(
        config, tensor_parallel_size=world_size, seed=0, sequence_parallel=sequence_parallel).train()
    inside, seen, shapes = [False], set(), []
    for block in next(m for m in model.modules() if isinstance(m, StageLayers)):
        block.register_forward_pre_hook(lambda module, args: inside.__setitem__(0, True))
        block.register_forward_hook(lambda module, args, out: inside.__setitem__(0, False))
    params = {getattr(p, "_oslo_storage", p).untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if inside[0] and key not in seen and key not in params:
            seen.add(key)
            shapes.append(tuple(tensor.shape))
        return tensor

    batch = case.batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch).loss
    with CountCollectives() as backward:
        loss.backward()
    return shapes, backward.counts["all_gather"], batch["input_ids"].shape, model.config.hidden_size


@pytest.mark.parametrize("arch", ["gpt2", "bert", "t5", "llama"])
def test_blocks_keep_only_shards_of_their_gathered_inputs(arch):
    """A column-parallel layer's input, gathered from the sequence shards, is kept for the backward as the shard
    and gathered again there (Megatron's saving): nothing saved inside a block has the whole sequence at the model's
    width, where the same call without sequence parallelism keeps such tensors (the norms' inputs, the layers'
    inputs); the backward all-gathers twice per block more than the gradients need."""
    layers = 4
    whole = {}
    for sequence_parallel in (False, True):
        shapes, gathers, (rows, length), width = run_distributed(_saved_in_blocks, 2, arch, sequence_parallel)[0]
        whole[sequence_parallel] = [shape for shape in shapes if shape == (rows, length, width)]
        if sequence_parallel:
            assert (rows, length // 2, width) in shapes  # the shards are what is kept
            assert gathers >= 4 * layers  # per block: 2 gradients to gather, 2 inputs gathered again
    assert len(whole[False]) >= 2 * layers, whole[False]
    assert whole[True] == [], whole[True]


def _residual_dropout_masks(rank, world_size, arch):
    """The mask of the first block's residual dropout on this rank's shard (dropout 0.5 there, 0 elsewhere)."""
    from oslo.parallel.pipeline import StageLayers

    case = _anchor(arch)
    config = case.config()
    config.resid_pdrop = 0.5
    model = getattr(oslo, case.name).from_config_with_parallel(
        config, tensor_parallel_size=world_size, seed=0, sequence_parallel=True).train()
    block = next(iter(next(m for m in model.modules() if isinstance(m, StageLayers))))
    masks = []
    block.attn.resid_dropout.register_forward_hook(lambda module, args, out: masks.append(out == 0))
    ids = torch.randint(3, config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(0))  # no padding
    model(input_ids=ids, labels=ids).loss.backward()
    return masks[0]


def test_dropout_on_shards_draws_distinct_masks_per_rank():
    """Each rank's shard holds other positions of the sequence: its residual dropout masks are its own (drawn from
    the stream distinct per rank, as Megatron does), not one pattern repeated over the shards."""
    first, second = run_distributed(_residual_dropout_masks, 2, "gpt2")
    assert first.shape == second.shape and first.shape[1] == 5
    assert 0.3 < first.float().mean() < 0.7 and 0.3 < second.float().mean() < 0.7  # dropout 0.5 applied
    assert not torch.equal(first, second)


def _refusals(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2, sequence_parallel=True)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="a call with gradients needs a length that 2 divides, got 7"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # without gradients an odd length runs whole
        reference = transformers.GPT2LMHeadModel.from_pretrained(path)
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    return True


def test_odd_lengths_are_refused_on_every_rank(tmp_path):
    save_reference(transformers.GPT2LMHeadModel, zoo.cases_of("gpt2")[0].config(), tmp_path)
    assert run_distributed(_refusals, 2, str(tmp_path)) == [True, True]


def test_classes_without_it_are_refused(tmp_path):
    class Plain(oslo.GPT2LMHeadModel):  # a class that does not declare it (a user's model, say)
        _supports_sequence_parallel = False

    with pytest.raises(NotImplementedError, match="Plain does not support sequence_parallel=True"):
        Plain.from_config_with_parallel(zoo.cases_of("gpt2")[0].config(), sequence_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel must be True or False"):
        oslo.GPT2LMHeadModel.from_config_with_parallel(zoo.cases_of("gpt2")[0].config(), sequence_parallel="yes")


FUSED_ARCHS = ["gpt2", "gpt_neo", "bert"]  # the classes whose fuse() adds a row-parallel bias in its own kernel


def _fused_residuals(record: list) -> None:
    """Make the fused models add bias + dropout + residual with oslo's op at every call (on CPU fuse() keeps torch's
    expression, which adds the bias inside the linear layer), recording each call's dropped positions."""
    from oslo.models import bert, body, gpt2, gpt_neo

    original = gpt2.bias_dropout_add

    def recorded(x, bias, residual, p, training=True):
        out = original(x, bias, residual, p, training)
        record.append((out - residual) == 0)  # exact zeros where dropped: the residual is added to 0
        return out

    for module in (gpt2, gpt_neo, bert):
        module.bias_dropout_add = recorded
    bert.fused_bias_dropout_add_pays = lambda x, p, training: True
    for module in (body, gpt2, gpt_neo):  # their blocks hand the residual to every fused attention and MLP
        module.adds_residual = lambda layer, x, dropout: layer.fused


def _no_loss_from_padding(case: zoo.Case) -> zoo.Case:
    """GPT-Neo's case with no label predicted from a padded query: its fused attention (sdpa) differentiates a
    padded query that sees only padding otherwise than eager does (see GPTNeoSelfAttention._sdpa_attention),
    with or without sequence parallelism."""
    def batch():
        values = case.batch()
        labels = values["labels"].clone()
        labels[:, 1:][values["attention_mask"][:, :-1] == 0] = -100
        return {**values, "labels": labels}

    return dataclasses.replace(case, batch=batch) if case.arch == "gpt_neo" else case


def _fused_training(rank, world_size, arch, path):
    calls = []
    _fused_residuals(calls)
    result = zoo.run_training(rank, world_size, _no_loss_from_padding(_anchor(arch)), path, 2, 1,
                              zoo.MICRO_BATCH_SIZE, False, fuse=True, sequence_parallel=True)
    return result, len(calls)


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fuse_equals_one_process(zoo_checkpoints, arch):
    """fuse() on shards: the fused bias + dropout + residual adds a row-parallel layer's bias to this rank's shard,
    whose gradient is summed over the tensor-parallel group as the layer's own addition is; the weights after the
    manual's step at tp=2 are one process's."""
    case = _anchor(arch)
    path = os.path.join(zoo_checkpoints(arch), case.key)
    results = run_distributed(_fused_training, 2, arch, path, timeout=240)
    assert all(calls > 0 for _, calls in results)
    zoo.check_training(_no_loss_from_padding(case), path, 1, [result for result, _ in results])


def _fused_dropout_masks(rank, world_size):
    masks = []
    _fused_residuals(masks)
    case = _anchor("gpt2")
    config = case.config()
    config.resid_pdrop = 0.5
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, tensor_parallel_size=world_size, seed=0, sequence_parallel=True).fuse().train()
    ids = torch.randint(3, config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return masks[0]


def test_fused_dropout_on_shards_draws_distinct_masks_per_rank():
    """The fused op's dropout on a shard draws from the stream distinct per rank, as the module it stands for."""
    first, second = run_distributed(_fused_dropout_masks, 2)
    assert first.shape == second.shape and first.shape[1] == 5
    assert 0.3 < first.float().mean() < 0.7 and 0.3 < second.float().mean() < 0.7
    assert not torch.equal(first, second)


def _adapted_fused_grads(rank, world_size, path, sequence_parallel):
    """LoRA (biases trained too: bias="all") on GPT2 at tp=2, fused with the residual op forced when on shards;
    the trainable parameters' whole gradients."""
    import peft

    from tests.helpers import full_grads

    if sequence_parallel:
        _fused_residuals([])
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2, seed=0,
                                                               sequence_parallel=sequence_parallel)
    if sequence_parallel:
        model.fuse()
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_proj", "c_fc"], bias="all",
                                                         init_lora_weights=False))
    batch = _anchor("gpt2").batch()
    adapted.train()(**batch).loss.backward()
    return {name: grad for name, grad in full_grads(model).items() if grad is not None}


def test_fused_residual_under_an_adapter_sums_the_bias_gradient(zoo_checkpoints):
    """PEFT around a row-parallel layer whose bias the fused op adds (bias="all" trains it): on shards its gradient
    is summed over the group as without sequence parallelism."""
    pytest.importorskip("peft")
    path = os.path.join(zoo_checkpoints("gpt2"), _anchor("gpt2").key)
    expected = run_distributed(_adapted_fused_grads, 2, path, False)[0]
    actual = run_distributed(_adapted_fused_grads, 2, path, True)[0]
    assert any("c_proj.base_layer.bias" in name for name in expected) and expected.keys() == actual.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, msg=lambda m, n=name: f"{n}: {m}")
