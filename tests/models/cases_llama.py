"""The Llama family's classes in the zoo's test registry (see tests/models/zoo.py): Llama here, Qwen2 and
Mistral (``cases_qwen2.py``, ``cases_mistral.py``) through :func:`family_cases`.

The tiny configs have 4 query heads and 2 key/value heads: split at tensor_parallel_size 2, replicated
(each rank projecting the one its query head reads) at 4, the anchor layout (4, 1). The batches have left
padding in row 1 and ``-100`` on it; the generations (6 prompt + 8 new tokens) run past Mistral's and
Qwen2's sliding windows of 4 keys."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from tests.models.zoo import Case

VOCAB = 1001  # divisible by neither 2 nor 4


def tiny_config(config_class, **overrides):
    """4 layers, 4 query heads over 2 key/value heads, an MLP of 48: small enough for 4 ranks on CPU."""
    values = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, attention_dropout=0.0,
    )
    values.update(overrides)
    return config_class(**values)


def tokens(seed: int = 1, rows: int = 4, length: int = 10) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3] = 0
    attention_mask[1, :3] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def lm_batch() -> dict:
    batch = tokens()
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


def family_cases(arch: str, prefix: str, config_class, tied_variant: bool = False, **overrides) -> list[Case]:
    """Every head of one Llama-family architecture (class names ``<prefix>ForCausalLM``...)."""

    def config(**more):
        return lambda: tiny_config(config_class, **{**overrides, **more})

    cases = [
        Case(arch, f"{prefix}ForCausalLM", config(), lm_batch, generate=True, anchor=True),
        Case(arch, f"{prefix}Model", config(), tokens, objective=lambda out: out.last_hidden_state.square().mean()),
        Case(arch, f"{prefix}ForSequenceClassification", config(num_labels=3),
             lambda: {**tokens(), "labels": torch.tensor([0, 2, 1, 2])}),
        Case(arch, f"{prefix}ForTokenClassification", config(num_labels=5),
             lambda: {**tokens(), "labels": torch.randint(0, 5, (4, 10), generator=torch.Generator().manual_seed(2))
                      .masked_fill(tokens()["attention_mask"] == 0, -100)}),
        Case(arch, f"{prefix}ForQuestionAnswering", config(),
             lambda: {**tokens(), "start_positions": torch.tensor([1, 4, 7, 0]),
                      "end_positions": torch.tensor([3, 9, 11, 2])}),
    ]
    if tied_variant:  # the LM head tied to the input embeddings (a copy on the last stage under pipelines)
        cases.append(Case(arch, f"{prefix}ForCausalLM", config(tie_word_embeddings=True), lm_batch, generate=True,
                          variant="tied"))
    return cases


CASES = family_cases("llama", "Llama", LlamaConfig, tied_variant=True)
