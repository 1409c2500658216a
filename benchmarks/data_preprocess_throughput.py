"""Preprocessing throughput vs the tokenizer's own batch encoding on the same text.

Claim: DatasetPreprocessor's binarization and I/O overhead is at most 10%, i.e. its end-to-end
tokens/s (read the .txt file, tokenize in worker processes, write .bin/.idx) is at least 0.9x the
tokens/s of the tokenizer batch-encoding the same documents already held in memory.

Two references are timed, both using every core through the Rust tokenizer's thread pool:
  * ``tokenizer(batch)["input_ids"]`` -- what a user calls (the stated reference);
  * ``backend.encode_batch_fast(batch)`` -- the bare Rust encoder, a stricter bound.
Runs alternate (reference, oslo, oslo, reference, ...) so load from other processes hits both
sides alike; each run's oslo/reference ratio is taken and the median over runs is reported.
Because wall-clock rates swing with whatever else runs on the machine, tokens per CPU-second
(user + system time of this process and its reaped workers) are reported as well: that ratio
measures the work oslo adds, independent of contention.

    python benchmarks/data_preprocess_throughput.py --size-mb 16 --repeats 10
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "men",
    "sa",
    "lo",
    "pe",
    "an",
    "ther",
    "ing",
    "ed",
    "re",
    "con",
    "di",
    "va",
    "ul",
    "es",
    "or",
    "ta",
    "bu",
    "ne",
    "mi",
    "st",
    "ch",
    "qu",
    "ph",
    "ly",
    "ou",
    "ea",
    "io",
    "ar",
    "er",
    "in",
    "on",
    "at",
    "en",
    "it",
    "is",
    "al",
    "le",
    "de",
    "co",
    "pro",
    "ex",
    "un",
    "ab",
    "ob",
    "sub",
    "inter",
    "tion",
    "ment",
    "ness",
    "able",
    "ful",
]


def make_corpus(path: Path, size_mb: float, seed: int = 0) -> Path:
    """Write a synthetic corpus of about ``size_mb`` MB: one document per line, Zipf-distributed words.

    A pool of 20,000 documents (about 30 MB) is generated once and lines are drawn from it at
    random until the size is reached, so even 1 GB is written in well under a minute.
    """
    target = int(size_mb * 1024 * 1024)
    if path.exists() and path.stat().st_size >= target * 0.99:
        return path
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4, size=50_000)
    words = np.array(["".join(rng.choice(_SYLLABLES, n)) for n in lengths], dtype=object)
    probabilities = 1.0 / np.arange(1, len(words) + 1)
    probabilities /= probabilities.sum()
    pool = []
    for _ in range(20_000):
        count = int(rng.integers(20, 600))
        text = " ".join(rng.choice(words, count, p=probabilities))
        pool.append(text.capitalize() + ".\n")
    written = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as stream:
        while written < target:
            block = "".join(pool[i] for i in rng.integers(0, len(pool), size=2000))
            stream.write(block)
            written += len(block)
    tmp.replace(path)
    return path


def make_tokenizer(path: Path, corpus: Path, vocab_size: int = 32_000):
    """Train (once) a byte-level BPE tokenizer on the first 8 MB of the corpus; returns an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not path.exists():
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        with open(corpus, encoding="utf-8") as stream:
            sample = stream.read(8 << 20).splitlines()
        tokenizer.train_from_iterator(sample, trainer)
        tokenizer.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) and of its reaped children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _timed(function, *arguments) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = function(*arguments)
    return result, time.perf_counter() - wall, _cpu_seconds() - cpu


def _reference_hf(tokenizer, documents: list[str], batch: int) -> int:
    tokens = 0
    for start in range(0, len(documents), batch):
        tokens += sum(map(len, tokenizer(documents[start : start + batch])["input_ids"]))
    return tokens


def _reference_backend(tokenizer, documents: list[str], batch: int) -> int:
    backend = tokenizer.backend_tokenizer
    tokens = 0
    for start in range(0, len(documents), batch):
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(documents[start : start + batch]))
    return tokens


def _oslo(preprocessor, corpus: Path, prefix: str) -> int:
    with open(corpus, encoding="utf-8") as source:
        stats = preprocessor.preprocess(source, prefix, progress_bar=False)
    # the preprocessor also writes one EOD per document; count only the tokenizer's tokens
    return stats.tokens - stats.documents


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=16, help="corpus size in MB")
    parser.add_argument("--repeats", type=int, default=10, help="alternating runs of each side")
    parser.add_argument("--chunk-size", type=int, default=1024, help="documents per chunk / batch")
    parser.add_argument("--num-workers", type=int, default=None, help="default: usable CPUs")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "oslo_data_bench")
    args = parser.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # the references use every core
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from oslo.data import DatasetPreprocessor

    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(args.workdir / f"corpus_{args.size_mb:g}mb.txt", args.size_mb)
    tokenizer = make_tokenizer(args.workdir / "tokenizer.json", corpus)
    with open(corpus, encoding="utf-8") as stream:
        documents = stream.read().splitlines()
    preprocessor = DatasetPreprocessor(
        tokenizer,
        chunk_size=args.chunk_size,
        num_workers=args.num_workers,
        eod_token_id=tokenizer.eos_token_id,
    )
    print(
        f"corpus: {corpus.stat().st_size / 2**20:.0f} MB, {len(documents):,} documents; "
        f"vocab {len(tokenizer):,}; "
        f"cpus {os.cpu_count()}; workers {preprocessor.num_workers}; load average {os.getloadavg()[0]:.2f}"
    )

    sides = {
        "tokenizer(batch)": (_reference_hf, tokenizer, documents, args.chunk_size),
        "backend.encode_batch_fast": (_reference_backend, tokenizer, documents, args.chunk_size),
        "oslo preprocess": (_oslo, preprocessor, corpus, str(args.workdir / "throughput")),
    }
    wall_rates: dict[str, list[float]] = {name: [] for name in sides}
    cpu_rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for repeat in range(args.repeats):
        counts = []
        # alternate the order so that neither side always runs right after the other
        for name in names if repeat % 2 == 0 else names[::-1]:
            function, *arguments = sides[name]
            tokens, wall, cpu = _timed(function, *arguments)
            counts.append(tokens)
            wall_rates[name].append(tokens / wall)
            cpu_rates[name].append(tokens / cpu)
        assert len(set(counts)) == 1, f"sides disagree on the token count: {counts}"
        print(
            f"run {repeat + 1} ({counts[0]:,} tokens, load {os.getloadavg()[0]:.2f}): "
            + " | ".join(
                f"{name} {wall_rates[name][-1]:,.0f} tok/s, {cpu_rates[name][-1]:,.0f} tok/cpu-s"
                for name in names
            ),
            flush=True,
        )
    ours = "oslo preprocess"
    for reference in ("tokenizer(batch)", "backend.encode_batch_fast"):
        # ratios are paired within a run (the sides ran back to back) and the median is taken
        wall = statistics.median(o / r for o, r in zip(wall_rates[ours], wall_rates[reference], strict=True))
        cpu = statistics.median(o / r for o, r in zip(cpu_rates[ours], cpu_rates[reference], strict=True))
        claim = "   (claim: >= 0.90)" if reference == "tokenizer(batch)" else ""
        print(
            f"oslo / {reference}: median wall-clock tokens/s ratio {wall:.3f}, "
            f"median tokens-per-CPU-second ratio {cpu:.3f}{claim}"
        )
    for suffix in (".bin", ".idx"):
        (args.workdir / f"throughput{suffix}").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
