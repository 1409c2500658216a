"""A training step under ``torch.compile(model, fullgraph=True)`` against the eager step, on CPU, tp=1.

Workload: ``GPT2LMHeadModel`` at gpt2 width (768, 12 heads), ``--n-layer`` blocks (default 2), vocab 50257, a
batch of ``--batch`` x ``--seq`` tokens (default 4 x 128), float32, dropout 0, one torch thread, a plain process
(tensor_parallel_size 1). A step is ``model(input_ids=ids, labels=ids).loss.backward()`` in training mode; the
gradients are cleared outside the timed region. Variants, built from the same weights:

* oslo eager and oslo compiled (``torch.compile(model, fullgraph=True)``, inductor: the call traces without a
  graph break, see tests/models/test_compile.py);
* transformers eager and transformers compiled, the same way: what compiling buys the model oslo stands in for.

Before timing, each compiled variant's first step (which compiles; its time is printed) is checked against its
eager twin's loss. Each round then runs every variant once, in an order that rotates; the ratios are medians of
the per-round ratios t(eager) / t(compiled) (> 1: compiling is faster). Nothing is claimed: the script prints
the ratios and exits 0.

``--tensor-parallel-size 2``: oslo alone (transformers has no such layout) on two gloo ranks, one thread each,
eager against compiled (inductor; the collectives, the input agreement and the failure watch are opaque custom
operators in the compiled program, see ``oslo.parallel.traced``); rank 0's times.

Run: ``python benchmarks/compile_step.py`` (``--rounds 10 --n-layer 2 --batch 4 --seq 128``), and
``python benchmarks/compile_step.py --tensor-parallel-size 2``.
"""

from __future__ import annotations

import argparse
import sys
import time

import _tp_harness as bench
import torch
import transformers

import oslo


def _step(model, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, choices=(1, 2))
    args = parser.parse_args(argv)
    config = bench.gpt2_config("small", n_layer=args.n_layer)
    if args.tensor_parallel_size == 2:
        return _tensor_parallel(config, args)
    bench.header("training step: torch.compile(model, fullgraph=True) vs eager, tp=1, 1 thread, CPU")
    print(f"   {bench.describe(config)}; batch {args.batch} x seq {args.seq}; float32")

    ours = oslo.GPT2LMHeadModel.from_config_with_parallel(config, seed=0).train()
    theirs = transformers.GPT2LMHeadModel(config).train()
    theirs.load_state_dict(ours.state_dict())
    # Its default loss_type (None) logs a warning inside forward, which Dynamo cannot trace under fullgraph=True;
    # the loss it then picks by default:
    theirs.loss_type = "ForCausalLM"
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    variants = {
        "oslo eager": ours,
        "oslo compiled": torch.compile(ours, fullgraph=True),
        "transformers eager": theirs,
        "transformers compiled": torch.compile(theirs, fullgraph=True),
    }
    for name in ("oslo", "transformers"):
        eager, compiled = variants[f"{name} eager"], variants[f"{name} compiled"]
        with torch.no_grad():
            expected = eager(input_ids=ids, labels=ids).loss
        start = time.perf_counter()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        print(f"   {name}: first compiled step (compiles) {time.perf_counter() - start:.1f} s; loss "
              f"{loss.item():.6f} vs eager {expected.item():.6f}")
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
        _step(eager, ids)  # warm-up

    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_index in range(args.rounds):
        for name in order[round_index % len(order):] + order[:round_index % len(order)]:
            times[name].append(_step(variants[name], ids))
    for name, values in times.items():
        print(f"   {name:22s} median step {bench.median(values):.3f} s  ({bench.fmt_times(values)})")
    for name in ("oslo", "transformers"):
        ratios = [e / c for e, c in zip(times[f"{name} eager"], times[f"{name} compiled"], strict=True)]
        print(f"   {name}: eager / compiled = {bench.median(ratios):.3f}x (median of {args.rounds} rounds)")
    ratios = [o / t for o, t in zip(times["oslo compiled"], times["transformers compiled"], strict=True)]
    print(f"   compiled oslo / compiled transformers = {bench.median(ratios):.3f}x (step time; 1.0: no overhead)")
    return 0


def _tp_rank(rank: int, world_size: int, config, args) -> dict[str, list[float]]:
    ours = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=2, seed=0).train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    variants = {"oslo eager": ours, "oslo compiled": torch.compile(ours, fullgraph=True)}
    with torch.no_grad():
        expected = ours(input_ids=ids, labels=ids).loss
    start = time.perf_counter()
    loss = variants["oslo compiled"](input_ids=ids, labels=ids).loss
    loss.backward()
    if rank == 0:
        print(f"   oslo tp=2: first compiled step (compiles) {time.perf_counter() - start:.1f} s; loss "
              f"{loss.item():.6f} vs eager {expected.item():.6f}", flush=True)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    _step(ours, ids)  # warm-up
    return bench.alternate(lambda name: _step(variants[name], ids), list(variants), args.rounds)


def _tensor_parallel(config, args) -> int:
    bench.header("training step: torch.compile(model, fullgraph=True) vs eager, tp=2 (gloo), 1 thread per rank, CPU")
    print(f"   {bench.describe(config)}; batch {args.batch} x seq {args.seq}; float32", flush=True)
    times = bench.launch(_tp_rank, 2, config, args, timeout=1800.0)[0]
    for name, values in times.items():
        print(f"   {name:22s} median step {bench.median(values):.3f} s  ({bench.fmt_times(values)})")
    ratios = [e / c for e, c in zip(times["oslo eager"], times["oslo compiled"], strict=True)]
    print(f"   oslo tp=2: eager / compiled = {bench.median(ratios):.3f}x (median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
