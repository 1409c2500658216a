"""The all-reduce of oslo's tensor-parallel layers on gloo (CPU): one all-to-all round for a small tensor, against
gloo's ring all-reduce (``torch.distributed.all_reduce``), the reference.

gloo's ring cuts every tensor into 2 x world segments and passes each around the ring, 4 (world - 1) messages a
rank, so that its time hardly depends on the size below a MiB. While the tensor's bytes times the world size stay
within ``GLOO_ONE_ROUND_BYTES`` (1 MiB: 512 KiB at 2 ranks, 256 KiB at 4) oslo sends each rank's whole tensor to
every other rank in one ``all_to_all_single`` and sums the copies on each rank (``oslo/parallel/collectives.py``).
Both variants run in the same ranks, alternated round by round: the reference is ``eager_all_reduce`` with
``GLOO_ONE_ROUND_BYTES = 0`` (every tensor through the ring).

Two measurements, at world sizes 2 and 4:

* one all-reduce of a float32 tensor (median microseconds over ``--calls`` calls, ``--rounds`` rounds), from 8
  elements to 1 MiB (above the limit, at 512 KiB for 4 ranks and at 1 MiB for both, both variants are the ring: an
  A/A check);
* a model's decode: greedy ``generate()`` of ``--new-tokens`` tokens, batch 1, of a 4-layer Llama-shaped model
  (hidden 256, 8 query heads over 4 key/value heads) at tensor_parallel_size = world size: each step's
  all-reduces carry 1 x 1 x 256 values; and a training step (forward + backward, batch 4 x 64).

Run: ``python benchmarks/gloo_all_reduce.py`` (about 2 minutes on 2 CPU cores); ``--worlds 2``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _tp_harness import alternate, header, launch, llama_config, median  # noqa: E402

import oslo  # noqa: E402
from oslo.parallel import collectives  # noqa: E402

SIZES = [8, 1024, 16384, 65536, 131072, 262144]  # float32 elements: 32 B, 4 KiB, 64 KiB, 256 KiB, 512 KiB, 1 MiB
VARIANTS = ["ring", "one round"]


ONE_ROUND_BYTES = collectives.GLOO_ONE_ROUND_BYTES


def _limit(variant: str) -> None:
    collectives.GLOO_ONE_ROUND_BYTES = 0 if variant == "ring" else ONE_ROUND_BYTES


def _calls(rank, world_size, calls, rounds):
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    result = {}
    for numel in SIZES:
        tensor = torch.ones(numel)

        def step(variant, tensor=tensor):
            _limit(variant)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                collectives.eager_all_reduce(tensor, group, "benchmark")
            return (time.perf_counter() - start) / calls

        alternate(step, VARIANTS, 1)  # warm-up
        result[numel] = {name: median(times) for name, times in alternate(step, VARIANTS, rounds).items()}
    dist.destroy_process_group()
    return result


def _model(rank, world_size, new_tokens, rounds):
    config = llama_config(n_layer=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                          num_key_value_heads=4, vocab_size=4096)
    model = oslo.LlamaForCausalLM.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0)
    prompt = torch.randint(3, 4096, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = torch.randint(3, 4096, (4, 64), generator=torch.Generator().manual_seed(1))
    tokens = {}

    def decode(variant):
        _limit(variant)
        model.eval()
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            tokens[variant] = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                             do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def train(variant):
        _limit(variant)
        model.train()
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    alternate(decode, VARIANTS, 1)
    alternate(train, VARIANTS, 1)
    result = {"decode": {k: median(v) for k, v in alternate(decode, VARIANTS, rounds).items()},
              "train": {k: median(v) for k, v in alternate(train, VARIANTS, rounds).items()},
              "same tokens": torch.equal(tokens["ring"], tokens["one round"])}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    header("gloo all-reduce: one all-to-all round (oslo, tensor x world <= 1 MiB) vs the ring "
           "(torch.distributed.all_reduce)")
    for world in args.worlds:
        print(f"-- world size {world}: one all-reduce, median microseconds per call")
        print(f"   {'float32 elements':>16} {'ring':>9} {'one round':>10} {'ring / one round':>17}")
        for numel, times in launch(_calls, world, args.calls, args.rounds, timeout=900)[0].items():
            ring, one = times["ring"] * 1e6, times["one round"] * 1e6
            print(f"   {numel:>16} {ring:>9.0f} {one:>10.0f} {ring / one:>17.2f}")
        result = launch(_model, world, args.new_tokens, args.rounds, timeout=900)[0]
        print(f"-- world size {world}: Llama-shaped, 4 layers, hidden 256, tensor_parallel_size {world}")
        for what, label in (("decode", f"greedy generate, {args.new_tokens} new tokens, batch 1"),
                            ("train", "training step (forward + backward), batch 4 x 64")):
            ring, one = result[what]["ring"], result[what]["one round"]
            print(f"   {label}: ring {ring * 1e3:.1f} ms, one round {one * 1e3:.1f} ms: ring / one round "
                  f"{ring / one:.2f}")
        print(f"   same tokens both ways: {result['same tokens']}")


if __name__ == "__main__":
    main()
