"""What pipelines do beyond the zoo's parity (tests/models/test_zoo.py checks every class's micro-batch losses,
gradients, outputs, generate() and checkpoints at every layout): the loss scale and fused kernels on stages, the
split checkpoint's files, the same random initialization at every layout, failures that reach every stage,
gradient accumulation across data-parallel replicas, partitioning and gradient buckets, autocast, a resized
vocabulary, the tied copies through training, StageLayers' indexing; shown on GPT2."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers

import oslo
from oslo.parallel.pipeline import partition_layers
from tests.distributed import run_distributed
from tests.helpers import full_grads, full_params, save_reference, tiny_gpt2_config


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm-4-layers")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=4), path)
    return str(path)


def _batch(seed=1, batch=4, length=10, vocab=1001):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding in one row
    input_ids[1, :3] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _train_step(rank, world_size, path, tp, micro_batch_size, scale, fuse=False):
    pp = world_size // tp
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=micro_batch_size
    ).train()
    if fuse:
        model.fuse()
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    batch = _batch()

    losses = []
    for micro_output in model(**batch):
        losses.append(micro_output.loss.detach())
        (micro_output.loss * scale).backward()
    # Each micro-batch reports its own loss; the gradients are those of the whole batch's loss.
    with torch.no_grad():
        expected = [reference(**{k: v[i : i + micro_batch_size] for k, v in batch.items()}).loss
                    for i in range(0, 4, micro_batch_size)]
    assert len(losses) == len(expected) == 4 // micro_batch_size
    for ours, theirs in zip(losses, expected, strict=True):  # on every stage, not only the last
        torch.testing.assert_close(ours, theirs)
    (reference(**batch).loss * scale).backward()

    def check_grads():
        grads = full_grads(model)
        theirs = {n: p.grad for n, p in reference.named_parameters()}
        theirs["lm_head.weight"] = theirs["transformer.wte.weight"]  # tied in transformers
        for name, grad in grads.items():
            torch.testing.assert_close(grad, theirs[name], msg=lambda m, n=name: f"gradient of {n}: {m}")
        return sorted(grads)

    names = check_grads()
    # Clipping sees the whole model's norm (every stage, the tied weight once) and scales alike.
    total = model.clip_grad_norm_(0.05)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    check_grads()
    return names


def test_fused_kernels_on_pipeline_stages(lm_checkpoint):
    """fuse() switches each stage's own blocks; the schedule's losses and gradients are unchanged."""
    run_distributed(_train_step, 4, lm_checkpoint, 2, 2, 1.0, True)


def test_scaled_backward_scales_every_stage(lm_checkpoint):
    """A loss scale (as GradScaler applies) reaches the stages that only receive gradients."""
    run_distributed(_train_step, 2, lm_checkpoint, 1, 2, 8.0)


def _inference(rank, world_size, path, tp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp
    )
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    batch = _batch(seed=3)
    with torch.no_grad():
        expected = reference(**batch)
        actual = model(**batch)
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    without_labels = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert without_labels.loss is None
    torch.testing.assert_close(without_labels.logits, expected.logits)
    # Its outputs carry no gradient to the stages: a loss computed from them fails, on every stage, saying so.
    with pytest.raises(RuntimeError, match="call without labels under pipeline parallelism"):
        without_labels.logits.logsumexp(-1).mean().backward()
    with torch.no_grad():
        assert model(**batch, gather_logits=False).logits is None


def test_no_gradient_pass_returns_outputs_on_every_stage(lm_checkpoint):
    """Every stage gets the outputs (at every layout: tests/models/test_zoo.py); without labels no loss, and a
    backward from the logits is refused; gather_logits=False returns none."""
    run_distributed(_inference, 4, lm_checkpoint, 2)


def _a_head_of_ones_own(rank, world_size, path):
    """BertModel at pp=2 under a classifier of the user's: with the model trainable the backward is refused (it
    would train the classifier alone); frozen, the classifier trains as on transformers' BertModel."""
    model = oslo.BertModel.from_pretrained_with_parallel(path, pipeline_parallel_size=world_size).train()
    reference = transformers.BertModel.from_pretrained(path).train()
    ids = torch.tensor([[2, 5, 6, 7, 3], [2, 9, 10, 11, 3]])
    labels = torch.tensor([0, 1])
    torch.manual_seed(0)
    head = torch.nn.Linear(reference.config.hidden_size, 2)
    theirs = copy.deepcopy(head)

    loss = torch.nn.functional.cross_entropy(head(model(input_ids=ids).pooler_output), labels)
    with pytest.raises(RuntimeError, match="cannot train the model"):
        loss.backward()
    head.zero_grad()

    model.requires_grad_(False)
    reference.requires_grad_(False)
    torch.nn.functional.cross_entropy(head(model(input_ids=ids).pooler_output), labels).backward()
    torch.nn.functional.cross_entropy(theirs(reference(input_ids=ids).pooler_output), labels).backward()
    torch.testing.assert_close(head.weight.grad, theirs.weight.grad)
    torch.testing.assert_close(head.bias.grad, theirs.bias.grad)
    return True


