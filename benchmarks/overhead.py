"""Overhead of oslo's models at tensor_parallel_size=1 against transformers', same weights (GPT2, GPT-Neo, BERT, T5).

Claim (issue 2, "Benchmarks / Overhead", for GPT2; the same claim for GPT-Neo, BERT and T5): oslo at
tp=1 vs transformers (same weights, same process, interleaved runs, median of >= 5): training-step
(forward+backward) time ratio <= 1.05, and ``generate()`` tokens/s ratio >= 0.95, per architecture.

Architectures (``--arch``; default all, one after another), each at the width of its small published
shape with ``--n-layer`` blocks: GPT2 (gpt2: ``GPT2LMHeadModel`` trains and generates), GPT-Neo
(gpt-neo-125M, layers alternating global / local attention, window 256: ``GPTNeoForCausalLM`` trains
and generates), BERT (bert-base: ``BertForMaskedLM`` trains with masked-LM labels, 15 % of the
positions, -100 elsewhere; ``BertLMHeadModel`` with ``is_decoder=True`` generates), T5 (t5-small
width, t5 v1.0 dense-relu, ``--n-layer`` encoder blocks and as many decoder blocks:
``T5ForConditionalGeneration`` trains on target ids as labels, as many per row as the input has,
which the decoder reads shifted right, and generates: the encoder reads the prompt once, then the
decoder emits the new tokens after its start token, caching its self-attention and keeping the
cross-attention's keys and values). At the default lengths (at most 128 tokens) GPT-Neo's local
layers build and apply their window mask, but the window (256) covers every key, as it does for any
sequence up to 256 tokens.

Both implementations live in this one process with one torch thread. For each class timed,
transformers' model is built with a fixed seed and saved; oslo loads that checkpoint with
``from_pretrained_with_parallel`` (tp=1, a plain process). Before timing, the script checks that
they agree (eval mode: loss and logits of the training class, greedy tokens of the generating
class). Timed:

* training step: ``model(input_ids, labels=labels).loss.backward()`` in training mode (dropout 0.1
  as in the published configs), labels the inputs (causal LMs, shifted by the model), masked-LM
  labels (BERT) or target ids (T5: each a token of its row's input, drawn at random); gradients are
  cleared outside the timed region;
* generation: greedy ``generate`` of exactly ``--new-tokens`` tokens (``min_new_tokens`` equal to
  ``max_new_tokens``), KV cache on, eval mode; the prompt avoids the pad token (BERT's and T5's is 0,
  which ``generate`` would otherwise mask out).

Runs rotate through every order of three models: transformers, a second transformers copy of the
same weights (an A/A control whose ratio shows the noise floor), and oslo, so drift in machine load
hits all three. Verdicts use the median CPU time of the process (one torch thread), which other
processes on the machine inflate far less than wall time; wall-time ratios are printed too. The
summary prints one line per architecture.

Run: ``python benchmarks/overhead.py``; options: ``--arch gpt2|gpt_neo|bert|t5|all --n-layer 4 --batch 2
--seq 128 --repeats 6 --prompt 32 --new-tokens 64 --gen-batch 1``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import shutil
import sys
import tempfile
import time

import _tp_harness as bench
import torch

import oslo  # noqa: F401 - the architectures' oslo_class imports it

TIME_TARGET = 1.05
TOKENS_TARGET = 0.95


def build(arch: bench.Arch, config, directory: str, causal: bool = False):
    """transformers' model of ``arch`` (its training class, or with ``causal`` its generating class;
    seeded), a second transformers copy (the A/A control), and oslo's, all with the same weights."""
    torch.manual_seed(0)
    reference = arch.hf_class(causal)(config)
    reference.save_pretrained(directory)
    control = arch.hf_class(causal).from_pretrained(directory)
    model = arch.oslo_class(causal).from_pretrained_with_parallel(directory, tensor_parallel_size=1)
    return reference, control, model


@torch.no_grad()
def check_outputs(reference, model, input_ids, batch: dict) -> list[str]:
    """Eval-mode loss and logits of the training class (``batch``: the labels, see ``Arch.batch``)."""
    reference.eval()
    model.eval()
    ours = model(input_ids, **batch)
    theirs = reference(input_ids, **batch)
    problems = []
    if ours.logits.shape != theirs.logits.shape:
        problems.append(f"logits shapes differ ({tuple(ours.logits.shape)} vs {tuple(theirs.logits.shape)})")
    elif not torch.allclose(ours.logits, theirs.logits, atol=1e-4, rtol=1e-4):
        problems.append(f"logits differ (max {float((ours.logits - theirs.logits).abs().max()):.2e})")
    if abs(float(ours.loss) - float(theirs.loss)) > 1e-4:
        problems.append(f"loss differs ({float(ours.loss):.6f} vs {float(theirs.loss):.6f})")
    return problems


