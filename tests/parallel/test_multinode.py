"""Two launcher agents on 127.0.0.1 as two "nodes" of 2 processes each (``torchrun --nnodes=2`` with c10d
rendezvous): the manual's loop at tensor parallel 2 x data parallel 2 keeps each tensor-parallel group inside a
node, puts data parallelism across the nodes, and gives the weights of one process on the global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from oslo.launch import free_port
from tests.helpers import save_reference, tiny_gpt2_config
from tests.scripts.train_dp import LR, MAX_NORM, STEPS, global_batch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "scripts" / "train_dp.py"


def launch_nodes(script_args: list[str], nodes: int = 2, procs_per_node: int = 2, timeout: float = 150) -> None:
    """Start one ``torch.distributed.run`` agent per node (c10d rendezvous on 127.0.0.1) and wait for all;
    kill every agent and fail if one fails or time runs out."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc_per_node={procs_per_node}",
             f"--node_rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=oslo-test",
             "--max-restarts=0", str(SCRIPT), *script_args],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(nodes)
    ]
    try:
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            agent.kill()
        outputs = [agent.communicate()[0] for agent in agents]
        tails = "\n".join(output[-3000:] for output in outputs)
        raise AssertionError(f"the launchers did not finish in time:\n{tails}") from None
    for node, (agent, output) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node} failed:\n{output[-5000:]}"


def reference_weights(path: str) -> dict[str, torch.Tensor]:
    """transformers' model, one process, the whole global batch, the script's steps."""
    model = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(**global_batch(step)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.timeout(180)
def test_two_nodes_tp2_dp2_equal_one_process(tmp_path):
    checkpoint = tmp_path / "gpt2"
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), checkpoint)
    out = tmp_path / "result.pt"
    launch_nodes([str(checkpoint), str(out), "2", "1"])
    places = torch.load(out)["places"]
    assert [p["rank"] for p in places] == [0, 1, 2, 3]
    # Global ranks are contiguous per node (the agents' group ranks): tensor-parallel peers share a node,
    # data-parallel peers sit on different nodes.
    assert [p["node"] for p in places] in ([0, 0, 1, 1], [1, 1, 0, 0])
    for place in places:
        assert {places[r]["node"] for r in place["tp_peers"]} == {place["node"]}, place
        assert len({places[r]["node"] for r in place["dp_peers"]}) == 2, place
    trained = transformers.GPT2LMHeadModel.from_pretrained(str(out) + ".merged")
    expected = reference_weights(str(checkpoint))
    for name, value in trained.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], msg=lambda m, n=name: f"{n}: {m}")
