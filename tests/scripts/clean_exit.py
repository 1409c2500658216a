"""A short oslo run under a real launcher, to check that the processes exit cleanly (exit code 0):
``python -m torch.distributed.run --nproc_per_node=N tests/scripts/clean_exit.py TP PP [--keep-process-group]``.

Each rank builds a tiny GPT2 at ``TP x PP`` (oslo initializes torch.distributed itself), takes one training
step, runs a forward pass without gradients, prints its loss and returns from the script without touching
torch.distributed. ``--context-only`` builds only the ``ParallelContext`` and runs one all-reduce (no model,
no transformers: a run takes a few seconds). ``--keep-process-group`` unregisters oslo's teardown at exit, so
the process ends with the process groups still alive, as before oslo tore them down (to measure what the
teardown changes).
"""

from __future__ import annotations

import atexit
import sys

import torch

import oslo
from oslo.parallel import context as context_module


def context_only(tp: int, pp: int, keep_process_group: bool) -> None:
    import torch.distributed as dist

    from oslo.parallel import ParallelContext

    context = ParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if keep_process_group:
        atexit.unregister(context_module.destroy_process_group_at_exit)
    value = torch.ones(1)
    dist.all_reduce(value, group=context.model_parallel_group)
    print(f"rank {context.rank} of {context.world_size}: sum {value.item():.0f}", flush=True)


def main(tp: int, pp: int, keep_process_group: bool) -> None:
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=1001, n_positions=64, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=2, seed=0).train()
    if keep_process_group:
        atexit.unregister(context_module.destroy_process_group_at_exit)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randint(3, 1001, (4, 16), generator=torch.Generator().manual_seed(0))
    output = model(input_ids=batch, labels=batch)
    for micro_output in output if pp > 1 else [output]:
        micro_output.loss.backward()
    optimizer.step()
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss
    print(f"rank {model.mpu.rank} of {model.mpu.world_size}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    arguments = [argument for argument in sys.argv[1:] if not argument.startswith("--")]
    run = context_only if "--context-only" in sys.argv[1:] else main
    run(int(arguments[0]), int(arguments[1]), "--keep-process-group" in sys.argv[1:])
