"""Where a training step of oslo spends its time on a GPU, beside transformers': a profile, not a benchmark.

The workload of ``benchmarks/gpu_step.py`` (GPT2 at gpt2-medium's shape, random weights, bf16 autocast, ``--batch``
8 x ``--seq`` 1024 tokens, ``--layers`` 24, dropout 0.1, AdamW), for transformers, oslo and oslo after ``fuse()``:
each model warmed up, then ``--steps`` steps under ``torch.profiler`` (CPU and CUDA activities). Printed per model:
the wall time of a step, the GPU's busy time in it (the kernels' time summed: the gap is time the GPU waited for the
CPU), the calls that make the host wait for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``cudaMemcpy``; ``cudaFree`` and ``cudaMalloc``: the caching allocator giving memory back), and the ``--top``
operators by their own GPU time. What it is for: finding what oslo's step does that transformers' does not (numbers
to compare are in ``gpu_step.py``'s output, not here).

Run: ``python benchmarks/gpu_profile.py`` (about 30 s on an H100); without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import oslo

_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaFree", "cudaMalloc")


def _step(model, optimizer, ids) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _report(name: str, model, ids, steps: int, top: int) -> dict[tuple[str, str], tuple[float, int]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for _ in range(3):
        _step(model, optimizer, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            _step(model, optimizer, ids)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    by_shape = prof.key_averages(group_by_input_shape=True)
    cuda = torch.autograd.DeviceType.CUDA
    busy = sum(e.self_device_time_total for e in events if e.device_type == cuda) / steps / 1e6  # µs -> s
    syncs = {e.key: e.count // steps for e in events if e.key in _SYNCS}
    print(f"\n== {name}: step {1e3 * wall:.1f} ms, GPU busy {1e3 * busy:.1f} ms ({100 * busy / wall:.0f} %); "
          f"per step: {syncs or 'no host synchronization'}")
    rows = sorted((e for e in events if e.device_type != cuda and e.self_device_time_total > 0),
                  key=lambda e: e.self_device_time_total, reverse=True)[:top]
    for e in rows:
        print(f"   {e.self_device_time_total / steps / 1e3:8.2f} ms  {e.count // steps:5d} calls  {e.key[:90]}")
    return {(e.key, str(e.input_shapes)[:120]): (e.self_device_time_total / steps / 1e3, e.count // steps)
            for e in by_shape if e.device_type != cuda and e.self_device_time_total > 0}


def _differences(name: str, ours: dict, theirs: dict, top: int) -> None:
    """The operators (with their input shapes) whose GPU time per step differs most between two models."""
    rows = []
    for key in set(ours) | set(theirs):
        mine, other = ours.get(key, (0.0, 0)), theirs.get(key, (0.0, 0))
        rows.append((mine[0] - other[0], key, mine, other))
    rows.sort(key=lambda row: abs(row[0]), reverse=True)
    total = sum(row[0] for row in rows)
    print(f"\n== {name} minus transformers: {total:+.2f} ms of GPU time per step; the largest differences "
          "(ms, calls: theirs -> ours; operator, input shapes):")
    for diff, (key, shapes), mine, other in rows[:top]:
        print(f"   {diff:+7.2f} ms  {other[0]:7.2f} ({other[1]:3d}) -> {mine[0]:7.2f} ({mine[1]:3d})  "
              f"{key[:40]} {shapes}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device on this machine; nothing profiled.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=args.layers, n_head=16,
                                     bos_token_id=50256, eos_token_id=50256, pad_token_id=50256)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    print(f"== gpu_profile on {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.layers} layers, "
          f"{args.batch} x {args.seq} tokens, bf16 autocast")
    with tempfile.TemporaryDirectory() as checkpoint:
        reference.save_pretrained(checkpoint)
        models = {"transformers": lambda: reference.cuda().train(),
                  "oslo": lambda: oslo.GPT2LMHeadModel.from_pretrained_with_parallel(checkpoint).cuda().train(),
                  "oslo fuse()": lambda: oslo.GPT2LMHeadModel.from_pretrained_with_parallel(checkpoint).cuda()
                  .train().fuse()}
        profiles = {}
        for name, build in models.items():
            try:
                model = build()
                profiles[name] = _report(name, model, ids, args.steps, args.top)
            except Exception as error:  # noqa: BLE001 - say so, profile the others
                print(f"\n== {name}: {type(error).__name__}: {error}")
            model = None
            torch.cuda.empty_cache()
    for name, profile_ in profiles.items():
        if name != "transformers" and "transformers" in profiles:
            _differences(name, profile_, profiles["transformers"], 2 * args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
