"""Fused kernels: Triton on CUDA, a torch reference (or vectorized torch) path on CPU.

Each fused op is a ``torch.library`` custom operator (``torch.ops.oslo.*``) with its autograd formula
and fake implementation registered, so ``torch.compile`` traces through it. The entry points pick the
path per call with :func:`use_triton`: Triton when it is installed and the tensors are on CUDA (or
``TRITON_INTERPRET=1`` is set, for tests), and for element-wise ops only at training-sized row counts;
the torch path otherwise. Triton is optional: importing this package never requires it.
"""

from oslo.kernels._triton import HAS_TRITON, triton_interpret_enabled, triton_interpreter_ready, use_triton
from oslo.kernels.bias_dropout_add import (
    FusedBiasDropoutAdd,
    bias_dropout_add,
    bias_dropout_add_reference,
    fused_bias_dropout_add_pays,
)
from oslo.kernels.bias_gelu import (
    HF_GELU_APPROXIMATIONS,
    FusedBiasGeLU,
    bias_gelu,
    bias_gelu_reference,
    gelu_approximation_for_activation,
)
from oslo.kernels.ngram import (
    FusedNoRepeatNGramLogitsProcessor,
    no_repeat_ngram_block,
    no_repeat_ngram_block_reference,
)
from oslo.kernels.softmax import FusedScaleMaskSoftmax, scaled_masked_softmax, scaled_masked_softmax_reference

__all__ = [
    "HAS_TRITON",
    "HF_GELU_APPROXIMATIONS",
    "FusedBiasDropoutAdd",
    "FusedBiasGeLU",
    "FusedNoRepeatNGramLogitsProcessor",
    "FusedScaleMaskSoftmax",
    "bias_dropout_add",
    "bias_dropout_add_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "fused_bias_dropout_add_pays",
    "gelu_approximation_for_activation",
    "no_repeat_ngram_block",
    "no_repeat_ngram_block_reference",
    "scaled_masked_softmax",
    "scaled_masked_softmax_reference",
    "triton_interpret_enabled",
    "triton_interpreter_ready",
    "use_triton",
]
