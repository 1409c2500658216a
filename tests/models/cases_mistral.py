"""Mistral's classes in the zoo's test registry: the Llama family's cases (``cases_llama.py``) with a sliding
window of 4 keys and a head size set apart from hidden_size / heads (``head_dim=16``)."""

from transformers import MistralConfig

from tests.models.cases_llama import family_cases

CASES = family_cases("mistral", "Mistral", MistralConfig, sliding_window=4, head_dim=16, tied_variant=True)
