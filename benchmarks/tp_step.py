"""A tensor-parallel training step against one transformers process (issue 17), alternated step by step.

Workload, as a new user trains: GPT2 at gpt2-medium width (1024, 16 heads), ``--n-layer`` blocks (default 2),
vocab 50257, a batch of 4 x 128 tokens, ``model(input_ids=ids, labels=ids).loss.backward()`` (the default
training call: no logits gather), float32, one torch thread per process.

Two gloo ranks are forked once and keep their models: rank 0 also holds the transformers model with the same
weights. Each round runs, in an order that rotates, (a) one transformers step on rank 0 alone (rank 1 idle
at a barrier) and (b) one oslo step at tp=2 on both ranks; a step's time is the slowest rank's. The claim is on
the median of the per-round ratios t(transformers) / t(oslo tp=2): this machine's speed drifts ±15 % within
minutes, and only variants measured side by side in the same processes compare. The ideal is 2.0.

A per-category breakdown of one oslo step on rank 0 (``torch.profiler``, CPU self time: matmuls, the loss,
collectives (including waiting for the other rank), the embedding's backward, allocation and copies, the rest)
is printed next to the ratio.

Run: ``python benchmarks/tp_step.py`` (``--rounds 10 --n-layer 2 --batch 4 --seq 128``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _tp_harness as bench
import torch
import torch.distributed as dist
import transformers

import oslo

_CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                "aten::_scaled_dot_product", "aten::baddbmm")),
    # oslo's mappings and its column-parallel linear's backward run their collectives inside these autograd
    # functions (self time: the all-reduce and the wait for the other rank; the matmuls are counted above)
    ("collectives + waiting", ("gloo", "all_reduce", "allreduce", "all_gather", "c10d", "record_param_comms",
                               "TensorParallel", "ColumnParallelLinearBackward")),
    ("loss", ("aten::exp", "aten::amax", "aten::max", "aten::log", "aten::gather", "aten::sum", "aten::div_",
              "aten::sub")),
    ("embedding backward", ("aten::embedding_dense_backward", "aten::index_add", "aten::embedding_backward")),
    ("allocation + copies", ("aten::empty", "aten::zeros", "aten::copy_", "aten::clone", "aten::cat",
                             "aten::contiguous", "aten::fill_", "aten::zero_")),
)


def rank_fn(rank: int, world_size: int, n_layer: int, batch: int, seq: int, rounds: int) -> dict:
    config = bench.gpt2_config("medium", n_layer=n_layer)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0).train()
    reference = None
    if rank == 0:
        merged = f"/tmp/oslo-tp-step-{dist.get_world_size()}"
    else:
        merged = None
    # transformers' model with oslo's weights (rank 0 only): through a merged checkpoint
    paths = [merged]
    dist.broadcast_object_list(paths, src=0)
    model.save_pretrained_with_parallel(paths[0], save_with_merging=True)
    if rank == 0:
        reference = transformers.GPT2LMHeadModel.from_pretrained(paths[0]).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def oslo_step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    def reference_step() -> None:
        reference.zero_grad(set_to_none=True)
        reference(input_ids=ids, labels=ids).loss.backward()

    def timed(step, alone: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        if not alone or rank == 0:
            step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    oslo_step()  # warm-up
    if rank == 0:
        reference_step()
    ratios, hf_times, oslo_times = [], [], []
    for index in range(rounds):
        if index % 2 == 0:
            t_hf = timed(reference_step, alone=True)
            t_oslo = timed(oslo_step, alone=False)
        else:
            t_oslo = timed(oslo_step, alone=False)
            t_hf = timed(reference_step, alone=True)
        hf_times.append(t_hf)
        oslo_times.append(t_oslo)
        ratios.append(t_hf / t_oslo)

    breakdown = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        oslo_step()
    if rank == 0:
        total = 0.0
        for event in profile.key_averages():
            seconds = event.self_cpu_time_total / 1e6
            total += seconds
            name = event.key.lower()
            category = next((label for label, keys in _CATEGORIES if any(k.lower() in name for k in keys)), "other")
            breakdown[category] = breakdown.get(category, 0.0) + seconds
        breakdown["total"] = total
    return {"ratios": ratios, "hf": hf_times, "oslo": oslo_times, "breakdown": breakdown}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    bench.header(f"training step, gpt2-medium width, {args.n_layer} blocks, {args.batch} x {args.seq} tokens: "
                 f"transformers 1 process vs oslo tp={args.tp} (1 thread each)")
    result = bench.launch(rank_fn, args.tp, args.n_layer, args.batch, args.seq, args.rounds, timeout=1800)[0]
    ratio = statistics.median(result["ratios"])
    print(f"   transformers step: median {statistics.median(result['hf']):.3f} s; oslo tp={args.tp} step: median "
          f"{statistics.median(result['oslo']):.3f} s")
    print(f"   per-round ratios: {', '.join(f'{r:.2f}' for r in result['ratios'])}")
    print(f"   median ratio transformers / oslo: {ratio:.3f}x (ideal {args.tp:.1f}x; target at tp=2: >= 1.8x)")
    breakdown = result["breakdown"]
    total = breakdown.pop("total")
    print("   one oslo step on rank 0, CPU self time by category (torch.profiler):")
    for label, seconds in sorted(breakdown.items(), key=lambda item: -item[1]):
        print(f"     {label:<24} {seconds * 1e3:8.1f} ms  {seconds / total:6.1%}")
    if args.tp == 2:
        print(f"   claim (>= 1.8x at tp=2): {bench.verdict(ratio >= 1.8)}")


if __name__ == "__main__":
    main()
