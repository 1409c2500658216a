"""Everything that talks to torch.distributed: context, collectives, parallel layers, loss, RNG."""

from oslo.parallel.agreement import InputMismatchError, agree_on_nonfinite_gradients, check_same_inputs
from oslo.parallel.clip import clip_grad_norm_
from oslo.parallel.context import ParallelContext
from oslo.parallel.dtensor import PipelineStageNormError
from oslo.parallel.errors import PeerLostError, PeerTimeoutError, RankFailedError
from oslo.parallel.failure import ModelUnusableError
from oslo.parallel.layers import (
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from oslo.parallel.loss import (
    causal_lm_loss,
    check_labels,
    linear_cross_entropy,
    loss_chunk_rows,
    vocab_parallel_cross_entropy,
)
from oslo.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from oslo.parallel.pipeline import PipelineAbortedError
from oslo.parallel.plan import ShardSpec
from oslo.parallel.random import ParallelRNG

__all__ = [
    "ParallelContext",
    "ParallelRNG",
    "ShardSpec",
    "ColumnParallelLinear",
    "ColumnParallelEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "vocab_parallel_cross_entropy",
    "causal_lm_loss",
    "linear_cross_entropy",
    "loss_chunk_rows",
    "check_labels",
    "clip_grad_norm_",
    "check_same_inputs",
    "agree_on_nonfinite_gradients",
    "InputMismatchError",
    "PeerTimeoutError",
    "PeerLostError",
    "RankFailedError",
    "ModelUnusableError",
    "PipelineAbortedError",
    "PipelineStageNormError",
]
