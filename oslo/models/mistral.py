"""Mistral: the Llama family's blocks (``llama.py``) without biases, every layer attending within
``config.sliding_window`` keys back when it is set."""

from __future__ import annotations

from transformers import MistralConfig

from oslo.models.body import FULL_ATTENTION, SLIDING_ATTENTION
from oslo.models.llama import (
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    LlamaPreTrainedModel,
)


class MistralPreTrainedModel(LlamaPreTrainedModel):
    config_class = MistralConfig
    config: MistralConfig

    @staticmethod
    def _projection_biases(config) -> tuple[bool, bool]:
        return False, False

    @staticmethod
    def _mlp_bias(config) -> bool:
        return False

    @staticmethod
    def _layer_types(config) -> list[str]:
        return [SLIDING_ATTENTION if config.sliding_window is not None else FULL_ATTENTION] * config.num_hidden_layers


class MistralModel(MistralPreTrainedModel, LlamaModel):
    cache_only_with_use_cache = True  # unlike Llama's, transformers' drops the cache without use_cache


class MistralForCausalLM(MistralPreTrainedModel, LlamaForCausalLM):
    _body_class = MistralModel


class MistralForSequenceClassification(MistralPreTrainedModel, LlamaForSequenceClassification):
    _body_class = MistralModel


class MistralForTokenClassification(MistralPreTrainedModel, LlamaForTokenClassification):
    _body_class = MistralModel


class MistralForQuestionAnswering(MistralPreTrainedModel, LlamaForQuestionAnswering):
    base_model_prefix = "model"  # transformers names Llama's and Qwen2's "transformer", Mistral's not
    _body_class = MistralModel


__all__ = [
    "MistralPreTrainedModel",
    "MistralModel",
    "MistralForCausalLM",
    "MistralForSequenceClassification",
    "MistralForTokenClassification",
    "MistralForQuestionAnswering",
]
