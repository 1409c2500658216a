"""oslo: pre-parallelized Hugging Face transformer models.

The public names are imported when first used (a module-level ``__getattr__``, as transformers does):
``import oslo`` imports neither torch nor transformers, ``from oslo import GPT2LMHeadModel`` imports the
model classes and what they need, and the data, deployment and checkpoint-conversion machinery (and the
libraries they use) load only when one of their names is asked for. ``from oslo import X`` and ``oslo.X``
work for every name of ``__all__``, and ``oslo.<submodule>`` for every submodule.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0.dev0"

# module -> the public names it provides (oslo.models' list is checked against its __all__ by the tests)
_EXPORTS: dict[str, list[str]] = {
    "transformers": ["BertConfig", "GPT2Config", "GPTNeoConfig", "LlamaConfig", "MistralConfig", "Qwen2Config",
                     "T5Config"],
    "oslo.models": [
        "BertEmbeddings", "BertSelfAttention", "BertSelfOutput", "BertAttention", "BertIntermediate", "BertOutput",
        "BertLayer", "BertPreTrainedModel", "BertModel", "BertForPreTraining", "BertLMHeadModel", "BertForMaskedLM",
        "BertForNextSentencePrediction", "BertForSequenceClassification", "BertForMultipleChoice",
        "BertForTokenClassification", "BertForQuestionAnswering",
        "GPT2Attention", "GPT2MLP", "GPT2Block", "GPT2PreTrainedModel", "GPT2Model", "GPT2LMHeadModel",
        "GPT2DoubleHeadsModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification",
        "GPT2ForQuestionAnswering",
        "GPTNeoAttention", "GPTNeoMLP", "GPTNeoBlock", "GPTNeoPreTrainedModel", "GPTNeoModel", "GPTNeoForCausalLM",
        "GPTNeoForSequenceClassification", "GPTNeoForTokenClassification", "GPTNeoForQuestionAnswering",
        "LlamaAttention", "LlamaMLP", "LlamaRMSNorm", "LlamaDecoderLayer", "LlamaPreTrainedModel", "LlamaModel",
        "LlamaForCausalLM", "LlamaForSequenceClassification", "LlamaForTokenClassification",
        "LlamaForQuestionAnswering",
        "Qwen2PreTrainedModel", "Qwen2Model", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification",
        "Qwen2ForTokenClassification", "Qwen2ForQuestionAnswering",
        "MistralPreTrainedModel", "MistralModel", "MistralForCausalLM", "MistralForSequenceClassification",
        "MistralForTokenClassification", "MistralForQuestionAnswering",
        "T5Attention", "T5Block", "T5DenseActDense", "T5DenseGatedActDense", "T5EncoderModel",
        "T5ForConditionalGeneration", "T5ForQuestionAnswering", "T5ForSequenceClassification",
        "T5ForTokenClassification", "T5LayerFF", "T5LayerNorm", "T5Model", "T5PreTrainedModel", "T5Stack",
    ],
    "oslo.models.auto": [
        "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForMultipleChoice",
        "AutoModelForNextSentencePrediction", "AutoModelForPreTraining", "AutoModelForQuestionAnswering",
        "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification", "AutoModelForTextEncoding",
        "AutoModelForTokenClassification",
    ],
    "oslo.parallel": ["ParallelContext", "clip_grad_norm_"],
    "oslo.training_state": ["save_training_state", "load_training_state"],
    "oslo.conversion": ["convert_state_dict"],
    "oslo.checkpoint": ["save_tensor_parallel"],
    "oslo.reshard": ["reshard_checkpoint"],
    "oslo.initialization": ["initialize"],
    "oslo.data": ["DatasetPreprocessor", "DatasetForCausalLM", "DatasetBlender", "DistributedProxySampler",
                  "InfiniteDataLoader"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_MODULE_OF)

def __getattr__(name: str) -> Any:
    """``oslo.X``: import the module that defines the public name ``X`` (once), or the submodule ``oslo.X``."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