def test_a_loss_of_ones_own_on_pipeline_outputs(tmp_path):
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=16,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    save_reference(transformers.BertModel, config, tmp_path)
    assert run_distributed(_a_head_of_ones_own, 2, str(tmp_path)) == [True, True]


def _save(rank, world_size, path, target, tp, merged):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp
    )
    model.save_pretrained_with_parallel(target, save_with_merging=merged)
    return {n: p for n, p in full_params(model).items()}


def _load_split(rank, world_size, path, tp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp
    )
    return full_params(model)


def test_split_save_round_trips(lm_checkpoint, tmp_path):
    saved = run_distributed(_save, 4, lm_checkpoint, str(tmp_path), 2, False)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["config.json", "generation_config.json", "model_parallel.index.json"]
        + [f"model_tp={t}_pp={p}.safetensors" for t in range(2) for p in range(2)]
    )
    index = json.loads((tmp_path / "model_parallel.index.json").read_text())
    assert index["pipeline_parallel_size"] == 2
    assert "transformer.h.0.attn.c_attn.weight" in index["files"]["model_tp=1_pp=0.safetensors"]
    assert "transformer.h.3.attn.c_attn.weight" in index["files"]["model_tp=1_pp=1.safetensors"]
    assert index["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    loaded = run_distributed(_load_split, 4, str(tmp_path), 2)
    for before, after in zip(saved, loaded, strict=True):
        assert before.keys() == after.keys()
        for name in before:
            torch.testing.assert_close(before[name], after[name], rtol=0, atol=0)


def _from_config(rank, world_size, target, tp):
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        tiny_gpt2_config(n_layer=4), tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp, seed=5
    )
    model.save_pretrained_with_parallel(target, save_with_merging=True)


def test_random_init_is_the_same_at_every_layout(tmp_path):
    run_distributed(_from_config, 1, str(tmp_path / "single"), 1)
    run_distributed(_from_config, 4, str(tmp_path / "tp2pp2"), 2)
    _assert_same_merged(tmp_path / "single", tmp_path / "tp2pp2")


def _assert_same_merged(first, second) -> None:
    """Two merged saves hold the same tensors, bit for bit."""
    a = transformers.GPT2LMHeadModel.from_pretrained(str(first)).state_dict()
    b = transformers.GPT2LMHeadModel.from_pretrained(str(second)).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def _bad_micro_batch(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2, micro_batch_size=3)
    with pytest.raises(ValueError, match=r"batch size 4 is not a multiple of micro_batch_size=3"):
        next(iter(model(**_batch())))
    model.set_micro_batch_size(2)
    with pytest.raises(RuntimeError, match="micro-batch 0 was not backpropagated on pipeline stage 1"):
        for _ in model(**_batch()):  # no backward: the last stage notices, and tells the first
            pass
    with pytest.raises(NotImplementedError, match="output_hidden_states"):
        model(**_batch(), output_hidden_states=True)


def test_bad_micro_batches_and_skipped_backward_fail_every_stage(lm_checkpoint):
    run_distributed(_bad_micro_batch, 2, lm_checkpoint)