@torch.no_grad()
def check_tokens(reference, model, prompt, new_tokens: int) -> list[str]:
    """Greedy tokens of the generating class."""
    reference.eval()
    model.eval()
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    if not torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)):
        return ["greedy generate() tokens differ"]
    return []


def clocked(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def train_step(model, input_ids, batch: dict) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    return clocked(lambda: model(input_ids, **batch).loss.backward())


def generate_time(model, prompt, new_tokens: int) -> tuple[float, float]:
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    with torch.no_grad():
        return clocked(lambda: model.generate(prompt, **kwargs))


def interleaved(functions: dict, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Each function ``repeats`` times, the order rotating through every permutation, after one
    unrecorded warm-up each."""
    for fn in functions.values():
        fn()
    orders = list(itertools.permutations(functions))
    times: dict[str, list] = {name: [] for name in functions}
    for i in range(repeats):
        for name in orders[i % len(orders)]:
            times[name].append(functions[name]())
    return times


def _medians(values: list[tuple[float, float]]) -> tuple[float, float]:
    return bench.median([w for w, _ in values]), bench.median([c for _, c in values])


def _print_times(label: str, values: list[tuple[float, float]], unit_fn=None) -> None:
    wall, cpu = _medians(values)
    extra = f"  ({unit_fn(wall):.1f} / {unit_fn(cpu):.1f} tokens/s)" if unit_fn else ""
    print(f"     {label:<22} wall s: {bench.fmt_times([w for w, _ in values])}")
    print(f"     {'':<22} cpu  s: {bench.fmt_times([c for _, c in values])}")
    print(f"     {'':<22} median wall {wall:.3f} s, cpu {cpu:.3f} s{extra}")


def _compare(runs: dict, rate: bool) -> dict:
    """Ratios oslo / transformers and transformers copy / transformers of the median times (``rate``:
    of the rates, i.e. the inverse), CPU and wall."""
    base_wall, base_cpu = _medians(runs["transformers"])
    out = {}
    for key, name in (("oslo", "oslo tp=1"), ("control", "transformers copy")):
        wall, cpu = _medians(runs[name])
        out[key] = (base_cpu / cpu, base_wall / wall) if rate else (cpu / base_cpu, wall / base_wall)
    return out


def measure(arch: bench.Arch, args) -> dict:
    """Agreement, then the interleaved training-step and generate() timings of one architecture."""
    config = arch.config("small", n_layer=args.n_layer, dropout=0.1)
    causal_config = arch.causal_config(config)
    separate = arch.causal_class != arch.lm_class or causal_config is not config
    print(f"\n-- {arch.name}: oslo {arch.lm_class}"
          + (f" and {arch.causal_class}" if separate else "")
          + f" (tp=1) vs transformers', same weights; {bench.describe(config)}; torch threads "
          f"{torch.get_num_threads()}; attention {config._attn_implementation or 'sdpa'}; float32")
    directory = tempfile.mkdtemp(prefix="oslo-bench-overhead-")
    try:
        reference, control, model = build(arch, config, os.path.join(directory, "lm"))
        if separate:
            gen_models = build(arch, causal_config, os.path.join(directory, "causal"), causal=True)
        else:
            gen_models = (reference, control, model)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator)
    batch = arch.batch(input_ids, generator)  # {"labels": ...}
    prompt = torch.randint(0, config.vocab_size, (args.gen_batch, args.prompt), generator=generator)
    pad = config.pad_token_id
    if pad is not None:  # generate() would mask the pad token out of the prompt (BERT's is 0)
        prompt[prompt == pad] = (pad + 1) % config.vocab_size

    problems = check_outputs(reference, model, input_ids, batch)
    problems += check_tokens(gen_models[0], gen_models[2], prompt, args.new_tokens)
    checked = f"eval loss and logits of {arch.lm_class}, greedy tokens of {arch.causal_class}"
    print(f"   agreement before timing ({checked}): {'same' if not problems else '; '.join(problems)}")

    for m in (reference, control, model):
        m.train()
    runs = interleaved({"transformers": lambda: train_step(reference, input_ids, batch),
                        "transformers copy": lambda: train_step(control, input_ids, batch),
                        "oslo tp=1": lambda: train_step(model, input_ids, batch)}, args.repeats)
    if arch.seq2seq:
        what = f"labels = {batch['labels'].shape[1]} target ids per row"
    else:
        what = "masked-LM labels (15 % of positions)" if arch.masked else "labels = inputs"
    print(f"\n   {arch.lm_class} forward+backward, batch {args.batch} x seq {args.seq}, {what}, "
          f"training mode, {args.repeats} runs each:")
    for name, values in runs.items():
        _print_times(name, values)
    train = _compare(runs, rate=False)
    time_ok = train["oslo"][0] <= TIME_TARGET
    print(f"     control: transformers copy / transformers = {train['control'][0]:.3f} cpu, "
          f"{train['control'][1]:.3f} wall")
    print(f"     ratio oslo / transformers (median time) = {train['oslo'][0]:.3f} cpu, "
          f"{train['oslo'][1]:.3f} wall  target <= {TIME_TARGET}  [{bench.verdict(time_ok)}]")
    for m in (reference, control, model):
        m.zero_grad(set_to_none=True)

    gen_reference, gen_control, gen_model = gen_models
    for m in gen_models:
        m.eval()
    tokens = args.gen_batch * args.new_tokens
    runs = interleaved({"transformers": lambda: generate_time(gen_reference, prompt, args.new_tokens),
                        "transformers copy": lambda: generate_time(gen_control, prompt, args.new_tokens),
                        "oslo tp=1": lambda: generate_time(gen_model, prompt, args.new_tokens)}, args.repeats)
    decoder = " (is_decoder=True)" if causal_config is not config else ""
    print(f"\n   {arch.causal_class}{decoder} generate(): greedy, batch {args.gen_batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, KV cache, {args.repeats} runs each:")
    for name, values in runs.items():
        _print_times(name, values, unit_fn=lambda seconds: tokens / seconds)
    rate = _compare(runs, rate=True)
    rate_ok = rate["oslo"][0] >= TOKENS_TARGET
    print(f"     control: transformers copy / transformers tokens/s = {rate['control'][0]:.3f} cpu, "
          f"{rate['control'][1]:.3f} wall")
    print(f"     ratio oslo / transformers (tokens/s) = {rate['oslo'][0]:.3f} cpu, "
          f"{rate['oslo'][1]:.3f} wall  target >= {TOKENS_TARGET}  [{bench.verdict(rate_ok)}]")
    return {"train": train, "rate": rate, "time_ok": time_ok, "rate_ok": rate_ok, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=[*bench.ARCHS, "all"], default="all")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gen-batch", type=int, default=1)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (the claim is a median of >= 5 runs)")

    torch.set_num_threads(1)
    names = bench.arch_names(args.arch)
    classes = [dict.fromkeys((bench.ARCHS[n].lm_class, bench.ARCHS[n].causal_class)) for n in names]
    bench.header("overhead: oslo (tp=1) vs transformers, same weights: " + ", ".join(" / ".join(c) for c in classes))
    print("   verdicts use the median CPU time of this (single-threaded) process, which other processes "
          "sharing the CPUs inflate far less than wall time; wall time is shown too. 'transformers copy' "
          "is a second transformers model with the same weights: its ratio is the noise floor.")
    results = {}
    for name in names:  # one architecture at a time
        results[name] = measure(bench.ARCHS[name], args)
        gc.collect()

    load = os.getloadavg()
    print(f"\nsummary (cpu-time ratios oslo / transformers, A/A control in brackets; load average now "
          f"{load[0]:.2f}):")
    ok = True
    for name, r in results.items():
        arch_ok = r["time_ok"] and r["rate_ok"] and not r["problems"]
        ok &= arch_ok
        agreement = "same" if not r["problems"] else "; ".join(r["problems"])
        print(f"   {name:<8} training step time {r['train']['oslo'][0]:.3f} ({r['train']['control'][0]:.3f}) "
              f"<= {TIME_TARGET} [{bench.verdict(r['time_ok'])}]; generate tokens/s {r['rate']['oslo'][0]:.3f} "
              f"({r['rate']['control'][0]:.3f}) >= {TOKENS_TARGET} [{bench.verdict(r['rate_ok'])}]; "
              f"agreement {agreement}  [{bench.verdict(arch_ok)}]")
    print(f"\noverhead overall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.pop("RANK", None)  # tp=1 in a plain process: no launcher needed (or wanted)
    sys.exit(main())
