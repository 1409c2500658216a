"""A tensor-parallel training step against one transformers process (issue 17), alternated step by step.

Workload, as a new user trains: GPT2 at gpt2-medium width (1024, 16 heads), ``--n-layer`` blocks (default 2),
vocab 50257, a batch of 4 x 128 tokens, float32, one torch thread per process. Variants:

* ``transformers``: ``model(input_ids=ids, labels=ids).loss.backward()`` in one process (rank 0; the other
  ranks wait at a barrier);
* oslo ``default``: the same call on every rank of tp=``--tp`` (the default training call: the loss from the
  vocabulary-split logits, no logits gathered);
* oslo ``loss-only``: the same with ``gather_logits=False`` (asking explicitly for no logits: since the default
  training call skips the gather, the same path).

For each tensor-parallel size the ranks are forked once and keep their models (rank 0 also holds the
transformers model, with the same weights). Each round runs every variant once, in an order that rotates; a
step's time is the slowest rank's. The claims are on the median of the per-round ratios t(transformers) /
t(oslo): this machine's speed drifts ±15 % within minutes, and only variants measured side by side in the same
processes compare. The ideal is the number of processes that run at once: tp, or the CPU count if fewer (tp=4
on 2 CPUs shares them: its ideal is 2.0).

A per-category breakdown of one oslo step on rank 0 (``torch.profiler``, CPU self time: matmuls, the loss,
collectives (including waiting for the other rank), the embedding's backward, allocation and copies, the rest)
is printed next to each ratio.

``--ablate`` adds variants of the default call with one of issue 17's changes undone (monkeypatched, in the same
processes, alternated with the others): the column-parallel backward's overlap of the input-gradient all-reduce
with the weight-gradient matmul; the embedding's rows added into the tied LM head's weight gradient (gradient
sink); the loss turning the logits into its softmax in place; one local view per parameter per call (without it
the tied weight's two gradients are summed as DTensors, out of place) — and all four undone. Each prints its step
time over the default's (the median of the rounds): what that change buys.

Run: ``python benchmarks/tp_step.py`` (``--rounds 10 --n-layer 2 --batch 4 --seq 128 --tp 2 4 [--ablate]``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
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


_VARIANTS = {
    "default": {},  # the default training call: the loss from vocabulary-split logits, no logits gathered
    "loss-only": {"gather_logits": False},  # asks explicitly for no logits (the same path since issue 4)
}

# --ablate: the default call with one of issue 17's changes undone at a time (monkeypatched in the same processes,
# so that each is measured side by side with the default), and with all of them undone.
_CHANGES = ("overlap", "embedding sink", "logits overwrite", "shared views")
_ABLATIONS = {f"without {change}": (change,) for change in _CHANGES} | {"without all four": _CHANGES}


class _SynchronousAllReduce:
    """``torch.distributed`` for oslo's layers, with an all-reduce that completes before it returns: the
    column-parallel backward then waits for the input gradient's sum before computing the weight's."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_reduce(tensor, *args, **kwargs):
        work = dist.all_reduce(tensor, *args, **kwargs)
        if work is not None:
            work.wait()
        return work


