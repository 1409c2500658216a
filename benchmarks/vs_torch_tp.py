"""oslo's tensor parallelism against PyTorch's own (``torch.distributed.tensor.parallel``), same GPT2.

Claim (issue 2, "Benchmarks / Against PyTorch's own tensor parallelism"): the same GPT2 weights as
``nn.Linear`` layers sharded with ``parallelize_module`` (colwise/rowwise) at tp=2: oslo's
forward+backward time / PyTorch's <= 1.0, measured in the same run.

The PyTorch side is a minimal GPT2 written here with ``nn.Linear`` / ``nn.Embedding`` /
``F.scaled_dot_product_attention``, weights copied from the same transformers checkpoint that oslo
loads, and sharded the way torchtitan shards a transformer on a ``DeviceMesh("cpu", [0, 1])``:

* ``c_attn`` (fused q|k|v, rows reordered so that each rank's contiguous shard holds its heads of q,
  k and v), ``mlp.c_fc``: ``ColwiseParallel``; ``attn.c_proj``, ``mlp.c_proj``: ``RowwiseParallel``;
* ``wte``: ``RowwiseParallel`` (vocabulary-parallel embedding), tied to ``lm_head``:
  ``ColwiseParallel(output_layouts=Shard(-1))``; the loss is ``F.cross_entropy`` under
  ``loss_parallel()`` (vocabulary-parallel cross entropy, no logits gather);
* LayerNorms and position embeddings are replicated plain tensors.

oslo runs ``GPT2LMHeadModel.from_pretrained_with_parallel(checkpoint, tensor_parallel_size=2)`` with
``labels`` and ``gather_logits=False``. Dropout is 0 in both. Before timing, both losses must agree.
Steps alternate between the two implementations (and which goes first); each step starts after a
barrier; a step's time is the slower rank's; the median is reported.

Run: ``python benchmarks/vs_torch_tp.py``; options: ``--size small|medium --n-layer 4 --batch 4
--seq 128 --repeats 6``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import _tp_harness as bench
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import oslo

TARGET = 1.0


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # 3 x (B, T, nh_local * hs)
        q, k, v = (t.view(batch, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh_local, T, hs)
        return self.c_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT2(nn.Module):
    """GPT2LMHeadModel in plain nn.Linear layers, for PyTorch's tensor parallelism."""

    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config.n_embd, config.n_head, config.layer_norm_epsilon)
                               for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1))[None]
        x = self.wte(input_ids) + self.wpe(positions)  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # DTensor (B, T, V), Shard(-1) over the mesh
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        # Vocabulary-parallel cross entropy: call under loss_parallel() (with the backward).
        return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


def load_torch_gpt2(config, state: dict[str, torch.Tensor], tp: int) -> TorchGPT2:
    """Copy a transformers GPT2 state dict (Conv1D weights are (in, out)) into ``TorchGPT2``."""
    model = TorchGPT2(config)
    hidden = config.n_embd
    ours = {}
    for name, value in state.items():
        name = name.removeprefix("transformer.")
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias") or name == "lm_head.weight":
            continue
        is_conv1d = any(name.endswith(f"{layer}.weight") for layer in ("c_attn", "c_proj", "c_fc"))
        value = value.t() if is_conv1d else value
        if ".c_attn." in name:
            # [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: a contiguous shard is one rank's heads.
            q, k, v = value.split(hidden, dim=0)
            value = torch.cat([piece for r in range(tp) for piece in
                               (q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r])], dim=0)
        ours[name] = value.contiguous()
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if set(missing) != {"lm_head.weight"} or unexpected:
        raise RuntimeError(f"weight copy mismatch: missing {missing}, unexpected {unexpected}")
    return model


def parallelize(model: TorchGPT2, mesh: DeviceMesh) -> TorchGPT2:
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.h)):
        plan.update({
            f"h.{i}.attn.c_attn": ColwiseParallel(),
            f"h.{i}.attn.c_proj": RowwiseParallel(),
            f"h.{i}.mlp.c_fc": ColwiseParallel(),
            f"h.{i}.mlp.c_proj": RowwiseParallel(),
        })
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # tied, as in GPT2 (both Shard(0) of (V, C))
    return model


