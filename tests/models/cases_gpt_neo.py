"""GPT-Neo's classes in the zoo's test registry (see tests/models/zoo.py).

The tiny config mixes global and local layers (``global, local, global, local``) with a window of 4
keys, shorter than the 10-token batches and than the generations (6 prompt + 8 new tokens), so the
sliding window, the left padding and the KV cache all shape the outputs."""

from __future__ import annotations

import torch
from transformers import GPTNeoConfig

from tests.models.zoo import Case

VOCAB = 1001  # divisible by neither 2 nor 4
WINDOW = 4


def tiny_gpt_neo_config(**overrides) -> GPTNeoConfig:
    """A GPT-Neo small enough for multi-rank CPU tests: 4 layers alternating global and local attention."""
    values = dict(
        vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32, num_layers=4, num_heads=4,
        attention_types=[[["global", "local"], 2]], window_size=WINDOW, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0,
    )
    values.update(overrides)
    return GPTNeoConfig(**values)


def _config(**overrides):
    return lambda: tiny_gpt_neo_config(**overrides)


def tokens(seed: int = 1, rows: int = 4, length: int = 10) -> dict:
    """Left padding in row 1 (3 pads: a padded query in a local layer sees only padding), labels ``-100``
    on the padding."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3] = 0
    attention_mask[1, :3] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def lm_batch() -> dict:
    batch = tokens()
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


CASES = [
    Case("gpt_neo", "GPTNeoForCausalLM", _config(), lm_batch, generate=True, anchor=True),
    Case("gpt_neo", "GPTNeoModel", _config(), tokens, objective=lambda out: out.last_hidden_state.square().mean()),
    Case("gpt_neo", "GPTNeoForSequenceClassification", _config(num_labels=3),
         lambda: {**tokens(), "labels": torch.tensor([0, 2, 1, 2])}),
    Case("gpt_neo", "GPTNeoForTokenClassification", _config(num_labels=5),
         lambda: {**tokens(), "labels": torch.randint(0, 5, (4, 10), generator=torch.Generator().manual_seed(2))
                  .masked_fill(tokens()["attention_mask"] == 0, -100)}),
    Case("gpt_neo", "GPTNeoForQuestionAnswering", _config(),
         lambda: {**tokens(), "start_positions": torch.tensor([1, 4, 7, 0]),
                  "end_positions": torch.tensor([3, 9, 11, 2])}),
]
