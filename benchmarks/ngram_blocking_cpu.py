"""N-gram repeat blocking on CPU: oslo's vectorized path vs transformers' processor, per generation step.

Claim (issue 3, "Benchmarks"): at batch x beams = 64, history 256 and 1024, n = 3, vocab 50257, the
vectorized path is >= 30x faster per step than transformers' ``NoRepeatNGramLogitsProcessor``. The
issue's "about 60 ms per step at 64 x 256" is transformers 4's algorithm; transformers 5 ships a
vectorized processor of its own. The verdict is printed against both; "overall" needs both.

Timed, per step (one call on ``[64, history]`` ids and ``[64, 50257]`` fp32 scores):

* ``transformers 5 processor``: ``NoRepeatNGramLogitsProcessor(3)`` of the installed transformers.
  Since transformers 5 it is itself vectorized (unfold + compare + a ``[rows, vocab + 1]`` ban mask +
  an out-of-place ``masked_fill``).
* ``transformers 4 algorithm``: the per-hypothesis n-gram dictionaries transformers used up to 4.x
  (``_get_ngrams`` / ``_get_generated_ngrams``, still shipped in ``transformers.generation``), plus the
  ``scores.clone()`` and per-row ban of that version. This is the "about 60 ms per step" baseline.
* ``oslo, copy``: ``no_repeat_ngram_block(ids, scores, 3)``; returns a modified copy of ``scores``.
  On CPU tensors this runs oslo's NumPy path.
* ``oslo, in place``: the same with ``inplace=True`` (what ``FusedNoRepeatNGramLogitsProcessor(3,
  inplace=True)`` does inside ``generate()`` when nobody else holds the scores tensor).
* ``oslo torch path, in place``: ``no_repeat_ngram_block_reference(..., inplace=True)``, the torch
  path that devices without Triton other than the CPU run; shown for comparison, not part of the claim.

Before timing, all five are checked to ban exactly the same tokens. Histories are drawn from a
Zipf-like distribution over the vocabulary so that prefixes recur and tokens get banned, as in text.
Runs alternate between the methods, so drift in machine load hits all of them; each figure is the
median over ``--repeats`` rounds of ``--steps`` calls.

Run: ``python benchmarks/ngram_blocking_cpu.py``; options: ``--rows 64 --histories 256 1024 --ngram 3
--vocab 50257 --steps 20 --repeats 7 --threads 1``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    _get_generated_ngrams,
    _get_ngrams,
)

from oslo.kernels import no_repeat_ngram_block, no_repeat_ngram_block_reference

TARGET = 30.0


def transformers4_processor(ngram_size: int):
    """transformers 4.x ``NoRepeatNGramLogitsProcessor.__call__``: per-row n-gram dictionaries."""

    def process(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, cur_len = input_ids.shape
        scores = scores.clone()
        if cur_len + 1 < ngram_size:
            return scores
        ngrams = _get_ngrams(ngram_size, input_ids, rows)
        for row in range(rows):
            banned = _get_generated_ngrams(ngrams[row], input_ids[row], ngram_size, cur_len)
            scores[row, banned] = -float("inf")
        return scores

    return process


def header() -> None:
    load = os.getloadavg()[0]
    print("== n-gram repeat blocking on CPU, per generation step")
    print(
        f"   {datetime.date.today()} | {platform.machine()} | {os.cpu_count()} CPUs | "
        f"torch {torch.__version__} | load average {load:.2f}"
    )
    if load > 0.5:
        print(f"   note: load average {load:.2f} > 0.5: other processes share the CPUs, timings are noisy.")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def zipf_history(rows: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(weights.expand(rows, vocab), length, replacement=True, generator=generator)


def per_step_ms(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps * 1e3


def measure(history: int, args: argparse.Namespace) -> bool:
    """Check and time the five methods at one history length; return whether the claim holds."""
    input_ids = zipf_history(args.rows, history, args.vocab, seed=history)
    scores = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    inplace_scores = scores.clone()
    hf5 = NoRepeatNGramLogitsProcessor(args.ngram)
    hf4 = transformers4_processor(args.ngram)
    methods = {
        "transformers 5 processor": lambda: hf5(input_ids, scores),
        "transformers 4 algorithm": lambda: hf4(input_ids, scores),
        "oslo, copy": lambda: no_repeat_ngram_block(input_ids, scores, args.ngram),
        "oslo, in place": lambda: no_repeat_ngram_block(input_ids, inplace_scores, args.ngram, inplace=True),
        "oslo torch path, in place": lambda: no_repeat_ngram_block_reference(
            input_ids, inplace_scores, args.ngram, inplace=True
        ),
    }
    expected = methods["transformers 5 processor"]()
    for name, fn in methods.items():
        if not torch.equal(fn(), expected):
            raise SystemExit(f"FAIL: {name} bans different tokens than transformers at history {history}")
    banned = torch.isinf(expected).sum().item()

    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            times[name].append(per_step_ms(methods[name], args.steps))
    ms = {name: statistics.median(values) for name, values in times.items()}

    print(f"\n-- history {history}: {banned} tokens banned over {args.rows} rows (identical for all methods)")
    for name in names:
        print(
            f"   {name:<26} {ms[name]:9.3f} ms/step median, {min(times[name]):9.3f} best   "
            f"(rounds: {', '.join(f'{t:.3f}' for t in times[name])})"
        )
    for baseline in ("transformers 5 processor", "transformers 4 algorithm"):
        for ours in ("oslo, copy", "oslo, in place", "oslo torch path, in place"):
            print(f"   speed-up {ours:<26} vs {baseline:<25} {ms[baseline] / ms[ours]:8.1f}x (medians)")
    ok = True
    for baseline in ("transformers 5 processor", "transformers 4 algorithm"):
        ratio = ms[baseline] / ms["oslo, in place"]
        ok &= ratio >= TARGET
        print(
            f"   claim (>= {TARGET:.0f}x, oslo in place vs {baseline}, medians): "
            f"{ratio:.1f}x {verdict(ratio >= TARGET)}"
        )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="batch size x number of beams")
    parser.add_argument("--histories", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=20, help="calls per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    header()
    print(
        f"   rows={args.rows} n={args.ngram} vocab={args.vocab} threads={args.threads} "
        f"steps={args.steps} repeats={args.repeats}"
    )
    results = [measure(history, args) for history in args.histories]
    print(f"\noverall: {verdict(all(results))}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
