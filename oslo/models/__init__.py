"""oslo's parallel model classes, one architecture per file."""

from oslo.models.base import OsloPreTrainedModel
from oslo.models.gpt2 import (
    GPT2MLP,
    GPT2Attention,
    GPT2Block,
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    GPT2PreTrainedModel,
)

__all__ = [
    "OsloPreTrainedModel",
    "GPT2Attention",
    "GPT2MLP",
    "GPT2Block",
    "GPT2PreTrainedModel",
    "GPT2Model",
    "GPT2LMHeadModel",
    "GPT2DoubleHeadsModel",
    "GPT2ForSequenceClassification",
    "GPT2ForTokenClassification",
    "GPT2ForQuestionAnswering",
]
