"""LoRA fine-tuning against full fine-tuning at tensor_parallel_size 2: step time, optimizer state and trainable
bytes per rank.

Workload: ``GPT2LMHeadModel`` at gpt2 width (768, 12 heads), ``--n-layer`` blocks (default 2), vocab 50257, a batch
of ``--batch`` x ``--seq`` tokens (default 4 x 128), float32, dropout 0, two gloo ranks with one torch thread each.
Variants, built from the same weights on each rank:

* full fine-tuning: AdamW over every parameter;
* LoRA: ``peft.get_peft_model`` with ``LoraConfig(r=--rank, target_modules=["c_attn", "c_proj", "c_fc"])``, the
  config a transformers user writes for GPT2; AdamW over the adapter.

A step is the training call, ``loss.backward()``, ``optimizer.step()`` and ``zero_grad()``; each round runs both
variants, in an order that alternates; a step's time is rank 0's; the median of the per-round ratios is reported.
After the rounds it prints, per rank, the optimizer state (AdamW's two moments) and the trainable parameters, and
the adapter's bytes per rank against an even split of the whole adapter (``adapter bytes / tp``): above 1 because a
column-parallel layer keeps ``lora_A`` whole on every rank and a row-parallel one ``lora_B``, as the math needs.
Nothing is claimed: the script prints the figures and exits 0.

Run: ``python benchmarks/lora_step.py`` (``--rounds 8 --n-layer 2 --batch 4 --seq 128 --rank 8``).
"""

from __future__ import annotations

import argparse
import sys
import time

import _tp_harness as bench
import torch

import oslo


def _bytes(tensors) -> int:
    from oslo.parallel.dtensor import plain

    return sum(plain(t).numel() * t.element_size() for t in tensors)


def _state_bytes(optimizer) -> int:
    return _bytes(v for state in optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)


def _rank(rank: int, world_size: int, config, args) -> dict:
    import peft

    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    full = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=2, seed=0).train()
    base = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=2, seed=0).train()
    lora = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                     target_modules=["c_attn", "c_proj", "c_fc"]))
    optimizers = {
        "full fine-tuning": torch.optim.AdamW(full.parameters(), lr=1e-5),
        "LoRA": torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4),
    }
    models = {"full fine-tuning": full, "LoRA": lora}

    def step(name: str) -> float:
        start = time.perf_counter()
        models[name](input_ids=ids, labels=ids).loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for name in models:  # warm-up; the optimizers' state exists from here on
        step(name)
    times = bench.alternate(step, list(models), args.rounds)
    adapter = [p for p in lora.parameters() if p.requires_grad]
    whole_adapter = sum(p.numel() * p.element_size() for p in adapter)  # DTensors: the global shape
    return {
        "times": times,
        "state": {name: _state_bytes(opt) for name, opt in optimizers.items()},
        "trainable": {"full fine-tuning": _bytes(full.parameters()), "LoRA": _bytes(adapter)},
        "adapter_whole": whole_adapter,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        import peft  # noqa: F401
    except ImportError:
        print("lora_step: PEFT is not installed (pip install -e \".[peft]\"); nothing measured.")
        return 0
    config = bench.gpt2_config("small", n_layer=args.n_layer)
    bench.header("LoRA vs full fine-tuning, training step at tp=2 (gloo), 1 thread per rank, CPU")
    print(f"   {bench.describe(config)}; batch {args.batch} x seq {args.seq}; float32; LoRA r={args.rank} on "
          "c_attn, c_proj, c_fc", flush=True)
    results = bench.launch(_rank, 2, config, args, timeout=1800.0)
    first = results[0]
    for name, values in first["times"].items():
        print(f"   {name:17s} median step {bench.median(values):.3f} s  ({bench.fmt_times(values)})")
    ratios = [lo / fu for lo, fu in zip(first["times"]["LoRA"], first["times"]["full fine-tuning"], strict=True)]
    print(f"   LoRA / full fine-tuning, step time: {bench.median(ratios):.3f}x "
          f"(median of {args.rounds} rounds, rank 0)")
    for rank, result in enumerate(results):
        state, trainable = result["state"], result["trainable"]
        print(f"   rank {rank}: AdamW state {bench.mib(state['full fine-tuning'])} full vs "
              f"{bench.mib(state['LoRA'])} LoRA ({state['LoRA'] / state['full fine-tuning']:.4f}x); trainable "
              f"{bench.mib(trainable['full fine-tuning'])} vs {bench.mib(trainable['LoRA'])}")
        even = result["adapter_whole"] / 2
        print(f"   rank {rank}: adapter bytes on this rank / (whole adapter / tp) = {trainable['LoRA'] / even:.3f} "
              "(1.0 would be an even split; the whole lora_A of column-parallel layers and lora_B of row-parallel "
              "ones sit on every rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
