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


# The manual's loop at more (tp, pp, dp, micro_batch_size, DistributedDataParallel) layouts than every anchor's:
# the LM head at six more (a pipeline of four with one row per micro-batch, the pipeline under DDP), every other
# head trained at tp2 x pp2 and pp2 x dp2.
LM_TRAINING = ((1, 2, 1, 2, False), (2, 2, 1, 4, False), (1, 2, 2, 2, True), (1, 4, 1, 1, False),
               (1, 1, 2, 4, True))
HEAD_TRAINING = ((2, 2, 1, 2, False), (1, 2, 2, 2, False))

CASES = [
    Case("gpt2", "GPT2LMHeadModel", _config(), _lm_batch, generate=True, anchor=True, extra_layouts=((1, 4),),
         training_layouts=LM_TRAINING),
    Case("gpt2", "GPT2Model", _config(), _tokens, objective=lambda out: out.last_hidden_state.square().mean()),
    # Under pipelines a step trains the language-modeling loss (every stage backpropagates one loss).
    Case("gpt2", "GPT2DoubleHeadsModel", _config(), _double_heads_batch,
         objective=lambda out: out.loss + out.mc_loss, pipeline_trains=True, pipeline_drop=("mc_labels",),
         training_layouts=HEAD_TRAINING),
    # Its labelled rows (the -100 rows ignored) differ across replicas at pp1 x dp2 under DDP.
    Case("gpt2", "GPT2ForSequenceClassification", _config(num_labels=3),
         lambda: {**_tokens(), "labels": torch.tensor([0, 2, 1, 2])},
         training_layouts=(*HEAD_TRAINING, (1, 1, 2, 4, True))),
    Case("gpt2", "GPT2ForTokenClassification", _config(num_labels=5, classifier_dropout=0.0),  # trains: no dropout
         lambda: {**_tokens(), "labels": torch.randint(0, 5, (4, 10), generator=torch.Generator().manual_seed(2))
                  .masked_fill(_tokens()["attention_mask"] == 0, -100)}, training_layouts=HEAD_TRAINING),
    Case("gpt2", "GPT2ForQuestionAnswering", _config(),
         lambda: {**_tokens(), "start_positions": torch.tensor([1, 4, 7, 0]),
                  "end_positions": torch.tensor([3, 9, 11, 2])}, training_layouts=HEAD_TRAINING),
]
