"""Qwen2's classes in the zoo's test registry: the Llama family's cases (``cases_llama.py``) with every layer
attending within a window of 4 keys (``max_window_layers=0``), and a causal LM mixing both kinds of layers
(``max_window_layers=2``: layers 0-1 full, 2-3 sliding), so that at pp=2 the second stage's cache holds sliding
layers from its slot 0 (tests/parallel/test_interleaved.py puts one of each kind on a stage)."""

from transformers import Qwen2Config

from tests.models.cases_llama import family_cases, lm_batch, tiny_config
from tests.models.zoo import Case

CASES = family_cases("qwen2", "Qwen2", Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=0)
CASES.append(Case("qwen2", "Qwen2ForCausalLM", lambda: tiny_config(Qwen2Config, use_sliding_window=True,
                                                                   sliding_window=4, max_window_layers=2),
                  lm_batch, generate=True, variant="mixed", extra_layouts=((2, 2),)))
