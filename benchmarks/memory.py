"""Memory of tensor-parallel models: parameter bytes per rank (GPT2, GPT-Neo, BERT, T5), and peak RSS while loading.

Claims (issue 2, "Benchmarks / Memory"; (a) for every architecture, (b) for GPT2):

(a) parameter bytes per rank / (total parameter bytes / tp) <= 1.01 at tp=2 and <= 1.03 at tp=4,
    for each architecture (``--arch``) at its large published shape:

    * GPT2 (``GPT2LMHeadModel``), gpt2-medium: n_embd 1024, n_layer 24, n_head 16, vocab 50257,
      n_positions 1024;
    * GPT-Neo (``GPTNeoForCausalLM``), gpt-neo-1.3B: hidden 2048, 24 layers (global / local
      attention alternating), 16 heads, vocab 50257, 2048 positions;
    * BERT (``BertForMaskedLM``), bert-large: hidden 1024, 24 layers, 16 heads, MLP 4096, vocab
      30522, 512 positions, 2 token types;
    * T5 (``T5ForConditionalGeneration``), t5-large (v1.0): d_model 1024, d_ff 4096 (dense-relu), 24
      encoder + 24 decoder layers, 16 heads, d_kv 64, vocab 32128, 32 relative position buckets;
      ``shared``, both stacks' ``embed_tokens`` and ``lm_head`` one tied weight.

    The ranks build the model with ``from_config_with_parallel`` (real gloo ranks, real allocation);
    the total is transformers' own model of the same class built on the meta device (tied weights
    once). What exceeds 1.0 is the replicated part (position / token-type embeddings, LayerNorms,
    row-parallel biases, BERT's pooler and MLM transform; T5: only its RMS norms, 122 x d_model,
    since its linear layers have no bias and its relative position tables are split by heads) and the
    vocabulary padding (none for T5: 32128 divides by 2 and 4). The architectures run one after
    another (gpt-neo-1.3B is 5.3 GB of float32: 2.6 GB per rank at tp=2; t5-large 2.9 GB).

(b) GPT2 only (``--arch`` does not apply): peak RSS per rank while loading a merged
    gpt2-medium-shaped safetensors checkpoint at tp=4 is at most 1.5 x that rank's shard bytes above
    the process's baseline RSS, measured just before ``from_pretrained_with_parallel``. The
    checkpoint is written by plain transformers (random weights) into a temporary directory. Peak
    RSS is the kernel's VmHWM after resetting it with ``/proc/self/clear_refs`` just before the call
    (exact, no sampling gaps); a sampling thread also records RssAnon (heap) and RssFile (mapped file
    pages) separately, since file pages of the mmap'ed safetensors file count in RSS although the
    kernel can drop them at any time.

Run: ``python benchmarks/memory.py``; options: ``--part a|b``, ``--arch gpt2|gpt_neo|bert|t5|all`` (part
(a); default all), ``--tp-load 4``, ``--n-layer 24`` (T5: per stack),
``--trace`` (per-tensor RSS during the load, to see where memory goes), ``--meta`` (part (a) from
meta-device construction in real ranks instead of allocating).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import threading
import time

import _tp_harness as bench
import torch
import transformers

import oslo
from oslo import checkpoint as oslo_checkpoint
from oslo.parallel.dtensor import local_named_parameters

TARGETS = {2: 1.01, 4: 1.03}
RSS_TARGET = 1.5
# gpt2-medium, gpt-neo-1.3B, bert-large, t5-large, Llama-3.2-1B (and Qwen2, Mistral of that shape)
SIZES = {"gpt2": "medium", "gpt_neo": "large", "bert": "large", "t5": "large", "llama": "large", "qwen2": "large",
         "mistral": "large"}


# ---------------------------------------------------------------------------------------------
# (a) parameter bytes per rank
# ---------------------------------------------------------------------------------------------
def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for _, p in local_named_parameters(model))  # tied weights once


def _total_bytes(arch: bench.Arch, config) -> int:
    with torch.device("meta"):
        reference = arch.hf_class()(config)
    return sum(p.numel() * 4 for p in reference.parameters())


def params_rank(rank: int, world_size: int, arch_name: str, config, meta: bool) -> dict:
    cls = bench.ARCHS[arch_name].oslo_class()
    if meta:
        context = oslo.ParallelContext(world_size)
        with torch.device("meta"):
            model = cls(config, parallel_context=context)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
    else:
        model = cls.from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0)
        nbytes = _param_bytes(model)
    from oslo.parallel.plan import parameter_specs

    specs = parameter_specs(model)
    replicated = sum(p.numel() * 4 for n, p in local_named_parameters(model) if specs[n] is None)
    return {"bytes": nbytes, "replicated": replicated}


def part_a(arch: bench.Arch, config, meta: bool) -> tuple[bool, dict[int, float]]:
    total = _total_bytes(arch, config)
    print(f"\n(a) {arch.name}: parameter bytes per rank, {arch.lm_class} {bench.describe(config)}, float32")
    print(f"    transformers {arch.lm_class} total: {total:,d} bytes ({bench.mib(total)})")
    ok = True
    ratios = {}
    for tp, target in TARGETS.items():
        start = time.perf_counter()
        results = bench.launch(params_rank, tp, arch.name, config, meta)
        elapsed = time.perf_counter() - start
        worst = max(r["bytes"] for r in results)
        ratio = worst / (total / tp)
        ratios[tp] = ratio
        ok &= ratio <= target
        per_rank = ", ".join(f"{r['bytes']:,d}" for r in results)
        how = "on meta" if meta else "with allocation"
        print(f"    tp={tp}: per rank [{per_rank}] bytes; ideal total/tp = {total / tp:,.0f}; replicated on "
              f"every rank {results[0]['replicated']:,d} bytes; built {how} in {elapsed:.1f} s")
        print(f"    tp={tp}: ratio (largest rank) / (total / tp) = {ratio:.4f}  target <= {target}  "
              f"[{bench.verdict(ratio <= target)}]")
    return ok, ratios


# ---------------------------------------------------------------------------------------------
# (b) peak RSS while loading
# ---------------------------------------------------------------------------------------------
def write_checkpoint(rank: int, world_size: int, config, directory: str) -> int:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


class RssSampler(threading.Thread):
    """Samples VmRSS / RssAnon / RssFile every ``interval`` seconds and keeps the maxima."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = dict.fromkeys(self.FIELDS, 0)
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            for key, value in bench.proc_status(*self.FIELDS).items():
                self.peak[key] = max(self.peak[key], value)
            self.samples += 1
            time.sleep(self.interval)

    def stop(self) -> dict[str, int]:
        self._stop_event.set()
        self.join()
        return self.peak


