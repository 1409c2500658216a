"""The training state with torch's tools (issue 16): optimizer-state bytes per rank with FSDP2, and the time
and memory of a DCP save and load of the whole training state.

Part a — FSDP2. GPT2 of gpt2-medium width (4 layers), AdamW after one step: the optimizer-state bytes a
rank holds with ``fully_shard`` over the data-parallel mesh, divided by the bytes it holds without FSDP2
(each replica keeps the whole state of its tensor-parallel shard). Claim: about 1 / dp (FSDP2 pads every
tensor to a multiple of dp rows: ≤ 1.05 / dp).

Part b — DCP. A gpt2-medium-shaped model (24 layers) at tp=2 with its AdamW state: ``oslo.save_training_state``
(DCP) and ``oslo.load_training_state`` at tp=2 — wall time and peak RSS above the rank's RSS before the
call — next to ``save_pretrained_with_parallel(save_with_merging=True)`` of the model alone (the merged
safetensors save). Reported, no target: the training state is three times the weights' bytes (weights,
two moments), so the reference is the merged save's time per byte.

Run: ``python benchmarks/training_state.py``; ``--part a`` or ``--part b``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import _tp_harness as bench
import torch
import torch.distributed as dist

import oslo


def _optimizer_bytes(optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def fsdp_rank(rank: int, world_size: int, config, tp: int, fsdp: bool) -> int:
    from torch.distributed.fsdp import fully_shard

    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=tp, seed=0).train()
    if fsdp:
        for block in model.transformer.h:
            fully_shard(block, mesh=model.device_mesh["dp"])
        fully_shard(model, mesh=model.device_mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return _optimizer_bytes(optimizer)


def part_a() -> bool:
    config = bench.gpt2_config("medium", n_layer=4)
    print("a) AdamW state bytes per rank, gpt2-medium width, 4 layers")
    ok = True
    for tp, world in ((1, 2), (1, 4), (2, 4)):
        dp = world // tp
        plain = max(bench.launch(fsdp_rank, world, config, tp, False))
        sharded = max(bench.launch(fsdp_rank, world, config, tp, True))
        ratio = sharded / plain
        ok &= ratio <= 1.05 / dp
        print(f"   tp={tp} dp={dp}: without FSDP2 {bench.mib(plain)}, with {bench.mib(sharded)}: "
              f"{ratio:.3f} (1/dp = {1 / dp:.3f}; target <= {1.05 / dp:.3f})")
    return ok


def dcp_rank(rank: int, world_size: int, config, directory: str) -> dict:
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    weights = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # DTensors
    result = {"state bytes": _optimizer_bytes(optimizer) + weights}

    def measured(name: str, call) -> None:
        dist.barrier()
        bench.reset_peak_rss()
        before = bench.proc_status("VmRSS")["VmRSS"]
        start = time.perf_counter()
        call()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        result[name] = (elapsed.item(), bench.proc_status("VmHWM")["VmHWM"] - before)

    measured("DCP save", lambda: oslo.save_training_state(f"{directory}/state", model, optimizer, step=1))
    measured("DCP load", lambda: oslo.load_training_state(f"{directory}/state", model, optimizer))
    measured("merged save (model only)", lambda: model.save_pretrained_with_parallel(
        f"{directory}/merged", save_with_merging=True))
    return result


def part_b() -> bool:
    config = bench.gpt2_config("medium")
    directory = tempfile.mkdtemp(prefix="oslo-dcp-")
    try:
        results = bench.launch(dcp_rank, 2, config, directory)
        sizes = {name: sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(
            os.path.join(directory, name)) for f in files) for name in ("state", "merged")}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("b) gpt2-medium shape (24 layers), tp=2: the training state (weights + AdamW moments) with DCP vs the "
          "merged safetensors save of the weights")
    print(f"   on disk: DCP {bench.mib(sizes['state'])}, merged {bench.mib(sizes['merged'])}")
    for name in ("DCP save", "DCP load", "merged save (model only)"):
        seconds = max(r[name][0] for r in results)
        peak = max(r[name][1] for r in results)
        size = sizes["state" if name.startswith("DCP") else "merged"]
        print(f"   {name:>24}: {seconds:6.2f} s ({size / seconds / 2**20:7.1f} MiB/s), peak RSS above start "
              f"{bench.mib(peak)} on the worst rank (its state: {bench.mib(results[0]['state bytes'])})")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["a", "b", "all"], default="all")
    args = parser.parse_args()
    bench.header("training state: FSDP2 optimizer bytes, DCP save/load")
    ok = True
    if args.part in ("a", "all"):
        ok &= part_a()
    if args.part in ("b", "all"):
        ok &= part_b()
    print(bench.verdict(ok))


if __name__ == "__main__":
    main()
