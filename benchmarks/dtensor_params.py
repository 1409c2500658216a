"""What DTensor parameters cost: a training step with oslo's DTensor parameters against the same model with
the plain shards of before (issue 16, "Must not regress"), measured in one run.

Claim: a step (forward, backward, AdamW step, zero_grad) at tensor parallel 2, and at tensor parallel 1 ×
data parallel 2 under ``DistributedDataParallel``, takes at most 3 % longer with DTensor parameters than
with plain ones. Both variants are built from the same weights on every rank; the plain one is the same
model with :func:`oslo.parallel.dtensor.undistribute_parameters` applied (what oslo models were before).
Steps alternate between the two (and which goes first); each step starts after a barrier; a step's time
is the slower rank's; the median is reported, with the ratio DTensor / plain.

Run: ``python benchmarks/dtensor_params.py``; options ``--n-layer 4 --batch 4 --seq 128 --repeats 8``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _tp_harness as bench
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import oslo
from oslo.parallel.dtensor import undistribute_parameters

TARGET = 1.03


def _rank(rank: int, world_size: int, config, tp: int, batch: int, seq: int, repeats: int) -> dict:
    def build(distributed: bool):
        model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=tp, seed=0).train()
        if not distributed:
            undistribute_parameters(model)
        call = model
        if world_size // tp > 1:
            call = DistributedDataParallel(model.gpu_modules(), process_group=model.mpu.get_data_parallel_group())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, call, optimizer

    variants = {"dtensor": build(True), "plain": build(False)}
    assert isinstance(next(variants["dtensor"][0].parameters()), torch.distributed.tensor.DTensor)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(rank // tp))

    def step(name: str) -> float:
        _, call, optimizer = variants[name]
        dist.barrier()
        start = time.perf_counter()
        call(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    for name in variants:  # warm-up
        step(name)
    times = {name: [] for name in variants}
    for i in range(repeats):
        order = ("dtensor", "plain") if i % 2 == 0 else ("plain", "dtensor")
        for name in order:
            times[name].append(step(name))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    config = bench.gpt2_config("small", n_layer=args.n_layer)
    bench.header("DTensor parameters vs plain shards, training step")
    print(f"GPT2 small width, {args.n_layer} layers, batch {args.batch} x {args.seq}; AdamW step included")
    ok = True
    for tp, world in ((2, 2), (1, 2)):
        result = bench.launch(_rank, world, config, tp, args.batch, args.seq, args.repeats)[0]
        ratio = result["dtensor"] / result["plain"]
        ok &= ratio <= TARGET
        layout = f"tp={tp}" + (f" x dp={world // tp} (DDP)" if world > tp else "")
        print(f"{layout:>18}: DTensor {result['dtensor'] * 1e3:8.1f} ms, plain {result['plain'] * 1e3:8.1f} ms, "
              f"ratio {ratio:.3f} (target <= {TARGET})")
    print(bench.verdict(ok))


if __name__ == "__main__":
    main()
