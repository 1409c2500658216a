"""The pipeline bubble of 1F1B and of interleaved 1F1B, with balanced, simulated stage compute (gloo, CPU).

What runs: ``oslo.parallel.pipeline.pipeline_schedule`` itself, in ``p`` forked gloo ranks (one torch
thread each), with a stage whose compute is simulated: its forward sleeps ``t_f`` (default 100 ms)
inside a custom ``torch.autograd.Function`` whose backward sleeps ``2 t_f``, so the backward that
``loss.backward()`` triggers takes ``2 t_f`` on every stage (the usual backward = 2 x forward). The
tensors sent between stages are tiny (4 x 8 float32), so what the run measures is the schedule: its
order of forwards and backwards, and its blocking ``recv`` / non-blocking ``isend`` between stages.
Sleeping rather than spinning keeps the stages balanced on a machine with fewer cores than ranks.

How the bubble is measured. Each stage records its ``TimelineEvent`` list (``timeline=[]``): one
event per forward (from after the activation has been received to after it has been handed to
``isend``) and one per backward (from after the gradient has been received to the end of
``loss.backward()``). Waiting in ``recv`` for a neighbour is outside every event: it is idle time.
Per step and stage, busy = the sum of the stage's event durations. The step span is common to all
stages: from the earliest event start over all stages (the first stage's first forward) to the
latest event end over all stages (the first stage's last backward). ``time.perf_counter`` is
``CLOCK_MONOTONIC``, one clock for all processes of the machine, so starts and ends of different
ranks compare directly. Idle fraction of a stage = 1 - busy / span. Measured against the common span
(not each stage's own first-to-last event), every stage is charged the whole bubble, the first stage
included: it starts first but finishes last, idle while its last backwards wait for gradients.
A ``dist.barrier()`` precedes each step; one warm-up step is discarded, then the median over
``--steps`` (default 3) steps of each stage's idle fraction is reported.

Reference: 1F1B with ``m`` micro-batches on ``p`` balanced stages takes ``(m + p - 1)`` forward +
backward slots, of which each stage is busy ``m``: idle fraction ``(p - 1) / (m + p - 1)`` on every
stage. Target: the mean measured idle fraction within 10 % (relative) of that, for every ``p`` in
{2, 4} and ``m`` in {4, 8, 16}.

Interleaved 1F1B (``--chunks 2``: ``virtual_pipeline_size``): each stage holds ``v`` chunks, and its
compute per micro-batch is split evenly over them (a chunk's forward sleeps ``t_f / v``, its backward
``2 t_f / v``), so the stages' work is the same as with 1F1B and only the schedule differs. Its bubble
is ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021); the same 10 % target. A stage then records
``2 v m`` events per step, and runs ``v`` times as many transfers, each paying the fixed cost below.

``--picture PATH`` draws the first timed step of each ``(v, m)`` at the largest ``p`` (one panel each:
a row per stage, forwards and backwards as boxes labelled with the micro-batch, chunks told apart by
shade), to compare 1F1B and the interleaved schedule by eye (needs matplotlib).

What the theory leaves out: what the schedule itself costs per micro-batch on each stage, outside
the forward and backward events: receiving (a blocking ``recv`` that must wake the process: 0.3 ms
median here even when the data has already arrived, with tails of several ms), packing and sending
the output, and the Python of the loop, about 1 ms per micro-batch in all on this 2-vCPU VM. (The
latency of a transfer itself is hidden: the schedule runs one forward more ahead than textbook 1F1B,
and after the first transfer of a step each transfer is one gloo message; see
``oslo/parallel/pipeline.py``.) That fixed cost is a larger share of a short simulated compute: with
``t_f = 100 ms`` (the default; a gpt2-medium-width stage of 4 blocks takes 170-470 ms per micro-batch
forward on one CPU thread, benchmarks/pipeline_timeline.py) it is about 0.3 % of a micro-batch, with
``--t-forward-ms 20`` about 2 %, which puts the larger ``m`` above the 10 % target. To show where the
time goes the script also

* measures the transfer latency between stages 0 and 1 with the schedule's own ``StageLink`` (a
  probe before the steps; mean of 12): "on time" (the receiver already waits in ``recv``) and
  "late" (the data was sent before the receiver calls ``recv``), forward and backward;
* prints the span's excess over the balanced ideal ``(m + p - 1) x`` (a stage's mean busy time per
  micro-batch), in total and per micro-batch;
* simulates oslo's schedule with the measured event durations and those latencies
  (:func:`simulate_1f1b`; with zero latency it reproduces ``(p - 1) / (m + p - 1)`` exactly) and
  prints measured / simulated.

Busy-waiting (``--spin``) does not help on this machine: with as many spinning ranks as cores,
gloo's own threads wait for a core and the latencies grow.

Run: ``python benchmarks/pipeline_bubble.py`` (about 5 minutes; with ``--t-forward-ms 20`` about
1.5 minutes); options: ``--stages 2 4``, ``--micro-batches 4 8 16``, ``--chunks 1 2``,
``--t-forward-ms 100``, ``--steps 3``, ``--spin`` (busy-wait instead of sleeping; needs a core per
rank), ``--picture assets/pipeline_interleaved.png``.
"""