def _install_trace(trace: list) -> None:
    """Record RSS after each tensor read (investigation only; wraps the reader, not library code).

    The library's reads are zero-copy views into the mmap'ed file: pages are faulted in when the
    view is copied into the parameter, after ``read`` returns. The trace touches the view
    (``sum``) so that the pages a read costs are counted on that read, not the next one."""
    original = oslo_checkpoint.TensorSource.read

    def read(self, key, dim=None, start=0, stop=None):
        value = original(self, key, dim, start, stop)
        value.sum()
        status = bench.proc_status("VmRSS", "RssAnon", "RssFile")
        trace.append((key, dim, tuple(value.shape), value.numel() * value.element_size(), status))
        return value

    oslo_checkpoint.TensorSource.read = read


def load_rank(rank: int, world_size: int, directory: str, trace_enabled: bool) -> dict:
    import torch.distributed as dist

    # The gloo process group is created before the baseline (oslo would create it inside the call):
    # its buffers are a fixed cost of distributed runs, not of loading, and are reported separately.
    # Modules are imported by the parent before fork, so no lazy import lands inside the measurement.
    before_init = bench.proc_status("VmRSS")["VmRSS"]
    dist.init_process_group("gloo")
    trace: list = []
    if trace_enabled:
        _install_trace(trace)
    fields = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    dist.barrier()
    reset_ok = bench.reset_peak_rss()
    baseline = bench.proc_status(*fields)
    sampler = RssSampler()
    sampler.start()
    start = time.perf_counter()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(directory, tensor_parallel_size=world_size)
    elapsed = time.perf_counter() - start
    sampled = sampler.stop()
    after = bench.proc_status(*fields)
    shard = _param_bytes(model)
    del model
    return {"gloo_init": baseline["VmRSS"] - before_init, "baseline": baseline, "after": after,
            "sampled": sampled, "samples": sampler.samples, "reset_ok": reset_ok, "shard": shard,
            "elapsed": elapsed, "trace": trace}


