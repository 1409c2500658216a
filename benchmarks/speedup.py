"""Speed-up of a tensor-parallel GPT2 forward on CPU over gloo.

Claim (issue 2, "Benchmarks / Speed-up"): gpt2-medium-shaped forward, batch 8 x 256 tokens:
tp=2 with one thread per rank vs tp=1 with one thread: >= 1.8x (a bare MLP stack of that shape
reaches 2.0x here over gloo). Also report tp=1 with two threads.

Two groups of long-lived processes are forked from this one and keep their model between runs,
with the same merged weights (``from_config_with_parallel(..., seed=0)`` gives the same weights at
any tp): one plain process (tp=1) and two gloo ranks (tp=2). The configurations

* ``tp=1, 1 thread``           the plain process with ``torch.set_num_threads(1)``;
* ``tp=2, 1 thread per rank``  the two ranks, one thread each (the two CPUs of this machine);
* ``tp=1, 2 threads``          the plain process with ``torch.set_num_threads(2)``;

take turns run by run (rotating which goes first), so that other load on the machine hits all of
them alike; only one configuration computes at a time. For context, the same processes also run a
bare MLP stack: ``n_layer`` Megatron MLP blocks (column 1024 -> 4096, GeLU, row 4096 -> 1024,
all-reduce) on the same 8 x 256 activations, tp=1 vs tp=2, plain torch + gloo: the ceiling the
matmul/all-reduce pattern reaches on this machine, without attention, embeddings or head.

Timed: ``model(input_ids)`` under ``torch.no_grad()`` in eval mode, with ``gather_logits=True``
(the default there: every rank gets the full 8 x 256 x 50257 logits, a 411 MB all-gather at tp=2)
and with ``gather_logits=False`` (each rank keeps its vocabulary shard); and the forward of a
training call ``model(input_ids, labels=input_ids)`` in train mode with gradients enabled, as a
training loop runs it: by default (no logits gather: the loss comes from the vocabulary-split
logits) and with ``gather_logits=True`` (what the default was before: the full logits assembled
for an output the loop does not read). Each run starts after a
barrier; a run's time is the slowest rank's; medians are reported. Also printed: the time spent
inside all-reduce / all-gather (includes waiting for the other rank) and the ratio of CPU times
(tp=1 process / slowest tp=2 rank), which other processes on the machine barely affect and which
an idle machine's wall-clock speed-up approaches. The verdict is on wall-clock time.

gpt2-medium (24 layers) is slow on one CPU thread (~20 s per forward), so the default reduces
``n_layer`` to 4 and keeps the width (1024, 16 heads, vocab 50257); the share of the LM head in the
work is then larger than in the full model. ``--n-layer 24`` runs the real depth.

Run: ``python benchmarks/speedup.py``; options: ``--n-layer 4 --iters 3 --batch 8 --seq 256
--logits all|gathered|local|train --skip-mlp``.
"""

from __future__ import annotations

import argparse
import sys
import time

import _tp_harness as bench
import torch
import torch.distributed as dist
import torch.nn.functional as F

import oslo

SPEEDUP_TARGET = 1.8


