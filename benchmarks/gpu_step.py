"""oslo on one GPU against transformers: a training step, eager and compiled, and generation (issue 13).

Workload: GPT2 at gpt2-medium's shape (n_embd 1024, ``--layers`` 24, 16 heads, vocab 50257, 1024 positions,
dropout ``--dropout`` 0.1 as gpt2-medium's config), random weights (transformers' model, seeded, saved once and
loaded by oslo: the same weights everywhere), float32 parameters under bf16 autocast, ``--batch`` 8 x
``--seq`` 1024 random tokens. A training step is ``model(input_ids=ids, labels=ids).loss.backward()``, then an
AdamW step (``fused=True`` on CUDA, lr 1e-5) and ``zero_grad(set_to_none=True)``.

Variants (one process, one model per family; a compiled variant wraps its family's model, sharing its
parameters and optimizer):

* ``transformers`` / ``transformers compiled`` (``torch.compile(model)``);
* ``oslo`` (``oslo.GPT2LMHeadModel.from_pretrained_with_parallel`` in this plain process, tp=1, then
  ``.to(device)``) / ``oslo compiled``;
* ``oslo fuse()`` / ``oslo fuse() compiled``.

Each variant is warmed up first (the compiled ones' warm-up is the compilation: timed and printed on its own),
then the variants are alternated round by round, in an order that rotates, ``--steps`` steps each per round,
until ``--rounds`` rounds or the ``--budget-s`` time budget (counted from the start; a compilation that would
start with less than a minute left is skipped). Per variant: the median step time, the median of the per-round
ratios to transformers eager (and to transformers compiled), the peak memory of a step (the memory allocated
above what was allocated before it, plus the variant's own parameters, gradients and optimizer state: what a
process holding that one model would peak at, without the CUDA context), the caching allocator's retries in a
round where there were any (each frees the cache with a synchronizing ``cudaFree``: the three models share one
process's memory), and the MFU, 6 * N * tokens / step time
/ peak bf16 FLOP/s (N: every parameter, embeddings included, the tied LM head once; attention's own FLOPs are
not counted), with 989 TFLOP/s dense bf16 for the H100 SXM and the H200 (``--peak-tflops`` for other devices).

Generation (unless ``--skip-generate``): batch ``--batch``, a prompt of ``--prompt`` 128 random tokens, +``--new``
128 tokens (``min_new_tokens`` as well: every call does the same work), greedy, ``no_repeat_ngram_size=3``, under
bf16 autocast, for transformers, oslo and oslo after ``fuse()``: tokens/s (new tokens, the best of
``--gen-repeats`` calls after one short warm-up call).

Goals, printed PASS / FAIL (n/a when a variant failed or was skipped): oslo <= 1.01x transformers eager;
``fuse()`` <= 0.75x transformers eager in step time and peak memory; oslo compiled <= 1.0x transformers
compiled; ``fuse()`` + compiled <= 0.95x transformers compiled; generation after ``fuse()`` >= 1.0x
transformers' tokens/s. Every variant runs in its own try/except: an error is printed and the run goes on.

Run on a GPU: ``python benchmarks/gpu_step.py [--budget-s 420] [--json out.json]``; without CUDA it says so and
exits 0. ``--families transformers,oslo`` builds only those families (transformers always; the experimental "oslo
fuse() + blocks compiled" only without ``--families``); ``--per-step`` also times each step on its own (a
synchronization after each) and prints them with the round's ``cudaMalloc`` calls: a step that is slow once (the
allocator, the host) shows apart from a steady difference. On CPU: ``--cpu`` runs the training variants alone
(compiled against eager) at a tiny shape (2 layers, 2 x 64 tokens, float32, 2 rounds); ``--device cpu --layers 2
--seq 64 --batch 2 --rounds 2`` runs everything, generation included.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers

import oslo

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core FLOP/s (SXM)
GIB = 2**30


@dataclass
class Variant:
    name: str
    family: str  # "transformers", "oslo" or "oslo fuse()"
    compiled: bool
    call: Callable | None = None  # the module called for a step (the model or its compiled wrapper)
    warmup_s: float | None = None
    error: str | None = None
    times: list[float] = field(default_factory=list)  # seconds per step, one per round
    steps: list[list[float]] = field(default_factory=list)  # each step's seconds, per round
    mallocs: list[int] = field(default_factory=list)  # cudaMalloc calls of the caching allocator, per round
    peaks: list[int] = field(default_factory=list)  # bytes above the memory allocated before the round
    retries: list[int] = field(default_factory=list)  # the caching allocator's retries (a freed cache) per round
    first_loss: float | None = None

    @property
    def ready(self) -> bool:
        return self.call is not None and self.error is None and self.warmup_s is not None


def _fail(variant: Variant, what: str, error: BaseException) -> None:
    variant.error = f"{what}: {type(error).__name__}: {error}"
    print(f"!! {variant.name}: {variant.error}")
    traceback.print_exc(limit=6)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.transformer.h:
        block.compile()
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, their gradients and the optimizer's state, in bytes (each storage once)."""
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    state = {
        t.data_ptr(): t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.device.type != "cpu"
    }
    return 2 * sum(params.values()) + sum(state.values())  # gradients: one per parameter


