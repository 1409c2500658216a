"""Pipeline parallelism on CPU over gloo: memory per stage, bytes between stages, and step time.

(a) Memory. Parameter bytes of the fullest stage of a gpt2-medium-shaped ``GPT2LMHeadModel`` (24
    layers, n_embd 1024, vocab 50257) at pp = 2 and 4, built on the meta device in real ranks.
    Reference: the floor ``(total + the tied copy of wte on the last stage) / pp``, where the total
    is transformers' own model (tied weights once); reported for oslo's parameter-balanced stages
    and, for comparison, for the uniform split (the same number of blocks per stage).
(b) Communication. Bytes a training step sends between stages (every ``isend``, counted in the
    ranks), against the minimum: per micro-batch and stage boundary, the activation forward and its
    gradient backward (``micro_batch x seq x n_embd`` float32 each). Also the no-gradient pass.
    GPT2 (n_embd 256, 4 layers) and, with ``--arch t5`` (or ``all``, the default), T5
    (``T5ForConditionalGeneration``: t5-small's vocabulary, d_kv and 32 position buckets; d_model 256,
    d_ff 1024, 4 heads, 3 + 3 layers; 32 input tokens and 16 target ids per row), at pp = 2 and 4;
    target ratio <= 1.01 for both. T5's minimum, per micro-batch and stage boundary, follows from the
    layers each stage holds (read from the built models; oslo balances parameters: e0 e1 e2 | d0 d1 d2
    at pp=2, e0 e1 | e2 d0 | d1 | d2 at pp=4, so all three kinds of boundary occur). Forward, the
    tensors the later stages need and cannot make themselves:

    * the encoder runs on across the boundary: its hidden state (``b x T_enc x d_model``) and its
      relative position table (``num_buckets x heads_local``, heads_local = heads / tp);
    * the encoder ended just before it and the decoder starts after it: the encoder's output
      (``b x T_enc x d_model``);
    * the decoder runs on: its hidden state (``b x T_dec x d_model``), the encoder's output (every
      decoder stage's cross-attentions read it) and the decoder's relative position table;

    backward, the gradients of the same floating-point tensors (the encoder output's gradient sums
    every later decoder stage's; the tables' gradients reach the stage holding the table); all
    float32. Nothing else is needed: masks and the decoder's input ids follow from the batch, which
    every stage has. The no-gradient pass's minimum is the same forward tensors for the whole batch
    once per boundary. Expected excess: one header per link and direction per step (dtype and shapes,
    344 bytes), a 32-byte trailer per message, each tensor padded to 8 bytes. Printed besides, not
    counted (as for GPT2): the tied embedding's gradient all-reduce over the stages holding ``shared``,
    the decoder's ``embed_tokens`` and ``lm_head`` (vocab x d_model float32 each), and the small
    all-gathers of the input check and the end of the step.
(c) Step time. A training step (forward + backward of every micro-batch) at pp=2, one thread per
    rank, against one process with one thread running the same micro-batches one after the other
    (gradient accumulation: the same work without the pipeline), and for context the whole batch in
    one forward + backward. Reference: the ideal of this partition on the 1F1B schedule, from FLOP
    counts: ``total / (fullest stage x (M + pp - 1) / M)`` (the stage with the LM head also computes
    the 50257-way projection). Runs alternate between the configurations; medians.

Run: ``python benchmarks/pipeline.py``; options: ``--part a|b|c``, ``--arch gpt2|t5|all`` for (b) ((a) and
(c) measure GPT2), ``--n-layer 8 --seq 64 --batch 8 --micro-batch-size 1 --iters 5`` for (c).
"""

from __future__ import annotations

import argparse
import sys
import time

import _tp_harness as bench
import torch
import torch.distributed as dist
import transformers

import oslo

FLOOR_TARGET = 1.05  # fullest stage / floor, balanced partition


# ---------------------------------------------------------------------------------------------
# (a) parameter bytes per stage
# ---------------------------------------------------------------------------------------------
def _stage_bytes(rank: int, world_size: int, config) -> int:
    context = oslo.ParallelContext(1, world_size)
    with torch.device("meta"):
        model = oslo.GPT2LMHeadModel(config, parallel_context=context)
    return sum(p.numel() * 4 for p in model.parameters())


