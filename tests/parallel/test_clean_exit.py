"""A process that let oslo initialize torch.distributed exits cleanly: oslo destroys the groups it created at
interpreter exit (``destroy_process_group_at_exit``), and never a group the user created.

Without it, a run under ``torchrun`` sometimes died after its last line with ``terminate called without an
active exception`` (exit -6, torchrun's ``ChildFailedError``). That failure is intermittent, so the runs here
only show that a real torchrun exits 0 a few times per layout; ``benchmarks/clean_exit.py --runs 30``
counts it over many runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oslo.launch import free_port
from oslo.parallel import ParallelContext
from oslo.parallel import context as context_module
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parent.parent.parent
RUNS = 2


def _groups_alive(*groups) -> list[bool]:
    return [group in dist.distributed_c10d._world.pg_map for group in groups]


def _oslo_initialized(rank, world_size):
    context = ParallelContext(tensor_parallel_size=world_size)
    groups = (context.tensor_parallel_group, context.model_parallel_group, context.world_group)
    assert dist.is_initialized() and all(_groups_alive(*groups))
    context_module.destroy_process_group_at_exit()
    return dist.is_initialized(), _groups_alive(*groups)


def test_oslo_destroys_the_default_group_it_initialized():
    assert run_distributed(_oslo_initialized, 2, timeout=60) == [(False, [False] * 3)] * 2


def _user_initialized(rank, world_size):
    dist.init_process_group("gloo")  # the user's: oslo must leave it alone
    default = dist.group.WORLD
    context = ParallelContext(tensor_parallel_size=world_size)
    groups = (context.tensor_parallel_group, context.world_group)
    dist.destroy_process_group(context.world_group)  # one of oslo's groups the user destroyed already
    context_module.destroy_process_group_at_exit()
    still = dist.is_initialized() and dist.group.WORLD is default
    value = torch.ones(1)
    dist.all_reduce(value)  # the user's group still works
    return still, _groups_alive(groups[0]), value.item()


def test_a_group_the_user_created_is_left_alone():
    """Only oslo's subgroups are destroyed; the default group is the user's to destroy."""
    assert run_distributed(_user_initialized, 2, timeout=60) == [(True, [False], 2.0)] * 2


def _replaced_by_the_user(rank, world_size):
    ParallelContext(tensor_parallel_size=world_size)  # oslo initializes the default group
    # The new group meets at a port agreed over the old one: re-using MASTER_PORT lets a fast rank reach the old
    # store (its stale keys) before the slow rank 0 has closed it, and rank 0 then waits for it forever.
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    # then the user replaces it with one of their own
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world_size)
    context_module.destroy_process_group_at_exit()
    return dist.is_initialized()


def test_a_default_group_the_user_replaced_is_left_alone():
    assert run_distributed(_replaced_by_the_user, 2, timeout=60) == [True, True]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_torchrun_exits_zero(tp, pp):
    """The real launcher, a few runs per layout (the acceptance count, 30 runs each, is the benchmark's)."""
    for run in range(RUNS):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * pp}",
             str(ROOT / "tests" / "scripts" / "clean_exit.py"), str(tp), str(pp)],
            capture_output=True, text=True, timeout=240, cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, f"run {run + 1}: exit {done.returncode}\n{done.stderr[-3000:]}"
        assert done.stdout.count(" loss ") == tp * pp, done.stdout
