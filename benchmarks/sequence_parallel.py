"""Sequence parallelism: activation bytes saved for backward per rank, and the collectives of one training step,
with and without ``sequence_parallel=True``, at tensor-parallel sizes 2 and 4 (gloo ranks on the CPU).

What it measures, on every rank, for one training call ``model(input_ids, labels=input_ids)`` (pipeline size 1,
float32, dropout 0.1 so that the dropout masks count):

* **saved bytes**: every tensor autograd saves for the backward during the forward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, the parameters' storages left out. Measured
  at ``--layers`` and twice as many layers; the difference divided by ``--layers`` is one block's share (the
  embeddings, the head and the loss cancel).
* **collectives**: the all-reduces, all-gathers and reduce-scatters of the forward and the backward, with the
  bytes of this rank's input, per block (the same difference).

What it compares them with: Megatron's count (Korthikanti et al. 2022, section 4) of a block's activations is
``sbh(10 + 24/t)`` bytes at tensor parallelism ``t`` (half precision; ``5as²b/t`` more for the attention
scores, which oslo's SDPA does not keep) and ``sbh·34/t`` with sequence parallelism: the ``10sbh`` that tensor
parallelism leaves whole (the two norms' inputs, the two column-parallel layers' inputs after them, two dropout
masks) divided by ``t``. oslo keeps those regions as sequence shards too: the norms' inputs and the dropout
masks are shards, and a column-parallel layer's gathered input is saved as its shard and gathered again in
the backward (:func:`oslo.parallel.mappings.keep_sequence_shards`, as Megatron does). The prediction printed
here is Megatron's rule applied to what oslo saves in float32 on the CPU: the block's bytes without sequence
parallelism minus ``(1 - 1/t)`` of those regions: ``6 · 4sbh`` in either kind of block, GPT2's and GPT-Neo's
two LayerNorm inputs, two column-parallel inputs and two dropout masks (torch's CPU dropout keeps a float32
mask), the Llama family's two column-parallel inputs and two RMSNorms that each keep their input and the
normalized input (transformers' RMSNorm, for the weight's gradient). The goal: measured within 5 % of it.
Megatron's half-precision share (``1 - (34/t) / (10 + 24/t)``) is printed beside it: oslo's block keeps more
that tensor parallelism already divides (float32, GELU's input and output, SDPA's outputs), so the same regions
are a smaller share of it.

Run: ``python benchmarks/sequence_parallel.py`` (gpt2-small's blocks, ``--seq 256 --batch 2 --layers 1``;
``--arch llama`` for a Llama-shaped one). About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse

import _tp_harness as h
import torch
import torch.distributed as dist

# A small all-reduce on gloo goes as one all_to_all_single of world-size copies (oslo/parallel/collectives.py).
COLLECTIVES = {"all_reduce": "all_reduce", "all_to_all_single": "all_reduce", "all_gather": "all_gather",
               "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}


def _measure(rank: int, world_size: int, arch: str, layers: int, seq: int, batch: int, sp: bool) -> dict:
    config = h.ARCHS[arch].config("small", n_layer=layers, dropout=0.1)
    model = h.ARCHS[arch].oslo_class().from_config_with_parallel(
        config, tensor_parallel_size=world_size, seed=0, sequence_parallel=sp).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    params = {getattr(p, "_oslo_storage", p).untyped_storage().data_ptr() for p in model.parameters()}
    seen, saved = set(), [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in params and tensor.device.type != "meta":
            seen.add(key)
            saved[0] += storage.nbytes()
        return tensor

    counts = {"forward": {}, "backward": {}}
    phase = ["forward"]
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, original):
        def call(*args, **kwargs):
            tensor = args[0] if name == "all_reduce" else args[1][0] if name == "all_to_all_single" else args[1]
            kind = COLLECTIVES[name]
            count, nbytes = counts[phase[0]].get(kind, (0, 0))
            counts[phase[0]][kind] = (count + 1, nbytes + tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids).loss
        phase[0] = "backward"
        loss.backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"saved": saved[0], "counts": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="gpt2", choices=["gpt2", "gpt_neo", "llama", "qwen2", "mistral"])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tp", default="2,4")
    args = parser.parse_args()
    h.header(f"sequence parallelism: {args.arch} (gpt2-small-shaped blocks), seq {args.seq}, batch {args.batch}")
    config = h.ARCHS[args.arch].config("small", n_layer=args.layers)
    sbh = args.seq * args.batch * config.hidden_size
    for tp in [int(t) for t in args.tp.split(",")]:
        block = {}
        for sp in (False, True):
            small, large = (h.launch(_measure, tp, args.arch, n, args.seq, args.batch, sp)[0]
                            for n in (args.layers, 2 * args.layers))
            per = {"saved": (large["saved"] - small["saved"]) / args.layers, "counts": {}}
            for phase in ("forward", "backward"):
                per["counts"][phase] = {
                    kind: tuple((large["counts"][phase].get(kind, (0, 0))[i] - small["counts"][phase].get(
                        kind, (0, 0))[i]) / args.layers for i in (0, 1))
                    for kind in ("all_reduce", "all_gather", "reduce_scatter")}
            block[sp] = per
        off, on = block[False]["saved"], block[True]["saved"]
        regions = 6 * 4 * sbh  # see the module's docstring
        predicted = off - regions * (1 - 1 / tp)
        megatron = 1 - (34 / tp) / (10 + 24 / tp)  # the share of a block's bytes sequence parallelism saves
        print(f"tp={tp}: saved for backward per block and rank: {h.mib(off)} without, {h.mib(on)} with sequence "
              f"parallelism (ratio {on / off:.3f}); predicted {h.mib(predicted)} (measured / predicted "
              f"{on / predicted:.3f}); saved {1 - on / off:.1%} of the block, Megatron's count {megatron:.1%}")
        for sp in (False, True):
            text = "; ".join(
                f"{phase}: " + ", ".join(f"{count:g} {kind} ({h.mib(nbytes)})" for kind, (count, nbytes) in
                                         block[sp]["counts"][phase].items() if count)
                for phase in ("forward", "backward"))
            print(f"   collectives per block, {'with' if sp else 'without'} sequence parallelism: {text}")


if __name__ == "__main__":
    main()