@contextlib.contextmanager
def _undone(changes: tuple[str, ...]):
    import oslo.models.base as base
    import oslo.models.heads as heads
    import oslo.parallel.layers as layers

    patches = {
        "overlap": (layers, "dist", _SynchronousAllReduce()),
        "embedding sink": (layers, "_embedding", layers._lookup),  # autograd's dense embedding gradient
        "logits overwrite": (heads, "logits_are_private", lambda model, returned: False),
        "shared views": (base, "shared_views", contextlib.nullcontext),
    }
    saved = []
    for change in changes:
        module, name, value = patches[change]
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def rank_fn(rank: int, world_size: int, n_layer: int, batch: int, seq: int, rounds: int,
            ablate: bool) -> dict:
    config = bench.gpt2_config("medium", n_layer=n_layer)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0).train()
    reference = None
    # transformers' model with oslo's weights (rank 0 only): through a merged checkpoint
    paths = [f"/tmp/oslo-tp-step-{world_size}" if rank == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    model.save_pretrained_with_parallel(paths[0], save_with_merging=True)
    if rank == 0:
        reference = transformers.GPT2LMHeadModel.from_pretrained(paths[0]).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def oslo_step(options: dict, undone: tuple[str, ...] = ()) -> None:
        model.zero_grad(set_to_none=True)
        with _undone(undone):
            model(input_ids=ids, labels=ids, **options).loss.backward()

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

    steps = [("transformers", reference_step, True)]
    steps += [(name, lambda options=options: oslo_step(options), False) for name, options in _VARIANTS.items()]
    if ablate:
        steps += [(name, lambda undone=undone: oslo_step({}, undone), False) for name, undone in _ABLATIONS.items()]
    for _, step, alone in steps:  # warm-up
        timed(step, alone)
    times = {name: [] for name, _, _ in steps}
    for index in range(rounds):
        shift = index % len(steps)  # the order rotates: each variant runs first, second, ... as often
        for name, step, alone in steps[shift:] + steps[:shift]:
            times[name].append(timed(step, alone))

    breakdowns = {}
    for name, options in _VARIANTS.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            oslo_step(options)
        if rank == 0:
            breakdown = {}
            for event in profile.key_averages():
                seconds = event.self_cpu_time_total / 1e6
                name_lower = event.key.lower()
                category = next((label for label, keys in _CATEGORIES
                                 if any(k.lower() in name_lower for k in keys)), "other")
                breakdown[category] = breakdown.get(category, 0.0) + seconds
            breakdowns[name] = breakdown
    return {"times": times, "breakdowns": breakdowns}


def report(tp: int, result: dict) -> bool:
    """Print the ratios of one tensor-parallel size; whether its claims (tp=2 only) hold."""
    ok = True
    times = result["times"]
    hf = times.pop("transformers")
    print(f"   tp={tp} ({tp} processes on {os.cpu_count()} CPUs): transformers step median "
          f"{statistics.median(hf):.3f} s")
    for name, values in times.items():
        ratios = [a / b for a, b in zip(hf, values, strict=True)]
        ratio = statistics.median(ratios)
        if name in _ABLATIONS:
            cost = statistics.median(a / b for a, b in zip(values, times["default"], strict=True))
            print(f"   oslo tp={tp} {name}: step median {statistics.median(values):.3f} s; ratio transformers / oslo "
                  f"{ratio:.3f}x; its step / the default's, median of the rounds: {cost:.3f}")
            continue
        print(f"   oslo tp={tp} {name}: step median {statistics.median(values):.3f} s; per-round ratios "
              f"{', '.join(f'{r:.2f}' for r in ratios)}")
        target = {"default": 1.8, "loss-only": 1.85}[name] if tp == 2 else None
        claim = f"; claim at tp=2 (>= {target}x): {bench.verdict(ratio >= target)}" if target else ""
        ok = ok and (target is None or ratio >= target)
        print(f"     median ratio transformers / oslo: {ratio:.3f}x (ideal {min(tp, os.cpu_count()):.1f}x){claim}")
        breakdown = dict(result["breakdowns"][name])
        total = sum(breakdown.values())
        print("     one step on rank 0, CPU self time by category (torch.profiler): " + ", ".join(
            f"{label} {seconds * 1e3:.0f} ms ({seconds / total:.1%})"
            for label, seconds in sorted(breakdown.items(), key=lambda item: -item[1])))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ablate", action="store_true",
                        help="also run the default call with each of issue 17's changes undone, and all of them")
    args = parser.parse_args()
    bench.header(f"training step, gpt2-medium width, {args.n_layer} blocks, {args.batch} x {args.seq} tokens: "
                 f"transformers 1 process vs oslo tp={'/'.join(map(str, args.tp))} (1 thread each)")
    ok = True
    for tp in args.tp:
        result = bench.launch(rank_fn, tp, args.n_layer, args.batch, args.seq, args.rounds, args.ablate,
                              timeout=3600)[0]
        ok = report(tp, result) and ok
    print(f"tp_step overall: {bench.verdict(ok)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