def _peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def _median_ratio(numerator: Variant, denominator: Variant) -> float | None:
    pairs = [a / b for a, b in zip(numerator.times, denominator.times, strict=False) if a and b]
    return statistics.median(pairs) if pairs else None


def _detail(variant: Variant, per_step: bool) -> str:
    """``--per-step``'s addition to a round's line: each step's milliseconds and the round's cudaMalloc calls."""
    if not per_step:
        return ""
    mallocs = f"; {variant.mallocs[-1]} cudaMalloc" if variant.mallocs else ""
    return f" [{' '.join(f'{1e3 * s:.1f}' for s in variant.steps[-1])}{mallocs}]"


def _fmt(value: float | None, spec: str, missing: str = "n/a") -> str:
    """``value`` formatted by ``spec``, or ``missing`` padded to the same width."""
    if value is None:
        width = spec.split(".")[0]
        return format(missing, f">{width}") if width.isdigit() else missing
    return format(value, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU check of the compiled variants: tiny shape, training only, float32")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--per-step", action="store_true",
                        help="also time each step on its own (a synchronization after each) and print it")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="autocast dtype (default: bf16 on CUDA; fp32, no autocast, on the CPU)")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--gen-repeats", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=0.0, help="stop adding work after this many seconds")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s for the MFU")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--families", default=None,
                        help="comma-separated families to build (default all): transformers,oslo,oslo fuse()")
    args = parser.parse_args()
    if args.cpu:
        args.device = "cpu"
        args.layers, args.seq, args.batch, args.rounds, args.steps = 2, 64, 2, 2, 1
        args.skip_generate = True
        args.dtype = args.dtype or "fp32"
    if args.device is None:
        if not torch.cuda.is_available():
            print("gpu_step: no CUDA device on this machine; nothing measured (use --cpu for a CPU check of the "
                  "compiled variants, or --device cpu for everything at a tiny shape).")
            return 0
        args.device = "cuda"
    device = torch.device(args.device)
    # bf16 autocast on CUDA; float32 on the CPU, where bf16 matmuls are many times slower
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    started = time.perf_counter()

    def left() -> float:
        return math.inf if not args.budget_s else args.budget_s - (time.perf_counter() - started)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"== gpu_step on {device_name} | torch {torch.__version__} | transformers {transformers.__version__} | "
          f"{args.layers} layers x 1024 wide, {args.batch} x {args.seq} tokens, "
          f"{'bf16 autocast' if dtype else 'float32'}, dropout {args.dropout}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    config = transformers.GPT2Config(
        vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=args.layers, n_head=16,
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
        bos_token_id=50256, eos_token_id=50256, pad_token_id=50256,
    )
    torch.manual_seed(0)
    families: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    reference = transformers.GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in reference.parameters())
    with tempfile.TemporaryDirectory() as checkpoint:
        reference.save_pretrained(checkpoint)
        builders = {
            "transformers": lambda: reference,
            "oslo": lambda: oslo.GPT2LMHeadModel.from_pretrained_with_parallel(checkpoint),
            "oslo fuse()": lambda: oslo.GPT2LMHeadModel.from_pretrained_with_parallel(checkpoint).fuse(),
        }
        if args.families:
            wanted = {name.strip() for name in args.families.split(",")}
            unknown = wanted - set(builders)
            if unknown or "transformers" not in wanted:
                parser.error(f"--families: {sorted(unknown)} unknown (known: {sorted(builders)}), or transformers "
                             "missing (every ratio is to it)")
            builders = {name: build for name, build in builders.items() if name in wanted}
        if device.type == "cuda" and not args.skip_compile and not args.families:
            # Not (yet) what fuse() does: each block compiled on its own (torchtitan's regional compile;
            # the blocks share one compiled graph), the embeddings, head and loss eager.
            builders["oslo fuse() + blocks compiled"] = lambda: _compile_blocks(
                oslo.GPT2LMHeadModel.from_pretrained_with_parallel(checkpoint).fuse())
        variants = [Variant(f"{family}{' compiled' if compiled else ''}", family, compiled)
                    for family in builders for compiled in (False, True)
                    if not (compiled and family.endswith("blocks compiled"))]
        for family, build in builders.items():
            try:
                model = build().to(device).train()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
                families[family] = (model, optimizer)
            except Exception as error:  # noqa: BLE001 - report, and measure the others
                for variant in variants:
                    if variant.family == family:
                        _fail(variant, "build", error)
    print(f"   parameters: {n_params / 1e6:.1f} M; built in {time.perf_counter() - started:.1f} s")

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    def step(variant: Variant) -> torch.Tensor:
        optimizer = families[variant.family][1]
        with autocast:
            loss = variant.call(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def warm(variant: Variant) -> None:
        if variant.family not in families:
            return
        if variant.compiled and args.skip_compile:
            variant.error = "skipped (--skip-compile)"
            return
        if variant.compiled and left() < 60:
            variant.error = f"skipped: {max(left(), 0):.0f} s of the budget left, too little to compile"
            print(f"-- {variant.name}: {variant.error}")
            return
        model = families[variant.family][0]
        try:
            variant.call = torch.compile(model) if variant.compiled else model
            start = time.perf_counter()
            variant.first_loss = float(step(variant).detach())
            step(variant)
            _sync(device)
            variant.warmup_s = time.perf_counter() - start
            what = "compilation + 2 steps" if variant.compiled else "2 steps"
            print(f"-- warm-up {variant.name:<24} {variant.warmup_s:7.1f} s ({what}); first loss "
                  f"{variant.first_loss:.4f}")
        except Exception as error:  # noqa: BLE001
            variant.call = None
            _fail(variant, "warm-up", error)

    for variant in variants:
        if not variant.compiled:
            warm(variant)

    generation = {} if args.skip_generate else _generate_all(args, families, device, autocast, config, left)

    for variant in variants:
        if variant.compiled:
            warm(variant)

    ready = [v for v in variants if v.ready]
    by_name = {v.name: v for v in variants}
    last_round = 0.0
    for index in range(args.rounds):
        if index and left() < last_round:
            print(f"-- budget: stopping after {index} rounds ({max(left(), 0):.0f} s left)")
            break
        round_start = time.perf_counter()
        order = ready[index % len(ready):] + ready[: index % len(ready)] if ready else []
        times = {}
        for variant in order:
            if variant.error:
                continue
            try:
                _sync(device)
                before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    stats = torch.cuda.memory_stats(device)
                    retries, mallocs = stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0)
                start = time.perf_counter()
                each = []
                for _ in range(args.steps):
                    step(variant)
                    if args.per_step:
                        _sync(device)
                        each.append(time.perf_counter() - start - sum(each))
                _sync(device)
                times[variant.name] = (time.perf_counter() - start) / args.steps
                variant.steps.append(each)
                if device.type == "cuda":
                    variant.peaks.append(torch.cuda.max_memory_allocated(device) - before)
                    stats = torch.cuda.memory_stats(device)
                    variant.retries.append(stats.get("num_alloc_retries", 0) - retries)
                    variant.mallocs.append(stats.get("num_device_alloc", 0) - mallocs)
            except Exception as error:  # noqa: BLE001
                _fail(variant, f"round {index + 1}", error)
        for variant in ready:
            variant.times.append(times.get(variant.name, 0.0))
        last_round = time.perf_counter() - round_start
        retried = {v.name: v.retries[-1] for v in ready if v.retries and v.retries[-1] and v.name in times}
        print(f"-- round {index + 1}: " + ", ".join(f"{name} {t * 1e3:.1f} ms{_detail(by_name[name], args.per_step)}"
                                                    for name, t in times.items())
              + (f" (allocator retries, each a synchronizing cudaFree of the cache: {retried})" if retried else ""))

    results = _report(args, variants, families, generation, n_params, device, device_name, dtype)
    results["total_s"] = time.perf_counter() - started
    print(f"   total {results['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
        print(f"   results written to {args.json}")
    return 0


def _generate_all(args, families, device, autocast, config, left) -> dict:
    """tokens/s of greedy generation with n-gram blocking, per family."""
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=generator).to(device)
    common = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                  no_repeat_ngram_size=3, pad_token_id=config.pad_token_id)
    results, tokens = {}, {}
    for family, (model, _) in families.items():
        if family.endswith("blocks compiled"):  # decoding shapes would recompile the blocks
            continue
        if left() < 30:
            results[family] = {"error": "skipped: budget"}
            continue
        try:
            model.eval()
            with torch.no_grad(), autocast:
                model.generate(**common, max_new_tokens=4, min_new_tokens=4)  # warm-up
                best = math.inf
                for _ in range(args.gen_repeats):
                    _sync(device)
                    start = time.perf_counter()
                    out = model.generate(**common, max_new_tokens=args.new, min_new_tokens=args.new)
                    _sync(device)
                    best = min(best, time.perf_counter() - start)
            tokens[family] = out[:, args.prompt:].cpu()
            results[family] = {"tokens_per_s": args.batch * args.new / best, "seconds": best}
            print(f"-- generate {family:<14} {args.batch * args.new / best:9.1f} tokens/s ({best:.2f} s for "
                  f"{args.batch} x {args.new})")
        except Exception as error:  # noqa: BLE001
            results[family] = {"error": f"{type(error).__name__}: {error}"}
            print(f"!! generate {family}: {results[family]['error']}")
            traceback.print_exc(limit=6)
        finally:
            model.train()
    if "transformers" in tokens:
        for family, new_tokens in tokens.items():
            if family != "transformers":
                same = bool(torch.equal(new_tokens, tokens["transformers"]))
                results[family]["same_tokens_as_transformers"] = same
    return results