def _skipped_backward(rank, world_size, path, skipped):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=world_size)
    with pytest.raises(RuntimeError, match=f"micro-batch {skipped} was not backpropagated on pipeline stage 3"):
        for i, micro_output in enumerate(model(**_batch())):
            if i < skipped:
                micro_output.loss.backward()
    return model.mpu.get_pipeline_parallel_rank()


@pytest.mark.parametrize("skipped", [0, 2])
def test_skipped_backward_reaches_every_stage_of_four(lm_checkpoint, skipped):
    """The failure travels from the last stage through the middle ones, which still have activations
    in flight, to the first: every stage raises, none waits. (Skipping micro-batch 0 aborts before the
    first gradient is sent, skipping micro-batch 2 after: the failure then replaces a packed tensor.)"""
    assert run_distributed(_skipped_backward, 4, lm_checkpoint, skipped, timeout=60) == [0, 1, 2, 3]


def _data_parallel_accumulation(rank, world_size, path, wrap):
    """tp 1 x pp 2 x dp 2, two batches accumulated before the optimizer step: the gradients are those
    transformers accumulates over the two global batches (both replicas' rows), and wte/lm_head are
    not counted twice; the same with the model wrapped in DistributedDataParallel, as the manual does."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2, micro_batch_size=2)
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    replica = model.mpu.get_data_parallel_rank()
    call = model
    if wrap:
        call = torch.nn.parallel.DistributedDataParallel(
            model.gpu_modules(), process_group=model.mpu.get_data_parallel_group()
        )
    for step in range(2):
        for micro_output in call(**_batch(seed=10 * step + replica)):
            micro_output.loss.backward()
    for step in range(2):
        batches = [_batch(seed=seed) for seed in (10 * step, 10 * step + 1)]
        reference(**{k: torch.cat([b[k] for b in batches]) for k in batches[0]}).loss.backward()
    theirs = {n: p.grad for n, p in reference.named_parameters()}
    theirs["lm_head.weight"] = theirs["transformer.wte.weight"]
    for name, grad in full_grads(model).items():  # the DTensors' whole gradients (tensor_parallel_size 1 here)
        torch.testing.assert_close(grad, theirs[name], msg=lambda m, n=name: f"gradient of {n}: {m}")


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "ddp"])
def test_data_parallel_replicas_and_accumulated_batches(lm_checkpoint, wrap):
    run_distributed(_data_parallel_accumulation, 4, lm_checkpoint, wrap)


HEADS = {
    "GPT2Model": ({}, None),
    "GPT2DoubleHeadsModel": ({}, "labels"),
    "GPT2ForSequenceClassification": ({"num_labels": 3}, "labels"),
    "GPT2ForTokenClassification": ({"num_labels": 5}, "labels"),
    "GPT2ForQuestionAnswering": ({}, "start_positions"),
}


def _head_batch(head):
    batch = _batch(seed=6, batch=4, length=8)
    input_ids, attention_mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    if head == "GPT2Model":
        return dict(input_ids=input_ids, attention_mask=attention_mask)
    if head == "GPT2DoubleHeadsModel":
        choices = input_ids.view(4, 1, 8).expand(4, 2, 8).contiguous()
        return dict(input_ids=choices, mc_token_ids=torch.tensor([[7, 6]] * 4), labels=choices)
    if head == "GPT2ForSequenceClassification":
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 2, 1, 1]))
    if head == "GPT2ForTokenClassification":
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels.clamp(-100, 4))
    return dict(input_ids=input_ids, attention_mask=attention_mask, start_positions=torch.tensor([1, 4, 7, 2]),
                end_positions=torch.tensor([3, 7, 7, 5]))


def _double_heads_mc_training(rank, world_size, path):
    model = oslo.GPT2DoubleHeadsModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2)
    with pytest.raises(NotImplementedError, match="pass labels without mc_labels"):
        model(**_head_batch("GPT2DoubleHeadsModel"), mc_labels=torch.tensor([0, 1, 1, 0]))


def test_double_heads_training_on_mc_labels_is_refused(tmp_path):
    save_reference(transformers.GPT2DoubleHeadsModel, tiny_gpt2_config(n_layer=4), tmp_path)
    run_distributed(_double_heads_mc_training, 2, str(tmp_path))


@pytest.mark.parametrize(
    "layers, stages, first, last, expected",
    [
        (24, 4, 0, 0, [6, 6, 6, 6]),
        (5, 2, 0, 0, [3, 2]),  # uniform: the earlier stage takes the extra block
        (7, 3, 0, 0, [3, 2, 2]),
        # gpt2-medium LM: embeddings ~4.17 blocks on the first stage, the tied head copy ~4.09 on the last
        (24, 4, 4.17, 4.09, [4, 8, 8, 4]),
        (24, 2, 4.17, 4.09, [12, 12]),
        (24, 2, 4.17, 0.0, [10, 14]),  # GPT2Model: nothing but ln_f after the blocks
        (4, 4, 2.6, 2.6, [1, 1, 1, 1]),  # every stage keeps at least one block
    ],
)
def test_partition_balances_parameters(layers, stages, first, last, expected):
    ranges = partition_layers(layers, stages, first, last)
    assert [len(r) for r in ranges] == expected
    assert [i for r in ranges for i in r] == list(range(layers))  # contiguous, in order, complete


def test_gradient_buckets_group_by_dtype_and_size():
    from oslo.parallel.data_parallel import _gradient_buckets

    grads = [torch.zeros(10), torch.zeros(4, dtype=torch.float16), torch.zeros(20), torch.zeros(30), torch.zeros(2)]
    buckets = list(_gradient_buckets(grads, bucket_bytes=100))  # a bucket closes once it reaches 100 bytes
    assert [[g.numel() for g in bucket] for bucket in buckets] == [[4], [10, 20], [30], [2]]
    assert [id(g) for bucket in buckets[1:] for g in bucket] == [id(grads[i]) for i in (0, 2, 3, 4)]  # in order


def _resized(rank, world_size, path, tp, target):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp, resize_token_embeddings=1100, seed=3
    )
    model.save_pretrained_with_parallel(target, save_with_merging=True)
    params = full_params(model)
    return {name: params[name] for name in ("transformer.wte.weight", "lm_head.weight") if name in params}


def test_resized_vocabulary_is_the_same_on_both_copies_and_at_every_layout(lm_checkpoint, tmp_path):
    """New rows of wte (first stage) and of its copy in lm_head (last stage) come from the same seed."""
    run_distributed(_resized, 1, lm_checkpoint, 1, str(tmp_path / "single"))
    stages = run_distributed(_resized, 4, lm_checkpoint, 2, str(tmp_path / "tp2pp2"))
    wte, lm_head = stages[0]["transformer.wte.weight"], stages[-1]["lm_head.weight"]
    assert wte.shape == (1100, 32)
    torch.testing.assert_close(lm_head, wte, rtol=0, atol=0)
    _assert_same_merged(tmp_path / "single", tmp_path / "tp2pp2")


def _autocast_step(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2, micro_batch_size=2)
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    batch = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # around the loop, as a user writes it
        losses = [out.loss.detach() for out in model(**batch) if out.loss.backward() is None]
        expected = [reference(**{k: v[i : i + 2] for k, v in batch.items()}).loss.detach() for i in (0, 2)]
    # bfloat16 matmuls: torch.testing's bfloat16 tolerances (rtol 1.6e-2) on float32 losses.
    for ours, theirs in zip(losses, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1.6e-2, atol=1e-5)
    full_precision = reference(**{k: v[:2] for k, v in batch.items()}).loss.detach()
    assert not torch.equal(losses[0], full_precision)  # autocast reached the stages' forward passes
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_autocast_around_the_micro_batch_loop(lm_checkpoint):
    run_distributed(_autocast_step, 2, lm_checkpoint)


def _train_with_dropout(rank, world_size, path, seed):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=2, pipeline_parallel_size=2, micro_batch_size=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, seed=seed,
    ).train()
    optimizer = torch.optim.AdamW(model.gpu_parameters(), lr=1e-2)
    # The ranks' global RNGs differ: with a seed the model's own streams decide the masks; without one torch's
    # generator does, each tensor-parallel group taking its first rank's state.
    torch.manual_seed(rank)
    for seed in range(3):
        optimizer.zero_grad()
        for micro_output in model(**_batch(seed=seed)):
            micro_output.loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("seed", [None, 3], ids=["torch-generator", "own-streams"])
def test_copies_stay_identical_through_training(lm_checkpoint, seed):
    """Three AdamW steps with dropout at tp 2 x pp 2: replicated parameters stay bit-identical across
    tensor-parallel ranks, and the last stage's lm_head stays bit-identical to the first stage's wte."""
    ranks = run_distributed(_train_with_dropout, 4, lm_checkpoint, seed)
    for stage in (0, 1):
        first, second = ranks[2 * stage], ranks[2 * stage + 1]
        for name in first:
            if name.endswith(("ln_1.weight", "ln_2.bias", "ln_f.weight", "c_proj.bias", "wpe.weight")):
                torch.testing.assert_close(first[name], second[name], rtol=0, atol=0, msg=name)
    for tp_rank in (0, 1):  # each tensor-parallel rank holds the same vocabulary shard on both stages
        wte, lm_head = ranks[tp_rank]["transformer.wte.weight"], ranks[2 + tp_rank]["lm_head.weight"]
        torch.testing.assert_close(wte, lm_head, rtol=0, atol=0)
    original = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint).transformer.ln_f.weight
    assert not torch.equal(ranks[2]["transformer.ln_f.weight"], original)  # the steps did change the weights


def _indexing(rank, world_size, path):
    pp = world_size
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=pp)
    layers = model.transformer.h
    if pp == 1:  # like the unsplit model's nn.ModuleList
        assert layers[-1] is layers[3] and [id(m) for m in layers[1:3]] == [id(layers[1]), id(layers[2])]
        assert isinstance(layers[:2], torch.nn.ModuleList) and len(layers[::2]) == 2
        with pytest.raises(IndexError, match="out of range for a model of 4 layers"):
            layers[4]
        return None
    stage = model.mpu.get_pipeline_parallel_rank()  # stage 0 holds blocks 0 and 1, stage 1 blocks 2 and 3
    if stage == 0:
        assert layers[-3] is layers[1] and list(layers[:2]) == [layers[0], layers[1]]
    else:
        assert layers[-1] is layers[3] and list(layers[2:]) == [layers[2], layers[3]]
    with pytest.raises(IndexError, match=r"layer \d is not on this pipeline stage, which holds layers"):
        layers[-1 if stage == 0 else 0]
    with pytest.raises(IndexError, match="is not on this pipeline stage"):
        layers[:]
    return stage


@pytest.mark.parametrize("pp", [1, 2])
def test_stage_layers_take_negative_indices_and_slices(lm_checkpoint, pp):
    run_distributed(_indexing, pp, lm_checkpoint)


def _loss_of_a_pipeline_step(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2).train()
    step = model(**_batch())
    with pytest.raises(AttributeError, match="returns the micro-batch outputs of a training step.*for micro_output in"):
        step.loss  # noqa: B018
    with pytest.raises(TypeError, match="not subscriptable.*micro_output.loss.backward"):
        step[0]
    for micro_output in step:
        micro_output.loss.backward()


def test_loss_of_a_pipeline_training_step_says_to_iterate(lm_checkpoint):
    run_distributed(_loss_of_a_pipeline_step, 2, lm_checkpoint)


def _classification_problem_type(rank, world_size, path, target):
    model = oslo.GPT2ForSequenceClassification.from_pretrained_with_parallel(
        path, pipeline_parallel_size=2, micro_batch_size=2
    ).train()
    assert model.config.problem_type is None
    for micro_output in model(**_head_batch("GPT2ForSequenceClassification")):
        micro_output.loss.backward()
    model.save_pretrained_with_parallel(target, save_with_merging=True)  # rank 0 (first stage) writes config.json
    return model.config.problem_type


def test_problem_type_is_decided_on_every_stage(tmp_path):
    save_reference(transformers.GPT2ForSequenceClassification, tiny_gpt2_config(n_layer=4, num_labels=3),
                   tmp_path / "source")
    types = run_distributed(_classification_problem_type, 2, str(tmp_path / "source"), str(tmp_path / "out"))
    assert types == ["single_label_classification"] * 2
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["problem_type"] == "single_label_classification"


def _frozen_first_stage(rank, world_size, path, interleaved):
    options = dict(virtual_pipeline_size=2) if interleaved else {}
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2, **options)
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    frozen = ("transformer.wte.", "transformer.wpe.", "transformer.h.0.", "transformer.h.1.")
    for net in (model, reference):
        for name, param in net.named_parameters():
            param.requires_grad_(not name.startswith(frozen))
    batch = _batch()
    reference(**batch).loss.backward()
    for micro_output in model(**batch):  # the manual's loop, on every stage
        micro_output.loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    actual = {name: grad for name, grad in full_grads(model).items() if grad is not None}
    if model.parallel_context.pipeline_parallel_rank == 0 and not interleaved:
        assert not actual  # nothing on the first stage trains
    for name, grad in actual.items():
        torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"{n}: {m}")
    return sorted(actual)


@pytest.mark.parametrize("interleaved", [False, True], ids=["1f1b", "interleaved"])
def test_a_frozen_first_stage_runs_the_manual_loop(tmp_path, interleaved):
    """Fine-tuning the top of a model: the first stage's layers are all frozen, so none of its outputs needs a
    gradient; its micro-batch losses still take ``backward()`` (recording the seed, computing nothing), and the
    other stages' gradients are those of one process."""
    config = tiny_gpt2_config(n_layer=4, tie_word_embeddings=False)
    save_reference(transformers.GPT2LMHeadModel, config, tmp_path)
    names = run_distributed(_frozen_first_stage, 2, str(tmp_path), interleaved, timeout=120)
    trained = {name for stage in names for name in stage}
    assert trained and not any(name.startswith("transformer.h.0.") for name in trained)