def part_a(config) -> bool:
    with torch.device("meta"):
        total = sum(p.numel() * 4 for p in transformers.GPT2LMHeadModel(config).parameters())
    wte = config.vocab_size * config.n_embd * 4
    print(f"\n(a) parameter bytes per stage, {bench.describe(config)}, float32")
    print(f"    transformers total {bench.mib(total)}; the last stage also holds a copy of wte ({bench.mib(wte)})")
    ok = True
    for pp in (2, 4):
        per_stage = bench.launch(_stage_bytes, pp, config)
        floor = (total + wte) / pp
        layers = [len(r) for r in oslo.GPT2LMHeadModel.pipeline_partition(config, pp)]
        uniform = _uniform_stage_bytes(config, pp, total, wte)
        ratio = max(per_stage) / floor
        ok &= ratio <= FLOOR_TARGET
        print(f"    pp={pp}: blocks per stage {layers}; bytes per stage "
              f"{', '.join(bench.mib(b) for b in per_stage)}")
        print(f"          fullest stage / floor {bench.mib(floor)}: {ratio:.3f} {bench.verdict(ratio <= FLOOR_TARGET)} "
              f"(target <= {FLOOR_TARGET}); uniform split would be {max(uniform) / floor:.3f}")
    return ok


def _uniform_stage_bytes(config, pp: int, total: int, wte: int) -> list[float]:
    width, inner = config.n_embd, 4 * config.n_embd
    block = (4 * width * width + 2 * width * inner + 9 * width + inner) * 4
    blocks = [config.n_layer // pp + (1 if s < config.n_layer % pp else 0) for s in range(pp)]
    embeddings = (config.vocab_size + config.n_positions) * width * 4
    sizes = [n * block for n in blocks]
    sizes[0] += embeddings
    sizes[-1] += wte + 2 * width * 4
    return sizes


# ---------------------------------------------------------------------------------------------
# (b) bytes between stages
# ---------------------------------------------------------------------------------------------
def _count_p2p(rank: int, world_size: int, config, batch: int, seq: int, micro: int) -> dict:
    sent = {"bytes": 0, "messages": 0}
    original = dist.isend

    def counting_isend(tensor, dst, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        sent["messages"] += 1
        return original(tensor, dst, *args, **kwargs)

    dist.isend = counting_isend
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, pipeline_parallel_size=world_size, micro_batch_size=micro, seed=0
    )
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    for micro_output in model(input_ids=input_ids, labels=input_ids):
        micro_output.loss.backward()
    training = dict(sent)
    sent.update(bytes=0, messages=0)
    with torch.no_grad():
        model(input_ids=input_ids, gather_logits=False)
    return {"training": training, "pass": dict(sent)}


def part_b(config, batch: int, seq: int, micro: int) -> bool:
    print(f"\n(b) bytes sent between stages, {bench.describe(config)}, batch {batch} x {seq} tokens, "
          f"micro-batches of {micro}")
    ok = True
    for pp in (2, 4):
        results = bench.launch(_count_p2p, pp, config, batch, seq, micro)
        activation = micro * seq * config.n_embd * 4
        minimum = (batch // micro) * (pp - 1) * 2 * activation
        sent = sum(r["training"]["bytes"] for r in results)
        messages = sum(r["training"]["messages"] for r in results)
        ratio = sent / minimum
        ok &= ratio <= 1.01
        print(f"    pp={pp} training step: {sent:,d} B in {messages} messages; minimum {minimum:,d} B "
              f"(activation + gradient per micro-batch and boundary): {ratio:.4f} {bench.verdict(ratio <= 1.01)}")
        passed = sum(r["pass"]["bytes"] for r in results)
        one_pass = (pp - 1) * batch * seq * config.n_embd * 4
        print(f"          no-gradient pass: {passed:,d} B point-to-point (minimum {one_pass:,d} B: the whole batch's "
              "activation once per boundary), plus the broadcast of the outputs to every stage")
    return ok


def _count_p2p_t5(rank: int, world_size: int, config, batch: int, seq: int, target_seq: int, micro: int) -> dict:
    """Bytes and messages this stage sends to each neighbour in a training step and in a no-gradient pass,
    the collectives of the training step (op -> this rank's input bytes per call), and the layers it holds."""
    sent: dict[int, list[int]] = {}
    collectives: dict[str, list[int]] = {}
    original = dist.isend

    def counting_isend(tensor, dst, *args, **kwargs):
        sent.setdefault(dst, []).append(tensor.numel() * tensor.element_size())
        return original(tensor, dst, *args, **kwargs)

    def counting(name, function):
        def wrapper(*args, **kwargs):
            position, keyword = (1, "tensor") if name == "all_gather" else (0, "tensor")
            tensor = args[position] if len(args) > position else kwargs[keyword]
            collectives.setdefault(name, []).append(tensor.numel() * tensor.element_size())
            return function(*args, **kwargs)
        return wrapper

    dist.isend = counting_isend
    for name in ("all_reduce", "all_gather", "broadcast"):
        setattr(dist, name, counting(name, getattr(dist, name)))
    model = oslo.T5ForConditionalGeneration.from_config_with_parallel(
        config, pipeline_parallel_size=world_size, micro_batch_size=micro, seed=0
    )
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    labels = bench.ARCHS["t5"].batch(input_ids, generator, target_seq)["labels"]
    collectives.clear()  # building the model agreed on things too
    for micro_output in model(input_ids=input_ids, labels=labels):
        micro_output.loss.backward()
    training = {peer: list(sizes) for peer, sizes in sent.items()}
    step_collectives = {name: list(sizes) for name, sizes in collectives.items()}
    sent.clear()
    with torch.no_grad():
        model(input_ids=input_ids, labels=labels, gather_logits=False)
    return {"training": training, "pass": dict(sent), "collectives": step_collectives,
            "encoder": model.encoder.held(), "decoder": model.decoder.held()}


def t5_boundaries(config, layouts: list[dict], rows: int, seq: int, target_seq: int, tp: int = 1) -> list[tuple]:
    """(what crosses, minimum forward bytes) of each stage boundary for ``rows`` sequences: see the module
    docstring. ``layouts``: per stage, the encoder's and the decoder's layers it holds."""
    hidden_enc = rows * seq * config.d_model * 4
    hidden_dec = rows * target_seq * config.d_model * 4
    table = config.relative_attention_num_buckets * (config.num_heads // tp) * 4
    out = []
    for layout in layouts[:-1]:
        if layout["decoder"]:
            out.append(("decoder runs on: hidden b x T_dec x d + encoder output b x T_enc x d + decoder table",
                        hidden_dec + hidden_enc + table))
        elif layout["encoder"][-1] == config.num_layers - 1:
            out.append(("encoder done, decoder next: encoder output b x T_enc x d", hidden_enc))
        else:
            out.append(("encoder runs on: hidden b x T_enc x d + encoder table", hidden_enc + table))
    return out


def _stage_text(layout: dict) -> str:
    return " ".join([f"e{i}" for i in layout["encoder"]] + [f"d{i}" for i in layout["decoder"]])


def part_b_t5(config, batch: int, seq: int, target_seq: int, micro: int) -> tuple[bool, dict[int, float]]:
    micro_batches = batch // micro
    print(f"\n(b) t5: bytes sent between stages, T5ForConditionalGeneration {bench.describe(config)}, batch {batch} "
          f"x {seq} input tokens and {target_seq} target ids, micro-batches of {micro} (tp=1: heads_local = heads)")
    ok = True
    ratios = {}
    for pp in (2, 4):
        results = bench.launch(_count_p2p_t5, pp, config, batch, seq, target_seq, micro)
        layouts = [{"encoder": r["encoder"], "decoder": r["decoder"]} for r in results]
        boundaries = t5_boundaries(config, layouts, micro, seq, target_seq)
        whole = t5_boundaries(config, layouts, batch, seq, target_seq)
        print(f"    pp={pp}: stages {' | '.join(_stage_text(layout) for layout in layouts)}")
        minimum = sent = messages = 0
        for stage, (what, forward) in enumerate(boundaries):
            fwd = results[stage]["training"].get(stage + 1, [])
            bwd = results[stage + 1]["training"].get(stage, [])
            floor = micro_batches * forward  # each direction
            minimum += 2 * floor
            sent += sum(fwd) + sum(bwd)
            messages += len(fwd) + len(bwd)
            print(f"      boundary {stage}|{stage + 1}: {what}")
            print(f"        minimum {forward:,d} B per micro-batch each way; sent forward {sum(fwd):,d} B in "
                  f"{len(fwd)} messages ({sum(fwd) / floor:.4f} x the minimum {floor:,d}), backward {sum(bwd):,d} B in "
                  f"{len(bwd)} ({sum(bwd) / floor:.4f} x {floor:,d})")
        ratio = sent / minimum
        ratios[pp] = ratio
        ok &= ratio <= 1.01
        print(f"    pp={pp} training step: {sent:,d} B in {messages} messages; minimum {minimum:,d} B (forward "
              f"tensors + their gradients, per micro-batch and boundary, {micro_batches} micro-batches): {ratio:.4f} "
              f"{bench.verdict(ratio <= 1.01)}")
        tied = [stage for stage, r in enumerate(results) if r["collectives"].get("all_reduce")]
        tied_bytes = [sum(results[stage]["collectives"]["all_reduce"]) for stage in tied]
        small = sum(len(r["collectives"].get("all_gather", [])) for r in results)
        print(f"          besides (collectives, not in the minimum; GPT2's tied wte / lm_head likewise): the tied "
              f"embedding's gradient all-reduce on stages {tied}, {', '.join(f'{b:,d}' for b in tied_bytes)} B "
              f"per stage (vocab x d_model fp32: {config.vocab_size * config.d_model * 4:,d}); {small} small "
              "all-gathers over the stages (input check, end-of-step status)")
        passed = sum(sum(sizes) for r in results for sizes in r["pass"].values())
        one_pass = sum(forward for _, forward in whole)
        print(f"          no-gradient pass: {passed:,d} B point-to-point (minimum {one_pass:,d} B: the whole batch's "
              f"forward tensors once per boundary): {passed / one_pass:.4f}, plus the broadcast of the outputs to "
              "every stage")
    return ok, ratios


# ---------------------------------------------------------------------------------------------
# (c) step time
# ---------------------------------------------------------------------------------------------
def _flops(config, seq: int) -> tuple[float, float]:
    """Forward FLOPs per sequence of one block and of the LM head (matmuls only)."""
    width = config.n_embd
    block = 24 * width * width * seq + 4 * width * seq * seq
    head = 2 * width * config.vocab_size * seq
    return block, head


def _pipeline_setup(rank, world_size, config, batch, seq, micro):
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, pipeline_parallel_size=world_size, micro_batch_size=micro, seed=0
    ).train()
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def handle(command):
        model.zero_grad(set_to_none=True)
        if world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        if world_size > 1:
            for micro_output in model(input_ids=input_ids, labels=input_ids):
                micro_output.loss.backward()
        elif command == "micro-batches":
            for chunk in input_ids.split(micro):
                model(input_ids=chunk, labels=chunk, gather_logits=False).loss.backward()
        else:
            model(input_ids=input_ids, labels=input_ids, gather_logits=False).loss.backward()
        return time.perf_counter() - start

    return handle


def part_c(config, batch: int, seq: int, micro: int, iters: int) -> None:
    pp = 2
    micro_batches = batch // micro
    block, head = _flops(config, seq)
    layers = [len(r) for r in oslo.GPT2LMHeadModel.pipeline_partition(config, pp)]
    stage_flops = [n * block for n in layers]
    stage_flops[-1] += head
    ideal = sum(stage_flops) / (max(stage_flops) * (micro_batches + pp - 1) / micro_batches)
    print(f"\n(c) training step time, {bench.describe(config)}, batch {batch} x {seq} tokens, "
          f"{micro_batches} micro-batches of {micro}")
    print(f"    blocks per stage {layers}; forward GFLOP per sequence by stage "
          f"{', '.join(f'{f / 1e9:.2f}' for f in stage_flops)}; ideal speed-up for this partition and "
          f"1F1B with {micro_batches} micro-batches: {ideal:.2f}x")
    single = bench.WorkerGroup(_pipeline_setup, 1, config, batch, seq, micro, env=False)
    pipelined = bench.WorkerGroup(_pipeline_setup, pp, config, batch, seq, micro)
    runs = {
        "pp=1, micro-batches, 1 thread": (single, "micro-batches"),
        "pp=1, whole batch, 1 thread": (single, "whole"),
        "pp=2, 1 thread per rank": (pipelined, "step"),
    }
    times = {name: [] for name in runs}
    try:
        for group, command in runs.values():
            group.call(command)  # warm-up
        names = list(runs)
        for i in range(iters):
            for name in names if i % 2 == 0 else names[::-1]:
                group, command = runs[name]
                times[name].append(max(group.call(command)))
    finally:
        single.close()
        pipelined.close()
    medians = {name: bench.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"    {name:<30} {medians[name]:.3f} s median (runs: {bench.fmt_times(values)})")
    speedup = medians["pp=1, micro-batches, 1 thread"] / medians["pp=2, 1 thread per rank"]
    whole = medians["pp=1, whole batch, 1 thread"] / medians["pp=2, 1 thread per rank"]
    print(f"    speed-up over the same micro-batches in one process: {speedup:.2f}x, {speedup / ideal:.2f} of the "
          f"ideal {ideal:.2f}x; over the whole batch in one pass: {whole:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--arch", choices=["gpt2", "t5", "all"], default="all",
                        help="part (b): architecture(s) to measure; (a) and (c) measure GPT2")
    parser.add_argument("--n-layer", type=int, default=8, help="layers for (c) (gpt2-medium width)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="batch for (c)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="micro-batch size for (c)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    bench.header("pipeline parallelism (gloo, CPU)")
    ok = True
    if args.part in ("a", "all"):
        ok &= part_a(bench.gpt2_config("medium"))
    if args.part in ("b", "all") and args.arch in ("gpt2", "all"):
        ok &= part_b(bench.gpt2_config("small", n_layer=4, n_embd=256, n_head=4), batch=8, seq=32, micro=2)
    if args.part in ("b", "all") and args.arch in ("t5", "all"):
        t5_ok, _ = part_b_t5(bench.t5_config("small", n_layer=3, d_model=256, d_ff=1024, num_heads=4), batch=8,
                             seq=32, target_seq=16, micro=2)
        ok &= t5_ok
    if args.part in ("c", "all"):
        part_c(bench.gpt2_config("medium", n_layer=args.n_layer), args.batch, args.seq, args.micro_batch_size,
               args.iters)
    print(f"\noverall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