from __future__ import annotations

import argparse
import sys
import time

import _tp_harness as bench
import torch
import torch.distributed as dist

import oslo
from oslo.parallel.pipeline import StageLink, interleaved_order, pipeline_schedule

TOLERANCE = 0.10  # relative, on the mean idle fraction


def _wait(seconds: float, spin: bool) -> None:
    if spin:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(seconds)


class _SimulatedCompute(torch.autograd.Function):
    """Identity whose forward takes ``seconds`` and whose backward takes ``2 x seconds``."""

    @staticmethod
    def forward(ctx, x, seconds, spin):
        ctx.seconds, ctx.spin = seconds, spin
        _wait(seconds, spin)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _wait(2 * ctx.seconds, ctx.spin)
        return grad, None, None


def _probe_latency(context, t_forward: float, spin: bool, repeats: int = 12) -> dict[str, list[float]]:
    """Latency of the schedule's transfers between stages 0 and 1, measured with its own ``StageLink``.

    ``forward``: one activation (4 x 8 float32) from stage 0 to stage 1; ``backward``: the gradient with
    the (loss, seed) pair riding along, from stage 1 to stage 0, as the schedule sends them (after the
    first transfer of each direction, which carries a header, one message each).
    ``on time``: the receiver is already blocked in ``recv`` when, after a wait of ``t_f``, the sender
    sends; latency from before the first ``isend`` to after the last ``recv`` (the shared clock).
    ``late``: the sender has sent long before the receiver calls ``recv`` (after a wait of ``t_f``);
    latency from the ``recv`` call to its return. Returns, on stage 1, the latencies in seconds.
    """
    link = StageLink(context)
    stage = context.pipeline_parallel_rank
    activation, pair = torch.zeros(4, 8), torch.tensor([1.0, 1.0])
    out: dict[str, list[float]] = {"forward on time": [], "forward late": [], "backward on time": [],
                                   "backward late": []}
    for _ in range(repeats):
        for case in out:
            dist.barrier()
            if stage > 1:
                continue
            sender = stage == (0 if case.startswith("forward") else 1)
            on_time = case.endswith("on time")
            if sender:
                if on_time:
                    _wait(t_forward, spin)
                start = time.perf_counter()
                if case.startswith("forward"):
                    link.send(activation, link.next)
                else:
                    link.send(activation, link.prev, extra=pair)
                link.wait_all()
                sent = torch.tensor([start], dtype=torch.float64)
                dist.send(sent, 1 - stage)
            else:
                if not on_time:
                    _wait(t_forward, spin)
                start = time.perf_counter()
                link.recv(link.prev if stage == 1 else link.next, with_extra=True)
                end = time.perf_counter()
                sent = torch.zeros(1, dtype=torch.float64)
                dist.recv(sent, 1 - stage)
                latency = end - (float(sent) if on_time else start)
                if stage == 1:
                    out[case].append(latency)
                else:
                    dist.send(torch.tensor([latency], dtype=torch.float64), 1)
            if stage == 1 and sender:
                value = torch.zeros(1, dtype=torch.float64)
                dist.recv(value, 0)
                out[case].append(float(value))
    return out


