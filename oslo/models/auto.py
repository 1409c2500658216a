"""oslo's Auto classes: ``oslo.AutoModelForCausalLM.from_pretrained_with_parallel(path, tensor_parallel_size=2)``
builds the oslo class that transformers' ``AutoModelForCausalLM`` picks for the checkpoint's ``model_type``
(``LlamaForCausalLM`` for a Llama checkpoint, ``GPT2LMHeadModel`` for a GPT2 one), with every argument of that
class's ``from_pretrained_with_parallel`` / ``from_config_with_parallel``. The tables are transformers' own
(``transformers.models.auto.modeling_auto``), kept to the classes oslo has."""

from __future__ import annotations

import os
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto import modeling_auto

from oslo import models
from oslo.hub import HUB_OPTIONS
from oslo.models.base import OsloPreTrainedModel

__all__ = ["AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForMultipleChoice",
           "AutoModelForNextSentencePrediction", "AutoModelForPreTraining", "AutoModelForQuestionAnswering",
           "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification", "AutoModelForTextEncoding",
           "AutoModelForTokenClassification"]


class _AutoParallelModel:
    """An Auto class: ``_mapping`` names transformers' table (``model_type`` -> class name) it follows."""

    _mapping: str

    def __init__(self, *args, **kwargs) -> None:
        raise OSError(f"{type(self).__name__} builds models through {type(self).__name__}.from_pretrained_with_parallel"
                      f"(path, ...) or {type(self).__name__}.from_config_with_parallel(config, ...), as transformers' "
                      "Auto classes through from_pretrained / from_config.")

    @classmethod
    def model_classes(cls) -> dict[str, type[OsloPreTrainedModel]]:
        """``{model_type: oslo class}`` of the architectures oslo has for this task."""
        classes = {}
        for model_type, name in getattr(modeling_auto, cls._mapping).items():
            oslo_class = getattr(models, name, None) if isinstance(name, str) else None
            # transformers maps some other model types to these classes (exaone to Llama's): their configs differ
            if isinstance(oslo_class, type) and oslo_class.config_class.model_type == model_type:
                classes[model_type] = oslo_class
        return classes

    @classmethod
    def class_for(cls, model_type: str | None) -> type[OsloPreTrainedModel]:
        """The oslo class for ``model_type`` (a config's ``model_type``)."""
        classes = cls.model_classes()
        if model_type not in classes:
            known = ", ".join(f"{model_type!r}: {oslo_class.__name__}" for model_type, oslo_class in classes.items())
            raise ValueError(
                f"{cls.__name__} has no oslo class for model_type {model_type!r}; oslo's for this task: {known}. "
                "Use the class of another task (AutoModel, AutoModelForSequenceClassification, ...) or load the "
                "checkpoint with transformers.")
        return classes[model_type]

    @classmethod
    def from_config_with_parallel(cls, config: PretrainedConfig, *args: Any, **kwargs: Any) -> OsloPreTrainedModel:
        """``class_for(config.model_type).from_config_with_parallel(config, ...)``."""
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}.")
        return cls.class_for(config.model_type).from_config_with_parallel(config, *args, **kwargs)

    @classmethod
    def from_pretrained_with_parallel(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
                                      config: PretrainedConfig | None = None, **kwargs: Any) -> OsloPreTrainedModel:
        """The oslo class for the checkpoint's ``model_type`` (``config``'s, when given; else its ``config.json``'s,
        read locally or through the Hub as transformers reads it), loaded with its ``from_pretrained_with_parallel``."""
        if config is not None:
            model_type = getattr(config, "model_type", None)
        else:
            hub_options = {name: kwargs[name] for name in HUB_OPTIONS if name in kwargs}
            model_type = PretrainedConfig.get_config_dict(pretrained_model_name_or_path, **hub_options)[0].get(
                "model_type")
            if model_type is None:
                raise ValueError(f"the config.json of {os.fspath(pretrained_model_name_or_path)!r} names no "
                                 f"model_type: {cls.__name__} cannot tell its class. Load it with the oslo class "
                                 "itself (oslo.GPT2LMHeadModel...).")
        return cls.class_for(model_type).from_pretrained_with_parallel(pretrained_model_name_or_path, *args,
                                                                       config=config, **kwargs)


class AutoModel(_AutoParallelModel):
    """The bare model (``GPT2Model``, ``LlamaModel``, ``T5Model``...)."""

    _mapping = "MODEL_MAPPING_NAMES"


class AutoModelForCausalLM(_AutoParallelModel):
    """Causal language models (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``BertLMHeadModel``...)."""

    _mapping = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


class AutoModelForMaskedLM(_AutoParallelModel):
    _mapping = "MODEL_FOR_MASKED_LM_MAPPING_NAMES"


class AutoModelForSeq2SeqLM(_AutoParallelModel):
    _mapping = "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"


class AutoModelForSequenceClassification(_AutoParallelModel):
    _mapping = "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"


class AutoModelForTokenClassification(_AutoParallelModel):
    _mapping = "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"


class AutoModelForQuestionAnswering(_AutoParallelModel):
    _mapping = "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"


class AutoModelForPreTraining(_AutoParallelModel):
    _mapping = "MODEL_FOR_PRETRAINING_MAPPING_NAMES"


class AutoModelForMultipleChoice(_AutoParallelModel):
    _mapping = "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"


class AutoModelForNextSentencePrediction(_AutoParallelModel):
    _mapping = "MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES"


class AutoModelForTextEncoding(_AutoParallelModel):
    _mapping = "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES"
