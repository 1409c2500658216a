"""GPT2's classes in the zoo's test registry (see tests/models/zoo.py)."""

from __future__ import annotations

import torch

from tests.helpers import tiny_gpt2_config
from tests.models.zoo import Case

VOCAB = 1001


def _config(**overrides):
    return lambda: tiny_gpt2_config(n_layer=4, **overrides)


def _tokens(seed: int = 1, rows: int = 4, length: int = 10) -> dict:
    """Left padding in row 1 (3 pads), labels ``-100`` on the padding."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3] = 0
    attention_mask[1, :3] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def _lm_batch() -> dict:
    batch = _tokens()
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


def _double_heads_batch() -> dict:
    choices = _tokens()["input_ids"].view(4, 1, 10).expand(4, 2, 10).contiguous()
    return dict(input_ids=choices, mc_token_ids=torch.tensor([[9, 8]] * 4), labels=choices,
                mc_labels=torch.tensor([0, 1, 1, 0]))


CASES = [
    Case("gpt2", "GPT2LMHeadModel", _config(), _lm_batch, generate=True, anchor=True),
    Case("gpt2", "GPT2Model", _config(), _tokens, objective=lambda out: out.last_hidden_state.square().mean()),
    # Under pipelines a step trains the language-modeling loss (every stage backpropagates one loss).
    Case("gpt2", "GPT2DoubleHeadsModel", _config(), _double_heads_batch,
         objective=lambda out: out.loss + out.mc_loss, pipeline_trains=True, pipeline_drop=("mc_labels",)),
    Case("gpt2", "GPT2ForSequenceClassification", _config(num_labels=3),
         lambda: {**_tokens(), "labels": torch.tensor([0, 2, 1, 2])}),
    Case("gpt2", "GPT2ForTokenClassification", _config(num_labels=5),
         lambda: {**_tokens(), "labels": torch.randint(0, 5, (4, 10), generator=torch.Generator().manual_seed(2))
                  .masked_fill(_tokens()["attention_mask"] == 0, -100)}),
    Case("gpt2", "GPT2ForQuestionAnswering", _config(),
         lambda: {**_tokens(), "start_positions": torch.tensor([1, 4, 7, 0]),
                  "end_positions": torch.tensor([3, 9, 11, 2])}),
]
