"""The timeline of one real pipeline training step of ``oslo.GPT2LMHeadModel`` (gloo, CPU), drawn to a PNG.

What runs: ``p`` forked gloo ranks (one torch thread each) build
``oslo.GPT2LMHeadModel.from_config_with_parallel(config, pipeline_parallel_size=p, micro_batch_size=mb)``
(default: gpt2-medium width, n_embd 1024, n_head 16, vocab 50257, 8 layers; batch 8 x 64 tokens;
micro-batches of 1, so m = 8; p = 2), run one warm-up training step, then record the second with
``model.pipeline_timeline = []``: every forward and backward of each stage as a
``TimelineEvent(micro_batch, phase, start, end)`` (``time.perf_counter``, one clock for all ranks of
the machine). A forward event runs from after the activation has been received to after it has been
handed to ``isend``; a backward event from after the gradient has been received to the end of
``micro_output.loss.backward()``. Waiting in ``recv`` for a neighbour is outside every event: idle.

Output: ``assets/pipeline_timeline.png`` (``--output``): x = ms from the step's start (the earliest
event of any stage), one row per stage, forward boxes in one colour and backward boxes in another,
each labelled with its micro-batch index, idle time left white. Printed per stage: blocks held,
busy ms, idle ms and idle fraction, all against the common step span (the earliest event start to
the latest event end over all stages), plus the mean forward and backward time per micro-batch.

Reference: the 1F1B bubble of balanced stages, ``(p - 1) / (m + p - 1)`` idle on every stage.
Real stages are not balanced: oslo balances *parameters* (the first stage also holds the embeddings,
the last the LM head), not time; the last stage also computes the 50257-way projection and the loss,
and a backward is not exactly twice a forward. The slowest stage sets the pace and the others wait
for it, so their idle fractions exceed the theory while the slowest stage's is closest to it. No
PASS/FAIL: the drawing and the numbers are for inspection (``benchmarks/pipeline_bubble.py`` checks
the schedule against the theory with balanced simulated stages).

Run: ``python benchmarks/pipeline_timeline.py`` (about 1 minute on 2 cores; needs matplotlib:
``pip install matplotlib``); options: ``--pp 2 --micro-batches 8 --micro-batch-size 1 --n-layer 8
--seq 64 --output assets/pipeline_timeline.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _tp_harness as bench
import torch
import torch.distributed as dist

import oslo

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452"}


def _record_step(rank: int, world_size: int, config, batch: int, seq: int, micro: int) -> dict:
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, pipeline_parallel_size=world_size, micro_batch_size=micro, seed=0
    ).train()
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    timelines = []
    for _ in range(2):  # a warm-up step, then the recorded one
        model.zero_grad(set_to_none=True)
        model.pipeline_timeline = []
        dist.barrier()
        for micro_output in model(input_ids=input_ids, labels=input_ids):
            micro_output.loss.backward()
        timelines.append([tuple(event) for event in model.pipeline_timeline])
    model.pipeline_timeline = None
    return {"events": timelines[-1], "blocks": len(model.transformer.h)}


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks/pipeline_timeline.py draws with matplotlib, which is not installed: "
                 "pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    return plt, Patch


def draw(events: list[list[tuple]], t0: float, title: str, output: Path) -> None:
    plt, Patch = _import_pyplot()
    p = len(events)
    span_ms = (max(e[3] for stage in events for e in stage) - t0) * 1e3
    fig, ax = plt.subplots(figsize=(max(10.0, min(24.0, 0.6 * len(events[0]))), 1.8 + 0.7 * p))
    for s, stage in enumerate(events):
        y = p - 1 - s  # stage 0 on top
        for micro_batch, phase, start, end, *_ in stage:
            left, width = (start - t0) * 1e3, (end - start) * 1e3
            ax.broken_barh([(left, width)], (y - 0.4, 0.8), facecolors=COLOURS[phase], edgecolor="black",
                           linewidth=0.5)
            if width > span_ms / 150:
                ax.text(left + width / 2, y, str(micro_batch), ha="center", va="center", fontsize=8,
                        color="white" if phase == "forward" else "black")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {p - 1 - y}" for y in range(p)])
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time from the step start (ms)")
    ax.set_title(title, fontsize=10)
    fig.legend(handles=[Patch(facecolor=c, edgecolor="black", label=k) for k, c in COLOURS.items()]
               + [Patch(facecolor="white", edgecolor="black", label="idle (waiting for a neighbour)")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if p <= 2 else 0.06, 1, 1))
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages p")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches m per step")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--n-layer", type=int, default=8, help="layers (gpt2-medium width)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parent.parent / "assets"
                        / "pipeline_timeline.png")
    args = parser.parse_args(argv)
    _import_pyplot()  # fail before the ranks start if matplotlib is missing
    p, m, micro = args.pp, args.micro_batches, args.micro_batch_size
    config = bench.gpt2_config("medium", n_layer=args.n_layer)
    batch = m * micro
    bench.header("pipeline timeline of a GPT2LMHeadModel training step (gloo, CPU)")
    print(f"   {bench.describe(config)}; batch {batch} x {args.seq} tokens, {m} micro-batches of {micro}, "
          f"pp={p}, 1 torch thread per rank; one warm-up step, the second recorded")
    results = bench.launch(_record_step, p, config, batch, args.seq, micro)
    events = [r["events"] for r in results]
    for s, stage in enumerate(events):
        if len(stage) != 2 * m:
            raise RuntimeError(f"stage {s} recorded {len(stage)} events, expected {2 * m}")
    t0 = min(e[2] for stage in events for e in stage)
    span = max(e[3] for stage in events for e in stage) - t0
    theory = (p - 1) / (m + p - 1)
    planned = [len(r) for r in oslo.GPT2LMHeadModel.pipeline_partition(config, p)]
    print(f"\nstep span {span * 1e3:.1f} ms (earliest event start to latest event end, all stages)")
    print("    stage  blocks  holds              busy ms    idle ms   idle fraction   fwd ms/mb   bwd ms/mb")
    idle_fractions = []
    for s, stage in enumerate(events):
        busy = sum(e[3] - e[2] for e in stage)
        forward = [e[3] - e[2] for e in stage if e[1] == "forward"]
        backward = [e[3] - e[2] for e in stage if e[1] == "backward"]
        holds = "+".join(filter(None, ["embeddings" if s == 0 else "", "LM head" if s == p - 1 else ""])) or "-"
        idle = 1 - busy / span
        idle_fractions.append(idle)
        print(f"    {s:>5}  {results[s]['blocks']:>6}  {holds:<17} {busy * 1e3:>8.1f}  {(span - busy) * 1e3:>9.1f}"
              f"   {idle:>13.3f}   {sum(forward) / m * 1e3:>9.1f}   {sum(backward) / m * 1e3:>9.1f}")
    mean_idle = sum(idle_fractions) / p
    busiest = min(range(p), key=lambda s: idle_fractions[s])
    print(f"    mean idle fraction {mean_idle:.3f}; the busiest stage ({busiest}) {idle_fractions[busiest]:.3f}; "
          f"1F1B theory for balanced stages (p-1)/(m+p-1) = {theory:.3f}")
    print("    (real stages are not balanced: oslo balances parameters, not time, so the stages other than the "
          "slowest wait for it and idle more than the theory; blocks per stage "
          f"{[r['blocks'] for r in results]}, planned {planned})")
    title = (f"oslo GPT2LMHeadModel training step, n_embd {config.n_embd}, {config.n_layer} layers, "
             f"batch {batch} x {args.seq}: pp={p}, m={m} micro-batches of {micro} (1F1B)\n"
             f"span {span * 1e3:.0f} ms; measured bubble (idle fraction) mean {mean_idle:.1%}, per stage "
             f"{', '.join(f'{v:.1%}' for v in idle_fractions)}; balanced-stage theory {theory:.1%}")
    draw(events, t0, title, args.output)
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