def _freeze_one_copy(rank, world_size, path):
    """Freeze the input embeddings as a transformers user does (``get_input_embeddings()``: the first stage only
    has them), train two steps, unfreeze through the last stage's copy (``get_output_embeddings()``), train one
    more."""
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, pipeline_parallel_size=2, micro_batch_size=2)
    model.train()
    for each in (reference, model):
        if each.get_input_embeddings() is not None:
            each.get_input_embeddings().weight.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = torch.optim.SGD(reference.parameters(), lr=0.5)
    flags = []
    for seed in range(3):
        if seed == 2:
            for each in (reference, model):
                if each.get_output_embeddings() is not None:
                    each.get_output_embeddings().weight.requires_grad_(True)
        optimizer.zero_grad()
        for micro_output in model(**_batch(seed=seed)):
            micro_output.loss.backward()
        optimizer.step()
        expected.zero_grad()
        reference(**_batch(seed=seed)).loss.backward()
        expected.step()
        tied = model.transformer.wte.weight if rank == 0 else model.lm_head.weight
        flags.append(tied.requires_grad)
    ours = full_params(model)
    weights = {name: (ours[name], param.detach())
               for name, param in reference.named_parameters(remove_duplicate=False) if name in ours}
    return flags, weights


def test_freezing_one_copy_of_a_tied_weight_freezes_both(lm_checkpoint):
    """In transformers GPT2's wte and lm_head are one parameter: freezing either freezes both. Under pipelines they
    are two copies on two stages; the step tells the other stage, and the weights stay transformers' (SGD steps:
    the frozen copy is not updated on either stage, and is again once unfrozen)."""
    for flags, weights in run_distributed(_freeze_one_copy, 2, lm_checkpoint, timeout=180):
        assert flags == [False, False, True]
        assert {"transformer.wte.weight", "lm_head.weight"} & set(weights)
        for name, (ours, theirs) in weights.items():
            torch.testing.assert_close(ours, theirs, msg=lambda m, n=name: f"{n}: {m}")
