"""What the hang-free failure handling costs a training step that does not fail (gloo, CPU).

Two mechanisms run on every step (see ``oslo/parallel/failure.py`` and ``StageLink.settle`` in
``oslo/parallel/pipeline.py``):

* tensor parallelism: each collective of a model call is started asynchronously and waited for in
  slices of 0.2 s, looking for a peer's failure record between slices (nothing is looked up while a
  collective finishes within its first slice);
* pipeline parallelism: every step ends with one all-gather of 5 int64 per stage (how the stage
  ended, how many messages went each way).

Reference: the same step with both turned off in this process (``failure.wait`` replaced by a plain
``work.wait()``, ``StageLink.settle`` by the old end of step, waiting for the sends), alternated
with the real one, median over ``--steps`` steps after one warm-up each. Prints the step times and
their ratio (target: within 1 %; on this 2-vCPU VM the noise between two identical runs is about
the same size, so the script also prints an A/A ratio: off vs off), and at pp=2 the median time of
the end-of-step agreement alone as a share of the step.

Run: ``python benchmarks/failure_overhead.py`` (about 2 minutes); ``--layout tp`` or ``pp`` only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from transformers import GPT2Config  # noqa: E402

import oslo  # noqa: E402
from oslo.parallel import failure, pipeline  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

torch.set_num_threads(1)


def _plain_wait(work, group, what, watch=None):
    work.wait()


def _plain_settle(self, status, message=""):
    self.wait_all()
    return []


def _measure(rank, world_size, tp, pp, steps):
    torch.set_num_threads(1)
    config = GPT2Config(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = oslo.GPT2LMHeadModel.from_config_with_parallel(
        config, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(0))
    real_wait, real_settle = failure.wait, pipeline.StageLink.settle

    def step():
        start = time.perf_counter()
        output = model(input_ids=ids, labels=ids)
        if pp == 1:
            output.loss.backward()
        else:
            for micro_output in output:
                micro_output.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    times = {"on": [], "off": [], "off2": []}
    for index in range(steps + 1):
        for variant in ("on", "off", "off2"):
            failure.wait = real_wait if variant == "on" else _plain_wait
            pipeline.StageLink.settle = real_settle if variant == "on" else _plain_settle
            torch.distributed.barrier()
            elapsed = step()
            if index:
                times[variant].append(elapsed)
    failure.wait, pipeline.StageLink.settle = real_wait, real_settle
    result = {variant: statistics.median(values) for variant, values in times.items()}
    # The end-of-step agreement alone (a link that carried nothing), less noisy than step differences.
    settles = []
    for _ in range(200 if pp > 1 else 0):
        link = pipeline.StageLink(model.parallel_context)
        start = time.perf_counter()
        link.settle(pipeline.STEP_OK)
        settles.append(time.perf_counter() - start)
    result["settle"] = statistics.median(settles) if settles else 0.0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["tp", "pp", "both"], default="both")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    layouts = {"tp": [(2, 1)], "pp": [(1, 2)], "both": [(2, 1), (1, 2)]}[args.layout]
    for tp, pp in layouts:
        result = run_distributed(_measure, tp * pp, tp, pp, args.steps, timeout=1200)[0]
        print(f"tp={tp} pp={pp}: step with failure handling {result['on'] * 1e3:.1f} ms, without "
              f"{result['off'] * 1e3:.1f} ms: ratio {result['on'] / result['off']:.4f} "
              f"(A/A without vs without: {result['off2'] / result['off']:.4f})")
        if pp > 1:
            print(f"  the end-of-step agreement alone: {result['settle'] * 1e3:.3f} ms = "
                  f"{result['settle'] / result['off'] * 100:.3f} % of the step")


if __name__ == "__main__":
    main()
