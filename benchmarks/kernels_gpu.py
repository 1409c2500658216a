"""Fused Triton kernels vs the unfused torch ops they replace, on a CUDA GPU.

Ready to run on a machine with CUDA and triton (``pip install "triton>=3.0"``); on a machine without
them it says so and exits 0. GPU numbers are pending a GPU run: none are claimed until this script
has been run on one.

Shapes are GPT-2 medium's (hidden 1024, MLP 4096, 16 heads, 1024 positions) at ``--batch`` 8,
``--dtype`` fp16. Timed with CUDA events, median of ``--repeats`` rounds of ``--iters`` calls, after
warm-up (which also compiles the kernels). Each fused op is first checked against its unfused
counterpart. Reported, each as unfused ms / fused ms (ratio > 1: fused is faster):

* MLP ``c_fc`` + GeLU: ``gelu(x @ W + b)`` (torch's tanh kernel, and transformers' ``NewGELUActivation``
  that GPT-2 runs) vs ``bias_gelu(x @ W, b, "tanh")``; element-wise part alone and with the matmul;
  forward, and forward + backward.
* bias + dropout + residual add (p = 0.1): ``residual + F.dropout(x + b)`` vs ``bias_dropout_add``.
* attention softmax: eager ``softmax(scores * scale + causal_mask)`` vs ``scaled_masked_softmax(scores,
  scale=..., causal=True)``, with a boolean padding mask, and GPT-Neo's sliding window (``window=256``).
* n-gram blocking (n = 3, 64 rows, history 1024, vocab 50257): transformers' processor vs
  ``no_repeat_ngram_block`` (copy and in place).

``model.fuse()`` end to end on a gpt2-medium-shaped model belongs here once ``fuse()`` exists.

Run: ``python benchmarks/kernels_gpu.py``; options: ``--batch 8 --seq 1024 --dtype fp16 --iters 20
--repeats 7``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from oslo.kernels import (
    HAS_TRITON,
    bias_dropout_add,
    bias_gelu,
    no_repeat_ngram_block,
    scaled_masked_softmax,
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def cuda_ms(fn, iters: int, repeats: int) -> float:
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


def forward_backward(fn, inputs):
    def run():
        out = fn()
        out.backward(torch.ones_like(out))
        for tensor in inputs:
            tensor.grad = None

    return run


def report(title: str, unfused_ms: float, fused_ms: float) -> None:
    ratio = unfused_ms / fused_ms
    print(f"   {title:<58} unfused {unfused_ms:8.3f} ms   fused {fused_ms:8.3f} ms   ratio {ratio:5.2f}x")


def check(name: str, fused: torch.Tensor, unfused: torch.Tensor, atol: float) -> None:
    if not torch.allclose(fused.float(), unfused.float(), rtol=1e-2, atol=atol):
        diff = (fused.float() - unfused.float()).abs().max().item()
        raise SystemExit(f"FAIL: fused {name} differs from unfused by {diff:.3g} (allowed {atol})")


def bench_mlp(tokens: int, dtype: torch.dtype, timing: dict) -> None:
    from transformers.activations import NewGELUActivation

    print("\n-- MLP c_fc + GeLU (tanh approximation, as GPT-2's gelu_new)")
    hidden, inner = 1024, 4096
    new_gelu = NewGELUActivation()
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(hidden, inner, device="cuda", dtype=dtype) * hidden**-0.5).requires_grad_()
    bias = torch.randn(inner, device="cuda", dtype=dtype, requires_grad=True)
    h = (x @ weight).detach().requires_grad_()
    check("bias+gelu", bias_gelu(h, bias, "tanh"), F.gelu(h + bias, approximate="tanh"), atol=1e-2)

    def fused():
        return bias_gelu(h, bias, "tanh")

    unfused_variants = {
        "torch gelu(tanh)": lambda: F.gelu(h + bias, approximate="tanh"),
        "transformers NewGELUActivation": lambda: new_gelu(h + bias),
    }
    for label, unfused in unfused_variants.items():
        report(f"element-wise, forward, vs {label}", cuda_ms(unfused, **timing), cuda_ms(fused, **timing))
        report(
            f"element-wise, fwd+bwd, vs {label}",
            cuda_ms(forward_backward(unfused, [h, bias]), **timing),
            cuda_ms(forward_backward(fused, [h, bias]), **timing),
        )
    report(
        "with matmul, fwd+bwd, vs torch gelu(tanh)",
        cuda_ms(
            forward_backward(lambda: F.gelu(x @ weight + bias, approximate="tanh"), [x, weight, bias]),
            **timing,
        ),
        cuda_ms(forward_backward(lambda: bias_gelu(x @ weight, bias, "tanh"), [x, weight, bias]), **timing),
    )


def bench_bias_dropout_add(tokens: int, dtype: torch.dtype, timing: dict) -> None:
    print("\n-- bias + dropout(0.1) + residual add")
    hidden = 1024
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
    residual = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    check("bias+dropout+add (p=0)", bias_dropout_add(x, bias, residual, 0.0), residual + x + bias, atol=1e-2)

    def unfused():
        return residual + F.dropout(x + bias, 0.1, training=True)

    def fused():
        return bias_dropout_add(x, bias, residual, 0.1, seed=1234)

    report("forward", cuda_ms(unfused, **timing), cuda_ms(fused, **timing))
    report(
        "fwd+bwd",
        cuda_ms(forward_backward(unfused, [x, bias, residual]), **timing),
        cuda_ms(forward_backward(fused, [x, bias, residual]), **timing),
    )


def bench_softmax(batch: int, seq: int, dtype: torch.dtype, timing: dict) -> None:
    print("\n-- attention scale + mask + softmax")
    heads, head_dim = 16, 64
    scores = torch.randn(batch, heads, seq, seq, device="cuda", dtype=dtype, requires_grad=True)
    scale = head_dim**-0.5
    causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    additive = torch.zeros(batch, 1, seq, seq, device="cuda", dtype=dtype)
    additive.masked_fill_(~causal, torch.finfo(dtype).min)
    padding = torch.ones(batch, 1, 1, seq, dtype=torch.bool, device="cuda")
    padding[0, ..., -seq // 4 :] = False

    def eager_causal():
        return F.softmax(scores * scale + additive, dim=-1)

    def fused_causal():
        return scaled_masked_softmax(scores, None, scale, causal=True)

    def eager_padding():
        return F.softmax((scores * scale).masked_fill(~padding, torch.finfo(dtype).min), dim=-1)

    def fused_padding():
        return scaled_masked_softmax(scores, padding, scale)

    window = 256  # GPT-Neo's config.window_size
    local = causal & ~causal.tril(-window)

    def eager_window():
        return F.softmax(torch.where(local, scores * scale, torch.finfo(dtype).min), dim=-1)

    def fused_window():
        return scaled_masked_softmax(scores, None, scale, causal=True, window=window)

    check("causal softmax", fused_causal(), eager_causal(), atol=1e-3)
    check("padding softmax", fused_padding(), eager_padding(), atol=1e-3)
    check("sliding-window softmax", fused_window(), eager_window(), atol=1e-3)
    report("causal, forward", cuda_ms(eager_causal, **timing), cuda_ms(fused_causal, **timing))
    report(
        "causal, fwd+bwd",
        cuda_ms(forward_backward(eager_causal, [scores]), **timing),
        cuda_ms(forward_backward(fused_causal, [scores]), **timing),
    )
    report(
        "boolean padding mask, forward", cuda_ms(eager_padding, **timing), cuda_ms(fused_padding, **timing)
    )
    report(
        f"sliding window {window}, fwd+bwd",
        cuda_ms(forward_backward(eager_window, [scores]), **timing),
        cuda_ms(forward_backward(fused_window, [scores]), **timing),
    )


def bench_ngram(timing: dict) -> None:
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    print("\n-- n-gram blocking, n=3, 64 rows, history 1024, vocab 50257, fp32 scores")
    input_ids = torch.randint(0, 200, (64, 1024), device="cuda")  # small alphabet: many bans
    logits = torch.randn(64, 50257, device="cuda")
    processor = NoRepeatNGramLogitsProcessor(3)
    if not torch.equal(no_repeat_ngram_block(input_ids, logits, 3), processor(input_ids, logits)):
        raise SystemExit("FAIL: fused n-gram blocking bans different tokens than transformers")
    unfused_ms = cuda_ms(lambda: processor(input_ids, logits), **timing)
    report(
        "vs transformers processor, copy",
        unfused_ms,
        cuda_ms(lambda: no_repeat_ngram_block(input_ids, logits, 3), **timing),
    )
    report(
        "vs transformers processor, in place",
        unfused_ms,
        cuda_ms(lambda: no_repeat_ngram_block(input_ids, logits, 3, inplace=True), **timing),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    if not torch.cuda.is_available() or not HAS_TRITON:
        missing = "CUDA" if not torch.cuda.is_available() else "triton"
        print(
            f"kernels_gpu: no {missing} on this machine; this benchmark needs a CUDA GPU and triton "
            '(pip install "triton>=3.0"). Nothing measured; GPU numbers are pending a GPU run.'
        )
        sys.exit(0)

    dtype = DTYPES[args.dtype]
    timing = {"iters": args.iters, "repeats": args.repeats}
    torch.manual_seed(0)
    print(
        f"== fused kernels vs unfused torch on {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"{args.dtype} | batch {args.batch} x seq {args.seq}, GPT-2 medium shapes"
    )
    bench_mlp(args.batch * args.seq, dtype, timing)
    bench_bias_dropout_add(args.batch * args.seq, dtype, timing)
    bench_softmax(args.batch, args.seq, dtype, timing)
    bench_ngram(timing)


if __name__ == "__main__":
    main()
