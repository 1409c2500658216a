"""DeepSpeed ZeRO-1 on an oslo model against oslo's own data-parallel path, at the same layout.

Claims, at tensor parallel 2 x data parallel 2 (4 forked gloo ranks, GPT2 small width):
- optimizer state (AdamW's two moments) per rank with ZeRO-1 is about ``1 / dp`` of what
  ``DistributedDataParallel`` + ``torch.optim.AdamW`` keeps (target: <= 1.05 / dp; ZeRO pads its partitions);
  ZeRO-1 also keeps a float32 master copy of its partition (reported, not part of the target);
- a ZeRO-1 step (forward, backward, reduction, AdamW step) takes at most 1.5x the DDP step on CPU (reported
  ratio; DeepSpeed's engine adds bookkeeping and a flat-buffer copy per step).

Both variants are built from the same weights on every rank, in the same processes, and their steps alternate
(which one goes first too); each step starts after a barrier; a step's time is the slower rank's; medians.
DeepSpeed runs over gloo (``DS_ACCELERATOR=cpu``), without its optional shared-memory kernel.

Run: ``python benchmarks/deepspeed_zero.py``; options ``--n-layer 2 --batch 4 --seq 64 --repeats 6``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import _tp_harness as bench  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import oslo  # noqa: E402

TP, DP = 2, 2
STATE_TARGET = 1.05 / DP
TIME_TARGET = 1.5


def _state_bytes(optimizer: torch.optim.Optimizer, keys=("exp_avg", "exp_avg_sq")) -> int:
    total = 0
    for state in optimizer.state.values():
        for key in keys:
            value = state.get(key)
            if value is not None:
                value = value.to_local() if hasattr(value, "to_local") else value
                total += value.numel() * value.element_size()
    return total


def _rank(rank: int, world_size: int, config, batch: int, seq: int, repeats: int) -> dict:
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    ddp_model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=TP, seed=0).train()
    mpu = ddp_model.mpu
    ddp = DistributedDataParallel(ddp_model.gpu_modules(), process_group=mpu.get_data_parallel_group())
    ddp_optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4)

    zero_model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=TP, seed=0).train()
    ds_config = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=zero_model.gpu_modules(), model_parameters=zero_model.gpu_parameters(),
                                           mpu=zero_model.mpu, config=ds_config)
    ids = torch.randint(0, config.vocab_size, (batch, seq),
                        generator=torch.Generator().manual_seed(mpu.get_data_parallel_rank()))

    def ddp_step() -> None:
        ddp(input_ids=ids, labels=ids).loss.backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()

    def zero_step() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    steps = {"ddp": ddp_step, "zero1": zero_step}

    def timed(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        steps[name]()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    for name in steps:  # warm-up (and the optimizers' states exist from here on)
        timed(name)
    times = {name: [] for name in steps}
    for i in range(repeats):
        for name in (("ddp", "zero1") if i % 2 == 0 else ("zero1", "ddp")):
            times[name].append(timed(name))
    inner = engine.optimizer.optimizer  # the torch AdamW over this rank's float32 partition
    master = sum(p.numel() * p.element_size() for group in inner.param_groups for p in group["params"])
    return dict(
        ddp=statistics.median(times["ddp"]), zero1=statistics.median(times["zero1"]),
        ddp_state=_state_bytes(ddp_optimizer), zero1_state=_state_bytes(inner), zero1_master=master,
        shard=sum(p.to_local().numel() * p.to_local().element_size() for p in ddp_model.parameters()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    config = bench.gpt2_config("small", n_layer=args.n_layer)
    bench.header("DeepSpeed ZeRO-1 vs DistributedDataParallel, tensor parallel 2 x data parallel 2")
    print(f"GPT2 small width, {args.n_layer} layers, batch {args.batch} x {args.seq} per replica; AdamW")
    results = bench.launch(_rank, TP * DP, config, args.batch, args.seq, args.repeats)
    ok = True
    state_ratio = max(r["zero1_state"] / r["ddp_state"] for r in results)
    ok &= state_ratio <= STATE_TARGET
    for rank, r in enumerate(results):
        print(f"  rank {rank}: parameters {bench.mib(r['shard'])}, AdamW moments DDP {bench.mib(r['ddp_state'])}, "
              f"ZeRO-1 {bench.mib(r['zero1_state'])} (+ float32 master partition {bench.mib(r['zero1_master'])})")
    print(f"  optimizer state ZeRO-1 / DDP (worst rank): {state_ratio:.3f} (target <= {STATE_TARGET:.3f})")
    time_ratio = results[0]["zero1"] / results[0]["ddp"]
    ok &= time_ratio <= TIME_TARGET
    print(f"  step time: DDP {results[0]['ddp'] * 1e3:.1f} ms, ZeRO-1 {results[0]['zero1'] * 1e3:.1f} ms, "
          f"ratio {time_ratio:.3f} (target <= {TIME_TARGET})")
    print(bench.verdict(ok))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
