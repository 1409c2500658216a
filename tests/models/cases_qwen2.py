"""Qwen2's classes in the zoo's test registry: the Llama family's cases (``cases_llama.py``) with every layer
attending within a window of 4 keys (``max_window_layers=0``: one kind of layer, as pipelines need)."""

from transformers import Qwen2Config

from tests.models.cases_llama import family_cases

CASES = family_cases("qwen2", "Qwen2", Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=0)
