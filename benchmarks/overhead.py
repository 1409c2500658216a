"""Overhead of oslo's GPT2 at tensor_parallel_size=1 against transformers' GPT2, same weights.

Claim (issue 2, "Benchmarks / Overhead"): oslo GPT2 at tp=1 vs transformers GPT2 (same weights,
same process, interleaved runs, median of >= 5): forward+backward time ratio <= 1.05, and
``generate()`` tokens/s ratio >= 0.95.

Both models live in this one process with one torch thread. transformers' ``GPT2LMHeadModel`` is
built with a fixed seed and saved; oslo loads that checkpoint with ``from_pretrained_with_parallel``
(tp=1, a plain process). Before timing, the script checks that they agree (eval-mode loss and
logits, greedy tokens). Timed:

* training step: ``model(input_ids, labels=input_ids).loss.backward()`` in training mode (dropout
  0.1 as in GPT2's config); gradients are cleared outside the timed region;
* generation: greedy ``generate`` of exactly ``--new-tokens`` tokens (``min_new_tokens`` equal to
  ``max_new_tokens``), KV cache on, eval mode.

Runs rotate through every order of three models: transformers, a second transformers copy of the
same weights (an A/A control whose ratio shows the noise floor), and oslo, so drift in machine load
hits all three. Verdicts use the median CPU time of the process (one torch thread), which other
processes on the machine inflate far less than wall time; wall-time ratios are printed too.

Run: ``python benchmarks/overhead.py``; options: ``--n-layer 4 --batch 2 --seq 128 --repeats 6
--prompt 32 --new-tokens 64 --gen-batch 1``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import time

import _tp_harness as bench
import torch
import transformers

import oslo

TIME_TARGET = 1.05
TOKENS_TARGET = 0.95


def build(config, directory: str):
    """transformers' model (seeded), a second transformers copy (the A/A control), and oslo's, all
    with the same weights."""
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config)
    reference.save_pretrained(directory)
    control = transformers.GPT2LMHeadModel.from_pretrained(directory)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(directory, tensor_parallel_size=1)
    return reference, control, model


@torch.no_grad()
def check_agreement(reference, model, input_ids, prompt, new_tokens: int) -> list[str]:
    reference.eval()
    model.eval()
    ours = model(input_ids, labels=input_ids)
    theirs = reference(input_ids, labels=input_ids)
    problems = []
    if not torch.allclose(ours.logits, theirs.logits, atol=1e-4, rtol=1e-4):
        problems.append(f"logits differ (max {float((ours.logits - theirs.logits).abs().max()):.2e})")
    if abs(float(ours.loss) - float(theirs.loss)) > 1e-4:
        problems.append(f"loss differs ({float(ours.loss):.6f} vs {float(theirs.loss):.6f})")
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    if not torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)):
        problems.append("greedy generate() tokens differ")
    return problems


def clocked(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def train_step(model, input_ids) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    return clocked(lambda: model(input_ids, labels=input_ids).loss.backward())


def generate_time(model, prompt, new_tokens: int) -> tuple[float, float]:
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    with torch.no_grad():
        return clocked(lambda: model.generate(prompt, **kwargs))


def interleaved(functions: dict, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Each function ``repeats`` times, the order rotating through every permutation, after one
    unrecorded warm-up each."""
    for fn in functions.values():
        fn()
    orders = list(itertools.permutations(functions))
    times: dict[str, list] = {name: [] for name in functions}
    for i in range(repeats):
        for name in orders[i % len(orders)]:
            times[name].append(functions[name]())
    return times


def _medians(values: list[tuple[float, float]]) -> tuple[float, float]:
    return bench.median([w for w, _ in values]), bench.median([c for _, c in values])


