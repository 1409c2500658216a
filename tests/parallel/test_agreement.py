"""What the ranks of one model must share: the same inputs on every tensor/pipeline-parallel rank (a
clear error on every rank otherwise, never a silent mix or a collective mismatch), and collectives
that fail within the model's timeout when a rank never joins."""

from __future__ import annotations

import os
import time

import pytest
import torch
import transformers

import oslo
from oslo.parallel.agreement import InputMismatchError, check_same_inputs
from oslo.parallel.comm import PeerTimeoutError
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm-agreement")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_layer=2), path)
    return str(path)


def _mismatch(rank, world_size, path, tp, case):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp
    ).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1001, (4, 10), generator=generator)
    labels = ids.clone()
    if case == "batches" and rank == 1:  # a sampler sharded over the world instead of the data-parallel group
        ids = torch.randint(3, 1001, (4, 10), generator=generator)
    if case == "lengths" and rank == 1:
        ids = ids[:, :8]
        labels = labels[:, :8]
    if case == "labels" and rank == world_size - 1:
        labels = labels.flip(0)
    with pytest.raises(InputMismatchError) as info:
        output = model(input_ids=ids, labels=labels)
        for micro_output in output if world_size // tp > 1 else [output]:
            micro_output.loss.backward()
    return str(info.value)


@pytest.mark.parametrize("case", ["batches", "lengths"])
def test_different_batches_on_tensor_parallel_ranks_raise_on_every_rank(lm_checkpoint, case):
    messages = run_distributed(_mismatch, 2, lm_checkpoint, 2, case, timeout=60)
    for message in messages:
        assert "global rank 1 (tensor-parallel rank 1) got [" in message, message
        assert "input_ids" in message and "DistributedSampler" in message, message
    if case == "lengths":
        assert "shape (4, 8)" in messages[0] and "shape (4, 10)" in messages[0]


def test_different_labels_on_pipeline_stages_raise_on_every_stage(lm_checkpoint):
    messages = run_distributed(_mismatch, 2, lm_checkpoint, 1, "labels", timeout=60)
    for message in messages:
        assert "global rank 1 (pipeline stage 1) got [labels: tensor int64 of shape (4, 10)" in message, message


def _options(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2)
    ids = torch.randint(3, 1001, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(InputMismatchError) as info:
        model(input_ids=ids, output_hidden_states=rank == 0)
    return str(info.value)


def test_different_options_raise_on_every_rank(lm_checkpoint):
    messages = run_distributed(_options, 2, lm_checkpoint, timeout=60)
    assert all("output_hidden_states: False" in m and "output_hidden_states: True" in m for m in messages)


def _fingerprints(rank, world_size):
    """The check on its own: equal inputs pass (tensors, options, nested tuples); a changed value of
    any dtype is caught."""
    context = oslo.ParallelContext(tensor_parallel_size=world_size)
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    check_same_inputs(context, (x,), {"mask": x > 3, "flag": True, "pair": (x, 2), "none": None})
    errors = 0
    for value in (x.to(torch.bfloat16), x.long(), x > 3):
        changed = value.clone()
        if rank == 1:
            changed.view(-1)[5] = 0
        try:
            check_same_inputs(context, (changed,), {})
        except InputMismatchError:
            errors += 1
    return errors


def test_fingerprint_catches_one_changed_value_of_any_dtype():
    assert run_distributed(_fingerprints, 2, timeout=60) == [3, 3]


def _stay_away_until(marker: str, limit: float = 30.0) -> None:
    """What the rank that never joins does: wait (without communicating) until its peer is done."""
    deadline = time.monotonic() + limit
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)


def _skip_save(rank, world_size, path, target):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2, timeout=3)
    marker = os.path.join(target, "rank0-done")
    if rank == 1:
        _stay_away_until(marker)  # never joins the save (and outlives rank 0's wait)
        return None
    start = time.monotonic()
    try:
        with pytest.raises(PeerTimeoutError) as info:
            model.save_pretrained_with_parallel(target)
    finally:
        open(marker, "w").close()
    return time.monotonic() - start, str(info.value)


def test_a_collective_one_rank_never_joins_fails_within_the_timeout(lm_checkpoint, tmp_path):
    (elapsed, message), _ = run_distributed(_skip_save, 2, lm_checkpoint, str(tmp_path), timeout=60)
    assert 2.5 < elapsed < 8, elapsed
    assert "rank 0 waited 0:00:03" in message and "saving and initialization run on every rank" in message, message


def _lone_forward(rank, world_size, path, marker):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2, timeout=2)
    if rank == 1:
        _stay_away_until(marker)
        return None
    try:
        with pytest.raises(PeerTimeoutError, match="comparing the inputs of a model call"):
            model(input_ids=torch.tensor([[5, 6, 7]]))
    finally:
        open(marker, "w").close()
    return "raised"


def test_a_forward_on_one_rank_only_fails_within_the_timeout(lm_checkpoint, tmp_path):
    marker = str(tmp_path / "rank0-done")
    assert run_distributed(_lone_forward, 2, lm_checkpoint, marker, timeout=60)[0] == "raised"


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout must be positive"):
        oslo.ParallelContext(timeout=0)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or a number of seconds"):
        oslo.ParallelContext(timeout="10m")


def _generate_mismatch(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2)
    prompt = torch.tensor([[5, 6, 7, 8 + rank]])  # a prompt that differs on rank 1
    with pytest.raises(InputMismatchError, match="positional argument 0: tensor int64 of shape"):
        model.generate(prompt, max_new_tokens=3, pad_token_id=0)
    same = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, pad_token_id=0)
    return same.tolist()


def test_generate_checks_its_prompt_on_every_rank(lm_checkpoint):
    first, second = run_distributed(_generate_mismatch, 2, lm_checkpoint, timeout=60)
    assert first == second


def _errors_carried(rank, world_size):
    """An error one rank found in its inputs is raised on every rank, by the one all-gather."""
    context = oslo.ParallelContext(tensor_parallel_size=world_size)
    x = torch.arange(6)
    raised = []
    for failing in ({1}, {0, 1}):
        error = IndexError(f"bad ids on rank {rank}") if rank in failing else None
        with pytest.raises(IndexError) as info:
            check_same_inputs(context, (x,), {}, error)
        raised.append(str(info.value))
    check_same_inputs(context, (x,), {})  # the ranks are still in step
    return raised


def test_an_input_error_of_one_rank_is_raised_on_every_rank():
    (alone0, both0), (alone1, both1) = run_distributed(_errors_carried, 2, timeout=60)
    assert alone1 == "bad ids on rank 1" and both0 == "bad ids on rank 0" and both1 == "bad ids on rank 1"
    assert alone0.startswith("global rank 1 (tensor-parallel rank 1): bad ids on rank 1 (this rank, global rank 0"), \
        alone0
