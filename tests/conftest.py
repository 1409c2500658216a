"""Test-wide setup: one torch thread, so forked gloo workers never inherit a busy thread pool."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def _import_triton_in_interpreter_mode() -> None:
    """Import triton with TRITON_INTERPRET=1 (its library functions are jitted at import), then restore
    the environment: this process can run Triton kernels in the CPU interpreter when a test asks for
    it, while every other test takes the torch paths. Must run before anything imports triton
    (torch._dynamo, which transformers pulls in, does)."""
    if "triton" in sys.modules or torch.cuda.is_available():
        return
    previous = os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    finally:
        del os.environ["TRITON_INTERPRET"]
        if previous is not None:
            os.environ["TRITON_INTERPRET"] = previous


_import_triton_in_interpreter_mode()

# Import the heavy modules once here: forked ranks inherit them instead of importing them again.
import transformers  # noqa: E402
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402,F401

import oslo  # noqa: E402
import oslo.launch  # noqa: E402

# torch 2.14: a worker whose first backward is a compiled one (tests/kernels/test_ops.py) could fork no rank
# able to run autograd afterwards; one plain backward first keeps forked ranks working (oslo.launch).
oslo.launch.prime_autograd_for_fork()

for _name in oslo.__all__:  # oslo imports its names lazily: resolve them now, once, for the forked ranks
    getattr(oslo, _name)

transformers.AutoModelForCausalLM  # noqa: B018 - resolve the lazy module now
# No "Loading weights" bar per rank and load: thousands of lines in a failing test's captured output, where they
# push the rank's own error out of view.
transformers.utils.logging.disable_progress_bar()
# No tqdm monitor thread in this process: the tests fork ranks from it, and a thread that holds a lock (tqdm's
# own, the allocator's) at the moment of a fork leaves that lock held forever in the child.
import tqdm  # noqa: E402

tqdm.tqdm.monitor_interval = 0
from oslo.integrations import peft as _oslo_peft  # noqa: E402

_oslo_peft.install()  # imports PEFT (a quarter of a second) here, once, instead of in every rank that builds a model


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def zoo_checkpoints(tmp_path_factory):
    """``get(arch)``: the directory holding a transformers checkpoint of every case of ``arch`` in the zoo
    (tests/models/zoo.py), each under its key; saved once per session, the first time it is asked for."""
    from tests.models import zoo

    saved: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in saved:
            root = str(tmp_path_factory.mktemp(f"zoo-{arch}"))
            zoo.save_checkpoints(root, arch)
            saved[arch] = root
        return saved[arch]

    return get
