"""oslo's eager all-reduce (what the tensor-parallel mappings run) on real gloo groups: a small CPU tensor goes in one
all-to-all round (its bytes times the world size within ``GLOO_ONE_ROUND_BYTES``), a larger one through gloo's ring
all-reduce; both give every rank the sum (or the maximum) of every rank's tensor, computed here from the ranks'
inputs, and the same bits on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from oslo.parallel.collectives import GLOO_ONE_ROUND_BYTES, eager_all_reduce
from tests.distributed import run_distributed


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)) * 8
    return values.to(dtype)


def _reduce(rank, world_size, numel, dtype, op):
    dist.init_process_group("gloo")
    calls = {"all_reduce": 0, "all_to_all_single": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in calls:
        setattr(dist, name, counting(name))
    try:
        mine = _inputs(rank, numel, dtype).view(2, -1)[:, 1:]  # not contiguous: reduced into a contiguous copy
        reduced = eager_all_reduce(mine, dist.group.WORLD, "testing", op)
        contiguous = _inputs(rank, numel, dtype)
        same = eager_all_reduce(contiguous, dist.group.WORLD, "testing", op)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    dist.destroy_process_group()
    return reduced, same is contiguous, contiguous, calls


# float32 elements. The one round holds world copies of the tensor: MEDIUM goes in one round at 2 ranks, through the
# ring at 4; LARGE through the ring at both (its non-contiguous cut too, 2 elements fewer).
SMALL = 1000
MEDIUM = 100_000
LARGE = GLOO_ONE_ROUND_BYTES // (4 * 2) + 4


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("numel, dtype, op", [
    (SMALL, torch.float32, "sum"), (SMALL, torch.float32, "max"), (SMALL, torch.bfloat16, "sum"),
    (SMALL, torch.int64, "sum"), (MEDIUM, torch.float32, "sum"), (LARGE, torch.float32, "sum"),
    (LARGE, torch.float32, "max"),
])
def test_eager_all_reduce_sums_every_rank_alike(world_size, numel, dtype, op):
    results = run_distributed(_reduce, world_size, numel, dtype, op, timeout=120)
    stacked = torch.stack([_inputs(rank, numel, dtype) for rank in range(world_size)])
    if op == "max":
        expected = stacked.amax(0)
    else:  # what any order of summing gives, to the dtype's rounding
        expected = stacked.double().sum(0)
    one_round = numel * stacked.element_size() * world_size <= GLOO_ONE_ROUND_BYTES
    for reduced, in_place, contiguous, calls in results:
        assert in_place  # a contiguous tensor is reduced in place, as dist.all_reduce does
        tol = {} if dtype != torch.bfloat16 else dict(atol=0.5, rtol=2 ** -7)  # bfloat16 rounds each partial sum
        torch.testing.assert_close(contiguous, expected.to(dtype), **tol)
        torch.testing.assert_close(reduced, expected.to(dtype).view(2, -1)[:, 1:], **tol)
        assert calls == ({"all_reduce": 0, "all_to_all_single": 2} if one_round
                         else {"all_reduce": 2, "all_to_all_single": 0})
    for reduced, _, contiguous, _ in results[1:]:  # the same bits on every rank
        assert torch.equal(contiguous, results[0][2]) and torch.equal(reduced, results[0][0])
