"""Activation checkpointing: activation memory per pipeline stage and step time, with and without (gloo, CPU).

What runs: ``oslo.GPT2LMHeadModel`` at gpt2-medium width (n_embd 1024, n_head 16, vocab 50257) with
8 layers (``--n-layer``), a training step on a batch of 4 x 256 tokens, float32, dropout 0, one torch
thread per process, in two layouts:

* pp=2: two forked gloo ranks, ``micro_batch_size=2`` (m = 2 micro-batches; stage 0 holds the
  embeddings and 4 blocks, stage 1 4 blocks and the LM head), ``for micro_output in model(...):
  micro_output.loss.backward()``;
* pp=1: one plain process, the whole batch in one ``model(...).loss.backward()``.

Each layout runs without and with ``model.activation_checkpointing_enable()``. Every configuration
is a long-lived process group that builds its model and runs one warm-up step; the configurations'
steps then alternate (order reversed every other round). Two separate sets of processes are used,
one after the other: one for memory (``--memory-iters`` steps, default 2, medians) and one for time
(``--iters`` steps, default 3, medians of the slowest rank), because making RSS exact needs an
allocator setting that slows large allocations down.

Activation memory of a step = peak RSS during the step - RSS just before it. Before the step the
process already holds the parameters and, from the warm-up, the gradients (``zero_grad`` keeps them
allocated); it runs ``gc.collect()`` and ``malloc_trim(0)``, reads ``VmRSS`` and resets the kernel's
peak-RSS counter (``/proc/self/clear_refs``, the harness's ``reset_peak_rss``); after the step it
reads ``VmHWM``: the exact peak, not a sample. torch's CPU allocator keeps no statistics, so the
memory processes make RSS follow the tensors: before building the model they set glibc's
``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` to 256 KiB, so every tensor of 256 KiB or more has its
own mapping, returned to the system when freed (otherwise glibc keeps freed blocks and the second
step's activations hide inside memory kept from the first). The timing processes keep glibc's
defaults. The script also measures, with ``torch.autograd.graph.saved_tensors_hooks``, the bytes
autograd keeps from one block's forward on the whole batch (distinct storages, parameters
excluded), without checkpointing (its activations) and with (its input only).

Expected. Without checkpointing a stage keeps every block's activations of each micro-batch in
flight (1F1B: stage ``s`` holds ``min(p - s, m)`` micro-batches at its peak): about 112 MiB per
block at 4 x 256 tokens (measured as above), 896 MiB for 8 blocks. With checkpointing a block keeps
only its input (4 MiB at 4 x 256) and recomputes the rest in the backward, one block at a time: the
blocks' share should fall to 4-16 % (inputs, plus one block's activations while it is recomputed).
Not checkpointed, and the same with and without: the LM head's logits (b x s x 50257 x 4 bytes:
196 MiB at 4 x 256, half per micro-batch of 2), the loss's log-softmax and the logits' gradient,
and the backward's temporaries, notably the dense gradient of the 196 MiB ``wte`` / ``lm_head``
matrix before it is added into ``.grad`` (at pp=1, where they are tied, autograd holds the head's
until the embedding's arrives and sums them). So the measured whole-step fraction that remains lies
well above the blocks' 4-16 %, most of all on the stage with the LM head, and depends on where in
the step the peak falls. The script prints, per stage, the blocks' expected saving next to the
measured one. Step time: checkpointing recomputes every block's forward once; by FLOPs (a block
24 h^2 + 4 h s per token, the head 2 h V, about 3.9 blocks at this shape; backward = 2 x forward)
with / without is 1 + 8 / (3 x (8 + 3.9)) = 1.22 at pp=1; at pp=2 stage 0 (4 blocks) 1.33 and
stage 1 (4 blocks + head) 1 + 4 / (3 x 7.9) = 1.17, which stays the slower stage and sets the step.
No PASS/FAIL: the script prints the fraction of the activation memory that remains and the time
ratio.

Run: ``python benchmarks/checkpointing.py`` (about 9 minutes on 2 cores: a step takes 15-20 s);
options: ``--n-layer 8 --batch 4 --seq 256 --micro-batch-size 2 --iters 3 --memory-iters 2
--layouts 1 2``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys

import _tp_harness as bench
import torch
import torch.distributed as dist

import oslo
from oslo.parallel.dtensor import local_named_parameters

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc settings of the memory processes (set before the model is built): every allocation of
# 256 KiB or more gets its own mapping, unmapped when freed, so that RSS follows the live tensors.
TRACKING = {M_MMAP_THRESHOLD: 256 * 1024, M_TRIM_THRESHOLD: 256 * 1024}


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _mallopt(settings: dict[int, int]) -> bool:
    libc = _libc()
    return libc is not None and all(libc.mallopt(option, value) == 1 for option, value in settings.items())


def _release_free_memory() -> None:
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _setup(rank: int, world_size: int, config, batch: int, seq: int, micro: int, checkpointing: bool,
           measure: str):
    tracked = _mallopt(TRACKING) if measure == "memory" else False
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, pipeline_parallel_size=world_size, micro_batch_size=micro, seed=0
    ).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        if world_size > 1:
            for micro_output in model(input_ids=input_ids, labels=input_ids):
                micro_output.loss.backward()
        else:
            model(input_ids=input_ids, labels=input_ids).loss.backward()

    step()  # warm-up: allocates the gradients

    def saved_by_one_block() -> int:
        """Bytes autograd keeps from one block's forward on the whole batch (distinct storages, parameters
        excluded): its activations without checkpointing, its input with."""
        block = next(iter(model.transformer.h))
        parameters = {p.untyped_storage().data_ptr() for _, p in local_named_parameters(model)}
        storages: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        hidden = torch.randn(batch, seq, config.n_embd, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = block(hidden)[0]
        del output
        return sum(storages.values())

    def handle(command: str):
        if command == "saved":
            return saved_by_one_block()
        model.zero_grad(set_to_none=False)  # the gradients stay allocated
        if measure == "time":
            if world_size > 1:
                dist.barrier()
            return bench.timed(step)
        gc.collect()
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)  # give back the little glibc still keeps
        if world_size > 1:
            dist.barrier()
        before = bench.proc_status("VmRSS")["VmRSS"]
        reset = bench.reset_peak_rss()
        step()
        peak = bench.proc_status("VmHWM")["VmHWM"]
        return {"before": before, "peak": peak, "reset": reset, "tracked": tracked,
                "parameters": sum(p.numel() * p.element_size() for _, p in local_named_parameters(model))}

    return handle


def _alternate(configurations, args, config, measure: str, iters: int) -> dict:
    """Build one process group per configuration, then run ``iters`` steps of each, alternating the order."""
    groups = {}
    results = {name: [] for name in configurations}
    try:
        for pp, checkpointing in configurations:
            micro = args.micro_batch_size if pp > 1 else args.batch
            groups[(pp, checkpointing)] = bench.WorkerGroup(
                _setup, pp, config, args.batch, args.seq, micro, checkpointing, measure, env=pp > 1
            )
        for i in range(iters):
            for name in configurations if i % 2 == 0 else configurations[::-1]:
                results[name].append(groups[name].call("step"))
        if measure == "memory":
            for checkpointing in (False, True):
                results[("saved", checkpointing)] = groups[(args.layouts[0], checkpointing)].call("saved")[0]
    finally:
        for group in groups.values():
            group.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8, help="layers (gpt2-medium width)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="for pp=2")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per configuration (medians)")
    parser.add_argument("--memory-iters", type=int, default=2, help="memory steps per configuration (medians)")
    parser.add_argument("--layouts", type=int, nargs="+", default=[1, 2], help="pipeline sizes to run")
    args = parser.parse_args(argv)
    config = bench.gpt2_config("medium", n_layer=args.n_layer)
    bench.header("activation checkpointing: activation memory and step time (gloo, CPU)")
    print(f"   {bench.describe(config)}; batch {args.batch} x {args.seq} tokens, float32, dropout 0; pp=2 with "
          f"micro-batches of {args.micro_batch_size}, pp=1 the whole batch; 1 torch thread per process; "
          f"1 warm-up + {args.iters} steps per configuration, alternating")
    logits = args.batch * args.seq * config.vocab_size * 4
    print(f"   logits of the whole batch (not checkpointed): {bench.mib(logits)}; one block's input: "
          f"{bench.mib(args.batch * args.seq * config.n_embd * 4)}")

    configurations = [(pp, checkpointing) for pp in args.layouts for checkpointing in (False, True)]
    memory = _alternate(configurations, args, config, "memory", args.memory_iters)
    times = _alternate(configurations, args, config, "time", args.iters)
    saved = {checkpointing: memory.pop(("saved", checkpointing)) for checkpointing in (False, True)}
    times = {name: [max(ranks) for ranks in values] for name, values in times.items()}

    first = memory[configurations[0]][0][0]
    if not (first["tracked"] and first["reset"]):
        print(f"   note: mallopt applied: {first['tracked']}; peak-RSS reset allowed: {first['reset']} "
              "(without them the numbers below are less exact)")
    print(f"   kept by autograd from one block's forward on the whole batch: {bench.mib(saved[False])} without "
          f"checkpointing, {bench.mib(saved[True])} with (its input)")
    for pp in args.layouts:
        off, on = memory[(pp, False)], memory[(pp, True)]
        micro = args.micro_batch_size if pp > 1 else args.batch
        m = args.batch // micro
        blocks = [len(r) for r in oslo.GPT2LMHeadModel.pipeline_partition(config, pp)]
        time_off, time_on = bench.median(times[(pp, False)]), bench.median(times[(pp, True)])
        print(f"\npp={pp}" + (f", micro-batches of {args.micro_batch_size} (m = {args.batch // args.micro_batch_size})"
                              if pp > 1 else ", whole batch"))
        print("    stage  parameters   RSS before step   activation memory: without    with checkpointing   "
              "remaining")
        for s in range(pp):
            act_off = bench.median([ranks[s]["peak"] - ranks[s]["before"] for ranks in off])
            act_on = bench.median([ranks[s]["peak"] - ranks[s]["before"] for ranks in on])
            before = bench.median([ranks[s]["before"] for ranks in off])
            print(f"    {s:>5}  {bench.mib(off[0][s]['parameters']):>10}   {bench.mib(before):>15}   "
                  f"{bench.mib(act_off):>26}   {bench.mib(act_on):>18}   {act_on / act_off:>9.1%}")
            each_off = ", ".join(f"{(r[s]['peak'] - r[s]['before']) / 2**20:.0f}" for r in off)
            each_on = ", ".join(f"{(r[s]['peak'] - r[s]['before']) / 2**20:.0f}" for r in on)
            print(f"           runs (MiB): without {each_off}; with {each_on}")
            in_flight = min(pp - s, m)  # micro-batches whose activations a 1F1B stage holds at its peak
            per_block = [value * micro / args.batch for value in (saved[False], saved[True])]  # per micro-batch
            blocks_off = in_flight * blocks[s] * per_block[0]
            inputs = in_flight * blocks[s] * per_block[1]
            print(f"           blocks' saved activations ({in_flight} micro-batch(es) in flight x {blocks[s]} blocks): "
                  f"{bench.mib(blocks_off)} without; with checkpointing their inputs {bench.mib(inputs)} (+ "
                  f"{bench.mib(per_block[0])} while a block is recomputed), i.e. {inputs / blocks_off:.1%}-"
                  f"{(inputs + per_block[0]) / blocks_off:.1%} of it remains")
            print(f"           expected saving {bench.mib(blocks_off - inputs - per_block[0])} to "
                  f"{bench.mib(blocks_off - inputs)}; measured saving {bench.mib(act_off - act_on)}")
        print(f"    step time (slowest rank): without {time_off:.2f} s (runs {bench.fmt_times(times[(pp, False)])}), "
              f"with {time_on:.2f} s (runs {bench.fmt_times(times[(pp, True)])}); with / without "
              f"{time_on / time_off:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
