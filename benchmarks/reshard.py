"""Resharding in one process (issue 12): peak memory against the largest tensor, throughput against a file copy.

A gpt2-small-shaped GPT2LMHeadModel (124M parameters, fp32; its largest tensor is the 50257 x 768 embedding,
154 MB) is saved by transformers as ``model.safetensors``. Each conversion runs in a fresh process
(``python -m oslo reshard``), which samples its own resident set (``/proc/self/statm``, every 2 ms) from just
before the call to its end:

* plain -> split (tp, pp) = (4, 2), split (4, 2) -> split (2, 1), split (2, 1) -> plain (merged).

Reported per conversion: peak RSS above the RSS before the call, divided by the largest tensor's bytes (claim:
about 1, at most 2.5 — a tensor being assembled and the one being written); throughput (bytes written / wall
time) divided by that of ``shutil.copyfile`` of the source's weight bytes on the same disk (the reference:
resharding reads and writes every byte once, as a copy does).

Run: ``python benchmarks/reshard.py`` (``--layers N`` for a smaller model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, os, sys, threading, time
import oslo
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
peak, stop = [0], []
def sample():
    while not stop:
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
src, dst, tp, pp, merged = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
base = rss()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
oslo.reshard_checkpoint(src, dst, tp, pp, merged=merged, progress=False)
elapsed = time.perf_counter() - start
stop.append(1)
thread.join()
peak[0] = max(peak[0], rss())
print(json.dumps({"extra": peak[0] - base, "seconds": elapsed}))
"""


def _weight_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.endswith((".safetensors", ".bin")))


def _copy_rate(directory: str, scratch: str) -> float:
    """Bytes per second of shutil.copyfile over the directory's weight files (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for name in os.listdir(directory):
            if name.endswith((".safetensors", ".bin")):
                shutil.copyfile(os.path.join(directory, name), os.path.join(scratch, name))
                with open(os.path.join(scratch, name), "rb+") as f:
                    os.fsync(f.fileno())  # the reshard flushes its files too
        best = min(best, time.perf_counter() - start)
    return _weight_bytes(directory) / best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()

    import torch
    import transformers

    config = transformers.GPT2Config(n_layer=args.layers)  # gpt2-small's shapes
    root = tempfile.mkdtemp(prefix="oslo-reshard-bench-")
    try:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(f"{root}/plain")
        del model
        print(f"GPT2LMHeadModel, {args.layers} layers of gpt2-small; largest tensor {largest / 1e6:.0f} MB; "
              f"weights {_weight_bytes(f'{root}/plain') / 1e6:.0f} MB")
        print(f"{'conversion':<28}{'peak RSS / largest':>20}{'GB/s':>8}{'÷ copy':>9}")
        for label, src, dst, tp, pp, merged in [
            ("plain -> (4, 2)", "plain", "s42", 4, 2, False),
            ("(4, 2) -> (2, 1)", "s42", "s21", 2, 1, False),
            ("(2, 1) -> plain", "s21", "merged", 1, 1, True),
        ]:
            done = subprocess.run([sys.executable, "-c", _CHILD, f"{root}/{src}", f"{root}/{dst}", str(tp), str(pp),
                                   "1" if merged else "0"], capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            written = _weight_bytes(f"{root}/{dst}")
            os.makedirs(f"{root}/copy-{dst}")
            rate = written / result["seconds"]
            reference = _copy_rate(f"{root}/{src}", f"{root}/copy-{dst}")
            shutil.rmtree(f"{root}/copy-{dst}")
            print(f"{label:<28}{result['extra'] / largest:>20.2f}{rate / 1e9:>8.2f}{rate / reference:>9.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
