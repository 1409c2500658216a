"""Parameter bytes per tensor-parallel rank against the ideal (the model's bytes / tp), Llama family.

Claim (issue 15, "Benchmark"): for a Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 query heads over
8 key/value heads, MLP 8192, vocabulary 128256, tied embeddings) at tensor_parallel_size 2 and 4, the bytes of
the parameters each rank holds ÷ (the transformers model's parameter bytes / tp) stay close to 1: what is
replicated (the RMSNorm weights; the key/value projections when tp does not divide the key/value heads) is
counted, and the vocabulary padding too. A variant with 2 key/value heads shows the cost of replicating them at
tp=4 (each rank then holds both heads' projections, as oslo replicates the whole ``k_proj`` / ``v_proj``).

How: every rank builds the oslo model on the meta device (no memory, the shapes only) with its own
``ParallelContext`` and sums the bytes of its parameters (a tied weight once); transformers' model, also built on
the meta device, gives the total. The ratio printed is the largest rank's bytes ÷ the ideal. No target: the
figures are what README reports.

Run: ``python benchmarks/param_bytes.py``; options: ``--tp 2 4 --dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import sys

import _tp_harness as bench
import torch
import transformers

from oslo.launch import run


def _unique_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def _rank_bytes(rank: int, world_size: int, name: str, config, dtype: torch.dtype) -> int:
    import oslo
    from oslo.parallel import ParallelContext

    context = ParallelContext(tensor_parallel_size=world_size)
    with torch.device("meta"):
        model = getattr(oslo, name)(config, parallel_context=context).to(dtype)
    return _unique_bytes(model)


def measure(name: str, config, tp: int, dtype: torch.dtype) -> tuple[float, list[int], int]:
    with torch.device("meta"):
        reference = getattr(transformers, name)(config).to(dtype)
    total = _unique_bytes(reference)
    per_rank = run(_rank_bytes, tp, (name, config, dtype), timeout=600)
    return max(per_rank) / (total / tp), per_rank, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bench.header("parameter bytes per tensor-parallel rank / ideal (model bytes / tp), Llama-3.2-1B shape")
    variants = [("LlamaForCausalLM", "8 key/value heads", bench.llama_config("large")),
                ("LlamaForCausalLM", "2 key/value heads", bench.llama_config("large", num_key_value_heads=2))]
    summary = []
    for name, label, config in variants:
        for tp in args.tp:
            ratio, per_rank, total = measure(name, config, tp, dtype)
            split = "split" if config.num_key_value_heads % tp == 0 else "replicated"
            print(f"   {name} {label} ({split} at tp={tp}), {args.dtype}: model {total / 2**20:,.1f} MiB; per rank "
                  f"{', '.join(f'{b / 2**20:,.1f}' for b in per_rank)} MiB; ideal {total / tp / 2**20:,.1f} MiB; "
                  f"largest / ideal = {ratio:.4f}")
            summary.append(f"   {label:18s} tp={tp}: {ratio:.4f}")
    print("summary (largest rank's parameter bytes / ideal):")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
