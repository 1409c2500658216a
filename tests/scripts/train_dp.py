"""The manual's data-parallel loop as a launcher runs it, for tests that start real launchers (``torchrun``,
``deepspeed``): ``python -m torch.distributed.run ... tests/scripts/train_dp.py CHECKPOINT OUT TP PP``.

Each replica trains on its rows of a fixed global batch (DDP over the data-parallel group at
pipeline_parallel_size 1; the pipeline averages itself otherwise), clips with ``model.clip_grad_norm_`` and
takes SGD steps; rank 0 writes ``OUT``: the merged weights, every rank's place (node, tensor/data-parallel
peers) and the losses."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import oslo

STEPS, ROWS, LR, MAX_NORM = 2, 8, 0.5, 0.5


def global_batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(3, 1001, (ROWS, 10), generator=generator)
    labels = input_ids.clone()
    for row, cut in enumerate([0, 4, 2, 0, 6, 1, 3, 0]):
        labels[row, :cut] = -100  # replicas' rows hold different numbers of label tokens
    return dict(input_ids=input_ids, labels=labels)


def main(path: str, out: str, tp: int, pp: int) -> None:
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=2).train()
    mpu = model.mpu
    call = DistributedDataParallel(model.gpu_modules(), process_group=mpu.get_data_parallel_group()) if pp == 1 \
        else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = ROWS // mpu.get_data_parallel_world_size()
    start = mpu.get_data_parallel_rank() * rows
    for step in range(STEPS):
        batch = {name: value[start:start + rows] for name, value in global_batch(step).items()}
        optimizer.zero_grad()
        if pp == 1:
            call(**batch).loss.backward()
        else:
            for micro_output in call(**batch):
                micro_output.loss.backward()
        model.clip_grad_norm_(MAX_NORM)
        optimizer.step()
    place = dict(rank=dist.get_rank(), node=int(os.environ["GROUP_RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                 tp_peers=dist.get_process_group_ranks(mpu.get_tensor_parallel_group()),
                 dp_peers=dist.get_process_group_ranks(mpu.get_data_parallel_group()))
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    model.save_pretrained_with_parallel(out + ".merged", save_with_merging=True)
    if dist.get_rank() == 0:
        torch.save({"places": places}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