def part_b(config, tp: int, trace: bool, keep: str | None) -> bool:
    directory = keep or tempfile.mkdtemp(prefix="oslo-bench-memory-")
    try:
        start = time.perf_counter()
        if not os.path.isfile(os.path.join(directory, "model.safetensors")):
            size = bench.launch(write_checkpoint, 1, config, directory, env=False)[0]
        else:
            size = os.path.getsize(os.path.join(directory, "model.safetensors"))
        print(f"\n(b) peak RSS while loading a merged safetensors checkpoint at tp={tp}")
        print(f"    checkpoint {directory}/model.safetensors: {size:,d} bytes ({bench.mib(size)}), "
              f"written by transformers in {time.perf_counter() - start:.1f} s; {bench.describe(config)}")
        results = bench.launch(load_rank, tp, directory, trace)
    finally:
        if keep is None:
            shutil.rmtree(directory, ignore_errors=True)
    ok = True
    print(f"    {'rank':>4} {'shard':>12} {'peak-baseline':>14} {'ratio':>6}  {'peak RssAnon':>13} "
          f"{'peak RssFile':>13} {'after: anon':>12} {'file':>10} {'load s':>7}")
    for rank, r in enumerate(results):
        base = r["baseline"]
        peak_delta = r["after"]["VmHWM"] - base["VmRSS"]
        ratio = peak_delta / r["shard"]
        anon_delta = r["sampled"]["RssAnon"] - base["RssAnon"]
        file_delta = r["sampled"]["RssFile"] - base["RssFile"]
        ok &= ratio <= RSS_TARGET
        print(f"    {rank:>4} {bench.mib(r['shard']):>12} {bench.mib(peak_delta):>14} {ratio:>6.2f}  "
              f"{bench.mib(anon_delta):>13} {bench.mib(file_delta):>13} "
              f"{bench.mib(r['after']['RssAnon'] - base['RssAnon']):>12} "
              f"{bench.mib(r['after']['RssFile'] - base['RssFile']):>10} {r['elapsed']:>7.1f}")
    first = results[0]
    worst = max(r["after"]["VmHWM"] - r["baseline"]["VmRSS"] for r in results)
    worst_ratio = max((r["after"]["VmHWM"] - r["baseline"]["VmRSS"]) / r["shard"] for r in results)
    anon_ratio = max((r["sampled"]["RssAnon"] - r["baseline"]["RssAnon"]) / r["shard"] for r in results)
    refused = "" if first["reset_ok"] else " (RESET REFUSED)"
    print(f"    (peak = VmHWM after resetting it before the call{refused}; "
          f"RssAnon/RssFile peaks from {first['samples']} samples of /proc/self/status)")
    print(f"    worst rank: peak RSS above baseline {bench.mib(worst)} = {worst_ratio:.2f} x its shard "
          f"bytes  target <= {RSS_TARGET}  [{bench.verdict(worst_ratio <= RSS_TARGET)}]")
    print(f"    anonymous memory only (heap, excludes mapped file pages): peak {anon_ratio:.2f} x shard "
          "bytes")
    print(f"    (not counted: creating the gloo process group before the baseline added "
          f"{bench.mib(max(r['gloo_init'] for r in results))} RSS per rank)")
    file_peak = max(r["sampled"]["RssFile"] - r["baseline"]["RssFile"] for r in results)
    if worst_ratio > RSS_TARGET and file_peak > 0.5 * worst:
        print(f"    diagnosis: mapped pages of the safetensors file (RssFile, up to {bench.mib(file_peak)}) "
              "make most of the peak; --trace attributes them per tensor.")
    if trace:
        _print_trace(results[0])
    return ok


