"""Qwen2: the Llama family's blocks (``llama.py``) with biases on the query, key and value projections, and
sliding-window attention on the layers ``config.layer_types`` names (``use_sliding_window``)."""

from __future__ import annotations

from transformers import Qwen2Config

from oslo.models.llama import (
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    LlamaPreTrainedModel,
)


class Qwen2PreTrainedModel(LlamaPreTrainedModel):
    config_class = Qwen2Config
    config: Qwen2Config

    @staticmethod
    def _projection_biases(config) -> tuple[bool, bool]:
        return True, False

    @staticmethod
    def _mlp_bias(config) -> bool:
        return False

    @staticmethod
    def _layer_types(config) -> list[str]:
        return list(config.layer_types)


class Qwen2Model(Qwen2PreTrainedModel, LlamaModel):
    cache_only_with_use_cache = True  # unlike Llama's, transformers' drops the cache without use_cache


class Qwen2ForCausalLM(Qwen2PreTrainedModel, LlamaForCausalLM):
    _body_class = Qwen2Model


class Qwen2ForSequenceClassification(Qwen2PreTrainedModel, LlamaForSequenceClassification):
    _body_class = Qwen2Model


class Qwen2ForTokenClassification(Qwen2PreTrainedModel, LlamaForTokenClassification):
    _body_class = Qwen2Model


class Qwen2ForQuestionAnswering(Qwen2PreTrainedModel, LlamaForQuestionAnswering):
    _body_class = Qwen2Model


__all__ = [
    "Qwen2PreTrainedModel",
    "Qwen2Model",
    "Qwen2ForCausalLM",
    "Qwen2ForSequenceClassification",
    "Qwen2ForTokenClassification",
    "Qwen2ForQuestionAnswering",
]
