"""Peak memory of DatasetPreprocessor is flat in the input size.

Claim: preprocessing streams its input and writes its output incrementally, so peak memory does not
grow with the corpus: a 1 GB corpus peaks at about the same memory as a 64 MB one.

Each corpus is preprocessed in a fresh child process while this script samples, every 50 ms, the
memory of the child and of its tokenizer workers: the summed PSS (proportional set size, which
splits pages shared between the forked processes instead of counting them once per process) and
the RSS of the main process. The printed ratio is peak(largest corpus) / peak(smallest corpus).

    python benchmarks/data_preprocess_memory.py --sizes-mb 16 64           # quick
    python benchmarks/data_preprocess_memory.py --sizes-mb 64 256 1024     # the 1 GB-class run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _read_kb(path: str, field: str) -> int:
    try:
        with open(path) as stream:
            for line in stream:
                if line.startswith(field):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _tree(pid: int) -> list[int]:
    pids, stack = [], [pid]
    while stack:
        current = stack.pop()
        pids.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as stream:
                    stack.extend(int(child) for child in stream.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pids


class _Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_tree_pss_kb = 0
        self.peak_main_rss_kb = 0
        self.peak_processes = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = _tree(self.pid)
            pss = sum(_read_kb(f"/proc/{pid}/smaps_rollup", "Pss:") for pid in pids)
            self.peak_tree_pss_kb = max(self.peak_tree_pss_kb, pss)
            self.peak_main_rss_kb = max(self.peak_main_rss_kb, _read_kb(f"/proc/{self.pid}/status", "VmRSS:"))
            self.peak_processes = max(self.peak_processes, len(pids))
            time.sleep(0.05)


def _child(corpus: str, tokenizer_path: str, output: str, num_workers: int | None) -> None:
    """Runs in the measured process: preprocess one corpus and report the counts as JSON."""
    sys.path.insert(0, str(_HERE.parent))
    from transformers import PreTrainedTokenizerFast

    from oslo.data import DatasetPreprocessor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_path, eos_token="<|endoftext|>")
    preprocessor = DatasetPreprocessor(tokenizer, num_workers=num_workers)
    with open(corpus, encoding="utf-8") as source:
        stats = preprocessor.preprocess(source, output, progress_bar=False)
    print(json.dumps({"documents": stats.documents, "tokens": stats.tokens, "seconds": stats.seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--num-workers", type=int, default=None, help="default: usable CPUs")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "oslo_data_bench")
    parser.add_argument("--keep-corpora", action="store_true", help="do not delete generated corpora")
    parser.add_argument("--child", nargs=3, metavar=("CORPUS", "TOKENIZER", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, args.num_workers)
        return

    sys.path.insert(0, str(_HERE))
    from data_preprocess_throughput import make_corpus, make_tokenizer

    args.workdir.mkdir(parents=True, exist_ok=True)
    sizes = sorted(args.sizes_mb)
    tokenizer_path = args.workdir / "tokenizer.json"
    rows = []
    for size in sizes:
        corpus = make_corpus(args.workdir / f"corpus_{size:g}mb.txt", size)
        make_tokenizer(tokenizer_path, corpus)
        output = args.workdir / f"memory_{size:g}mb"
        command = [sys.executable, __file__, "--child", str(corpus), str(tokenizer_path), str(output)]
        if args.num_workers is not None:
            command += ["--num-workers", str(args.num_workers)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        sampler = _Sampler(process.pid)
        sampler.start()
        stdout, _ = process.communicate()
        sampler.stop.set()
        sampler.join()
        if process.returncode != 0:
            raise SystemExit(f"preprocessing {corpus} failed with exit code {process.returncode}")
        stats = json.loads(stdout.strip().splitlines()[-1])
        bin_mb = os.path.getsize(f"{output}.bin") / 2**20
        rows.append((size, corpus.stat().st_size / 2**20, bin_mb, stats, sampler))
        print(
            f"{corpus.stat().st_size / 2**20:8.0f} MB corpus -> {bin_mb:7.0f} MB .bin, "
            f"{stats['tokens']:,} tokens "
            f"in {stats['seconds']:.0f}s ({stats['tokens'] / stats['seconds']:,.0f} tok/s) | peak PSS of "
            f"{sampler.peak_processes} processes {sampler.peak_tree_pss_kb / 1024:,.0f} MB | peak main RSS "
            f"{sampler.peak_main_rss_kb / 1024:,.0f} MB",
            flush=True,
        )
        for suffix in (".bin", ".idx"):
            Path(f"{output}{suffix}").unlink(missing_ok=True)
        if not args.keep_corpora:
            corpus.unlink(missing_ok=True)
    if len(rows) > 1:
        small, large = rows[0], rows[-1]
        input_ratio = large[1] / small[1]
        print(
            f"input grew {input_ratio:.1f}x; peak PSS ratio (largest / smallest) "
            f"{large[4].peak_tree_pss_kb / small[4].peak_tree_pss_kb:.3f}; peak main RSS ratio "
            f"{large[4].peak_main_rss_kb / small[4].peak_main_rss_kb:.3f}  (claim: flat, ~1.0)"
        )


if __name__ == "__main__":
    main()