def _bubble_rank(rank: int, world_size: int, m: int, t_forward: float, steps: int, spin: bool,
                 chunks: int = 1) -> dict:
    context = oslo.ParallelContext(tensor_parallel_size=1, pipeline_parallel_size=world_size,
                                   virtual_pipeline_size=chunks)
    dist.barrier()
    probe = _probe_latency(context, t_forward, spin)
    weight = torch.ones(4, 8, requires_grad=True)  # something on every stage for the backward to reach
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    def stage_forward(i: int, received: dict | None, stage: int) -> dict:
        x = (inputs if received is None else received["hidden_states"]) * weight
        return {"hidden_states": _SimulatedCompute.apply(x, t_forward / chunks, spin)}

    timelines = []
    for _ in range(steps + 1):  # the first is the warm-up
        timeline: list = []
        dist.barrier()
        schedule = pipeline_schedule(
            context, m, stage_forward,
            micro_output=lambda result, loss: loss,
            last_stage_loss=lambda result: result["hidden_states"].sum(),
            after_step=lambda scaled: None,
            timeline=timeline,
        )
        for loss in schedule:
            loss.backward()
        weight.grad = None
        timelines.append([tuple(event) for event in timeline])
    return {"timelines": timelines[1:], "probe": probe}


def _latency(results: list[dict]) -> dict[str, float]:
    """Mean transfer latencies between stages 0 and 1 (see :func:`_probe_latency`); the mean, since
    the latencies on a critical path add up, tails included."""
    return {case: sum(values) / len(values) for case, values in results[1]["probe"].items()}


def simulate_1f1b(p: int, m: int, t_f: float, t_b: float, latency: dict[str, float] | None = None) -> float:
    """Idle fraction (every stage alike) of oslo's 1F1B order with stage times ``t_f``/``t_b`` and latencies.

    Each stage runs its operations in the schedule's order (``p - s`` warm-up forwards, none on the
    last stage, then one forward and one backward alternately, then the remaining backwards); see
    :func:`_simulate` for when an operation starts. Without latencies every stage is idle
    ``(p - 1) / (m + p - 1)``.
    """
    orders = []
    for s in range(p):
        warmup = 0 if s == p - 1 else min(p - s, m)
        order = [("forward", 0, i) for i in range(warmup)]
        for i in range(m):
            if i + warmup < m:
                order.append(("forward", 0, i + warmup))
            order.append(("backward", 0, i))
        orders.append(order)
    return _simulate(orders, 1, t_f, t_b, latency)


def simulate_interleaved(p: int, v: int, m: int, t_f: float, t_b: float,
                         latency: dict[str, float] | None = None) -> float:
    """Idle fraction (mean over the stages) of :func:`oslo.parallel.pipeline.interleaved_order` with chunk times
    ``t_f``/``t_b`` and latencies (:func:`_simulate`). Without latencies and with ``p`` dividing ``m`` every stage
    is idle ``(p - 1) / (v m + p - 1)``."""
    return _simulate([interleaved_order(p, v, m, s) for s in range(p)], v, t_f, t_b, latency)