class CommTimer:
    """Wall time spent inside all_reduce / all_gather (includes waiting for the other rank)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals = {}

    def install(self) -> None:
        for name in ("all_reduce", "all_to_all_single", "all_gather"):  # (a small all-reduce: all_to_all_single)
            original = getattr(dist, name)
            self._originals[name] = original

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(dist, name, timed)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def setup_rank(rank: int, world_size: int, config, batch: int, seq: int):
    """Build this rank's model shard and bare-MLP shard once; return the command handler."""
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0)
    model.eval()
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    hidden, inner = config.n_embd, 4 * config.n_embd
    generator = torch.Generator().manual_seed(0)
    layers = []
    columns = slice(rank * inner // world_size, (rank + 1) * inner // world_size)
    for _ in range(config.n_layer):
        w_fc = torch.randn(hidden, inner, generator=generator) * 0.02
        w_proj = torch.randn(inner, hidden, generator=generator) * 0.02
        layers.append((w_fc[:, columns].contiguous(), torch.zeros(inner // world_size),
                       w_proj[columns].contiguous(), torch.zeros(hidden)))
    x = torch.randn(batch * seq, hidden, generator=generator)

    def mlp_forward():
        h = x
        for w_fc, b_fc, w_proj, b_proj in layers:
            partial = F.gelu(torch.addmm(b_fc, h, w_fc), approximate="tanh") @ w_proj
            if world_size > 1:
                dist.all_reduce(partial)
            h = partial + b_proj
        return h

    def training_forward(**options):
        model.train()
        try:
            with torch.enable_grad():
                return model(input_ids, labels=input_ids, use_cache=False, **options).loss.item()
        finally:
            model.eval()

    workloads = {
        "mlp": mlp_forward,
        "gathered": lambda: model(input_ids, gather_logits=True, use_cache=False),
        "local": lambda: model(input_ids, gather_logits=False, use_cache=False),
        "train-default": training_forward,
        "train-gathered": lambda: training_forward(gather_logits=True),
    }
    timer = CommTimer()
    timer.install()

    def handle(command: tuple[str, int]) -> tuple[float, float, float]:
        """Run a workload with ``threads`` torch threads: (wall s, CPU s of the process, s in collectives)."""
        workload, threads = command
        torch.set_num_threads(threads)
        if world_size > 1:
            dist.barrier()
        timer.seconds = 0.0
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            workloads[workload]()
        return time.perf_counter() - wall, time.process_time() - cpu, timer.seconds

    return handle


SETUPS = (
    ("tp=1, 1 thread", "single", 1),
    ("tp=2, 1 thread per rank", "double", 1),
    ("tp=1, 2 threads", "single", 2),
)


def measure(groups: dict, workload: str, iters: int, setups=SETUPS) -> dict[str, list[tuple]]:
    """Each setup ``iters`` times (after one warm-up), rotating which setup goes first; per run the
    slowest rank's (wall, cpu, collectives) times."""
    for _, group, threads in setups:
        groups[group].call((workload, threads))
    runs: dict[str, list] = {label: [] for label, _, _ in setups}
    for i in range(iters):
        for label, group, threads in setups[i % len(setups):] + setups[: i % len(setups)]:
            results = groups[group].call((workload, threads))
            runs[label].append(max(results, key=lambda r: r[0]))
    return runs


def _report(label: str, runs: list[tuple[float, float, float]], ranks: int) -> tuple[float, float]:
    wall = bench.median([r[0] for r in runs])
    cpu = bench.median([r[1] for r in runs])
    comm = f"; in collectives {bench.median([r[2] for r in runs]):.3f} s" if ranks > 1 else ""
    print(f"     {label:<24} wall s: {bench.fmt_times([r[0] for r in runs])}  median {wall:.3f}{comm}; "
          f"CPU {cpu:.3f} s")
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--logits", choices=["all", "gathered", "local", "train"], default="all")
    parser.add_argument("--skip-mlp", action="store_true")
    args = parser.parse_args(argv)
    modes = {"all": ["gathered", "local", "train-default", "train-gathered"], "gathered": ["gathered"],
             "local": ["local"], "train": ["train-default", "train-gathered"]}[args.logits]
    config = bench.gpt2_config("medium", n_layer=args.n_layer)
    bench.header("speedup: gpt2-medium-shaped forward (no grad), tp=2 x 1 thread vs tp=1 x 1 thread, gloo")
    depth = "" if args.n_layer == 24 else f" (n_layer reduced from 24 to {args.n_layer}; width kept)"
    print(f"   {bench.describe(config)}{depth}; batch {args.batch} x seq {args.seq}; float32; "
          f"{args.iters} timed iterations after 1 warm-up; times are the slowest rank's")

    groups = {}
    try:
        groups["single"] = bench.WorkerGroup(setup_rank, 1, config, args.batch, args.seq, env=False)
        groups["double"] = bench.WorkerGroup(setup_rank, 2, config, args.batch, args.seq)
        workloads = (["mlp"] if not args.skip_mlp else []) + modes
        results = {w: measure(groups, w, args.iters, SETUPS[:2] if w == "mlp" else SETUPS) for w in workloads}
    finally:
        for group in groups.values():
            group.close()

    reference = None
    if "mlp" in results:
        width, inner = config.n_embd, 4 * config.n_embd
        shape = f"{config.n_layer} x [{width} -> {inner} GeLU -> {width}, all-reduce]"
        print(f"\n   reference: bare MLP stack ({shape}), {args.batch * args.seq} tokens, "
              "plain torch + gloo:")
        walls = {label: _report(label, runs, 2 if "tp=2" in label else 1)[0]
                 for label, runs in results["mlp"].items()}
        reference = walls["tp=1, 1 thread"] / walls["tp=2, 1 thread per rank"]
        print(f"     speed-up = {reference:.2f}x (the claim is 2.0x for this reference on an idle "
              "machine; well below that, other processes are taking CPU time from the ranks)")

    ok = True
    for workload in modes:
        what = {"gathered": "no grad, gather_logits=True (the default there: full logits on every rank)",
                "local": "no grad, gather_logits=False (each rank keeps its vocabulary shard)",
                "train-default": "training call with labels, the default (no logits gather)",
                "train-gathered": "training call with labels and gather_logits=True (the old default)",
                }[workload]
        print(f"\n   forward, {what}:")
        measured = {label: _report(label, runs, 2 if "tp=2" in label else 1)
                    for label, runs in results[workload].items()}
        base_wall, base_cpu = measured["tp=1, 1 thread"]
        speedup = base_wall / measured["tp=2, 1 thread per rank"][0]
        if workload == "local":  # the forward itself; the target of issue 2
            passed = speedup >= SPEEDUP_TARGET
            ok &= passed
            print(f"     speed-up tp=2 (1 thread/rank) vs tp=1 (1 thread) = {speedup:.2f}x  "
                  f"target >= {SPEEDUP_TARGET}  [{bench.verdict(passed)}]")
        else:
            why = ("the forward plus the vocabulary-parallel loss" if workload == "train-default"
                   else "assembling the full logits on every rank")
            print(f"     speed-up tp=2 (1 thread/rank) vs tp=1 (1 thread) = {speedup:.2f}x  (no target: {why})")
        two_threads = base_wall / measured["tp=1, 2 threads"][0]
        cpu_ratio = base_cpu / measured["tp=2, 1 thread per rank"][1]
        print(f"     speed-up tp=1 (2 threads) vs tp=1 (1 thread) = {two_threads:.2f}x")
        print(f"     CPU-time ratio tp=1 / slowest tp=2 rank = {cpu_ratio:.2f}x (work per rank, insensitive "
              "to other load; the wall speed-up an idle machine would approach)")
        if reference is not None:
            print(f"     oslo's speed-up / the bare MLP stack's in this run = {speedup / reference:.2f}")
    print(f"\nspeedup overall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
