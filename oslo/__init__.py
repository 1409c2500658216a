"""oslo: pre-parallelized Hugging Face transformer models."""

from transformers import GPT2Config

from oslo.data import (
    DatasetBlender,
    DatasetForCausalLM,
    DatasetPreprocessor,
    DistributedProxySampler,
    InfiniteDataLoader,
)
from oslo.models import (
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
from oslo.parallel import ParallelContext, clip_grad_norm_

__version__ = "0.1.0.dev0"

__all__ = [
    "GPT2Config",
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
    "ParallelContext",
    "DatasetPreprocessor",
    "DatasetForCausalLM",
    "DatasetBlender",
    "DistributedProxySampler",
    "InfiniteDataLoader",
    "clip_grad_norm_",
]
