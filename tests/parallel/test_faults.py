"""A rank whose process ends mid-step: the survivors raise PeerLostError naming what they were doing,
the group, and the lost rank where it is known, instead of gloo's bare "Connection closed by peer"."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import oslo
from oslo.parallel import ParallelContext
from oslo.parallel.comm import run_on_all_ranks
from oslo.parallel.errors import PeerLostError, naming_timeouts
from tests.distributed import LOST_EXIT, run_distributed
from tests.helpers import tiny_gpt2_config

# What gloo says, kept in the message: the lost peer's address, its socket closed or reset.
GLOO_LOST = r"\((Connection closed by peer|Read error) \[127\.0\.0\.1\]:\d+(: Connection reset by peer)?\)"


def _end_soon(delay: float = 0.3) -> None:
    """End this process after ``delay`` seconds (the peers are inside the collective by then)."""
    time.sleep(delay)
    os._exit(LOST_EXIT)


def _lost_in_agreement(rank, world_size):
    context = ParallelContext(tensor_parallel_size=2, timeout=30)
    dist.barrier()
    if rank == 1:
        _end_soon()
    start = time.monotonic()
    with pytest.raises(PeerLostError) as info:
        run_on_all_ranks(context, lambda: None, "saving the checkpoint")
    return time.monotonic() - start, str(info.value)


def test_a_peer_that_ends_during_a_collective_is_named():
    # PeerLostError, not the 30 s timeout's error
    (_, message), _ = run_distributed(_lost_in_agreement, 2, lost={1}, timeout=60)
    assert message.startswith(
        "rank 0 lost its connection to global rank 1 (tensor-parallel rank 1) of the oslo world group (global "
        "ranks [0-1]) while saving the checkpoint ("), message
    assert re.search(GLOO_LOST, message), message
    assert "Restart every process" in message, message


def _lost_sender(rank, world_size):
    context = ParallelContext(pipeline_parallel_size=2, timeout=30)
    dist.barrier()
    if rank == 1:
        _end_soon()
    with pytest.raises(PeerLostError) as info, naming_timeouts(context, "receiving activations", peer=1):
        dist.recv(torch.empty(4), 1)
    return str(info.value)


def test_a_lost_point_to_point_peer_is_named_by_stage():
    message, _ = run_distributed(_lost_sender, 2, lost={1}, timeout=60)
    assert message.startswith("rank 0 lost its connection to global rank 1 (pipeline stage 1) while receiving "
                              "activations ("), message
    assert re.search(GLOO_LOST, message), message


def _lost_in_larger_group(rank, world_size):
    context = ParallelContext(timeout=30)  # three data-parallel replicas
    dist.barrier()
    if rank == 2:
        _end_soon()
    with pytest.raises(PeerLostError) as info, \
            naming_timeouts(context, "averaging gradients", group=context.data_parallel_group):
        dist.all_reduce(torch.ones(1000), group=context.data_parallel_group)
    return str(info.value)


def test_every_survivor_of_a_larger_group_raises():
    """In a group of three the lost rank is not known, the group is; no survivor is left waiting."""
    for message in run_distributed(_lost_in_larger_group, 3, lost={2}, timeout=60)[:2]:
        assert "lost its connection to a rank of the data-parallel group (global ranks [0-2]) while averaging " \
               "gradients (" in message, message
        assert re.search(GLOO_LOST, message), message


def _lost_before_a_model_call(rank, world_size):
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(), tensor_parallel_size=2, timeout=30)
    dist.barrier()
    if rank == 1:
        os._exit(LOST_EXIT)
    with pytest.raises(PeerLostError, match="while comparing the inputs of a model call") as info:
        model(torch.tensor([[1, 2, 3]]))
    return str(info.value)


def test_a_model_call_after_a_peer_ended_raises_peer_lost():
    message, _ = run_distributed(_lost_before_a_model_call, 2, lost={1}, timeout=60)
    assert message.startswith("rank 0 lost its connection to") and re.search(GLOO_LOST, message), message


def _lost_mid_step(rank, world_size, tp, pp):
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        tiny_gpt2_config(), tensor_parallel_size=tp, pipeline_parallel_size=pp, timeout=30)
    if rank == 1:  # ends after its first block: rank 0 waits in a tensor-parallel sum, or for a gradient
        next(m for n, m in model.named_modules() if re.search(r"\bh\.\d+$", n)).register_forward_hook(
            lambda *_: os._exit(LOST_EXIT))
    ids = torch.tensor([[1, 2, 3, 4]] * 2)
    start = time.monotonic()
    with pytest.raises(PeerLostError) as info:
        for micro_output in model(input_ids=ids, labels=ids) if pp > 1 else [model(input_ids=ids, labels=ids)]:
            micro_output.loss.backward()
    elapsed = time.monotonic() - start
    with pytest.raises(RuntimeError, match="lost its connection to global rank 1"):  # the next call: no hang
        model(input_ids=ids)
    return elapsed, str(info.value)


@pytest.mark.parametrize("tp, pp, lost", [
    (2, 1, "global rank 1 (tensor-parallel rank 1) of the tensor-parallel group (global ranks [0-1]) while summing"),
    (1, 2, "global rank 1 (pipeline stage 1) while receiving from the neighbouring pipeline stage"),
])
def test_a_peer_lost_mid_step_is_named_at_once(tp, pp, lost):
    (_, message), _ = run_distributed(_lost_mid_step, 2, tp, pp, lost={1}, timeout=60)  # PeerLostError
    assert message.startswith(f"rank 0 lost its connection to {lost}") and re.search(GLOO_LOST, message), message
