"""BERT's classes in the zoo's test registry (see tests/models/zoo.py).

The batches pad (right padding for the encoder, as BERT's tokenizers do; left padding for the causal LM,
whose generations continue the prompts) and carry two token types, so the padding mask, the token-type
embeddings and the pooler's first token all shape the outputs."""

from __future__ import annotations

import torch
from transformers import BertConfig

from tests.models.zoo import Case

VOCAB = 1003  # divisible by neither 2 nor 4


def tiny_bert_config(**overrides) -> BertConfig:
    """A BERT small enough for multi-rank CPU tests: 4 layers, 4 heads, dropout 0."""
    values = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, type_vocab_size=2, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    values.update(overrides)
    return BertConfig(**values)


def _config(**overrides):
    return lambda: tiny_bert_config(**overrides)


def tokens(seed: int = 1, rows: int = 4, length: int = 10, left_padding: bool = False) -> dict:
    """Row 1 padded (3 pads, right or left), token types 0 then 1 (the second sentence from position 5)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    pads = slice(0, 3) if left_padding else slice(length - 3, length)
    input_ids[1, pads] = 0
    attention_mask[1, pads] = 0
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, 5:] = 1
    token_type_ids[1, pads] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


def masked_lm_batch() -> dict:
    """Labels on every other real token (``-100`` elsewhere, padding included)."""
    batch = tokens()
    labels = batch["input_ids"].clone()
    labels[:, ::2] = -100
    return {**batch, "labels": labels.masked_fill(batch["attention_mask"] == 0, -100)}


def causal_lm_batch() -> dict:
    batch = tokens(left_padding=True)
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


def multiple_choice_batch() -> dict:
    """``(4, 2, 10)``: two choices per example, each its own padding and token types."""
    first, second = tokens(seed=1), tokens(seed=2)
    batch = {name: torch.stack([first[name], second[name].roll(1, 0)], dim=1) for name in first}
    return {**batch, "labels": torch.tensor([0, 1, 1, 0])}


CASES = [
    Case("bert", "BertForMaskedLM", _config(), masked_lm_batch, anchor=True),
    Case("bert", "BertModel", _config(), tokens,
         objective=lambda out: out.last_hidden_state.square().mean() + out.pooler_output.square().mean()),
    Case("bert", "BertForPreTraining", _config(),
         lambda: {**masked_lm_batch(), "next_sentence_label": torch.tensor([0, 1, 1, 0])}),
    Case("bert", "BertLMHeadModel", _config(is_decoder=True), causal_lm_batch, generate=True),
    Case("bert", "BertForNextSentencePrediction", _config(),
         lambda: {**tokens(), "labels": torch.tensor([1, 0, 0, 1])}),
    Case("bert", "BertForSequenceClassification", _config(num_labels=3),
         lambda: {**tokens(), "labels": torch.tensor([0, 2, 1, 2])}),
    Case("bert", "BertForMultipleChoice", _config(), multiple_choice_batch),
    Case("bert", "BertForTokenClassification", _config(num_labels=5),
         lambda: {**tokens(), "labels": torch.randint(0, 5, (4, 10), generator=torch.Generator().manual_seed(2))
                  .masked_fill(tokens()["attention_mask"] == 0, -100)}),
    Case("bert", "BertForQuestionAnswering", _config(),
         lambda: {**tokens(), "start_positions": torch.tensor([1, 4, 7, 0]),
                  "end_positions": torch.tensor([3, 9, 11, 2])}),
]
