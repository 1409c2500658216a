"""oslo demo: train a small GPT2 split across 2 processes on CPU, save, reload in transformers, generate.

    python examples/demo.py                # launches its own 2 gloo ranks through torchrun
    torchrun --nproc_per_node=2 examples/demo.py
    python examples/demo.py --tensor-parallel-size 1 --pipeline-parallel-size 2   # 2 pipeline stages

No network and no GPU are needed: the model config, the tokenizer and the training text
(Jane Austen's *Persuasion*, public domain) are bundled in ``assets/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from oslo.parallel.dtensor import local_named_parameters

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="with pipeline parallelism")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time budget")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--output-dir", default="demo_output")
    return parser.parse_args()


def launch_self(args: argparse.Namespace) -> int:
    """Re-run this script under torchrun with one process per model-parallel rank."""
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={ranks}", __file__, *sys.argv[1:],
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    print(f"launching {ranks} ranks: {' '.join(command[1:])}", flush=True)
    return subprocess.call(command, env=env)


def main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from tqdm import tqdm
    from transformers import GPT2Config, PreTrainedTokenizerFast

    import oslo

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ASSETS / "tokenizer")
    config = GPT2Config.from_json_file(ASSETS / "demo_config.json")
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        micro_batch_size=args.micro_batch_size, seed=42,
    )
    context = model.parallel_context
    is_main = context.rank == 0

    # Tokenize the corpus once and cut it into training samples.
    ids = tokenizer((ASSETS / "corpus.txt").read_text(), return_tensors="pt").input_ids[0]
    samples = ids[: len(ids) // args.seq_length * args.seq_length].view(-1, args.seq_length)
    generator = torch.Generator().manual_seed(0)
    held_out, samples = samples[:16], samples[16:]

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=held_out, labels=held_out, gather_logits=False).loss.item()
        model.train()
        return loss

    if is_main:
        shard_bytes = sum(p.numel() * p.element_size() for _, p in local_named_parameters(model))
        print(f"{context}\nthis rank holds {shard_bytes / 2**20:.2f} MiB of parameters", flush=True)
    start_loss = held_out_loss()
    optimizer = torch.optim.AdamW(model.gpu_parameters(), lr=args.lr, weight_decay=0.01)
    model.train()
    progress = tqdm(desc="training", unit="step", disable=not is_main)
    started, step = time.monotonic(), 0
    while True:
        # Rank 0's clock decides when to stop, so every rank runs the same number of steps.
        stop = torch.tensor([time.monotonic() - started >= args.seconds], dtype=torch.int32)
        dist.broadcast(stop, src=0)
        if stop.item():
            break
        batch = samples[torch.randint(len(samples), (args.batch_size,), generator=generator)]
        optimizer.zero_grad()
        if args.pipeline_parallel_size > 1:
            # The 1F1B schedule: each output is one micro-batch; its backward is the schedule's step.
            micro_losses = []
            for micro_output in model(input_ids=batch, labels=batch):
                (micro_output.loss / (args.batch_size // args.micro_batch_size)).backward()
                micro_losses.append(micro_output.loss.detach())
            loss = torch.stack(micro_losses).mean()
        else:
            loss = model(input_ids=batch, labels=batch, gather_logits=False).loss
            loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        step += 1
        progress.update()
        progress.set_postfix(loss=f"{loss.item():.3f}")
    progress.close()
    end_loss = held_out_loss()
    if is_main:
        print(f"held-out loss: {start_loss:.3f} before training -> {end_loss:.3f} after {step} steps", flush=True)

    output = Path(args.output_dir)
    model.save_pretrained_with_parallel(output / "split")
    model.save_pretrained_with_parallel(output / "merged", save_with_merging=True)
    if is_main:
        tokenizer.save_pretrained(output / "merged")
        print(f"split checkpoint:  {sorted(p.name for p in (output / 'split').iterdir())}")
        print(f"merged checkpoint: {sorted(p.name for p in (output / 'merged').iterdir())}", flush=True)

    prompt = tokenizer("Anne Elliot", return_tensors="pt")
    model.eval()
    sample = model.generate(**prompt, max_new_tokens=40, do_sample=True, top_k=40, pad_token_id=0)
    with torch.no_grad():
        ours = model(held_out[:2]).logits  # every rank takes part in the forward
    if is_main:
        # The merged checkpoint is a plain Hugging Face model.
        plain = transformers.AutoModelForCausalLM.from_pretrained(output / "merged").eval()
        with torch.no_grad():
            theirs = plain(held_out[:2]).logits
        difference = (ours - theirs).abs().max().item()
        print(f"reloaded {type(plain).__module__}.{type(plain).__name__}: max |logit difference| = {difference:.2e}")
        print("sample:", tokenizer.decode(sample[0], skip_special_tokens=True), flush=True)
    dist.barrier()


if __name__ == "__main__":
    arguments = parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch_self(arguments))
    main(arguments)