def _print_times(label: str, values: list[tuple[float, float]], unit_fn=None) -> None:
    wall, cpu = _medians(values)
    extra = f"  ({unit_fn(wall):.1f} / {unit_fn(cpu):.1f} tokens/s)" if unit_fn else ""
    print(f"     {label:<22} wall s: {bench.fmt_times([w for w, _ in values])}")
    print(f"     {'':<22} cpu  s: {bench.fmt_times([c for _, c in values])}")
    print(f"     {'':<22} median wall {wall:.3f} s, cpu {cpu:.3f} s{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gen-batch", type=int, default=1)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (the claim is a median of >= 5 runs)")

    torch.set_num_threads(1)
    config = bench.gpt2_config("small", n_layer=args.n_layer, dropout=0.1)
    bench.header("overhead: oslo GPT2LMHeadModel (tp=1) vs transformers GPT2LMHeadModel, same weights")
    print(f"   {bench.describe(config)}; torch threads {torch.get_num_threads()}; attention "
          f"{config._attn_implementation or 'sdpa'}; float32")
    directory = tempfile.mkdtemp(prefix="oslo-bench-overhead-")
    try:
        reference, control, model = build(config, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator)
    prompt = torch.randint(0, config.vocab_size, (args.gen_batch, args.prompt), generator=generator)

    problems = check_agreement(reference, model, input_ids, prompt, args.new_tokens)
    print(f"   agreement before timing (eval loss, logits, greedy tokens): "
          f"{'same' if not problems else '; '.join(problems)}")
    print("   verdicts use the median CPU time of this (single-threaded) process, which other processes "
          "sharing the CPUs inflate far less than wall time; wall time is shown too. 'transformers copy' "
          "is a second transformers model with the same weights: its ratio is the noise floor.")

    for m in (reference, control, model):
        m.train()
    runs = interleaved({"transformers": lambda: train_step(reference, input_ids),
                        "transformers copy": lambda: train_step(control, input_ids),
                        "oslo tp=1": lambda: train_step(model, input_ids)}, args.repeats)
    print(f"\n   forward+backward, batch {args.batch} x seq {args.seq}, training mode, "
          f"{args.repeats} runs each:")
    for name, values in runs.items():
        _print_times(name, values)
    base_wall, base_cpu = _medians(runs["transformers"])
    oslo_wall, oslo_cpu = _medians(runs["oslo tp=1"])
    ctrl_wall, ctrl_cpu = _medians(runs["transformers copy"])
    time_ok = oslo_cpu / base_cpu <= TIME_TARGET
    print(f"     control: transformers copy / transformers = {ctrl_cpu / base_cpu:.3f} cpu, "
          f"{ctrl_wall / base_wall:.3f} wall")
    print(f"     ratio oslo / transformers (median time) = {oslo_cpu / base_cpu:.3f} cpu, "
          f"{oslo_wall / base_wall:.3f} wall  target <= {TIME_TARGET}  [{bench.verdict(time_ok)}]")

    for m in (reference, control, model):
        m.eval()
    tokens = args.gen_batch * args.new_tokens
    runs = interleaved({"transformers": lambda: generate_time(reference, prompt, args.new_tokens),
                        "transformers copy": lambda: generate_time(control, prompt, args.new_tokens),
                        "oslo tp=1": lambda: generate_time(model, prompt, args.new_tokens)}, args.repeats)
    print(f"\n   generate(): greedy, batch {args.gen_batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, KV cache, {args.repeats} runs each:")
    for name, values in runs.items():
        _print_times(name, values, unit_fn=lambda seconds: tokens / seconds)
    base_wall, base_cpu = _medians(runs["transformers"])
    oslo_wall, oslo_cpu = _medians(runs["oslo tp=1"])
    ctrl_wall, ctrl_cpu = _medians(runs["transformers copy"])
    rate_ok = base_cpu / oslo_cpu >= TOKENS_TARGET
    print(f"     control: transformers copy / transformers tokens/s = {base_cpu / ctrl_cpu:.3f} cpu, "
          f"{base_wall / ctrl_wall:.3f} wall")
    print(f"     ratio oslo / transformers (tokens/s) = {base_cpu / oslo_cpu:.3f} cpu, "
          f"{base_wall / oslo_wall:.3f} wall  target >= {TOKENS_TARGET}  [{bench.verdict(rate_ok)}]")
    ok = time_ok and rate_ok and not problems
    print(f"\noverhead overall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.pop("RANK", None)  # tp=1 in a plain process: no launcher needed (or wanted)
    sys.exit(main())
