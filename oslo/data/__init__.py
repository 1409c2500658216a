"""Data utilities: corpus preprocessing, causal LM datasets, blending, samplers and loaders."""

from oslo.data.blending import DatasetBlender
from oslo.data.causal_lm import DatasetForCausalLM
from oslo.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from oslo.data.loaders import InfiniteDataLoader
from oslo.data.preprocess import DatasetPreprocessor, JsonKeyError, JsonlSource, PreprocessStats
from oslo.data.samplers import DistributedProxySampler

__all__ = [
    "DatasetBlender",
    "DatasetForCausalLM",
    "DatasetPreprocessor",
    "DistributedProxySampler",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "InfiniteDataLoader",
    "JsonKeyError",
    "JsonlSource",
    "PreprocessStats",
]
