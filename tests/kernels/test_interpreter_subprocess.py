"""oslo.kernels works without triton installed."""

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = Path(__file__).resolve().parent


def _run(args, env_updates, timeout):
    env = {**os.environ, **env_updates}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        args, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_kernels_import_and_run_without_triton():
    """Triton is optional: with it unimportable, every op takes its torch path."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, oslo.kernels as K\n"
        "assert not K.HAS_TRITON and not K.use_triton(torch.zeros(1))\n"
        "x, b = torch.randn(2, 5), torch.randn(5)\n"
        "K.bias_gelu(x, b, 'tanh'); K.bias_dropout_add(x, b, x, 0.5)\n"
        "K.scaled_masked_softmax(torch.randn(1, 1, 2, 3), causal=True)\n"
        "K.no_repeat_ngram_block(torch.tensor([[1, 2, 1]]), torch.zeros(1, 4), 2)\n"
        "print('ok')\n"
    )
    result = _run([sys.executable, "-c", script], {"TRITON_INTERPRET": "1"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
