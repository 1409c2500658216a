"""Does a pipeline-parallel training loop leak host memory? RSS per step over thousands of steps.

Question: at ``pipeline_parallel_size=2`` (world 2, gloo, CPU) RSS grew about 2.8 KB per step over
1,000 steps with a constant Python object count. Is that a leak, or does it flatten?

Each rank runs ``--steps`` training steps of a tiny GPT2 (tests/helpers.py's shape: n_embd 32, 2 layers,
vocab 1001) built with ``GPT2LMHeadModel.from_config_with_parallel(config, pipeline_parallel_size=2)``:
the manual's loop ``for micro_output in model(input_ids=..., labels=...): micro_output.loss.backward()``
then ``optimizer.step()`` and ``optimizer.zero_grad()``. Every ``--every`` steps it samples

* ``rss``: VmRSS of the process (what the report was about);
* ``anon``: RssAnon (the heap and anonymous mappings, without mapped library pages);
* ``in_use``: bytes glibc malloc has handed out and not got back (``mallinfo2``: uordblks + hblkhd).
  RSS growing while ``in_use`` stays flat is the allocator holding freed memory (fragmentation);
  ``in_use`` growing is memory some code still holds, a real leak;
* ``objects``: ``len(gc.get_objects())``, the Python objects the collector tracks.

The slope of each (least squares, bytes per step) is printed over the first and the last half of the
samples, per rank. The verdict: RSS *flattens* when the last half's slope is under ``--flat`` bytes per
step (default 200, i.e. 2 MB per 10,000 steps) on every rank, *keeps growing* otherwise. Run enough
steps for the first half to cover the warm-up (at least ~4,000 with the default Flight Recorder).

Other workloads isolate candidates (each the same number of steps on 2 ranks):

* ``--workload p2p``: only the pipeline's point-to-point traffic (``StageLink.send``/``recv`` of the
  activation and the gradient per micro-batch, ``wait_all`` per step), no model;
* ``--workload collectives``: only the collectives a pipeline step makes besides that (the input check's
  all-gather over the model-parallel group, the tied embedding's all-reduce);
* ``--workload single``: the same model and loop in one process without pipelines (torch, autograd and
  the optimizer alone, no gloo).

``--trim`` calls glibc's ``malloc_trim(0)`` before every sample (RSS then follows what is in use); run
with ``MALLOC_ARENA_MAX=2`` in the environment to see the effect of fewer malloc arenas.

Run: ``python benchmarks/pipeline_memory.py``; options ``--steps 6000 --every 100 --workload pipeline
--trim --micro-batch-size 2 --batch 4 --seq 16``. 6,000 steps take about 2 minutes on 2 idle CPU cores.

Result (2026-11-23, 2-core x86_64, torch 2.13.0+cpu, glibc 2.36): not a leak. RSS and ``in_use`` grow
~2.5 KB/step for the first ~1,000 steps, then flatten (6,000 steps: last-half RSS slope 84-173 B/step,
``in_use`` 3-8 B/step; objects constant). The growth is torch's c10d Flight Recorder, a ring buffer of
the last ``TORCH_FR_BUFFER_SIZE`` (default 2000) collectives, each entry holding its Python stack
(~1.3 KB): a pipeline step makes 2 collectives (the input check's all-gather, the tied embedding's
all-reduce; gloo's isend/recv are not recorded), so it fills at step ~1,000 and then only overwrites.
``--workload collectives`` shows the same curve, ``--workload p2p`` none; ``TORCH_FR_BUFFER_SIZE=500``
moves the knee to step ~250, ``TORCH_FR_BUFFER_SIZE=0`` removes it (``in_use`` +89 KB instead of
+2.57 MB after 2,000 steps). What remains (a few B/step of ``in_use``, decreasing) is also there in
one process without gloo (``--workload single``); the rest of the RSS creep is the allocator
(``--trim``: 28-39 B/step, ``MALLOC_ARENA_MAX=2``: 45 B/step).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import sys
import time
from collections.abc import Callable

import _tp_harness as bench
import torch
import torch.distributed as dist
from transformers import GPT2Config

import oslo

_libc = ctypes.CDLL(ctypes.util.find_library("c"))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc.mallinfo2.restype = _MallInfo2


def tiny_config() -> GPT2Config:
    """tests/helpers.py's tiny_gpt2_config (kept here so the script does not import the tests)."""
    return GPT2Config(
        vocab_size=1001, n_positions=64, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def sample(trim: bool) -> dict[str, int]:
    """This process's memory now (bytes) and the number of Python objects the collector tracks."""
    gc.collect()
    if trim:
        _libc.malloc_trim(0)
    status = bench.proc_status("VmRSS", "RssAnon")
    info = _libc.mallinfo2()
    return {"rss": status["VmRSS"], "anon": status["RssAnon"], "in_use": info.uordblks + info.hblkhd,
            "objects": len(gc.get_objects())}


def _step_function(rank: int, world_size: int, args) -> Callable[[], None]:
    """``step()`` running one iteration of ``args.workload`` on this rank."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 1001, (args.batch, args.seq), generator=generator)
    if args.workload in ("pipeline", "single"):
        torch.manual_seed(0)
        if args.workload == "single":
            model = oslo.GPT2LMHeadModel(tiny_config()).train()
        else:
            model = oslo.GPT2LMHeadModel.from_config_with_parallel(
                tiny_config(), pipeline_parallel_size=world_size, micro_batch_size=args.micro_batch_size, seed=0
            ).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            if args.workload == "single":
                for chunk in input_ids.split(args.micro_batch_size):
                    model(input_ids=chunk, labels=chunk).loss.backward()
            else:
                for micro_output in model(input_ids=input_ids, labels=input_ids):
                    micro_output.loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return step

    context = oslo.ParallelContext(1, world_size)
    if args.workload == "p2p":
        from oslo.parallel.pipeline import StageLink

        activation = torch.randn(args.micro_batch_size, args.seq, tiny_config().n_embd)
        extra = torch.tensor([1.0, 1.0], dtype=torch.float64)
        micro_batches = args.batch // args.micro_batch_size

        def step():
            link = StageLink(context)  # one per step, as pipeline_schedule makes
            for _ in range(micro_batches):
                if link.next is not None:
                    link.send(activation, link.next)
                    link.recv(link.next, with_extra=True)
                else:
                    link.recv(link.prev)
                    link.send(activation, link.prev, extra=extra)
            link.wait_all()

        return step

    if args.workload == "collectives":
        mine = torch.zeros(2, dtype=torch.int64)
        tied = torch.zeros(1001, tiny_config().n_embd)

        def step():
            gathered = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(gathered, mine, group=context.model_parallel_group)
            dist.all_reduce(tied, group=context.embedding_group)

        return step
    raise ValueError(f"unknown workload {args.workload!r}: use pipeline, p2p, collectives or single.")


def run_rank(rank: int, world_size: int, args) -> dict:
    step = _step_function(rank, world_size, args)
    for _ in range(args.warmup):
        step()
    samples, steps = [], []
    start = time.perf_counter()
    for index in range(args.steps + 1):
        if index % args.every == 0:
            steps.append(index)
            samples.append(sample(args.trim))
        if index < args.steps:
            step()
    return {"steps": steps, "samples": samples, "seconds": time.perf_counter() - start}


def slope(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def halves(steps: list[int], values: list[int]) -> tuple[float, float]:
    middle = len(steps) // 2
    return slope(steps[: middle + 1], values[: middle + 1]), slope(steps[middle:], values[middle:])


def report(results: list[dict], args) -> bool:
    """Print the curves and the slopes; return whether RSS flattens on every rank."""
    flat = True
    for rank, result in enumerate(results):
        steps, samples = result["steps"], result["samples"]
        base = samples[0]
        print(f"\n-- rank {rank}: {args.steps} steps in {result['seconds']:.0f} s; values relative to step 0 "
              f"(rss {bench.mib(base['rss'])}, in_use {bench.mib(base['in_use'])}, {base['objects']} objects)")
        print(f"   {'step':>6} {'rss KB':>9} {'anon KB':>9} {'in_use KB':>10} {'objects':>8}")
        stride = max(1, len(steps) // args.rows)
        for i in sorted({*range(0, len(steps), stride), len(steps) - 1}):
            s = samples[i]
            print(f"   {steps[i]:>6} {(s['rss'] - base['rss']) / 1e3:>9.1f} {(s['anon'] - base['anon']) / 1e3:>9.1f} "
                  f"{(s['in_use'] - base['in_use']) / 1e3:>10.1f} {s['objects'] - base['objects']:>+8d}")
        print("   slope, bytes/step   first half  last half")
        for key in ("rss", "anon", "in_use", "objects"):
            first, last = halves(steps, [s[key] for s in samples])
            print(f"   {key:<18} {first:>10.1f} {last:>10.1f}")
        first, last = halves(steps, [s["rss"] for s in samples])
        rank_flat = last < args.flat
        flat = flat and rank_flat
        print(f"   rank {rank}: RSS {'flattens' if rank_flat else 'still grows'} "
              f"({last:.0f} B/step in the last half vs {first:.0f} in the first)")
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="pipeline", choices=["pipeline", "p2p", "collectives", "single"])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20, help="steps before the first sample")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) before every sample")
    parser.add_argument("--flat", type=float, default=200.0,
                        help="a last-half RSS slope under this many bytes/step counts as flat")
    parser.add_argument("--rows", type=int, default=12, help="about how many samples to print per rank")
    args = parser.parse_args()

    bench.header(f"pipeline_memory: workload={args.workload}, {args.steps} steps, sample every {args.every}, "
                 f"trim={args.trim}, MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')}, "
                 f"TORCH_FR_BUFFER_SIZE={os.environ.get('TORCH_FR_BUFFER_SIZE', 'unset (2000)')}")
    world_size = 1 if args.workload == "single" else 2
    results = bench.launch(run_rank, world_size, args, env=world_size > 1, timeout=3600)
    flat = report(results, args)
    print(f"\nverdict: RSS {'FLATTENS' if flat else 'KEEPS GROWING'} (workload {args.workload})")
    sys.exit(0 if flat else 1)


if __name__ == "__main__":
    main()
