"""Test-wide setup: one torch thread, so forked gloo workers never inherit a busy thread pool."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# Import the heavy modules once here: forked ranks inherit them instead of importing them again.
import transformers  # noqa: E402
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402,F401

import oslo  # noqa: E402,F401

transformers.AutoModelForCausalLM  # noqa: B018 - resolve the lazy module now
