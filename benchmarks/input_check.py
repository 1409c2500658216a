"""Cost of checking that every rank of a tensor/pipeline-parallel group got the same inputs, in range.

Every outermost model call at tensor or pipeline parallelism first runs
``oslo.parallel.agreement.embedding_index_error`` (a min and a max of the token ids, token types and
positions: ids outside the embeddings raise IndexError) and ``check_same_inputs``: a digest of every
input (shapes, dtypes, options, and a weighted sum of the values) and one all-gather of three int64 per
rank over the model-parallel group (the third carries the range verdict). Calls nested in it (the
body, generate()'s steps) run the range check again, locally. Measured at tp=2 over gloo, one thread
per rank, against what it guards:

(a) a training step (forward + backward of ``GPT2LMHeadModel``, gpt2-medium width, 4 layers,
    8 x 256 tokens with labels and an attention mask). Target: the check costs < 1 % of the step.
(b) ``generate()`` (8 prompts of 256 tokens, 16 new tokens, greedy, KV cache): it checks the prompt
    and options once per call, its steps do not (their inputs follow from the prompt alike on every
    rank), so the check is reported against the whole call.

The check (range check + comparison, as a call runs them) is timed on its own (median of 200 calls on
the same inputs), the range check alone too, and so are the step and the generate() call (medians of a
few runs); the ratio is check / what it guards.

Run: ``python benchmarks/input_check.py``; options: ``--n-layer 4 --batch 8 --seq 256 --iters 3``.
"""

from __future__ import annotations

import argparse
import sys
import time

import _tp_harness as bench
import torch
import torch.distributed as dist

import oslo
from oslo.parallel.agreement import check_same_inputs, embedding_index_error

TARGET = 0.01


def _measure(rank: int, world_size: int, config, batch: int, seq: int, iters: int) -> dict[str, float]:
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0)
    context = model.parallel_context
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    training = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids)

    def timed_median(fn, count):
        times = []
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return bench.median(times)

    def check(kwargs):
        check_same_inputs(context, (), kwargs, embedding_index_error(model, (), kwargs))

    check_training = timed_median(lambda: check(training), 200)
    range_training = timed_median(lambda: embedding_index_error(model, (), training), 200)

    def step():
        model.zero_grad(set_to_none=True)
        model(**training).loss.backward()

    model.train()
    step()  # warm-up
    step_time = timed_median(step, iters)

    model.eval()
    prompt = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    options = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    check_generate = timed_median(lambda: check({**prompt, **options}), 200)
    model.generate(**prompt, **options)  # warm-up
    generate_time = timed_median(lambda: model.generate(**prompt, **options), iters)
    return dict(check_training=check_training, range_training=range_training, step=step_time,
                check_generate=check_generate, generate=generate_time)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    config = bench.gpt2_config("medium", n_layer=args.n_layer)
    bench.header("input check: id ranges + digest + one all-gather per model call, tp=2 x 1 thread, gloo")
    print(f"   {bench.describe(config)}; batch {args.batch} x seq {args.seq}; float32")
    results = bench.launch(_measure, 2, config, args.batch, args.seq, args.iters)
    slowest = {key: max(r[key] for r in results) for key in results[0]}
    training_ratio = slowest["check_training"] / slowest["step"]
    generate_ratio = slowest["check_generate"] / slowest["generate"]
    passed = training_ratio < TARGET
    print(f"   (a) check {slowest['check_training'] * 1e3:.3f} ms / training step {slowest['step']:.3f} s "
          f"= {training_ratio * 100:.3f} %  target < {TARGET * 100:.0f} %  [{bench.verdict(passed)}]")
    print(f"       of which the id range check {slowest['range_training'] * 1e3:.3f} ms "
          f"= {slowest['range_training'] / slowest['step'] * 100:.4f} % of the step")
    print(f"   (b) check {slowest['check_generate'] * 1e3:.3f} ms / generate() of 16 tokens "
          f"{slowest['generate']:.3f} s = {generate_ratio * 100:.3f} %")
    print(f"\ninput_check overall: {bench.verdict(passed)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
