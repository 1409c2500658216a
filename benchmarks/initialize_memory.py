"""``oslo.initialize`` (issue 12): a rank's peak and remaining memory against the transformers model's size.

Each rank (forked gloo ranks, as torchrun starts them) builds a gpt2-small-shaped transformers
``GPT2LMHeadModel`` (124M parameters, fp32: 498 MB), then calls ``oslo.initialize`` at tensor_parallel_size
= world size. Measured per rank from ``/proc/self/status``, relative to the RSS before the transformers model
was built, divided by the model's parameter bytes M:

* before: the transformers model alone (about 1);
* peak: the highest RSS during ``initialize`` (VmHWM reset before the call). Claim: at most 1 + 1/tp + 0.1 —
  the full model the user built plus the rank's slices, nothing materialized beyond them;
* after: once ``initialize`` returned (the given model's weights moved to the meta device). Claim: about
  1/tp (+ replicated tensors), i.e. the transformers model's memory is not kept alive.

Run: ``python benchmarks/initialize_memory.py`` (``--tp 2 4``, ``--layers N``).
"""

from __future__ import annotations

import argparse
import gc

import _tp_harness as bench
import torch
import transformers

import oslo


def rank_fn(rank: int, world_size: int, layers: int) -> dict:
    base = bench.proc_status("VmRSS")["VmRSS"]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(bench.gpt2_config("small", n_layer=layers))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    before = bench.proc_status("VmRSS")["VmRSS"]
    bench.reset_peak_rss()
    parallel = oslo.initialize(model, {"model_parallelism": {"tensor_parallel_size": world_size}})
    peak = bench.proc_status("VmHWM")["VmHWM"]
    gc.collect()
    after = bench.proc_status("VmRSS")["VmRSS"]
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in parallel.parameters())
    return {"size": size, "before": (before - base) / size, "peak": (peak - base) / size,
            "after": (after - base) / size, "local": local / size}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    bench.header("oslo.initialize: RSS per rank ÷ the transformers model's bytes (M)")
    ok = True
    for tp in args.tp:
        results = bench.launch(rank_fn, tp, args.layers)
        worst = max(results, key=lambda r: r["peak"])
        print(f"   tp={tp}: M = {bench.mib(worst['size'])}; per rank (worst): before {worst['before']:.2f} M, "
              f"peak {worst['peak']:.2f} M, after {max(r['after'] for r in results):.2f} M "
              f"(its parameters: {max(r['local'] for r in results):.2f} M)")
        ok &= worst["peak"] <= 1 + 1 / tp + 0.1 and max(r["after"] for r in results) <= 1 / tp + 0.15
    print(f"   claim (peak <= 1 + 1/tp + 0.1, after <= 1/tp + 0.15): {bench.verdict(ok)}")


if __name__ == "__main__":
    main()