def _print_trace(result: dict) -> None:
    base = result["baseline"]
    print("\n    trace of rank 0 (RSS after each tensor read; delta to baseline):")
    by_kind: dict[str, list] = collections.defaultdict(list)
    previous_file = base["RssFile"]
    for key, dim, shape, nbytes, status in result["trace"]:
        kind = key.split(".")[-2] + "." + key.split(".")[-1] if ".h." in key else key
        file_growth = status["RssFile"] - previous_file
        previous_file = status["RssFile"]
        by_kind[kind].append((nbytes, file_growth))
        if ".h.0." in key or ".h." not in key:
            print(f"      {key:<42} dim={dim!s:<4} read {shape!s:<16} {bench.mib(nbytes):>10}  "
                  f"RssAnon {bench.mib(status['RssAnon'] - base['RssAnon']):>11}  "
                  f"RssFile {bench.mib(status['RssFile'] - base['RssFile']):>11} (+{bench.mib(file_growth)})")
    print("    mapped file pages added per tensor kind (all layers) vs bytes this rank actually needs:")
    for kind, rows in by_kind.items():
        needed = sum(n for n, _ in rows)
        mapped = sum(g for _, g in rows)
        print(f"      {kind:<28} needed {bench.mib(needed):>11}  mapped {bench.mib(mapped):>11}  "
              f"x{mapped / max(needed, 1):.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "both"], default="both")
    parser.add_argument("--arch", choices=[*bench.ARCHS, "all"], default="all",
                        help="part (a): architecture(s) to measure; part (b) is GPT2 only")
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--tp-load", type=int, default=4)
    parser.add_argument("--meta", action="store_true", help="part (a) from meta-device construction")
    parser.add_argument("--trace", action="store_true", help="part (b): RSS after each tensor read")
    parser.add_argument("--keep", default=None, help="part (b): checkpoint directory to reuse / keep")
    args = parser.parse_args(argv)
    names = bench.arch_names(args.arch) if args.part in ("a", "both") else []
    measured = ", ".join(f"{n} ({SIZES[n]})" for n in names)
    bench.header("memory: parameter bytes per rank" + (f" of {measured}" if names else "")
                 + ("; peak RSS while loading (gpt2-medium shape)" if args.part in ("b", "both") else ""))
    ok = True
    summary = []
    for name in names:  # one architecture at a time: gpt-neo-1.3B alone is 5.3 GB
        arch = bench.ARCHS[name]
        arch_ok, ratios = part_a(arch, arch.config(SIZES[name], n_layer=args.n_layer, dropout=0.1), args.meta)
        ok &= arch_ok
        summary.append((name, ratios))
    if summary:
        print("\n(a) summary: largest rank / (total / tp)")
        for name, ratios in summary:
            text = "; ".join(f"tp={tp} {ratio:.4f} (<= {TARGETS[tp]}) [{bench.verdict(ratio <= TARGETS[tp])}]"
                             for tp, ratio in ratios.items())
            print(f"    {name:<8} {text}")
    if args.part in ("b", "both"):
        ok &= part_b(bench.gpt2_config("medium", n_layer=args.n_layer, dropout=0.1), args.tp_load, args.trace,
                     args.keep)
    print(f"\nmemory overall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