def write_checkpoint(rank: int, world_size: int, config, directory: str) -> None:
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)


def rank_main(rank: int, world_size: int, config, directory: str, batch: int, seq: int, repeats: int) -> dict:
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(directory, tensor_parallel_size=world_size)
    model.train()
    mesh = DeviceMesh("cpu", list(range(world_size)))
    state = load_file(os.path.join(directory, "model.safetensors"))
    reference = parallelize(load_torch_gpt2(config, state, world_size), mesh)
    reference.train()
    del state

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)

    def oslo_step() -> torch.Tensor:
        loss = model(input_ids, labels=input_ids, gather_logits=False).loss
        loss.backward()
        return loss

    def torch_step() -> torch.Tensor:
        with loss_parallel():
            loss = reference(input_ids, input_ids)
            loss.backward()
        return loss

    steps = {"oslo": (model, oslo_step), "pytorch": (reference, torch_step)}
    losses = {}
    for name, (module, step) in steps.items():  # warm-up, and the agreement check
        module.zero_grad(set_to_none=True)
        loss = step()
        loss = loss.detach()
        losses[name] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    grad_oslo = model.transformer.h[0].mlp.c_proj.weight.grad.to_local()  # (inner_local, C), Conv1D layout
    grad_torch = reference.h[0].mlp.c_proj.weight.grad.to_local().t()
    grad_close = torch.allclose(grad_oslo, grad_torch, atol=1e-5, rtol=1e-4)

    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for i in range(repeats):
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        for name in order:
            module, step = steps[name]
            module.zero_grad(set_to_none=True)
            dist.barrier()
            wall, cpu_start = time.perf_counter(), time.process_time()
            step()
            times[name].append(time.perf_counter() - wall)
            cpu[name].append(time.process_time() - cpu_start)
    return {"losses": losses, "grad_close": grad_close, "times": times, "cpu": cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "medium"], default="small")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args(argv)
    config = bench.gpt2_config(args.size, n_layer=args.n_layer)
    bench.header(f"vs_torch_tp: oslo vs torch.distributed.tensor.parallel, GPT2 forward+backward at "
                 f"tp={args.tp}")
    print(f"   {bench.describe(config)}; batch {args.batch} x seq {args.seq}; training mode, dropout 0; "
          f"float32; 1 thread per rank; {args.repeats} steps each, alternating")
    directory = tempfile.mkdtemp(prefix="oslo-bench-vs-torch-tp-")
    try:
        bench.launch(write_checkpoint, 1, config, directory, env=False)
        results = bench.launch(rank_main, args.tp, config, directory, args.batch, args.seq, args.repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    losses = results[0]["losses"]
    same_loss = abs(losses["oslo"] - losses["pytorch"]) <= 1e-4 * max(1.0, abs(losses["pytorch"]))
    grads = all(r["grad_close"] for r in results)
    print(f"   loss before timing: oslo {losses['oslo']:.6f}, PyTorch TP {losses['pytorch']:.6f} "
          f"[{'same' if same_loss else 'DIFFERENT'}]; h.0.mlp.c_proj weight gradient shards equal: {grads}")
    slowest = {name: [max(r["times"][name][i] for r in results) for i in range(args.repeats)]
               for name in ("oslo", "pytorch")}
    cpu = {name: bench.median([r["cpu"][name][i] for r in results for i in range(args.repeats)])
           for name in slowest}
    for name, label in (("pytorch", "PyTorch TP (DTensor)"), ("oslo", "oslo")):
        print(f"     {label:<21} s: {bench.fmt_times(slowest[name])}  "
              f"median {bench.median(slowest[name]):.3f} (median CPU time per rank {cpu[name]:.3f} s)")
    ratio = bench.median(slowest["oslo"]) / bench.median(slowest["pytorch"])
    ok = ratio <= TARGET and same_loss and grads
    print(f"     ratio oslo / PyTorch (median wall time) = {ratio:.3f}  target <= {TARGET}  "
          f"[{bench.verdict(ratio <= TARGET)}]; CPU-time ratio {cpu['oslo'] / cpu['pytorch']:.3f}")
    print(f"\nvs_torch_tp overall: {bench.verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
