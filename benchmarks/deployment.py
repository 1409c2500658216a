"""The deployment launcher's costs (oslo/deployment.py): a model in worker processes driven from plain python.

Claims (issue "Deployment launcher"): through the launcher, ``generate()`` runs at >= 0.95 of the tokens/s
of the same layout run in-process under a launcher; a call's round trip (command to every worker, inputs and
outputs through shared memory) adds a few milliseconds.

Measured, at tensor_parallel_size=2 (two workers, one torch thread each, as the in-process reference):

* per-call overhead: median wall time of a tiny GPT2's forward (1 x 8 tokens) through the launcher vs the
  same call on the ranks of an in-process launch (forked ranks with the launcher's variables, each timing
  its own call; the slowest rank counts);
* generate tokens/s: greedy ``generate`` of exactly ``--new-tokens`` tokens by a GPT2 (width 256, 4 blocks,
  vocab 8000), KV cache on, through the launcher vs in-process; runs alternate between the two;
* the example server (``examples/deployment_server.py``, tiny GPT2, 4 new tokens a request): requests/s at
  1, 4 and 16 concurrent HTTP clients (threads of this process).

Run: ``python benchmarks/deployment.py`` (about 2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _tp_harness as harness  # first: pins torch threads before torch is used
import torch
import transformers
from transformers import GPT2Config

import oslo
from oslo.launch import free_port

ROOT = Path(__file__).resolve().parent.parent


def _configs() -> dict[str, GPT2Config]:
    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return {
        "tiny": GPT2Config(vocab_size=1001, n_positions=64, n_embd=64, n_layer=2, n_head=4, **common),
        "mid": GPT2Config(vocab_size=8000, n_positions=256, n_embd=256, n_layer=4, n_head=8, **common),
    }


def _setup(rank, world_size, directories, new_tokens):
    models = {name: oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
              for name, path in directories.items()}

    def handle(command):
        kind, repeats = command
        if kind == "forward":
            ids = torch.arange(3, 11).unsqueeze(0)
            times = []
            with torch.no_grad():
                for _ in range(repeats):
                    start = time.perf_counter()
                    models["tiny"](ids)
                    times.append(time.perf_counter() - start)
            return times
        prompt = torch.arange(3, 19).unsqueeze(0)
        start = time.perf_counter()
        models["mid"].generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        return time.perf_counter() - start

    return handle


def _server_rates(directory: str, concurrencies: list[int], requests: int) -> dict[int, float]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "deployment_server.py"), directory, "--tensor-parallel-size", "2",
         "--port", str(port)], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    body = json.dumps({"input_ids": [5, 6, 7, 8], "max_new_tokens": 4}).encode()

    def post(_):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return len(json.loads(response.read())["output_ids"][0])

    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the example server did not start") from None
                time.sleep(0.5)
        post(0)  # warm-up
        rates = {}
        for clients in concurrencies:
            with ThreadPoolExecutor(clients) as pool:
                start = time.perf_counter()
                answers = list(pool.map(post, range(requests)))
                rates[clients] = requests / (time.perf_counter() - start)
            assert all(length == 8 for length in answers)
        return rates
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=50, help="forward calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100, help="HTTP requests per concurrency level")
    args = parser.parse_args()
    harness.header("deployment launcher: overhead and throughput (tp=2, one torch thread per worker)")

    with tempfile.TemporaryDirectory() as root:
        directories = {}
        for name, config in _configs().items():
            torch.manual_seed(0)
            directories[name] = os.path.join(root, name)
            transformers.GPT2LMHeadModel(config).save_pretrained(directories[name])
        print(f"tiny: {harness.describe(_configs()['tiny'])}\nmid:  {harness.describe(_configs()['mid'])}")

        in_process = harness.WorkerGroup(_setup, 2, directories, args.new_tokens)
        deployed = {name: oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
            path, tensor_parallel_size=2, deployment=True) for name, path in directories.items()}
        try:
            ids = torch.arange(3, 11).unsqueeze(0)
            prompt = torch.arange(3, 19).unsqueeze(0)
            with torch.no_grad():
                expected = in_process.call(("forward", 1))  # warm-up of both
                deployed["tiny"](ids)
            launcher_call, local_call, launcher_gen, local_gen = [], [], [], []
            for _ in range(args.rounds):
                local_call += [max(times) for times in zip(*in_process.call(("forward", args.calls)), strict=True)]
                for _ in range(args.calls):
                    start = time.perf_counter()
                    deployed["tiny"](ids)
                    launcher_call.append(time.perf_counter() - start)
                local_gen.append(max(in_process.call(("generate", 0))))
                start = time.perf_counter()
                tokens = deployed["mid"].generate(prompt, max_new_tokens=args.new_tokens,
                                                  min_new_tokens=args.new_tokens, pad_token_id=0)
                launcher_gen.append(time.perf_counter() - start)
                assert tokens.shape[1] == prompt.shape[1] + args.new_tokens
            del expected
        finally:
            in_process.close()
            for model in deployed.values():
                model.close()

        call_launcher, call_local = statistics.median(launcher_call), statistics.median(local_call)
        print(f"\nforward round trip, tiny GPT2, 1 x 8 tokens (median of {len(launcher_call)}):")
        print(f"  through the launcher {call_launcher * 1e3:7.2f} ms")
        print(f"  in-process (tp=2)    {call_local * 1e3:7.2f} ms")
        print(f"  overhead             {(call_launcher - call_local) * 1e3:7.2f} ms per call")
        rate_launcher = args.new_tokens / statistics.median(launcher_gen)
        rate_local = args.new_tokens / statistics.median(local_gen)
        ratio = rate_launcher / rate_local
        print(f"\ngenerate, mid GPT2, {args.new_tokens} new tokens (median of {args.rounds}, runs alternating):")
        print(f"  through the launcher {rate_launcher:7.1f} tokens/s")
        print(f"  in-process (tp=2)    {rate_local:7.1f} tokens/s")
        print(f"  ratio                {ratio:7.3f}  (claim >= 0.95: {harness.verdict(ratio >= 0.95)})")

        rates = _server_rates(directories["tiny"], [1, 4, 16], args.requests)
        print(f"\nexample server (examples/deployment_server.py, tiny GPT2, tp=2, 4 new tokens, {args.requests} "
              "requests per level):")
        for clients, rate in rates.items():
            print(f"  {clients:2d} concurrent clients {rate:7.1f} requests/s")


if __name__ == "__main__":
    main()
