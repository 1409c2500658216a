"""Count the collectives of one training step (forward + backward) under tensor parallelism, per block.

Claim (issue 2, "Benchmarks / Communication", for GPT2; the same claim for GPT-Neo and BERT): per
block exactly 2 all-reduces forward and 2 backward (the Megatron minimum), plus 1 for the embedding
and at most 3 small (batch x seq sized) for the loss; nothing else. Counted by wrapping
``torch.distributed``, printed with bytes. Architectures (``--arch``): GPT2 (``GPT2LMHeadModel``),
GPT-Neo (``GPTNeoForCausalLM``, layers alternating global / local attention), BERT
(``BertForMaskedLM`` with masked-LM labels: 15 % of the positions, -100 elsewhere), T5
(``T5ForConditionalGeneration``, t5 v1.0: labels are target ids, ``--target-seq`` per row, default
half of ``--seq``, so that the encoder's and the decoder's calls differ in size).

T5's claim (issue 11): exactly 2 all-reduces forward and 2 backward per encoder block, 3 and 3 per
decoder block (self-attention, cross-attention, feed-forward); the encoder's output enters the
decoder's tensor-parallel region once per pipeline stage, which costs 1 backward all-reduce of
``batch x seq x d_model`` (its gradient summed over the ranks once, not once per cross-attention),
counted in its own region, "encoder output"; the one tied embedding runs twice forward (1 all-reduce
for the encoder's input, 1 for the decoder's); the loss and the LM head as for the others. The
encoder output's call is told from the block that ran last by a tensor hook on the copy that the
decoder blocks receive (``encoder_hidden_states``): it runs when the gradient summed over every
cross-attention reaches the copy, just before the copy's backward all-reduce.

How it counts, on every rank:

* every public collective of ``torch.distributed`` is wrapped; a call is recorded with its API
  name, the bytes of this rank's input tensor(s), the phase (forward / backward) and the module it
  ran in (forward: the innermost module whose ``forward`` is running; backward: the module whose
  output gradient arrived last, set by tensor hooks on module outputs), plus the oslo source line
  that made the call; a small all-reduce on gloo, which oslo runs as one ``all_to_all_single`` of
  world-size copies of the tensor (``oslo/parallel/collectives.py``), is recorded as the
  ``all_reduce`` it stands for, with the bytes of the tensor reduced;
* independently, a ``TorchDispatchMode`` counts the ``c10d.*`` operators that reach the process
  group, so a collective issued some other way (a ``from torch.distributed import ...`` alias,
  DTensor, a C++ path) would still show up as a mismatch.

The step is ``model(input_ids, labels=labels)`` (a training call, which does not gather the logits)
then ``loss.backward()``, in training mode (dropout on). A second step with
``gather_logits=True`` counts the logits all-gather that a user asks for when they want the full
logits back. Before anything else every model call compares its inputs across the tensor-parallel
group (``oslo.parallel.agreement.check_same_inputs``): one all-gather of three int64 per rank (two
digests and the verdict of the id range check), counted as "input check".

Run: ``python benchmarks/comm_count.py`` (every architecture, tp 2 and 4, 2 layers of gpt2 /
gpt-neo-125M / bert-base / t5-small width, T5: 2 + 2 layers); options: ``--arch gpt2|gpt_neo|bert|t5|all
--tp 2 4 --n-layer 2 --batch 2 --seq 64 --target-seq 32 --size small|large`` (``large``: gpt2-medium,
gpt-neo-1.3B, bert-large, t5-large widths).
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import re
import sys
import traceback

import _tp_harness as bench
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import oslo  # noqa: F401 - imported once before the ranks fork (the architectures use it)
from oslo.parallel.collectives import eager_all_reduce

COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "_all_gather_base", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "reduce", "broadcast", "gather", "scatter",
    "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "monitored_barrier",
)


ENCODER_OUTPUT = "<encoder output>"  # the backward "module" of the decoder's copy of the encoder output


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _input_of(name: str, args, kwargs):
    """The tensor(s) this rank contributes to the collective (what its bytes are counted from)."""
    if name in ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
                "all_to_all", "all_to_all_single"):
        # (output, input, ...): count the input.
        return args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
    return args[0] if args else kwargs.get("tensor")


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        return "x".join(str(s) for s in value.shape) or "scalar"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return f"{len(value)}*[{_shape(value[0])}]"
    return "-"


def _oslo_caller() -> str:
    """``file:function`` of the innermost oslo frame that led to the collective, looking past the
    generic wrappers of ``mappings.py`` and ``collectives.py`` when a caller outside them is on the stack (in
    forward)."""
    frames = []
    for frame in reversed(traceback.extract_stack()[:-2]):
        match = re.search(r"(oslo/[\w/]+\.py)$", frame.filename.replace("\\", "/"))
        if match:
            frames.append(f"{match.group(1)}:{frame.name}")
    outside = [f for f in frames if not f.startswith(("oslo/parallel/mappings.py", "oslo/parallel/collectives.py"))]
    return outside[0] if outside else frames[-1] if frames else "?"


class CommCounter:
    """Wraps torch.distributed collectives and attributes each call to a phase and a module."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.phase: str | None = None  # None: not recording
        self.module_stack: list[str] = []
        self.backward_module = "?"
        self._depth = 0
        self._originals: dict[str, object] = {}
        self._encoder_outputs: list[torch.Tensor] = []  # the decoder's copies of the encoder output, hooked

    # -- wrapping ---------------------------------------------------------------------------
    def install(self) -> None:
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _wrap(self, name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            # Collectives built from others (all_gather_object -> all_gather) count once, at the top.
            if self.phase is not None and self._depth == 0:
                tensor, op = _input_of(name, args, kwargs), name
                if name == "all_to_all_single" and sys._getframe(1).f_code is eager_all_reduce.__code__:
                    # A small all-reduce on gloo: one all-to-all of this rank's tensor, repeated for every rank.
                    tensor, op = tensor[0], "all_reduce"
                if self.phase == "forward":  # the input check runs before the model's forward starts
                    module = self.module_stack[-1] if self.module_stack else None
                else:
                    module = self.backward_module
                group = kwargs.get("group")
                is_tensor = isinstance(tensor, torch.Tensor)
                self.records.append({
                    "phase": self.phase, "op": op, "module": module or "<model>",
                    "bytes": _tensor_bytes(tensor), "numel": _numel(tensor), "shape": _shape(tensor),
                    "dtype": str(tensor.dtype).removeprefix("torch.") if is_tensor else "-",
                    "caller": _oslo_caller(), "group_size": dist.get_world_size(group),
                })
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
        return wrapper

    # -- module attribution -----------------------------------------------------------------
    def attach(self, model: torch.nn.Module, arch: bench.Arch | None = None) -> None:
        for name, module in model.named_modules():
            module.register_forward_pre_hook(functools.partial(self._enter, name))
            module.register_forward_hook(functools.partial(self._leave, name))
            if arch is not None and arch.seq2seq and re.fullmatch(re.escape(arch.decoder_block_prefix) + r"\.\d+",
                                                                   name):
                module.register_forward_pre_hook(self._decoder_block_inputs, with_kwargs=True)

    def _decoder_block_inputs(self, module, args, kwargs) -> None:
        """An encoder-decoder's decoder block gets the encoder's output as the model copied it into the
        tensor-parallel region (once per stage, for all of the stage's blocks). A hook on that tensor runs
        when its gradient, summed over the blocks' cross-attentions, reaches the copy, just before the copy's
        backward all-reduce: that call is the encoder output's, not the block's that ran last."""
        states = inspect.signature(module.forward).bind(*args, **kwargs).arguments.get("encoder_hidden_states")
        if (isinstance(states, torch.Tensor) and states.requires_grad and self.phase == "forward"
                and not any(states is seen for seen in self._encoder_outputs)):
            self._encoder_outputs.append(states)
            states.register_hook(functools.partial(self._grad_arrived, ENCODER_OUTPUT))

    def _enter(self, name, module, args):
        self.module_stack.append(name)

    def _leave(self, name, module, args, output):
        self.module_stack.pop()
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if hasattr(first, "last_hidden_state"):
            first = first.last_hidden_state
        if isinstance(first, torch.Tensor) and first.requires_grad and self.phase == "forward":
            first.register_hook(functools.partial(self._grad_arrived, name))

    def _grad_arrived(self, name, grad):
        self.backward_module = name


class C10dOpCounter(TorchDispatchMode):
    """Counts the c10d operators that reach a process group, whatever Python API issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def _region(module: str, caller: str, arch: bench.Arch) -> str:
    if "agreement.py" in caller:
        return "input check"
    if module == ENCODER_OUTPUT:
        return "encoder output"
    for prefix, label in _block_labels(arch):
        match = re.match(re.escape(prefix) + r"\.(\d+)(?:\.|$)", module)
        if match:
            return f"{label}{match.group(1)}"
    if module.startswith(arch.embedding_prefix):
        return "embedding"
    if "loss.py" in caller:
        return "loss"
    if caller.endswith(":gather"):
        return "logits gather"
    if module.startswith(arch.head_prefix):
        return "lm head"
    return f"other ({module} {caller})"


def _block_labels(arch: bench.Arch) -> list[tuple[str, str]]:
    """(module prefix, region label before the block's index): "block " for one stack; "enc block " and
    "dec block " for an encoder-decoder."""
    if not arch.seq2seq:
        return [(arch.block_prefix, "block ")]
    return [(arch.block_prefix, "enc block "), (arch.decoder_block_prefix, "dec block ")]


def _step(model, input_ids, batch: dict, counter: CommCounter, gather_logits: bool) -> tuple[dict, float]:
    model.zero_grad(set_to_none=True)
    counter._encoder_outputs = []
    mode = C10dOpCounter()
    with mode:
        counter.phase = "forward"
        out = model(input_ids, **batch, **({"gather_logits": True} if gather_logits else {}))
        forward_ops = sum(mode.ops.values())
        counter.phase = "backward"
        out.loss.backward()
        counter.phase = None
    c10d = {"forward": forward_ops, "backward": sum(mode.ops.values()) - forward_ops}
    return c10d, out.loss.item()


def rank_main(rank: int, world_size: int, arch_name: str, config, batch: int, seq: int, target_seq: int) -> dict:
    arch = bench.ARCHS[arch_name]
    model = arch.oslo_class().from_config_with_parallel(config, tensor_parallel_size=world_size, seed=0)
    model.train()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    call = arch.batch(input_ids, generator, target_seq)
    counter = CommCounter()
    counter.attach(model, arch)
    counter.install()
    try:
        # Warm-up step (not recorded) so lazy initializations cannot pollute the count.
        out = model(input_ids, **call)
        out.loss.backward()
        runs = {}
        for gather_logits in (False, True):
            counter.records = []
            c10d, loss = _step(model, input_ids, call, counter, gather_logits)
            runs[gather_logits] = {"records": counter.records, "c10d": c10d, "loss": loss}
    finally:
        counter.uninstall()
    return runs


def _summarize(records: list[dict], arch: bench.Arch) -> dict:
    """(region, phase) -> list of records."""
    table: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for record in records:
        table[(_region(record["module"], record["caller"], arch), record["phase"])].append(record)
    return table


def _stacks(arch: bench.Arch, config) -> list[tuple[str, str, int, int]]:
    """(region label, words, blocks, all-reduces per block each way) of each stack: 2 per block of one
    stack (attention and MLP); an encoder-decoder's decoder block has 3 (its cross-attention too)."""
    if not arch.seq2seq:
        return [("block ", "block", config.num_hidden_layers, 2)]
    return [("enc block ", "encoder block", config.num_layers, 2),
            ("dec block ", "decoder block", config.num_decoder_layers, 3)]


def _report(arch: bench.Arch, tp: int, runs_per_rank: list[dict], config, batch: int, seq: int,
            target_seq: int) -> tuple[bool, dict]:
    runs = runs_per_rank[0]
    same = all(
        [(r["op"], r["bytes"], r["phase"], r["module"]) for r in other[g]["records"]]
        == [(r["op"], r["bytes"], r["phase"], r["module"]) for r in runs[g]["records"]]
        for other in runs_per_rank for g in (False, True)
    )
    records = runs[False]["records"]
    table = _summarize(records, arch)
    tokens = batch * (target_seq if arch.seq2seq else seq)  # the positions the loss predicts
    print(f"\n-- {arch.name}, tp={tp}: {describe_run(arch, config, batch, seq, target_seq)}; "
          f"loss {runs[False]['loss']:.4f}; "
          f"all ranks recorded identical calls: {same}")
    print(f"   {'region':<14} {'phase':<9} {'calls':>5}  {'op':<16} {'bytes/call (this rank)':>24}  "
          f"{'shape':<14} where")
    for (region, phase), recs in sorted(table.items(), key=lambda kv: _order(kv[0])):
        groups = collections.Counter((r["op"], r["bytes"], r["shape"], r["dtype"], r["caller"]) for r in recs)
        for (op, nbytes, shape, dtype, caller), count in groups.items():
            print(f"   {region:<14} {phase:<9} {count:>5}  {op:<16} {nbytes:>15,d} ({dtype:<7}) "
                  f"{shape:<14} {caller}")

    checks = []
    stacks = _stacks(arch, config)
    per_block = {}
    for label, words, layers, target in stacks:
        blocks = range(layers)
        per_block[label] = {}
        for phase in ("forward", "backward"):
            counts = [len(table.get((f"{label}{i}", phase), [])) for i in blocks]
            per_block[label][phase] = counts
            ops = {r["op"] for i in blocks for r in table.get((f"{label}{i}", phase), [])}
            ok = all(c == target for c in counts) and ops <= {"all_reduce"}
            text = f"per {words} {phase}: {counts} calls, ops {sorted(ops)} (target exactly {target} all_reduce)"
            checks.append((text, ok))
    # An encoder-decoder embeds twice with the one (tied) vocabulary-parallel embedding: the encoder's input
    # and the decoder's (the labels shifted right).
    embeddings = 2 if arch.seq2seq else 1
    embed_fwd = table.get(("embedding", "forward"), [])
    embed_bwd = table.get(("embedding", "backward"), [])
    embed_ok = (len(embed_fwd) == embeddings and all(r["op"] == "all_reduce" for r in embed_fwd)
                and not embed_bwd)
    embed_text = (f"embedding: {len(embed_fwd)} forward + {len(embed_bwd)} backward (target {embeddings} "
                  "all_reduce + 0" + (": the encoder's input and the decoder's)" if arch.seq2seq else ")"))
    checks.append((embed_text, embed_ok))
    if arch.seq2seq:
        copy_fwd = table.get(("encoder output", "forward"), [])
        copy_bwd = table.get(("encoder output", "backward"), [])
        expected = batch * seq * config.d_model * 4
        copy_ok = (not copy_fwd and len(copy_bwd) == 1 and copy_bwd[0]["op"] == "all_reduce"
                   and copy_bwd[0]["bytes"] == expected)
        sizes = ", ".join(f"{r['bytes']:,d}" for r in copy_bwd) or "-"
        checks.append((f"encoder output (copied into the decoder's tensor-parallel region once per stage): "
                       f"{len(copy_fwd)} forward + {len(copy_bwd)} backward, {sizes} bytes/rank "
                       f"(target 0 + 1 all_reduce of batch x seq x d_model fp32 = {expected:,d}; not one per "
                       "cross-attention)", copy_ok))
    head_fwd = table.get(("lm head", "forward"), [])
    head_bwd = table.get(("lm head", "backward"), [])
    head_ok = not head_fwd and len(head_bwd) <= 1 and all(r["op"] == "all_reduce" for r in head_bwd)
    head_text = (f"lm head (vocab-parallel, tied to {arch.embedding_prefix}): {len(head_fwd)} forward + "
                 f"{len(head_bwd)} backward "
                 "(not in the claim's list; the Megatron minimum is 0 + 1: the gradient of the head's "
                 "replicated input is a sum over the vocabulary shards)")
    checks.append((head_text, head_ok))
    loss = table.get(("loss", "forward"), []) + table.get(("loss", "backward"), [])
    largest = max((r["numel"] for r in loss), default=0)
    positions = "batch*target_seq" if arch.seq2seq else "batch*seq"
    loss_text = (f"loss: {len(loss)} calls, largest {largest} elements = {largest / tokens:.1f} x {positions} "
                 f"(target <= 3 calls, each <= 3 x {positions})")
    checks.append((loss_text, len(loss) <= 3 and largest <= 3 * tokens))
    check = table.get(("input check", "forward"), []) + table.get(("input check", "backward"), [])
    check_ok = len(check) == 1 and check[0]["op"] == "all_gather" and check[0]["phase"] == "forward" \
        and check[0]["bytes"] == 24
    checks.append((f"input check: {len(check)} call(s), "
                   + ", ".join(f"{r['phase']} {r['op']} {r['bytes']} bytes/rank" for r in check)
                   + " (target 1 forward all_gather of 3 int64: two digests and the range verdict)", check_ok))
    known = {"embedding", "loss", "lm head", "input check", "encoder output"}
    known |= {f"{label}{i}" for label, _, layers, _ in stacks for i in range(layers)}
    other = [r for (region, _), recs in table.items() if region not in known for r in recs]
    checks.append((f"anything else: {len(other)} calls (target 0)", not other))
    python_counts = {p: sum(1 for r in records if r["phase"] == p) for p in ("forward", "backward")}
    c10d = runs[False]["c10d"]
    checks.append((f"c10d operators seen by the dispatcher {c10d} == wrapped calls {python_counts}",
                   c10d == python_counts))
    checks.append(("every rank made the same calls", same))

    blocks_bound = sum(target * layers for _, _, layers, target in stacks)
    blocks_text = " + ".join(f"{target} x {layers} {words}s" for _, words, layers, target in stacks)
    claimed_fwd = blocks_bound + embeddings + 3 + 1
    claimed_bwd = blocks_bound + (1 if arch.seq2seq else 0)
    total_bytes = sum(r["bytes"] for r in records)
    print(f"   totals: forward {python_counts['forward']} calls, backward {python_counts['backward']} calls, "
          f"{total_bytes:,d} bytes contributed by this rank "
          f"({sum(r['bytes'] for r in records if r['phase'] == 'forward'):,d} forward)")
    embed_words = "2 embeddings" if arch.seq2seq else "1 embedding"
    print(f"   ratio forward calls / the claimed bound ({blocks_text} + {embed_words} + 3 loss, + 1 "
          f"input check = {claimed_fwd}): {python_counts['forward'] / claimed_fwd:.2f}")
    copy_words = " + 1 encoder output" if arch.seq2seq else ""
    print(f"   ratio backward calls / the claimed bound ({blocks_text}{copy_words} = {claimed_bwd}): "
          f"{python_counts['backward'] / claimed_bwd:.2f}; with the lm head's input gradient "
          f"({claimed_bwd + 1}): {python_counts['backward'] / (claimed_bwd + 1):.2f}")

    gathered = runs[True]["records"]
    extra = [r for r in gathered if _region(r["module"], r["caller"], arch) == "logits gather"]
    extra_ok = (len(gathered) == len(records) + 1 and len(extra) == 1 and extra[0]["op"] == "all_gather"
                and extra[0]["phase"] == "forward")
    full_logits = batch * seq * config.vocab_size * 4
    if extra:
        print(f"   gather_logits=True: {len(gathered)} calls in all; logits gather: "
              + ", ".join(f"{r['phase']} {r['op']} {r['bytes']:,d} bytes/rank ({r['shape']})" for r in extra)
              + f"; the full fp32 logits are {full_logits:,d} bytes")
    checks.append(("gather_logits=True adds exactly 1 forward all_gather (the logits) and nothing else",
                   extra_ok))
    for text, ok in checks:
        print(f"   [{bench.verdict(ok)}] {text}")
    summary = {"per_block": per_block, "forward": python_counts["forward"], "backward": python_counts["backward"],
               "regions": {f"{region} {phase}": len(recs) for (region, phase), recs in table.items()
                           if not re.match(r"(?:enc |dec )?block \d", region)},
               "gather_extra": len(gathered) - len(records)}
    return all(ok for _, ok in checks), summary


def describe_run(arch: bench.Arch, config, batch: int, seq: int, target_seq: int) -> str:
    if arch.seq2seq:
        labels = f"labels = {target_seq} target ids per row (the decoder reads them shifted right)"
    else:
        labels = "masked-LM labels (15 % of positions)" if arch.masked else "labels = inputs"
    return f"{arch.lm_class} {bench.describe(config)}, batch {batch} x seq {seq}, {labels}, training mode"


def _order(key: tuple[str, str]) -> tuple:
    region, phase = key
    match = re.match(r"(enc |dec )?block (\d+)", region)
    stack = {None: 0, "enc ": 0, "dec ": 1}[match.group(1)] if match else 0
    rank = (0, 0) if region == "embedding" else (1, stack, int(match.group(2))) if match else (2, 0)
    return rank, phase != "forward"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=[*bench.ARCHS, "all"], default="all")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size", choices=["small", "medium", "large"], default="small")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--target-seq", type=int, default=None,
                        help="t5: target ids per row (default --seq / 2, so the decoder's calls differ in size)")
    args = parser.parse_args(argv)
    target_seq = args.target_seq or max(1, args.seq // 2)
    names = bench.arch_names(args.arch)
    bench.header("comm_count: collectives per forward + backward of "
                 + ", ".join(bench.ARCHS[n].lm_class for n in names) + " (a training call with labels)")
    ok = True
    summaries = []
    for name in names:
        arch = bench.ARCHS[name]
        config = arch.config(args.size, n_layer=args.n_layer, dropout=0.1)
        for tp in args.tp:
            runs = bench.launch(rank_main, tp, name, config, args.batch, args.seq, target_seq)
            arch_ok, summary = _report(arch, tp, runs, config, args.batch, args.seq, target_seq)
            ok &= arch_ok
            summaries.append((name, tp, arch_ok, summary))
    print("\nsummary (calls of one training step; per block: forward / backward of each block):")
    for name, tp, arch_ok, summary in summaries:
        stacks = []
        for label, counts in summary["per_block"].items():
            blocks = sorted(set(zip(counts["forward"], counts["backward"], strict=True)))
            stacks.append(f"per {label}{' / '.join(f'{f}+{b}' for f, b in blocks)}")
        others = ", ".join(f"{k} {v}" for k, v in sorted(summary["regions"].items()))
        print(f"   {name:<8} tp={tp}: {', '.join(stacks)}; "
              f"total {summary['forward']} forward + {summary['backward']} backward; {others}; "
              f"gather_logits=True adds {summary['gather_extra']}  [{bench.verdict(arch_ok)}]")
    print(f"\ncomm_count overall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
