"""README's "Your first training script" is examples/first_training.py, and it runs as README says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "first_training.py"


def test_readme_shows_the_script():
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{SCRIPT.read_text()}```" in readme


def test_first_script_trains_under_torchrun(tmp_path):
    (tmp_path / "assets").symlink_to(ROOT / "assets")  # the script reads assets/ from where it runs
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(v) for v in re.findall(r"^step \d+: loss ([\d.]+)$", done.stdout, re.M)]
    assert len(losses) == 6, done.stdout  # rank 0 alone prints
    assert losses[-1] < losses[0] - 1.0, losses
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "my_first_model")
    assert type(model).__name__ == "GPT2LMHeadModel"