def _report(args, variants, families, generation, n_params, device, device_name, dtype) -> dict:
    by_name = {v.name: v for v in variants}
    eager, compiled = by_name["transformers"], by_name["transformers compiled"]
    peak_flops = _peak_flops(device, args.peak_tflops) if dtype is not None or args.peak_tflops else None
    tokens = args.batch * args.seq
    rows = {}
    print(f"\n{'variant':<26}{'step ms':>9}{'x eager':>9}{'x compiled':>11}{'peak GiB':>10}{'MFU':>7}"
          f"{'warm-up s':>11}")
    for variant in variants:
        measured = [t for t in variant.times if t]
        median = statistics.median(measured) if measured else None
        state = _state_bytes(*families[variant.family]) if variant.family in families else 0
        peak = (max(variant.peaks) + state) / GIB if variant.peaks else None
        mfu = 6 * n_params * tokens / median / peak_flops if median and peak_flops else None
        row = {
            "median_step_ms": median * 1e3 if median else None,
            "ratio_to_transformers_eager": _median_ratio(variant, eager) if measured else None,
            "ratio_to_transformers_compiled": _median_ratio(variant, compiled) if measured else None,
            "peak_gib": peak, "mfu": mfu, "warmup_s": variant.warmup_s, "first_loss": variant.first_loss,
            "step_ms_per_round": [t * 1e3 for t in variant.times], "allocator_retries_per_round": variant.retries,
            "cuda_mallocs_per_round": variant.mallocs,
            "step_ms_each": [[s * 1e3 for s in steps] for steps in variant.steps if steps],
            "error": variant.error,
        }
        rows[variant.name] = row
        if variant.error and not measured:
            print(f"{variant.name:<26}  {variant.error[:90]}")
            continue
        print(f"{variant.name:<26}{_fmt(row['median_step_ms'], '9.1f')}"
              f"{_fmt(row['ratio_to_transformers_eager'], '9.3f')}"
              f"{_fmt(row['ratio_to_transformers_compiled'], '11.3f')}"
              f"{_fmt(peak, '10.2f')}{_fmt(mfu and 100 * mfu, '6.1f')}{'%' if mfu else ' '}"
              f"{_fmt(variant.warmup_s, '11.1f')}")
    if peak_flops is None:
        print("   MFU: n/a (no bf16 peak known for this device; pass --peak-tflops)")
    else:
        print(f"   MFU = 6 x {n_params / 1e6:.1f} M x {tokens} tokens / step time / {peak_flops / 1e12:.0f} TFLOP/s")

    def ratio(name: str, key: str) -> float | None:
        return rows[name][key] if name in rows else None

    def memory_ratio() -> float | None:
        fused, base = rows.get("oslo fuse()", {}).get("peak_gib"), rows["transformers"]["peak_gib"]
        return fused / base if fused and base else None

    gen_ratio = None
    if generation and "tokens_per_s" in generation.get("oslo fuse()", {}) and \
            "tokens_per_s" in generation.get("transformers", {}):
        gen_ratio = generation["oslo fuse()"]["tokens_per_s"] / generation["transformers"]["tokens_per_s"]
    if generation:
        print("\ngenerate (tokens/s):   " + ", ".join(
            f"{family} {_fmt(result.get('tokens_per_s'), '.1f', result.get('error', 'n/a'))}"
            for family, result in generation.items()))
    goals = [
        ("oslo <= 1.01x transformers eager (step)", ratio("oslo", "ratio_to_transformers_eager"), "<=", 1.01),
        ("fuse() <= 0.75x transformers eager (step)", ratio("oslo fuse()", "ratio_to_transformers_eager"), "<=",
         0.75),
        ("fuse() <= 0.75x transformers eager (peak memory)", memory_ratio(), "<=", 0.75),
        ("oslo compiled <= 1.0x transformers compiled (step)",
         ratio("oslo compiled", "ratio_to_transformers_compiled"), "<=", 1.0),
        ("fuse() + compiled <= 0.95x transformers compiled (step)",
         ratio("oslo fuse() compiled", "ratio_to_transformers_compiled"), "<=", 0.95),
        ("generate after fuse() >= 1.0x transformers (tokens/s)", gen_ratio, ">=", 1.0),
    ]
    print("\ngoals:")
    goal_rows = []
    for title, value, op, bound in goals:
        verdict = "n/a" if value is None else ("PASS" if (value <= bound if op == "<=" else value >= bound) else "FAIL")
        goal_rows.append({"goal": title, "value": value, "verdict": verdict})
        print(f"  {verdict:<5} {title}: {_fmt(value, '.3f')}")
    return {
        "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
        "layers": args.layers, "batch": args.batch, "seq": args.seq, "dtype": "bf16" if dtype else "fp32",
        "parameters": n_params, "optimizer": "AdamW", "variants": rows, "generate": generation, "goals": goal_rows,
    }


if __name__ == "__main__":
    sys.exit(main())
