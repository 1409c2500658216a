"""oslo's fused kernels against what ``fuse()`` replaces, at the shapes ``fuse()`` runs them on, on a CUDA GPU.

Ready to run on a machine with CUDA and triton (``pip install "triton>=3.0"``); on a machine without them it
says so and exits 0.

Shapes are GPT-2 medium's (hidden 1024, MLP 4096, 16 heads) at ``--dtype`` bf16: training rows ``--batch`` 8 x
``--seq`` 1024 = 8192, and decoding rows ``--batch`` 8 (one new token per sequence; attention over a cache of
``--cache`` 256 keys). Training cases are timed with CUDA events (the GPU's time; median of ``--repeats`` rounds
of ``--iters`` calls, after warm-up, which also compiles the kernels), forward + backward. Decoding cases are
forward only and timed by the wall clock (a decode step is launch-bound: the CPU time of the calls is the cost).
Each case says which of the two ``fuse()`` runs there (its dispatch rules, asked at that shape: the row
threshold :data:`oslo.kernels._triton.TRITON_MIN_ROWS`, :func:`oslo.kernels.fused_bias_dropout_add_pays`), and
the kernel is forced where ``fuse()`` would not take it, so both sides are always measured. Ratios are
unfused / fused: above 1, the kernel is faster.

* MLP: ``NewGELUActivation(x @ W + b)`` (transformers' and unfused oslo's GPT-2 MLP) and torch's
  ``gelu(x @ W + b, approximate="tanh")`` (what ``fuse()`` runs) against ``bias_gelu(x @ W, b, "tanh")``;
  matmul included.
* bias + dropout(0.1) + residual: ``residual + dropout(x @ W + b)`` (the bias in the matmul) against
  ``bias_dropout_add(x @ W, b, residual, 0.1)``; matmul included.
* attention softmax, where scores are materialized (eager attention, ``output_attentions=True``; otherwise
  ``fuse()`` keeps sdpa, measured too for scale): eager ``softmax(scores * scale + causal_mask)`` against
  ``scaled_masked_softmax(scores, scale=..., causal=True)``; GPT-Neo's window (256) against the unfused band.
* RMSNorm of the Llama family (hidden 2048): transformers' ``LlamaRMSNorm`` against torch's ``F.rms_norm``, what
  ``fuse()`` runs on CUDA.
* n-gram blocking (n = 3, vocab 50257; generation's 8 rows x 256 tokens, and 64 x 1024): transformers'
  processor (what ``generate()`` runs without ``fuse()``) against ``no_repeat_ngram_block`` in place.

Run: ``python benchmarks/kernels_gpu.py`` (``--quick`` for fewer iterations; ``--batch 8 --seq 1024 --cache 256
--dtype bf16 --iters 20 --repeats 7``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import oslo.kernels._triton as triton_support
from oslo.kernels import (
    HAS_TRITON,
    bias_dropout_add,
    bias_gelu,
    fused_bias_dropout_add_pays,
    no_repeat_ngram_block,
    scaled_masked_softmax,
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HIDDEN, INNER, HEADS, HEAD_DIM = 1024, 4096, 16, 64


def cuda_ms(fn, iters: int, repeats: int) -> float:
    """GPU time per call (CUDA events), median of ``repeats`` rounds of ``iters`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / iters)
    return statistics.median(rounds)


def wall_ms(fn, iters: int, repeats: int) -> float:
    """Wall-clock time per call, synchronized once per round: what a launch-bound decode step pays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters * 5):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) * 1e3 / (iters * 5))
    return statistics.median(rounds)


def forward_backward(fn, inputs):
    def run():
        out = fn()
        out.backward(torch.ones_like(out))
        for tensor in inputs:
            tensor.grad = None

    return run


@contextlib.contextmanager
def forced_kernel():
    """Launch the Triton kernels whatever the row count (to measure what fuse() does not pick)."""
    saved = triton_support.TRITON_MIN_ROWS
    triton_support.TRITON_MIN_ROWS = 0
    try:
        yield
    finally:
        triton_support.TRITON_MIN_ROWS = saved


def report(title: str, unfused_ms: float, fused_ms: float, picks: str) -> None:
    ratio = unfused_ms / fused_ms
    print(f"   {title:<50} unfused {unfused_ms:8.3f} ms   fused {fused_ms:8.3f} ms   ratio {ratio:5.2f}x   "
          f"fuse() picks: {picks}")


def check(name: str, fused: torch.Tensor, unfused: torch.Tensor, atol: float) -> None:
    if not torch.allclose(fused.float(), unfused.float(), rtol=2e-2, atol=atol):
        diff = (fused.float() - unfused.float()).abs().max().item()
        print(f"   !! {name}: fused differs from unfused by {diff:.3g} (allowed {atol})")


def bench_mlp(rows: dict, dtype: torch.dtype, timing: dict) -> None:
    from transformers.activations import NewGELUActivation

    print("\n-- MLP c_fc + GeLU (tanh approximation, GPT-2's gelu_new), matmul included")
    new_gelu = NewGELUActivation()
    weight = (torch.randn(HIDDEN, INNER, device="cuda", dtype=dtype) * HIDDEN**-0.5).requires_grad_()
    bias = torch.randn(INNER, device="cuda", dtype=dtype, requires_grad=True)
    for label, count in rows.items():
        _mlp_case(label, count, weight, bias, new_gelu, dtype, timing)


def _mlp_case(label, count, weight, bias, new_gelu, dtype, timing) -> None:
    x = torch.randn(count, HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
    picks = "torch gelu(linear(x))"  # the models' fuse(): the bias rides the matmul (see oslo.models.gpt2.GPT2MLP)
    with forced_kernel():
        check(f"bias+gelu {label}", bias_gelu(x @ weight, bias, "tanh"),
              F.gelu(x @ weight + bias, approximate="tanh"), atol=2e-2)

        def fused():
            return bias_gelu(x @ weight, bias, "tanh")

        unfused = {
            "transformers gelu_new": lambda: new_gelu(F.linear(x, weight.t(), bias)),
            "torch gelu(tanh)": lambda: F.gelu(F.linear(x, weight.t(), bias), approximate="tanh"),
        }
        for name, fn in unfused.items():
            if label == "training":
                report(f"{label} {count} rows, fwd+bwd, vs {name}",
                       cuda_ms(forward_backward(fn, [x, weight, bias]), **timing),
                       cuda_ms(forward_backward(fused, [x, weight, bias]), **timing), picks)
            else:
                with torch.no_grad():
                    report(f"{label} {count} rows, forward (wall), vs {name}", wall_ms(fn, **timing),
                           wall_ms(fused, **timing), picks)
    # What fuse() runs, against transformers.
    if label == "training":
        report(f"{label} {count} rows, fwd+bwd, fuse()'s path vs transformers gelu_new",
               cuda_ms(forward_backward(unfused["transformers gelu_new"], [x, weight, bias]), **timing),
               cuda_ms(forward_backward(unfused["torch gelu(tanh)"], [x, weight, bias]), **timing), picks)
    else:
        with torch.no_grad():
            report(f"{label} {count} rows, fuse()'s path (wall) vs transformers gelu_new",
                   wall_ms(unfused["transformers gelu_new"], **timing), wall_ms(unfused["torch gelu(tanh)"], **timing),
                   picks)


def bench_bias_dropout_add(rows: dict, dtype: torch.dtype, timing: dict, p: float = 0.1) -> None:
    print(f"\n-- c_proj + bias + dropout({p}) + residual add, matmul included")
    weight = (torch.randn(HIDDEN, INNER, device="cuda", dtype=dtype) * INNER**-0.5).requires_grad_()
    bias = torch.randn(HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
    for label, count in rows.items():
        _bias_dropout_add_case(label, count, weight, bias, p, dtype, timing)


def _bias_dropout_add_case(label, count, weight, bias, p, dtype, timing) -> None:
    x = torch.randn(count, INNER, device="cuda", dtype=dtype, requires_grad=True)
    residual = torch.randn(count, HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
    picks = "kernel" if fused_bias_dropout_add_pays(x, p, training=True) else "torch residual + dropout(linear)"
    with forced_kernel():
        # bf16: the bias added after rounding the matmul (fused) or inside it (unfused): an ulp of ~10
        check(f"bias+dropout+add p=0 {label}", bias_dropout_add(F.linear(x, weight), bias, residual, 0.0),
              residual + F.linear(x, weight, bias), atol=0.1)

        def unfused():
            return residual + F.dropout(F.linear(x, weight, bias), p, training=True)

        def fused():
            return bias_dropout_add(F.linear(x, weight), bias, residual, p)

        def unfused_elementwise():
            return residual + F.dropout(x[:, :HIDDEN] + bias, p)

        def fused_elementwise():
            return bias_dropout_add(x[:, :HIDDEN], bias, residual, p)

        if label == "training":
            inputs = [x, weight, bias, residual]
            report(f"{label} {count} rows, fwd+bwd", cuda_ms(forward_backward(unfused, inputs), **timing),
                   cuda_ms(forward_backward(fused, inputs), **timing), picks)
            report(f"{label} {count} rows, element-wise only, fwd+bwd",
                   cuda_ms(forward_backward(unfused_elementwise, [x, bias, residual]), **timing),
                   cuda_ms(forward_backward(fused_elementwise, [x, bias, residual]), **timing), picks)
        else:
            with torch.no_grad():
                report(f"{label} {count} rows, forward (wall)", wall_ms(unfused, **timing), wall_ms(fused, **timing),
                       picks)


def bench_rms_norm(rows: dict, dtype: torch.dtype, timing: dict, hidden: int = 2048) -> None:
    """The Llama family's RMSNorm (hidden 2048: Llama-3.2-1B): transformers' expression (seven kernels) against
    torch's ``F.rms_norm``, which ``fuse()`` runs on CUDA (:class:`oslo.models.llama.LlamaRMSNorm`)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm as TransformersRMSNorm

    from oslo.models.llama import LlamaRMSNorm

    print(f"\n-- RMSNorm (hidden {hidden}), transformers' LlamaRMSNorm against oslo's after fuse()")
    unfused_norm = TransformersRMSNorm(hidden, eps=1e-5).to("cuda", dtype)
    fused_norm = LlamaRMSNorm(hidden, eps=1e-5).to("cuda", dtype)
    fused_norm.fuse()
    for label, count in rows.items():
        x = torch.randn(count, hidden, device="cuda", dtype=dtype, requires_grad=True)
        unfused, fused = functools.partial(unfused_norm, x), functools.partial(fused_norm, x)
        check(f"rms_norm {label}", fused(), unfused(), atol=2e-2)
        if label == "training":
            inputs = [x, unfused_norm.weight, fused_norm.weight]
            report(f"{label} {count} rows, fwd+bwd", cuda_ms(forward_backward(unfused, inputs), **timing),
                   cuda_ms(forward_backward(fused, inputs), **timing), "torch F.rms_norm")
        else:
            with torch.no_grad():
                report(f"{label} {count} rows, forward (wall)", wall_ms(unfused, **timing), wall_ms(fused, **timing),
                       "torch F.rms_norm")


def bench_softmax(batch: int, seq: int, cache: int, dtype: torch.dtype, timing: dict) -> None:
    print("\n-- attention softmax where the scores are materialized (eager attention, output_attentions=True)")
    scale = HEAD_DIM**-0.5
    scores = torch.randn(batch, HEADS, seq, seq, device="cuda", dtype=dtype, requires_grad=True)
    causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    additive = torch.zeros(batch, 1, seq, seq, device="cuda", dtype=dtype)
    additive.masked_fill_(~causal, torch.finfo(dtype).min)
    window = 256  # GPT-Neo's config.window_size
    band = causal & ~causal.tril(-window)

    def eager_causal():  # transformers' eager_attention_forward
        return F.softmax(scores * scale + additive, dim=-1)

    def fused_causal():
        return scaled_masked_softmax(scores, additive, scale)

    def eager_window():  # unfused GPT-Neo: float32 scores, the band, the padding mask, softmax
        return F.softmax(torch.where(band, scores.float(), torch.finfo(torch.float32).min) + additive, dim=-1)

    def fused_window():
        return scaled_masked_softmax(scores, additive, 1.0, causal=True, window=window)

    check("causal softmax", fused_causal(), eager_causal(), atol=1e-2)
    report(f"training {batch}x{HEADS}x{seq}x{seq}, eager mask, fwd+bwd",
           cuda_ms(forward_backward(eager_causal, [scores]), **timing),
           cuda_ms(forward_backward(fused_causal, [scores]), **timing), "kernel")
    report(f"training, GPT-Neo window {window}, fwd+bwd", cuda_ms(forward_backward(eager_window, [scores]), **timing),
           cuda_ms(forward_backward(fused_window, [scores]), **timing), "kernel (weights asked for), else sdpa")
    decode = torch.randn(batch, HEADS, 1, cache, device="cuda", dtype=dtype)
    decode_mask = torch.zeros(batch, 1, 1, cache, device="cuda", dtype=dtype)
    with torch.no_grad():
        report(f"decode {batch}x{HEADS}x1x{cache}, eager mask (wall)",
               wall_ms(lambda: F.softmax(decode * scale + decode_mask, dim=-1), **timing),
               wall_ms(lambda: scaled_masked_softmax(decode, decode_mask, scale), **timing), "kernel")

    print("   for scale, what fuse() keeps when no weights are asked for (sdpa), against eager attention:")
    q, k, v = (torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))

    def eager_attention():
        return F.softmax(q @ k.transpose(-1, -2) * scale + additive, dim=-1) @ v

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fused_attention():
        return scaled_masked_softmax(q @ k.transpose(-1, -2), additive, scale) @ v

    report("training attention fwd+bwd: eager vs sdpa (is_causal)",
           cuda_ms(forward_backward(eager_attention, [q, k, v]), **timing),
           cuda_ms(forward_backward(sdpa, [q, k, v]), **timing), "sdpa")
    report("training attention fwd+bwd: eager vs fused softmax",
           cuda_ms(forward_backward(eager_attention, [q, k, v]), **timing),
           cuda_ms(forward_backward(fused_attention, [q, k, v]), **timing), "sdpa (fused only with weights)")


def bench_ngram(timing: dict) -> None:
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    print("\n-- n-gram blocking, n=3, vocab 50257, fp32 scores (what generate() runs per step)")
    processor = NoRepeatNGramLogitsProcessor(3)
    for rows, history in ((8, 256), (64, 1024)):
        input_ids = torch.randint(0, 200, (rows, history), device="cuda")  # small alphabet: many bans
        logits = torch.randn(rows, 50257, device="cuda")
        if not torch.equal(no_repeat_ngram_block(input_ids, logits, 3), processor(input_ids, logits)):
            print("   !! fused n-gram blocking bans different tokens than transformers")
        report(f"{rows} rows x {history} tokens, in place (wall)",
               wall_ms(lambda ids=input_ids, scores=logits: processor(ids, scores.clone()), **timing),
               wall_ms(lambda ids=input_ids, scores=logits: no_repeat_ngram_block(ids, scores.clone(), 3, inplace=True),
                       **timing),
               "kernel (after fuse())")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--cache", type=int, default=256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (--iters 5 --repeats 3)")
    args = parser.parse_args()
    if args.quick:
        args.iters, args.repeats = 5, 3

    if not torch.cuda.is_available() or not HAS_TRITON:
        missing = "CUDA" if not torch.cuda.is_available() else "triton"
        print(
            f"kernels_gpu: no {missing} on this machine; this benchmark needs a CUDA GPU and triton "
            '(pip install "triton>=3.0"). Nothing measured.'
        )
        sys.exit(0)

    dtype = DTYPES[args.dtype]
    timing = {"iters": args.iters, "repeats": args.repeats}
    torch.manual_seed(0)
    rows = {"training": args.batch * args.seq, "decode": args.batch}
    print(
        f"== fused kernels vs what fuse() replaces on {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"{args.dtype} | training {rows['training']} rows, decode {rows['decode']} rows | row threshold "
        f"{triton_support.TRITON_MIN_ROWS}"
    )
    for name, bench in (
        ("mlp", lambda: bench_mlp(rows, dtype, timing)),
        ("bias_dropout_add", lambda: bench_bias_dropout_add(rows, dtype, timing)),
        ("softmax", lambda: bench_softmax(args.batch, args.seq, args.cache, dtype, timing)),
        ("rms_norm", lambda: bench_rms_norm(rows, dtype, timing)),
        ("ngram", lambda: bench_ngram(timing)),
    ):
        try:
            bench()
        except Exception as error:  # noqa: BLE001 - report, measure the rest
            print(f"   !! {name}: {type(error).__name__}: {error}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
