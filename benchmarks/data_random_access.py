"""Random-access read throughput of DatasetForCausalLM for the mmap, lazy and cached impls.

Writes a dataset of random token ids (no tokenizer needed), then reads samples in a random order
through ``DatasetForCausalLM.__getitem__`` (the path a DataLoader takes) with each impl, and prints
samples/s and the ratio to ``cached`` (everything in memory, the upper bound). Two regimes:

  * warm: the .bin is in the OS page cache (a dataset that fits in RAM, after the first epoch);
  * cold: the .bin's pages are evicted first with ``posix_fadvise(DONTNEED)``, so reads go to disk
    (a corpus far larger than RAM). ``cached`` pays for its cold start in its construction time,
    which is printed separately.

    python benchmarks/data_random_access.py --tokens 20_000_000 --reads 5000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _evict(path: str) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=200_000_000, help="dataset size in tokens")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--reads", type=int, default=20_000, help="random samples read per impl and regime")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians are reported")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "oslo_data_bench")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from oslo.data import DatasetForCausalLM, IndexedDatasetBuilder

    args.workdir.mkdir(parents=True, exist_ok=True)
    prefix = str(args.workdir / f"random_access_{args.tokens}")
    for impl in ("mmap", "lazy"):  # the two index layouts; cached reads the legacy one
        if not os.path.exists(f"{prefix}_{impl}.idx"):
            rng = np.random.default_rng(0)
            with IndexedDatasetBuilder(f"{prefix}_{impl}", np.uint16, impl) as builder:
                for start in range(0, args.tokens, 1 << 22):
                    count = min(1 << 22, args.tokens - start)
                    sizes = np.full(max(1, count // 512), 512, dtype=np.int64)
                    sizes[-1] += count - sizes.sum()
                    builder.add_documents(rng.integers(0, 50_000, count, dtype=np.uint16), sizes)
    files = {"mmap": f"{prefix}_mmap", "lazy": f"{prefix}_lazy", "cached": f"{prefix}_lazy"}
    size_mb = os.path.getsize(f"{prefix}_mmap.bin") / 2**20
    print(f"dataset: {args.tokens:,} tokens ({size_mb:,.0f} MB .bin), samples of {args.seq_length} tokens")

    rates: dict[tuple[str, str], list[float]] = {}
    build_seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for regime in ("warm", "cold"):
            for impl in ("mmap", "lazy", "cached"):
                if regime == "cold":
                    _evict(files[impl] + ".bin")
                else:  # bring the file into the page cache
                    with open(files[impl] + ".bin", "rb") as stream:
                        while stream.read(64 << 20):
                            pass
                started = time.perf_counter()
                dataset = DatasetForCausalLM(
                    files[impl], args.seq_length, split_type="train", binarization_impl=impl, seed=0
                )
                build_seconds.setdefault((regime, impl), []).append(time.perf_counter() - started)
                order = np.random.default_rng(1).integers(0, len(dataset), args.reads)
                started = time.perf_counter()
                for index in order:
                    dataset[int(index)]
                rates.setdefault((regime, impl), []).append(args.reads / (time.perf_counter() - started))
                del dataset

    for regime in ("warm", "cold"):
        reference = statistics.median(rates[(regime, "cached")])
        for impl in ("mmap", "lazy", "cached"):
            rate = statistics.median(rates[(regime, impl)])
            build = statistics.median(build_seconds[(regime, impl)])
            print(
                f"{regime:>4} {impl:>6}: {rate:10,.0f} samples/s "
                f"({rate * args.seq_length / 1e6:8,.1f} M tokens/s)"
                f"  ratio to cached {rate / reference:5.2f}   construction {build:6.2f}s"
            )


if __name__ == "__main__":
    main()
