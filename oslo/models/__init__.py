"""oslo's parallel model classes, one architecture per file; :func:`oslo_class` finds the one a model or config
names."""

from __future__ import annotations

import sys

from torch import nn
from transformers import PretrainedConfig

from oslo.models.base import OsloPreTrainedModel
from oslo.models.bert import (
    BertAttention,
    BertEmbeddings,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertIntermediate,
    BertLayer,
    BertLMHeadModel,
    BertModel,
    BertOutput,
    BertPreTrainedModel,
    BertSelfAttention,
    BertSelfOutput,
)
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
from oslo.models.gpt_neo import (
    GPTNeoAttention,
    GPTNeoBlock,
    GPTNeoForCausalLM,
    GPTNeoForQuestionAnswering,
    GPTNeoForSequenceClassification,
    GPTNeoForTokenClassification,
    GPTNeoMLP,
    GPTNeoModel,
    GPTNeoPreTrainedModel,
)
from oslo.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
)
from oslo.models.mistral import (
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
    MistralPreTrainedModel,
)
from oslo.models.qwen2 import (
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
    Qwen2PreTrainedModel,
)
from oslo.models.t5 import (
    T5Attention,
    T5Block,
    T5DenseActDense,
    T5DenseGatedActDense,
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5ForQuestionAnswering,
    T5ForSequenceClassification,
    T5ForTokenClassification,
    T5LayerFF,
    T5LayerNorm,
    T5Model,
    T5PreTrainedModel,
    T5Stack,
)

__all__ = [
    "OsloPreTrainedModel",
    "BertEmbeddings",
    "BertSelfAttention",
    "BertSelfOutput",
    "BertAttention",
    "BertIntermediate",
    "BertOutput",
    "BertLayer",
    "BertPreTrainedModel",
    "BertModel",
    "BertForPreTraining",
    "BertLMHeadModel",
    "BertForMaskedLM",
    "BertForNextSentencePrediction",
    "BertForSequenceClassification",
    "BertForMultipleChoice",
    "BertForTokenClassification",
    "BertForQuestionAnswering",
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
    "GPTNeoAttention",
    "GPTNeoMLP",
    "GPTNeoBlock",
    "GPTNeoPreTrainedModel",
    "GPTNeoModel",
    "GPTNeoForCausalLM",
    "GPTNeoForSequenceClassification",
    "GPTNeoForTokenClassification",
    "GPTNeoForQuestionAnswering",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaRMSNorm",
    "LlamaDecoderLayer",
    "LlamaPreTrainedModel",
    "LlamaModel",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaForTokenClassification",
    "LlamaForQuestionAnswering",
    "Qwen2PreTrainedModel",
    "Qwen2Model",
    "Qwen2ForCausalLM",
    "Qwen2ForSequenceClassification",
    "Qwen2ForTokenClassification",
    "Qwen2ForQuestionAnswering",
    "MistralPreTrainedModel",
    "MistralModel",
    "MistralForCausalLM",
    "MistralForSequenceClassification",
    "MistralForTokenClassification",
    "MistralForQuestionAnswering",
    "T5Attention",
    "T5Block",
    "T5DenseActDense",
    "T5DenseGatedActDense",
    "T5EncoderModel",
    "T5ForConditionalGeneration",
    "T5ForQuestionAnswering",
    "T5ForSequenceClassification",
    "T5ForTokenClassification",
    "T5LayerFF",
    "T5LayerNorm",
    "T5Model",
    "T5PreTrainedModel",
    "T5Stack",
]


def supported_classes() -> list[str]:
    """The names of oslo's model classes (the architectures' own, not their ``...PreTrainedModel`` bases)."""
    module = sys.modules[__name__]
    return sorted(name for name in __all__ if isinstance(getattr(module, name), type)
                  and issubclass(getattr(module, name), OsloPreTrainedModel) and not name.endswith("PreTrainedModel"))


def oslo_class(model_or_config) -> tuple[type, PretrainedConfig]:
    """The oslo class of a model (a transformers or oslo instance) or of a config (its ``architectures``), and
    the config.

    Raises:
        TypeError: ``model_or_config`` is a class, or neither a model nor a config.
        ValueError: a config without ``architectures``, or a class oslo does not have.
    """
    if isinstance(model_or_config, type) and issubclass(model_or_config, OsloPreTrainedModel):
        raise TypeError(
            "convert_state_dict needs the model's config too: pass a config (its `architectures` naming the "
            f"class, e.g. {model_or_config.__name__!r}) or a model instance."
        )
    if isinstance(model_or_config, nn.Module):
        config, name = model_or_config.config, type(model_or_config).__name__
    elif isinstance(model_or_config, PretrainedConfig):
        config = model_or_config
        names = getattr(config, "architectures", None) or []
        if not names:
            raise ValueError(
                "convert_state_dict got a config without `architectures`, so the model class is unknown: set "
                "config.architectures = ['GPT2LMHeadModel'] (the class the state dict belongs to), or pass the "
                "model itself."
            )
        name = names[0]
    else:
        raise TypeError(f"model_or_config must be a transformers/oslo model or a PretrainedConfig, not "
                        f"{type(model_or_config).__name__}")
    cls = getattr(sys.modules[__name__], name, None)
    if not (isinstance(cls, type) and issubclass(cls, OsloPreTrainedModel)):
        raise ValueError(f"oslo has no parallel class {name!r}; the supported classes are {supported_classes()}")
    return cls, config