def _simulate(orders: list[list[tuple[str, int, int]]], chunks: int, t_f: float, t_b: float,
              latency: dict[str, float] | None) -> float:
    """Run every stage's ``(phase, chunk, micro_batch)`` order. An operation that receives (a forward from the
    previous virtual stage's forward of its micro-batch; a backward from the next one's backward) starts at
    ``max(sent + on-time latency, stage free + late latency)``, with the latencies of :func:`_probe_latency`;
    the others start when the stage is free (the last virtual stage's backward right after its forward).
    Returns the mean idle fraction of the stages over the common span."""
    latency = latency or {}
    p = len(orders)
    last = p * chunks - 1
    end: dict[tuple[str, int, int], float] = {}
    position, free = [0] * p, [0.0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                phase, chunk, i = orders[s][position[s]]
                virtual = chunk * p + s
                duration = t_f if phase == "forward" else t_b
                if phase == "forward" and virtual == 0:
                    start = free[s]
                elif phase == "backward" and virtual == last:
                    start = max(free[s], end[("forward", virtual, i)])
                else:
                    sender = (phase, virtual - 1 if phase == "forward" else virtual + 1, i)
                    if sender not in end:
                        break
                    start = max(end[sender] + latency.get(f"{phase} on time", 0.0),
                                free[s] + latency.get(f"{phase} late", 0.0))
                end[(phase, virtual, i)] = free[s] = start + duration
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the simulated schedule deadlocked")
    operations = len(orders[0]) // 2  # forwards (= backwards) per stage
    return 1.0 - operations * (t_f + t_b) / max(free)  # the first stage's first forward starts at 0


def _analyse(per_rank: list[list[list[tuple]]], p: int, m: int, chunks: int = 1) -> dict:
    """Idle fraction per stage and step, the spans, and the span's excess over the balanced ideal."""
    steps, slots = len(per_rank[0]), chunks * m + p - 1
    forwards = [e[3] - e[2] for stage in per_rank for step in stage for e in step if e[1] == "forward"]
    backwards = [e[3] - e[2] for stage in per_rank for step in stage for e in step if e[1] == "backward"]
    idle = [[0.0] * steps for _ in range(p)]
    spans, excess = [], []
    for k in range(steps):
        events = [per_rank[s][k] for s in range(p)]
        for s in range(p):
            if len(events[s]) != 2 * m * chunks:
                raise RuntimeError(f"stage {s} recorded {len(events[s])} events, expected {2 * m * chunks}")
        start = min(e[2] for stage in events for e in stage)
        end = max(e[3] for stage in events for e in stage)
        span = end - start
        busy = [sum(e[3] - e[2] for e in stage) for stage in events]
        for s in range(p):
            idle[s][k] = 1.0 - busy[s] / span
        spans.append(span)
        excess.append(span - slots * (sum(busy) / p) / (chunks * m))
    return {
        "idle": [bench.median(values) for values in idle],
        "span": bench.median(spans),
        "excess": bench.median(excess),
        "t_f": bench.median(forwards),
        "t_b": bench.median(backwards),
    }


def _draw(path: str, drawn: list[tuple[int, int, int, list[list[tuple]]]]) -> None:
    """One panel per ``(p, v, m, timeline)``: a row per stage, forwards and backwards as boxes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(drawn), 1, figsize=(14, 1.0 + 1.1 * sum(d[0] for d in drawn)), squeeze=False)
    colours = {"forward": ["#4c78a8", "#9ecae9"], "backward": ["#e45756", "#ff9d98"]}
    for axis, (p, chunks, m, stages) in zip(axes[:, 0], drawn, strict=True):
        start = min(event[2] for stage in stages for event in stage)
        end = max(event[3] for stage in stages for event in stage)
        for s, events in enumerate(stages):
            for micro_batch, phase, begin, finish, *rest in events:
                chunk = rest[0] if rest else 0
                axis.barh(s, (finish - begin) * 1e3, left=(begin - start) * 1e3, height=0.8,
                          color=colours[phase][chunk % 2], edgecolor="black", linewidth=0.3)
                axis.text((begin + finish - 2 * start) / 2 * 1e3, s, str(micro_batch), ha="center", va="center",
                          fontsize=6)
        busy = [sum(e[3] - e[2] for e in stage) for stage in stages]
        idle = sum(1 - b / (end - start) for b in busy) / p
        name = "1F1B" if chunks == 1 else f"interleaved 1F1B, v={chunks}"
        axis.set_title(f"{name}: p={p}, m={m}; idle {idle:.3f} (theory {(p - 1) / (chunks * m + p - 1):.3f})",
                       fontsize=9)
        axis.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        axis.invert_yaxis()
        axis.set_xlabel("ms from the step's first event")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"\ntimelines drawn to {path} (dark: chunk 0, light: chunk 1; blue forward, red backward)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2], help="virtual_pipeline_size values")
    parser.add_argument("--t-forward-ms", type=float, default=100.0, help="simulated forward per stage")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up (median)")
    parser.add_argument("--spin", action="store_true", help="busy-wait instead of sleeping")
    parser.add_argument("--picture", default=None, help="draw the timelines at the largest p to this PNG")
    args = parser.parse_args(argv)
    t_forward = args.t_forward_ms / 1000
    bench.header("1F1B and interleaved 1F1B pipeline bubble, balanced simulated stages (gloo, CPU)")
    print(f"   forward {args.t_forward_ms:g} ms, backward {2 * args.t_forward_ms:g} ms per stage and micro-batch "
          f"(split evenly over a stage's v chunks; {'busy-wait' if args.spin else 'sleep'}), 4 x 8 float32 between "
          f"stages, 1 warm-up + median of {args.steps} steps; idle = 1 - busy / common step span; target: mean "
          f"within {TOLERANCE:.0%} of (p-1)/(v m+p-1)")
    ok = True
    rows, drawn = [], []
    for p in args.stages:
        for m in args.micro_batches:
            for chunks in args.chunks:
                results = bench.launch(_bubble_rank, p, m, t_forward, args.steps, args.spin, chunks)
                result = _analyse([r["timelines"] for r in results], p, m, chunks)
                if args.picture and p == max(args.stages):
                    drawn.append((p, chunks, m, [r["timelines"][0] for r in results]))
                latency = _latency(results)
                theory = (p - 1) / (chunks * m + p - 1)
                mean = sum(result["idle"]) / p
                ratio = mean / theory
                passed = abs(ratio - 1) <= TOLERANCE
                ok &= passed
                with_latency = simulate_1f1b(p, m, result["t_f"], result["t_b"], latency) if chunks == 1 else \
                    simulate_interleaved(p, chunks, m, result["t_f"], result["t_b"], latency)
                rows.append((p, m, chunks, mean, theory, ratio, passed, with_latency))
                ideal_span = (chunks * m + p - 1) * 3 * t_forward / chunks
                print(f"\np={p} m={m} v={chunks}: span {result['span'] * 1e3:.1f} ms (nominal (v m+p-1) x 3 t_f / v = "
                      f"{ideal_span * 1e3:.0f} ms); excess over (v m+p-1) x measured busy per chunk and micro-batch: "
                      f"{result['excess'] * 1e3:.2f} ms = {result['excess'] / m * 1e3:.2f} ms per micro-batch")
                print(f"    measured event times (median): forward {result['t_f'] * 1e3:.2f} ms, backward "
                      f"{result['t_b'] * 1e3:.2f} ms")
                print("    transfer latency stage 0 <-> 1 (probe, mean of 12): "
                      + ", ".join(f"{case} {value * 1e3:.2f} ms" for case, value in latency.items()))
                print("    stage  idle fraction")
                for s, value in enumerate(result["idle"]):
                    print(f"    {s:>5}  {value:.4f}")
                print(f"    mean   {mean:.4f}   theory {theory:.4f}   measured / theory {ratio:.3f} "
                      f"{bench.verdict(passed)}")
                print(f"    the schedule simulated with the measured event times and latencies: {with_latency:.4f} "
                      f"(measured / that {mean / with_latency:.3f})")
    print("\nsummary (idle fraction; the verdict compares with the theory, (p-1)/(v m+p-1))")
    print("    p   m   v   measured (mean)   theory   measured/theory   simulated with latency   measured/simulated")
    for p, m, chunks, mean, theory, ratio, passed, with_latency in rows:
        print(f"   {p:>2} {m:>3} {chunks:>3}   {mean:>15.4f}   {theory:.4f}   {ratio:>10.3f} {bench.verdict(passed)}   "
              f"{with_latency:>22.4f}   {mean / with_latency:>18.3f}")
    for p in args.stages:
        for m in args.micro_batches:
            base = next((r for r in rows if r[:3] == (p, m, 1)), None)
            for row in rows:
                if base is not None and row[:2] == (p, m) and row[2] > 1:
                    print(f"    p={p} m={m}: interleaved v={row[2]} idle {row[3]:.4f} vs 1F1B {base[3]:.4f} "
                          f"({row[3] / base[3]:.2f}x)")
    if drawn:
        _draw(args.picture, drawn)
    print(f"\noverall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
